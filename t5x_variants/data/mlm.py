"""BERT-style masked language modelling as a seqio preprocessor (Devlin et al. 2019, Sec. 3.1).

A fraction of a chunk's tokens is selected; of those, most become a mask token, some a random
token and the rest stay, and the model predicts the original tokens at the selected positions.
This is Devlin et al.'s encoder-only objective, not the "BERT-style" one T5 compares with span
corruption (Raffel et al. 2020, Sec. 3.3.1: an encoder-decoder denoising objective whose targets
are the whole original text, 90% of the corrupted tokens a mask and 10% a random token, none
kept). The seqio vocabularies have no [MASK] token, so the first sentinel stands in for it.
"""
from typing import Dict, Sequence, Tuple

import seqio
import tensorflow as tf

from t5x_variants.data import vocab
from t5x_variants.data.span_corruption import split_tokens


def bert_mask(tokens, seeds, mask_id: int, random_ids: Tuple[int, int], mask_rate: float = 0.15,
              random_rate: float = 0.1, keep_rate: float = 0.1, special_ids: Sequence[int] = (0, 1)):
  """(corrupted tokens, float32 weights marking the selected positions) for a 1-D ``tokens``.

  Selects round(mask_rate * n) of the n tokens not in ``special_ids`` (at least 1 if n > 0); each
  selected token becomes a random id in [random_ids[0], random_ids[1]) with probability
  ``random_rate``, stays with probability ``keep_rate`` and becomes ``mask_id`` otherwise.
  ``seeds``: three stateless seeds (selection, choice of replacement, random ids).
  """
  shape = tf.shape(tokens)
  valid = tf.reduce_all(tokens[:, None] != tf.constant(special_ids, tokens.dtype), axis=1)
  num_valid = tf.reduce_sum(tf.cast(valid, tf.int32))
  num_selected = tf.cast(tf.round(tf.cast(num_valid, tf.float64) * mask_rate), tf.int32)
  num_selected = tf.minimum(tf.maximum(num_selected, 1), num_valid)
  # Invalid positions score above every uniform draw, so they rank last and are never selected.
  scores = tf.where(valid, tf.random.stateless_uniform(shape, seeds[0]), 2.0)
  selected = tf.argsort(tf.argsort(scores)) < num_selected
  choice = tf.random.stateless_uniform(shape, seeds[1])
  random_tokens = tf.random.stateless_uniform(shape, seeds[2], random_ids[0], random_ids[1],
                                              tokens.dtype)
  replacement = tf.where(choice < random_rate, random_tokens,
                         tf.where(choice < random_rate + keep_rate, tokens, mask_id))
  return tf.where(selected, replacement, tokens), tf.cast(selected, tf.float32)


def mlm(dataset: tf.data.Dataset, sequence_length: Dict[str, int],
        output_features: Dict[str, seqio.Feature], mask_rate: float = 0.15,
        random_rate: float = 0.1, keep_rate: float = 0.1, mask_id=None,
        first_normal_id: int = 3) -> tf.data.Dataset:
  """Tokenized 'targets' documents -> {'inputs': corrupted, 'targets': original, 'mlm_weights'}.

  Chunking as in ``span_corruption``: documents are concatenated and cut into chunks of
  ``sequence_length['inputs'] - 1`` tokens (room for EOS, appended later by
  ``append_eos_after_trim``), dropping the last partial one. ``mlm_weights`` covers the chunk, so
  it is one shorter than the inputs with EOS (the EOS position has weight 0 once padded).
  ``mask_id`` defaults to the first sentinel, vocab_size - 1; random ids are drawn from
  [first_normal_id, vocab_size - extra_ids), i.e. never PAD/EOS/UNK or a sentinel.
  Random state comes from seqio's seed (``map_over_dataset`` seeds into stateless ops).
  """
  if not (0 < mask_rate <= 1 and random_rate >= 0 and keep_rate >= 0
          and random_rate + keep_rate <= 1):
    raise ValueError(f'need 0 < mask_rate <= 1 and random_rate + keep_rate <= 1 (both >= 0), got '
                     f'{mask_rate}, {random_rate}, {keep_rate}')
  if sequence_length['inputs'] < 2:
    raise ValueError(f"sequence_length['inputs']={sequence_length['inputs']} leaves no room for a "
                     'token besides EOS')
  if sequence_length.get('targets', sequence_length['inputs']) != sequence_length['inputs']:
    raise ValueError(f"an MLM example's targets are its inputs before masking, as long as them: "
                     f"the targets length {sequence_length['targets']} is not the inputs length "
                     f"{sequence_length['inputs']}; give both the same (TASK_FEATURE_LENGTHS)")
  vocabulary = output_features['targets'].vocabulary
  vocab_size = vocabulary.vocab_size
  mask_id = vocab_size - 1 if mask_id is None else mask_id
  random_ids = (first_normal_id, vocab_size - vocab.sentinels(vocabulary))
  special_ids = tuple(i for i in (vocabulary.pad_id, vocabulary.eos_id) if i is not None)

  @seqio.map_over_dataset(num_seeds=3)
  def corrupt(features, seeds):
    tokens = features['targets']
    inputs, weights = bert_mask(tokens, seeds, mask_id, random_ids, mask_rate, random_rate,
                                keep_rate, special_ids)
    return {'inputs': inputs, 'targets': tokens, 'mlm_weights': weights}

  return corrupt(split_tokens(dataset, sequence_length['inputs'] - 1))
