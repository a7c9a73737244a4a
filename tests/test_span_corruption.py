"""Span corruption (Raffel et al. 2020, Sec. 3.1.4) and BERT masking (Devlin et al. 2019) in seqio."""
import re
import uuid

import numpy as np
import pytest

from conftest import NO_DATA_LAYER

seqio = pytest.importorskip('seqio', reason=NO_DATA_LAYER)
tf = pytest.importorskip('tensorflow', reason=NO_DATA_LAYER)

from t5x_variants.data.mlm import mlm  # noqa: E402
from t5x_variants.data.span_corruption import (  # noqa: E402
    input_and_target_lengths, merge_span_corruption, noise_statistics, random_spans_noise_mask,
    span_corruption)

VOCAB = seqio.ByteVocabulary(extra_ids=100)
V = VOCAB.vocab_size  # sentinels are V - 1, V - 2, ...
LENGTHS = {'inputs': 512, 'targets': 114}
RAW = 568


def _documents(num, seed, max_length=900):
  rng = np.random.RandomState(seed)
  letters = np.frombuffer(b'abcdefghijklmnopqrstuvwxyz ', np.uint8)
  return [rng.choice(letters, rng.randint(1, max_length)).tobytes() for _ in range(num)]


def _chunks(documents, length):
  """Expected chunks: documents joined, cut into ``length`` tokens, the last partial one dropped."""
  tokens = np.concatenate([VOCAB.encode(d.decode()) for d in documents])
  return tokens[:len(tokens) // length * length].reshape(-1, length)


@pytest.fixture(scope='module')
def make_task():
  names = []

  def make(preprocessor, documents):
    name = f'test_span_corruption_{uuid.uuid4().hex}'
    def dataset(split, shuffle_files, seed=None):
      return tf.data.Dataset.from_tensor_slices({'targets': documents})

    feature = seqio.Feature(VOCAB)
    seqio.TaskRegistry.add(
        name, seqio.FunctionDataSource(dataset, splits=['train']),
        preprocessors=[seqio.preprocessors.tokenize, preprocessor,
                       seqio.preprocessors.append_eos_after_trim],
        output_features={'inputs': feature, 'targets': feature})
    names.append(name)
    return seqio.get_mixture_or_task(name)

  yield make
  for name in names:
    seqio.TaskRegistry.remove(name)


def _examples(task, lengths, seed):
  dataset = task.get_dataset(lengths, split='train', shuffle=False, seed=seed)
  return list(dataset.as_numpy_iterator())


@pytest.fixture(scope='module')
def corrupted(make_task):
  documents = _documents(300, seed=0)
  task = make_task(span_corruption, documents)
  return task, _chunks(documents, RAW), _examples(task, LENGTHS, seed=7)


def _sentinels(ids):
  return [int(i) for i in ids if i >= V - VOCAB.extra_ids]


def _spec_inputs_length(raw, density=0.15, mean_span=3.0):
  """Inputs length with EOS for ``raw`` tokens: non-noise tokens + one sentinel per span + EOS."""
  noise = min(max(round(raw * density), 1), raw - 1)
  spans = min(max(round(noise / mean_span), 1), raw - noise)
  return raw - noise + spans + 1, noise + spans + 1


def _t5_random_spans_helper(inputs_length, noise_density, mean_noise_span_length):
  """T5's ``random_spans_helper`` (t5/data/preprocessors.py), restated: the largest raw length
  whose unclipped inputs fit, one less at noise density 0.5 if its targets are the longer."""
  def lengths(raw):
    noise = int(round(raw * noise_density))
    spans = int(round(noise / mean_noise_span_length))
    return raw - noise + spans + 1, noise + spans + 1
  raw = inputs_length - 1
  while lengths(raw + 1)[0] <= inputs_length:
    raw += 1
  inputs, targets = lengths(raw)
  if noise_density == 0.5 and targets > inputs:
    raw, targets = raw - 1, targets - 1
  return raw, targets


def test_lengths_for_512_match_t5():
  assert input_and_target_lengths(512) == (568, 114)
  assert input_and_target_lengths(512, 0.5, 3.0) == (766, 512)  # not (767, 513)


@pytest.mark.parametrize('noise_density', [0.1, 0.15, 0.25, 0.5])
@pytest.mark.parametrize('mean_noise_span_length', [1.0, 2.0, 3.0, 5.0, 10.0])
def test_lengths_match_t5s_helper_from_64_tokens(noise_density, mean_noise_span_length):
  """The same raw length from 64 tokens up (below, T5's helper leaves out the mask's clipping
  to at least one noise token and span, and ours is the exact one); the same targets length,
  except at 0.5 where T5 subtracts 1 from the dropped token's and ours is exact (not longer)."""
  for inputs_length in range(64, 1100, 7):
    raw, targets = input_and_target_lengths(inputs_length, noise_density, mean_noise_span_length)
    t5_raw, t5_targets = _t5_random_spans_helper(inputs_length, noise_density, mean_noise_span_length)
    assert raw == t5_raw, inputs_length
    assert targets == t5_targets if noise_density != 0.5 else targets <= t5_targets, inputs_length


@pytest.mark.parametrize('inputs_length', [3, 17, 128, 256, 1024])
def test_raw_length_is_the_largest_that_fits(inputs_length):
  raw, targets_length = input_and_target_lengths(inputs_length)
  fits = [n for n in range(2, 3 * inputs_length) if _spec_inputs_length(n)[0] <= inputs_length]
  assert raw == max(fits)
  assert _spec_inputs_length(raw) == (inputs_length, targets_length)


@pytest.mark.parametrize('inputs_length', [0, 1, 2])
def test_too_short_inputs_length_raises(inputs_length):
  with pytest.raises(ValueError, match=f'inputs_length={inputs_length} is too short'):
    input_and_target_lengths(inputs_length)


@pytest.mark.parametrize('length', [2, 10, 100, 568])
def test_noise_mask_counts_and_convention_in_graph_mode(length):
  make_mask = tf.function(lambda n, seed: random_spans_noise_mask(n, 0.15, 3.0, [seed, seed + 1]))
  noise = min(max(round(length * 0.15), 1), length - 1)
  spans = min(max(round(noise / 3.0), 1), length - noise)
  masks = [make_mask(tf.constant(length), tf.constant([s, 3])).numpy() for s in range(20)]
  for mask in masks:
    assert mask.dtype == bool and mask.shape == (length,)
    assert mask.sum() == noise and not mask[0] and mask[-1]
    assert np.sum(mask[1:] & ~mask[:-1]) == spans  # span starts
  if length >= 100:
    assert len({m.tobytes() for m in masks}) == len(masks)


def test_merge_and_statistics_on_a_handmade_example():
  inputs = [5, V - 1, 7, V - 2, 1, 0, 0]
  targets = [V - 1, 6, 6, V - 2, 8, 1, 0]
  np.testing.assert_array_equal(merge_span_corruption(inputs, targets, V), [5, 6, 6, 7, 8])
  assert noise_statistics(inputs, targets, V) == dict(noise_fraction=0.6, mean_span_length=1.5,
                                                     num_spans=2)


def test_merging_by_sentinels_gives_back_the_chunks(corrupted):
  _, chunks, examples = corrupted
  assert len(examples) == len(chunks) >= 200
  for example, chunk in zip(examples, chunks):
    np.testing.assert_array_equal(merge_span_corruption(example['inputs'], example['targets'], V),
                                  chunk)


def test_noise_fraction_and_span_lengths(corrupted):
  _, _, examples = corrupted
  stats = noise_statistics([e['inputs'] for e in examples], [e['targets'] for e in examples], V)
  assert abs(stats['noise_fraction'] - 0.15) < 0.01
  assert abs(stats['mean_span_length'] - 3.0) < 0.2
  assert stats['num_spans'] == 28 * len(examples)
  # Random segmentation: span lengths vary rather than all being 3.
  starts = [np.flatnonzero(e['targets'] >= V - VOCAB.extra_ids) for e in examples]
  span_lengths = np.concatenate([np.diff(np.append(s, len(e['targets']) - 1)) - 1
                                 for s, e in zip(starts, examples)])
  assert span_lengths.min() == 1 and span_lengths.max() >= 6


def test_sentinel_order_lengths_and_eos(corrupted):
  _, _, examples = corrupted
  for example in examples:
    inputs, targets = example['inputs'], example['targets']
    assert len(inputs) == LENGTHS['inputs'] and len(targets) <= LENGTHS['targets']
    for ids in (inputs, targets):
      assert ids[-1] == 1 and np.sum(ids == 1) == 1
    sentinels = _sentinels(targets)
    assert targets[0] == V - 1 and sentinels == list(range(V - 1, V - 1 - len(sentinels), -1))
    assert _sentinels(inputs) == sentinels


def test_same_seed_same_examples_other_seed_other_masks(make_task):
  documents = _documents(40, seed=1)
  task = make_task(span_corruption, documents)
  first, again, other = (_examples(task, LENGTHS, seed) for seed in (3, 3, 4))
  assert len(first) == len(other) >= 20
  for a, b in zip(first, again):
    for key in ('inputs', 'targets'):
      np.testing.assert_array_equal(a[key], b[key])
  assert all(a['inputs'].tobytes() != c['inputs'].tobytes() for a, c in zip(first, other))


def test_sentinels_beyond_the_extra_ids_are_refused(make_task):
  task = make_task(span_corruption, _documents(2, seed=2))
  features = {'targets': seqio.Feature(seqio.ByteVocabulary(extra_ids=10))}
  with pytest.raises(ValueError, match='28 noise spans'):
    span_corruption(task.source.get_dataset('train'), LENGTHS, features)


def test_byt5s_sentinels_are_its_final_byte_ids(make_task):
  """ByT5's vocabulary has no extra ids: span corruption's sentinels are its final byte ids,
  258 down (Xue et al. 2022, Sec. 3.1), and it holds 100 of them: T5's 28 spans of 512 inputs
  fit (its extra ids were 0, and the count went unchecked), 102 spans do not."""
  from t5x_variants.data import vocab  # pylint: disable=g-import-not-at-top
  byt5 = vocab.ByT5Vocabulary()
  tokens = tf.data.Dataset.from_tensor_slices({'targets': _documents(20, seed=3)}).map(
      lambda ex: {'targets': byt5.encode_tf(ex['targets'])})  # letters: ids 35 to 125
  features = {'targets': seqio.Feature(byt5)}
  example = next(span_corruption(tokens, LENGTHS, features).as_numpy_iterator())
  assert [int(t) for t in example['targets'] if t > 125] == list(range(258, 258 - 28, -1))
  assert [int(t) for t in example['inputs'] if t > 125] == list(range(258, 258 - 28, -1))
  with pytest.raises(ValueError, match='102 noise spans per example need as many sentinels, but '
                     'the vocabulary has 100'):
    span_corruption(tokens, {'inputs': 512, 'targets': 1024}, features, noise_density=0.5,
                    mean_noise_span_length=4.0)


def test_byt5s_statistics_and_display_on_multibyte_text():
  """ByT5's sentinels are bytes of text too (0x9C-0xFF): every span is counted from the inputs'
  last token, so the statistics are exact on text of multi-byte characters (a byte after the last
  span's sentinel equal to the next one, Japanese's 0xE3 after 28 spans, was counted as a span);
  t5xv-data reads only the next sentinel as one (every byte from 0x9C read as a sentinel: 'é' as
  <extra_id_60>)."""
  from t5x_variants.cli.data import _decode  # pylint: disable=g-import-not-at-top
  from t5x_variants.data import vocab  # pylint: disable=g-import-not-at-top
  byt5 = vocab.ByT5Vocabulary()
  rng = np.random.RandomState(4)
  words = ['数据', 'です', 'ありがとう', '注意', '变换器', '한국어', 'été', 'naïve', 'the']
  texts = [' '.join(rng.choice(words, 400)) for _ in range(4)]
  tokens = tf.data.Dataset.from_tensor_slices({'targets': texts}).map(
      lambda ex: {'targets': byt5.encode_tf(ex['targets'])})
  examples = list(span_corruption(tokens, LENGTHS, {'targets': seqio.Feature(byt5)}).as_numpy_iterator())
  assert len(examples) >= 5
  stats = noise_statistics([e['inputs'] for e in examples], [e['targets'] for e in examples], 259)
  assert stats == dict(noise_fraction=85 / 568, mean_span_length=85 / 28, num_spans=28 * len(examples))
  accented = tf.data.Dataset.from_tensor_slices({'targets': ['naïve été über ' * 60]}).map(
      lambda ex: {'targets': byt5.encode_tf(ex['targets'])})
  example = next(span_corruption(accented, LENGTHS, {'targets': seqio.Feature(byt5)}).as_numpy_iterator())
  shown = _decode(byt5, example['inputs'])
  assert re.findall(r'<extra_id_(\d+)>', shown) == [str(i) for i in range(28)]
  assert 'ï' in shown and 'é' in shown and 'ü' in shown


def test_mlm_masking(make_task):
  documents = _documents(250, seed=5)
  lengths = {'inputs': 129, 'targets': 129}
  task = make_task(mlm, documents)
  examples = _examples(task, lengths, seed=11)
  chunks = _chunks(documents, 128)
  assert len(examples) == len(chunks) >= 200
  picked = []
  for example, chunk in zip(examples, chunks):
    inputs, targets, weights = example['inputs'], example['targets'], example['mlm_weights']
    assert inputs[-1] == targets[-1] == 1 and np.sum(inputs == 1) == 1
    np.testing.assert_array_equal(targets[:-1], chunk)
    selected = weights == 1.0
    assert weights.dtype == np.float32 and set(np.unique(weights)) <= {0.0, 1.0}
    assert selected.sum() == round(0.15 * 128)
    np.testing.assert_array_equal(inputs[:-1][~selected], chunk[~selected])
    picked.append(np.stack([inputs[:-1][selected], chunk[selected]]))
  new, old = np.concatenate(picked, axis=1)
  masked, kept = new == V - 1, new == old
  other = new[~masked & ~kept]
  assert abs(masked.mean() - 0.8) < 0.03
  assert abs(kept.mean() - 0.1) < 0.02
  assert abs(other.size / new.size - 0.1) < 0.02
  assert other.min() >= 3 and other.max() < V - VOCAB.extra_ids
  again = _examples(task, lengths, seed=11)
  assert all(a['inputs'].tobytes() == b['inputs'].tobytes() for a, b in zip(examples, again))
