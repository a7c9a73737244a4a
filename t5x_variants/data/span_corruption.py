"""T5 span corruption as seqio preprocessors (Raffel et al. 2020, Sec. 3.1.4 and 3.3).

A chunk of raw tokens gets a random noise mask of contiguous spans; the inputs keep the
non-noise tokens with every noise span replaced by one sentinel, the targets list every noise
span after its sentinel. Sentinels count down from the top of the vocabulary (span i uses
``vocab_size - 1 - i``, i.e. ``<extra_id_i>`` of a seqio vocabulary with extra ids). EOS is left to
``seqio.preprocessors.append_eos_after_trim``, which runs after ``span_corruption``.

The noise density and mean span length are T5's (0.15, 3) unless gin binds
``span_corruption.noise_density`` / ``span_corruption.mean_noise_span_length`` (T5's Table 7
ablation; ByT5's 20).
"""
from typing import Dict, Sequence, Tuple

import gin
import numpy as np
import seqio
import tensorflow as tf

from t5x_variants.data import vocab


def _corrupted_lengths(raw_length: int, noise_density: float, mean_noise_span_length: float):
  """(inputs, targets, noise spans) for ``raw_length`` tokens, EOS included.

  Rounds and clips exactly as ``random_spans_noise_mask`` below so that the lengths are exact.
  Both round in float64, as T5's ``random_spans_helper``; T5's own mask rounds in float32, and
  at some lengths (190, 350, 390, ... raw tokens: inputs_length 172, 316, 352, ..., never 64, 128
  or 512) has one noise token and span more than its helper counted, its targets then trimmed
  by seqio and left without their EOS.
  """
  num_noise = min(max(int(round(raw_length * noise_density)), 1), raw_length - 1)
  num_spans = min(max(int(round(num_noise / mean_noise_span_length)), 1), raw_length - num_noise)
  return raw_length - num_noise + num_spans + 1, num_noise + num_spans + 1, num_spans


NOISE_DENSITY, MEAN_NOISE_SPAN_LENGTH = 0.15, 3.0  # T5's (Sec. 3.3)


def input_and_target_lengths(inputs_length: int, noise_density: float = NOISE_DENSITY,
                             mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH
                             ) -> Tuple[int, int]:
  """(raw_tokens_length, targets_length) so that corrupted inputs plus EOS fill ``inputs_length``.

  raw_tokens_length is the largest raw chunk whose inputs (non-noise tokens, one sentinel per
  span, EOS) fit. With noise_density <= 0.5 the inputs length grows by 0 or 1 per raw token, so
  it hits ``inputs_length`` exactly. 512 gives (568, 114) as in T5. At noise_density 0.5, where
  the targets can come out one longer than the inputs, one raw token less, as T5's
  ``random_spans_helper`` does (512 at mean span 3: (766, 512), not (767, 513)); the inputs may
  then be one short. The targets length is then counted again for the shorter chunk, where T5's
  helper takes one off its own (512 at mean span 1: (510, 511) here, (510, 512) there, a slot
  that stays padding).
  """
  if not 0 < noise_density < 1 or mean_noise_span_length < 1:
    raise ValueError(f'need 0 < noise_density < 1 and mean_noise_span_length >= 1, got '
                     f'{noise_density} and {mean_noise_span_length}')
  lengths = lambda raw: _corrupted_lengths(raw, noise_density, mean_noise_span_length)
  raw = 2  # the shortest chunk holding a non-noise token and a noise span
  if lengths(raw)[0] > inputs_length:
    raise ValueError(f'inputs_length={inputs_length} is too short for span corruption: one noise '
                     f'span needs {lengths(raw)[0]} positions (a token, a sentinel and EOS)')
  while lengths(raw + 1)[0] <= inputs_length:
    raw += 1
  if noise_density == 0.5 and raw > 2 and lengths(raw)[1] > lengths(raw)[0]:
    raw -= 1
  return raw, lengths(raw)[1]


def _random_segmentation(num_items, num_segments, seed):
  """Lengths (each >= 1, summing to ``num_items``) of a uniformly random split into segments.

  The segments start at position 0 and at ``num_segments - 1`` distinct random cut points.
  """
  scores = tf.random.stateless_uniform([num_items - 1], seed=seed)
  is_cut = tf.argsort(tf.argsort(scores)) < num_segments - 1
  starts = tf.concat([[True], is_cut], axis=0)
  segment_ids = tf.cumsum(tf.cast(starts, tf.int32)) - 1
  return tf.math.unsorted_segment_sum(tf.ones([num_items], tf.int32), segment_ids, num_segments)


def random_spans_noise_mask(length, noise_density: float, mean_noise_span_length: float, seeds):
  """Bool [length] mask, True at round(length * noise_density) noise tokens (at least 1).

  The noise tokens form round(num_noise / mean_noise_span_length) spans (1 to the number of
  non-noise tokens), alternating
  with as many non-noise spans, starting with non-noise and ending with noise (T5's convention).
  ``seeds``: two stateless seeds, one for each of the two random segmentations. ``length`` >= 2.
  """
  num_noise = tf.cast(tf.round(tf.cast(length, tf.float64) * noise_density), tf.int32)
  num_noise = tf.clip_by_value(num_noise, 1, length - 1)
  num_spans = tf.cast(tf.round(tf.cast(num_noise, tf.float64) / mean_noise_span_length), tf.int32)
  num_spans = tf.clip_by_value(num_spans, 1, length - num_noise)  # a non-noise token per span
  noise_lengths = _random_segmentation(num_noise, num_spans, seeds[0])
  kept_lengths = _random_segmentation(length - num_noise, num_spans, seeds[1])
  span_lengths = tf.reshape(tf.stack([kept_lengths, noise_lengths], axis=1), [-1])
  span_is_noise = tf.tile([False, True], [num_spans])
  return tf.reshape(tf.repeat(span_is_noise, span_lengths), [length])


def split_tokens(dataset: tf.data.Dataset, length: int, feature: str = 'targets') -> tf.data.Dataset:
  """Concatenates ``feature`` over the stream of documents and cuts it into ``length``-token chunks.

  Documents are joined (no separator) into one stream and a final partial chunk is dropped (T5
  joins a random chunk of each document, 128 documents at a time, and keeps a partial last
  chunk); only ``feature`` is kept, since other features cannot follow tokens across document
  borders.
  """
  tokens = dataset.map(lambda ex: ex[feature], num_parallel_calls=tf.data.AUTOTUNE).unbatch()
  return tokens.batch(length, drop_remainder=True).map(lambda chunk: {feature: chunk})


def _replace_spans(tokens, span_mask, vocab_size):
  """Drops the masked tokens, putting sentinel ``vocab_size - i`` where the i-th masked span began."""
  previous = tf.concat([[False], span_mask[:-1]], axis=0)
  starts = span_mask & ~previous
  sentinels = vocab_size - tf.cumsum(tf.cast(starts, tf.int32))
  return tf.boolean_mask(tf.where(starts, sentinels, tokens), ~span_mask | starts)


@gin.configurable(denylist=['dataset', 'sequence_length', 'output_features'])
def span_corruption(dataset: tf.data.Dataset, sequence_length: Dict[str, int],
                    output_features: Dict[str, seqio.Feature],
                    noise_density: float = NOISE_DENSITY,
                    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> tf.data.Dataset:
  """Tokenized 'targets' documents -> span-corrupted {'inputs', 'targets'} (both without EOS).

  Chunking: documents are concatenated and split into chunks of
  ``input_and_target_lengths(sequence_length['inputs'])[0]`` tokens, dropping the last partial
  one, so every example's inputs plus EOS are exactly ``sequence_length['inputs']`` long (at most
  one short at noise_density 0.5). Random
  state comes from seqio's seed (``map_over_dataset`` seeds into stateless ops).
  """
  raw_length, targets_length = input_and_target_lengths(sequence_length['inputs'], noise_density,
                                                        mean_noise_span_length)
  if sequence_length.get('targets', targets_length) < targets_length:
    raise ValueError(f"span corruption of {sequence_length['inputs']} inputs (noise density "
                     f'{noise_density}, mean span {mean_noise_span_length}) makes targets of '
                     f"{targets_length} tokens, but the targets length is {sequence_length['targets']}; "
                     f'set it to {targets_length} or more (--targets_length, or the run\'s '
                     'TASK_FEATURE_LENGTHS)')
  vocabulary = output_features['targets'].vocabulary
  num_spans = _corrupted_lengths(raw_length, noise_density, mean_noise_span_length)[2]
  sentinels = vocab.sentinels(vocabulary)
  if sentinels and sentinels < num_spans:
    raise ValueError(f'{num_spans} noise spans per example need as many sentinels, but the '
                     f'vocabulary has {sentinels}')
  vocab_size = vocabulary.vocab_size

  @seqio.map_over_dataset(num_seeds=2)
  def corrupt(features, seeds):
    tokens = features['targets']
    noise = random_spans_noise_mask(raw_length, noise_density, mean_noise_span_length, seeds)
    # Targets: the non-noise span before noise span i becomes that span's sentinel.
    return {'inputs': _replace_spans(tokens, noise, vocab_size),
            'targets': _replace_spans(tokens, ~noise, vocab_size)}

  return corrupt(split_tokens(dataset, raw_length))


def bound_targets_length(inputs_length: int) -> int:
  """The targets length of ``inputs_length`` inputs under ``span_corruption``'s gin bindings."""
  bound = gin.get_bindings(span_corruption)
  return input_and_target_lengths(
      inputs_length, bound.get('noise_density', NOISE_DENSITY),
      bound.get('mean_noise_span_length', MEAN_NOISE_SPAN_LENGTH))[1]


def _strip(ids) -> np.ndarray:
  """Tokens before the first EOS (1) or padding (0)."""
  ids = np.asarray(ids)
  ends = np.flatnonzero(ids <= 1)
  return ids[:ends[0]] if ends.size else ids


def _noise_spans(targets, vocab_size: int):
  """Noise spans of one targets row, in order; sentinels must be vocab_size - 1, - 2, ..."""
  spans = []
  for token in _strip(targets):
    if token == vocab_size - 1 - len(spans):
      spans.append([])
    elif spans:
      spans[-1].append(int(token))
    else:
      raise ValueError(f'targets must start with sentinel {vocab_size - 1}, got {token}')
  return spans


def merge_span_corruption(inputs, targets, vocab_size: int) -> np.ndarray:
  """Original chunk of one example: each sentinel in ``inputs``, in order, replaced by its targets
  span (a token is the next sentinel or itself, as the targets are read: of ByT5's, whose
  sentinels are bytes too, a byte equal to the next sentinel is taken for it)."""
  spans, merged, used = _noise_spans(targets, vocab_size), [], 0
  for token in _strip(inputs):
    if used < len(spans) and token == vocab_size - 1 - used:
      merged.extend(spans[used])
      used += 1
    else:
      merged.append(int(token))
  return np.asarray(merged, np.int32)


def _rows(x) -> Sequence:
  return [x] if np.ndim(x[0]) == 0 else list(x)


def noise_statistics(inputs, targets, vocab_size: int) -> Dict[str, float]:
  """Noise fraction, mean span length and span count over one example or a batch of rows. A row's
  spans are counted from its inputs' last token, the last span's sentinel (the mask ends in noise):
  no sentinel is looked for among the tokens, where ByT5's are bytes of text as well."""
  num_kept = num_noise = num_spans = 0
  for row_inputs, row_targets in zip(_rows(inputs), _rows(targets)):
    row_inputs = _strip(row_inputs)
    spans = vocab_size - int(row_inputs[-1]) if row_inputs.size else 0
    if not 0 < spans <= row_inputs.size // 2:
      raise ValueError('span-corrupted inputs end with the last span\'s sentinel (a row of the '
                       f'span corruption task\'s), not with {row_inputs[-1:]}')
    num_spans += spans
    num_noise += len(_strip(row_targets)) - spans
    num_kept += len(row_inputs) - spans
  return dict(noise_fraction=num_noise / max(num_noise + num_kept, 1),
              mean_span_length=num_noise / max(num_spans, 1), num_spans=num_spans)
