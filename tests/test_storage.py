"""Run directories on an object store, offline: a ``mock://`` scheme registered with etils epath
(the abstraction every run-directory read and write goes through) keeps its objects under a local
directory and, like a bucket, refuses to append. A run, its resume, t5xv-eval and t5xv-infer
against ``mock://bucket/run`` must leave every file there, append nowhere, and create no local
directory named after the URI."""
import json
import os

import gin
import pytest
from etils import epath
from etils.epath import gpath

from t5x_variants.train import storage

STORE = {}  # 'root': the local directory behind mock://


class MockStorePath(gpath.PosixGPath):
  """mock://bucket/x -> STORE['root']/bucket/x; opening for append is an error, as on GCS."""

  @property
  def _path_str(self):
    if self.parts and self.parts[0] == 'mock:':
      return os.path.join(STORE['root'], *self.parts[1:])
    return super()._path_str

  def open(self, mode='r', *args, **kwargs):  # pylint: disable=arguments-differ
    if 'a' in mode:
      raise AssertionError(f'append to {self} on an object store')
    return super().open(mode, *args, **kwargs)


epath.register_path_cls('mock://')(MockStorePath)


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  STORE['root'] = str(tmp_path / 'store')
  monkeypatch.chdir(tmp_path)  # a plain open('mock://...') would create tmp_path/mock:
  yield tmp_path / 'store' / 'bucket'
  assert not (tmp_path / 'mock:').exists(), 'a file was written with local calls'


def test_an_appended_file_on_a_store_is_one_object_per_writer_session(bucket):
  """Two writers at once (a run and a t5xv-eval beside it) lose nothing of each other's."""
  run = storage.AppendedFile('mock://bucket/run/metrics.jsonl', flush_secs=3600)
  run.write('1\n')
  assert not list((bucket / 'run').iterdir())  # buffered until the period or close
  run.flush()
  evaluation = storage.AppendedFile('mock://bucket/run/metrics.jsonl')
  evaluation.write('eval\n')
  run.write('2\n')
  evaluation.close()
  run.close()
  objects = sorted(p.name for p in (bucket / 'run').iterdir())
  assert len(objects) == 2 and all(o.startswith('metrics.') and o.endswith('.jsonl') for o in objects)
  assert sorted(storage.read_appended('mock://bucket/run/metrics.jsonl').splitlines()) == ['1', '2', 'eval']
  local = bucket.parent / 'local.jsonl'  # a local file is appended to, in place
  for text in ('a\n', 'b\n'):
    f = storage.AppendedFile(str(local))
    f.write(text)
    f.close()
  assert storage.read_appended(str(local)) == local.read_text() == 'a\nb\n'


def test_scheme_and_join_keep_uris():
  assert storage.scheme('gs://b/run') == 'gs' and storage.scheme('/tmp/gs://x') == ''
  assert storage.join('gs://b/run/', 'tensorboard') == 'gs://b/run/tensorboard'
  assert storage.join('/tmp/run', 'a', 'b') == '/tmp/run/a/b'


@pytest.mark.slow
def test_train_resume_eval_and_infer_on_a_store(bucket):
  from t5x_variants.cli import eval as eval_cli, infer, train  # pylint: disable=g-import-not-at-top
  run = 'mock://bucket/run'
  tiny = ["--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", '--gin.BATCH_SIZE=4',
          '--gin.train.log_period=2', '--gin.train.eval_period=4', '--gin.train.eval_batches=1',
          '--gin.Checkpointer.period=4', '--gin.train.diagnostics_period=4', f"--gin.MODEL_DIR='{run}'"]
  def main(command, *args):  # each command reads its own gin files, as in its own process
    gin.clear_config()
    return command.main(list(args))
  train_args = ['--gin_file=gin/experiments/quickstart.gin', *tiny]
  assert main(train, *train_args, '--gin.TRAIN_STEPS=4') == 0
  assert main(train, *train_args, '--gin.TRAIN_STEPS=8') == 0  # resumes from checkpoint_4
  names = set(os.listdir(bucket / 'run'))
  assert {'config.gin', 'model-info.txt', 'vocab.model', 'tensorboard', 'diagnostics.npz',
          'checkpoint_4', 'checkpoint_8'} <= names, names
  records = [json.loads(l) for l in storage.read_appended(f'{run}/metrics.jsonl').splitlines()]
  assert [r['step'] for r in records if r['kind'] == 'train'] == [2, 4, 6, 8]  # both sessions
  assert os.listdir(bucket / 'run' / 'tensorboard')

  assert main(eval_cli, f'--gin_file={run}/config.gin', '--gin_file=gin/runs/eval.gin',
              f"--gin.CHECKPOINT_PATH='{run}'", '--gin.EVAL_ALL=True',
              '--gin.evaluate_checkpoints.max_batches=1', '--gin.evaluate_checkpoints.max_examples=2') == 0
  results = json.loads((bucket / 'run' / 'eval_results.json').read_text())['validation']
  assert {'4', '8'} <= set(results)
  from t5x_variants.sweeps import runs  # pylint: disable=g-import-not-at-top
  record = runs.read_run(run)  # what t5xv-report reads
  assert record.total_steps == 8 and [s for s, _ in record.eval_curve()] == [4, 8]

  texts = 'mock://bucket/texts.txt'
  storage.write_text(texts, 'Return the number of items.\n')
  assert main(infer, f'--gin_file={run}/config.gin', '--gin_file=gin/runs/infer.gin',
              f"--gin.CHECKPOINT_PATH='{run}'", f"--gin.INPUT_FILE='{texts}'",
              f"--gin.INFER_OUTPUT='{run}/predictions.jsonl'") == 0
  (row,) = [json.loads(l) for l in (bucket / 'run' / 'predictions.jsonl').read_text().splitlines()]
  assert row['inputs'] == 'Return the number of items.' and row['prediction']


def test_write_text_replaces_a_file_whole_or_not_at_all(tmp_path, monkeypatch):
  """A write that dies half-way (a kill, a full disk) leaves the previous eval_results.json or
  config.gin as it was, and its temporary file is removed."""
  target = tmp_path / 'eval_results.json'
  storage.write_text(target, '{"10": {}}')
  real = epath.Path.write_text

  def half_then_fail(self, text, *args, **kwargs):
    real(self, text[:len(text) // 2])
    raise OSError(28, 'No space left on device')
  monkeypatch.setattr(epath.Path, 'write_text', half_then_fail)
  with pytest.raises(OSError):
    storage.write_text(target, '{"10": {}, "20": {}}')
  assert target.read_text() == '{"10": {}}'
  assert [p.name for p in tmp_path.iterdir()] == ['eval_results.json']
  monkeypatch.undo()
  storage.write_text(target, '{"20": {}}')
  assert target.read_text() == '{"20": {}}'
  assert [p.name for p in tmp_path.iterdir()] == ['eval_results.json']
