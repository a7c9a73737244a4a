"""Pre-built batches (train/prebuilt.py, t5xv-train / t5xv-sweep --batches_dir): written once,
read back batch for batch with the position checkpointed; keyed by what decides the data; and a
run trained from them without TensorFlow logs the same losses as the run that reads the data
layer."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import needs_data_layer

from t5x_variants.data.config import DatasetConfig
from t5x_variants.train import prebuilt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def batches(n, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(n):
    yield {'tokens': rng.integers(0, 100, (2, 5), dtype=np.int32),
           'weights': rng.random((2, 5)).astype(np.float32)}


def describe(steps=4, eval_batches=None, init_checkpoint=None, **train):
  return prebuilt.description(DatasetConfig(mixture_or_task_name='t', **train),
                              DatasetConfig(mixture_or_task_name='t', split='validation'),
                              'decoder_only', steps, eval_batches, init_checkpoint)


def test_written_batches_read_back_in_order_and_resume_at_the_saved_position(tmp_path):
  vocab = tmp_path / 'vocab.model'
  vocab.write_bytes(b'spm')
  desc = describe(eval_batches=2)
  directory = prebuilt.write(str(tmp_path / 'b'), desc, lambda: batches(10),
                             lambda: {'t': batches(3, seed=1)}, {'vocab.model': str(vocab)}, 100)
  assert directory == str(tmp_path / 'b' / prebuilt.key(desc))
  assert os.listdir(tmp_path / 'b') == [prebuilt.key(desc)]  # no temporary directory left
  data = prebuilt.Prebuilt(str(tmp_path / 'b'), desc)
  assert data.meta['eval_counts'] == {'t': 2} and data.meta['vocabulary_size'] == 100
  assert open(data.files()['vocab.model'], 'rb').read() == b'spm'
  train = data.train()
  got = list(train)
  want = list(batches(4))  # only the run's 4 steps were written
  assert len(got) == 4
  for g, w in zip(got, want):
    assert g.keys() == w.keys() and all(np.array_equal(g[k], w[k]) for k in w)
    assert g['tokens'].dtype == np.int32 and g['weights'].dtype == np.float32
  # The position a checkpoint saves: a restored iterator goes on with the next batch.
  train = data.train()
  next(train), next(train)
  train.save(str(tmp_path / 'host-0'))
  again = data.train()
  again.restore(str(tmp_path / 'host-0'))
  assert np.array_equal(next(again)['tokens'], want[2]['tokens'])
  # Batches of another shape (batch size, lengths) than the saved position's: refused (a resume
  # went on silently with twice the rows).
  wider = tmp_path / 'wider'
  wider.mkdir()
  for name, a in train.arrays.items():
    np.save(wider / f'{name}.npy', np.concatenate([a, a], axis=1))
  with pytest.raises(ValueError, match=r"its batches had tokens int32\[2, 5\], this run's "
                                       r"int32\[4, 5\] \(2 feature\(s\) differ"):
    prebuilt.PrebuiltBatches(str(wider)).restore(str(tmp_path / 'host-0'))
  # Eval batches: read anew at each call, at most eval_batches of them.
  for _ in range(2):
    evals = [b['tokens'] for b in data.evals()['t']]
    assert len(evals) == 2
    assert np.array_equal(evals[1], list(batches(3, seed=1))[1]['tokens'])


def test_existing_batches_are_kept_and_a_short_source_is_refused(tmp_path):
  desc = describe()
  prebuilt.write(str(tmp_path), desc, lambda: batches(4), dict, {}, None)
  built = []
  prebuilt.write(str(tmp_path), desc, lambda: built.append(1) or batches(4), dict, {}, None)
  assert not built  # the data is not even built again
  with pytest.raises(ValueError, match='ended after 3 of the 5 training batches'):
    prebuilt.write(str(tmp_path), describe(steps=5), lambda: batches(3), dict, {}, None)
  assert sorted(os.listdir(tmp_path)) == [prebuilt.key(desc)]  # the failed write left nothing
  # An empty eval split is refused when written (its reader had no array to take a length from).
  with pytest.raises(ValueError, match=r'^the evaluation data of t is empty'):
    prebuilt.write(str(tmp_path), describe(steps=6), lambda: batches(6), lambda: {'t': iter(())},
                   {}, None)
  assert sorted(os.listdir(tmp_path)) == [prebuilt.key(desc)]
  # The data layer's bindings are not in the key (a reader cannot see them): batches written
  # with others are refused, not reused.
  corpus = {'local_corpus_files': {'pattern': '/data/a/*.txt'}}
  prebuilt.write(str(tmp_path / 'c'), desc, lambda: batches(4), dict, {}, None, corpus)
  prebuilt.write(str(tmp_path / 'c'), desc, lambda: built.append(1) or batches(4), dict, {}, None, corpus)
  assert not built
  with pytest.raises(ValueError, match=r"other data-layer bindings \(\{'local_corpus_files': "
                     r"\{'pattern': '/data/a/\*.txt'\}\}; this run: .*/data/b/.*use another --batches_dir"):
    prebuilt.write(str(tmp_path / 'c'), desc, lambda: batches(4), dict, {}, None,
                   {'local_corpus_files': {'pattern': '/data/b/*.txt'}})
  # A configurable the data layer gained since, unbound, is no change (span_corruption's: the
  # batches of every run were refused when it came).
  prebuilt.write(str(tmp_path / 'c'), desc, lambda: built.append(1) or batches(4), dict, {}, None,
                 {**corpus, 'span_corruption': {}})
  assert not built


def test_the_key_follows_everything_that_decides_the_batches():
  base = describe()
  assert prebuilt.key(base) == prebuilt.key(describe())
  for other in (describe(seed=1), describe(steps=5), describe(eval_batches=3),
                describe(batch_size=64), describe(task_feature_lengths={'targets': 32}),
                describe(init_checkpoint='/runs/pretrained/checkpoint_100'),
                dict(base, architecture='encoder_decoder')):
    assert prebuilt.key(other) != prebuilt.key(base)


def test_missing_batches_say_how_to_write_them(tmp_path):
  with pytest.raises(FileNotFoundError, match='no pre-built batches .* --write_batches'):
    prebuilt.Prebuilt(str(tmp_path), describe())
  # Memory-mapped local files: a bucket is refused (it was written to a local './gs:/...').
  assert prebuilt.local_root(str(tmp_path)) == str(tmp_path)
  with pytest.raises(ValueError, match='--batches_dir=gs://b/batches: .* give a local directory'):
    prebuilt.local_root('gs://b/batches')


@pytest.mark.parametrize('damage', ['deleted', 'cut', 'meta', 'deleted_eval'])
def test_damaged_batches_are_one_error_saying_to_write_them_again(tmp_path, damage):
  """Was: a deleted feature file trained on without it (or a 50-line traceback at the first step),
  a cut one or a damaged data.json an error naming no file."""
  desc = describe(eval_batches=2)
  directory = prebuilt.write(str(tmp_path / 'b'), desc, lambda: batches(10),
                             lambda: {'t': batches(3, seed=1)}, {}, 100)
  target = {'deleted': 'train/weights.npy', 'cut': 'train/tokens.npy', 'meta': prebuilt.META,
            'deleted_eval': 'eval0/tokens.npy'}[damage]
  path = os.path.join(directory, target)
  if damage.startswith('deleted'):
    os.remove(path)
  else:
    with open(path, 'r+b') as f:
      f.truncate(os.path.getsize(path) // 2)
  says = {'deleted': r'train/weights.npy is missing', 'cut': r'ValueError: ',
          'meta': r'data.json: JSONDecodeError', 'deleted_eval': r'eval0/tokens.npy is missing'}[damage]
  with pytest.raises(ValueError, match=rf'the pre-built batches in {directory} are damaged \(.*{says}'
                                       r'.*\): remove that directory and write them again with the '
                                       r'same t5xv-train command and --write_batches'):
    data = prebuilt.Prebuilt(str(tmp_path / 'b'), desc)
    data.train(), data.evals()


# Runs t5xv-train with TensorFlow, seqio and TFDS made unimportable.
WITHOUT_TF = '''
import sys
for name in ('tensorflow', 'seqio', 'tensorflow_datasets'):
  sys.modules[name] = None
from t5x_variants.cli import train
sys.exit(train.main(sys.argv[1:]))
'''


@needs_data_layer
@pytest.mark.slow
def test_a_run_from_prebuilt_batches_without_tensorflow_matches_the_data_layer_run(tmp_path):
  bin_dir = os.path.dirname(sys.executable)
  flags = ['--gin_file=gin/experiments/stability/lm_small.gin', '--gin.TRAIN_STEPS=6',
           '--gin.train.log_period=2', '--gin.train.eval_period=3', '--gin.train.eval_batches=2',
           '--gin.TransformerConfig.num_decoder_layers=1']
  run = lambda cmd, d: subprocess.run([*cmd, *flags, f'--gin.MODEL_DIR="{tmp_path / d}"'],
                                      cwd=REPO, capture_output=True, text=True)
  train = os.path.join(bin_dir, 't5xv-train')
  out = run([train], 'reference')
  assert out.returncode == 0, out.stderr
  missing = run([sys.executable, '-c', WITHOUT_TF, f'--batches_dir={tmp_path / "b"}'], 'nothing')
  assert missing.returncode == 2
  assert 'error: no pre-built batches' in missing.stderr and '--write_batches' in missing.stderr
  out = run([train, f'--batches_dir={tmp_path / "b"}', '--write_batches'], 'unused')
  assert out.returncode == 0 and out.stdout.startswith('batches: '), out.stderr
  assert not (tmp_path / 'unused').exists()  # writing batches trains nothing
  out = run([sys.executable, '-c', WITHOUT_TF, f'--batches_dir={tmp_path / "b"}'], 'prebuilt')
  assert out.returncode == 0, out.stderr
  records = lambda d: [json.loads(l) for l in (tmp_path / d / 'metrics.jsonl').read_text().split('\n')
                       if l]
  losses = lambda d: [(r['step'], r['kind'], r['loss']) for r in records(d)]
  assert losses('prebuilt') == losses('reference')
  assert [r['kind'] for r in records('prebuilt')].count('eval') == 3  # steps 0, 3, 6
  assert (tmp_path / 'prebuilt' / 'vocab.model').read_bytes() == (
      tmp_path / 'reference' / 'vocab.model').read_bytes()
  # resumed from the data layer, the run cannot take the pre-built position: one line that says so
  out = run([train, '--gin.TRAIN_STEPS=8'], 'prebuilt')
  assert out.returncode == 2 and 'cannot take its data position' in out.stderr, out.stderr[-2000:]
  assert 'pre-built batches (--batches_dir) where the run that wrote it read' in out.stderr


@needs_data_layer
def test_dataset_config_is_the_data_layers():
  from t5x_variants.data import pipeline  # pylint: disable=g-import-not-at-top
  assert pipeline.DatasetConfig is DatasetConfig
  assert [f.name for f in dataclasses.fields(DatasetConfig)][:2] == ['mixture_or_task_name',
                                                                      'task_feature_lengths']
