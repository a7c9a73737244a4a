"""One outcome for every process (train/multihost.py), with the exchange between two processes
faked: this process is one of two, and the other's part is scripted. The real exchange between
two processes is in tests/test_trainer.py (``test_evaluation_data_that_differs_on_one_process_
stops_both``)."""
import errno
import os
import time

import jax
import numpy as np
import pytest

from t5x_variants.train import multihost, trainer
from t5x_variants.train.metrics import MetricsLogger


def two_processes(monkeypatch):
  """Makes this process one of 2 (process 0 unless ``jax.process_index`` is patched); ``.codes``
  of what it returns are the codes the other contributes to the next exchanges, in order ('end'
  of a batch iterator: None's code)."""
  class Other:
    codes = []
  monkeypatch.setattr(jax, 'process_count', lambda: 2)

  def allgather(x):
    code = Other.codes.pop(0)
    codes = [int(x), multihost.fingerprint(None) if code == 'end' else code]
    return np.asarray(codes[::-1] if jax.process_index() == 1 else codes)
  monkeypatch.setattr(multihost.multihost_utils, 'process_allgather', allgather)
  return Other


@pytest.fixture
def other(monkeypatch):
  return two_processes(monkeypatch)


def test_agree_raises_this_processs_error_or_names_the_other(other):
  other.codes = [0, 0, -2, -2]
  assert multihost.agree('x', lambda: 3) == 3
  mine = ValueError('my own line')
  def fail():
    raise mine
  with pytest.raises(ValueError) as raised:
    multihost.agree('x', fail)
  assert raised.value is mine  # the process that failed keeps its own error
  with pytest.raises(multihost.ProcessError,
                     match=r'^reading the data failed on process 1 \(its log says why\)'):
    multihost.agree('reading the data', lambda: 3)
  with pytest.raises(ValueError) as raised:
    multihost.agree('x', fail)  # both failed: still its own
  assert raised.value is mine


def test_same_compares_every_processs_value(other):
  batch = {'tokens': np.arange(6, dtype=np.int32).reshape(2, 3)}
  other.codes = [multihost.fingerprint(batch),
                 multihost.fingerprint(dict(batch, tokens=batch['tokens'] + 1)), 'end']
  assert multihost.same('the batch', lambda: batch) is batch
  with pytest.raises(ValueError, match=r'^the processes disagree on the batch: process 0 has one, '
                     r'process 1 has another; every process must read the same'):
    multihost.same('the batch', lambda: batch)
  with pytest.raises(ValueError, match=r'process 0 has one, process 1 has none;'):
    multihost.same('the batch', lambda: batch)
  other.codes = [multihost.fingerprint(batch)]
  with pytest.raises(ValueError, match=r'process 0 has none, process 1 has one;'):
    multihost.same('the batch', lambda: None)
  other.codes = [multihost.fingerprint([1, 2])]
  assert multihost.same('x', lambda: ('vocabulary', [1, 2]), key=lambda v: v[1]) == (
      'vocabulary', [1, 2])
  other.codes = [0]
  with pytest.raises(TypeError):  # a key that fails here is this process's error, agreed
    multihost.same('x', lambda: {1: 'a', 'b': 2}, key=lambda v: multihost.fingerprint(v))


def test_a_fingerprint_sees_values_dtypes_and_shapes_not_key_order():
  a = {'x': np.zeros((2, 3), np.int32), 'y': [1, 'two']}
  assert multihost.fingerprint(a) == multihost.fingerprint(
      {'y': [1, 'two'], 'x': np.zeros((2, 3), np.int32)})
  for b in ({'x': np.zeros((3, 2), np.int32), 'y': [1, 'two']},
            {'x': np.zeros((2, 3), np.int64), 'y': [1, 'two']},
            {'x': np.zeros((2, 3), np.int32), 'y': [1, 'three']},
            {'x': np.ones((2, 3), np.int32), 'y': [1, 'two']}):
    assert multihost.fingerprint(a) != multihost.fingerprint(b)
  assert 0 <= multihost.fingerprint(a) < 2 ** 31 and multihost.fingerprint(None) == -1
  # Strings in object arrays (a task's answers) by value: their bytes are the objects' addresses.
  texts = lambda: np.array([''.join(['an', 'swer']), ''.join(['ot', 'her'])], dtype=object)
  mine, theirs = texts(), texts()  # equal strings, other objects
  assert multihost.fingerprint({'answers': mine}) == multihost.fingerprint({'answers': theirs})
  assert multihost.fingerprint(mine) != multihost.fingerprint(mine[::-1])


def test_batches_that_end_early_or_differ_on_another_process_stop_both(other):
  """Evaluation's batches go through ``same_batches``: a process whose data ends early would
  leave the others in the next eval step; one whose batch differs would compute another mean."""
  batches = [{'t': np.full((2, 2), i, np.int32)} for i in range(3)]
  other.codes = [multihost.fingerprint(b) for b in batches] + ['end']
  assert [b['t'][0, 0] for b in multihost.same_batches('data', batches)] == [0, 1, 2]
  other.codes = [multihost.fingerprint(batches[0]), 'end']
  with pytest.raises(ValueError, match=r'^the processes disagree on the evaluation data of glue '
                     r'\(batch 2\): process 0 has one, process 1 has none;'):
    list(multihost.same_batches('the evaluation data of glue', batches))
  other.codes = [multihost.fingerprint(batches[0]), 7]
  with pytest.raises(ValueError, match=r'\(batch 2\): process 0 has one, process 1 has another;'):
    list(multihost.same_batches('data', batches))
  other.codes = [multihost.fingerprint(batches[0]), multihost.fingerprint(batches[1]), 'end']
  assert len(list(multihost.same_batches('data', batches[:2] + [None]))) == 2  # both end at once


def test_a_host_whose_training_data_is_empty_stops_every_process(other):
  """The first batch is read by all at once: empty data on process 1 alone is one error on both
  (before, process 1 went to its final save while process 0 stepped alone)."""
  other.codes = [0, 1]  # process 1 read without error, and had no batch
  with pytest.raises(ValueError, match=r'^the training data of process 1 has no batch while the '
                     'others have one'):
    trainer._first_batch(iter([{'t': np.zeros(2)}]))  # pylint: disable=protected-access
  other.codes = [0, 1]
  assert trainer._first_batch(iter([])) is None  # pylint: disable=protected-access


def test_process0_says_asks_process_0_alone_and_agrees_on_its_failure(monkeypatch):
  """The question is asked on process 0 only; if it raises there, every process raises (the
  others a ProcessError), instead of the others waiting for process 0's broadcast."""
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(multihost.multihost_utils, 'broadcast_one_to_all', np.asarray)
  assert multihost.process0_says('x', lambda: True) is True
  def fail():
    raise PermissionError('403 on the bucket')
  with pytest.raises(PermissionError, match='403'):
    multihost.process0_says('x', fail)
  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  asked = []
  monkeypatch.setattr(multihost.multihost_utils, 'broadcast_one_to_all', lambda x: np.asarray(-2))
  with pytest.raises(multihost.ProcessError, match=r'^looking for r failed on process 0'):
    multihost.process0_says('looking for r', lambda: asked.append(1))
  assert not asked


def test_process0_json_gives_process_0s_value_or_its_failure(monkeypatch):
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  sent = []
  def broadcast(x):  # as process 0: what it sends comes back
    sent.append(np.asarray(x))
    return np.asarray(x)
  monkeypatch.setattr(multihost.multihost_utils, 'broadcast_one_to_all', broadcast)
  assert multihost.process0_json('x', lambda: {'1': [2, 3]}) == {'1': [2, 3]}
  assert sent[0] == len(b'{"1": [2, 3]}')
  def fail():
    raise OSError('cannot read')
  with pytest.raises(OSError, match='cannot read'):
    multihost.process0_json('x', fail)
  monkeypatch.setattr(jax, 'process_index', lambda: 1)  # as process 1: process 0's failure
  monkeypatch.setattr(multihost.multihost_utils, 'broadcast_one_to_all', lambda x: np.asarray(-2))
  with pytest.raises(multihost.ProcessError, match=r'^reading r.json failed on process 0'):
    multihost.process0_json('reading r.json', lambda: {})


def test_a_train_record_process_0_cannot_write_stops_every_process_at_the_next_check(
    other, tmp_path, monkeypatch):
  """Process 0 alone writes metrics.jsonl. A train record it cannot write (a full disk) is held
  there, not raised (the others are already in the next step), until the check every process
  makes before a checkpoint is saved; later records are not attempted. With one process it
  raises at once, as before."""
  metrics = dict(loss=1.0, token_accuracy=0.5, learning_rate=0.01, tokens_per_second=1.0,
                 step_time=0.1)
  other.codes = [0]  # the files opened on process 0, agreed
  logger = MetricsLogger(str(tmp_path), console=False)
  attempts = []
  def full(line):
    attempts.append(line)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(logger._jsonl, 'write', full)  # pylint: disable=protected-access
  logger.train(1, metrics, 0, time.time())
  logger.train(2, metrics, 0, time.time())
  assert len(attempts) == 1
  other.codes = [0]
  with pytest.raises(OSError, match='No space left on device'):
    logger.check()
  other.codes = [0]
  with pytest.raises(OSError, match='No space left on device'):
    logger.eval(2, 'task', {'loss': 1.0})  # and every agreed record after it
  monkeypatch.setattr(jax, 'process_count', lambda: 1)
  logger = MetricsLogger(str(tmp_path / 'one'), console=False)
  monkeypatch.setattr(logger._jsonl, 'write', full)  # pylint: disable=protected-access
  with pytest.raises(OSError, match='No space left on device'):
    logger.train(1, metrics, 0, time.time())


def test_processes_that_read_other_metadata_of_a_checkpoint_stop_together(monkeypatch, tmp_path):
  """What each process decides from a checkpoint's metadata (another model? parameters only?)
  it decides from its own read: the arrays' names and shapes are compared, so processes that
  read different metadata (a stale view of a store) stop together instead of going different
  ways."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import checkpoint_reads, checkpoints  # pylint: disable=g-import-not-at-top
  ckpt = checkpoints.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(1, {'params': {'w': jnp.zeros((2, 3))}}, force=True)
  ckpt.close()
  path, other = tmp_path / 'checkpoint_1', two_processes(monkeypatch)  # saved by one process
  other.codes = [0, multihost.fingerprint({'params/w': (2, 3)})]  # the read, then the same shapes
  assert checkpoint_reads.array_shapes(checkpoint_reads.saved_tree(path)) == {'params/w': (2, 3)}
  other.codes = [0, multihost.fingerprint({'params/w': (3, 2)})]
  with pytest.raises(ValueError, match=r'^the processes disagree on the arrays saved in .*'
                     r'checkpoint_1: process 0 has one, process 1 has another'):
    checkpoint_reads.saved_tree(path)


def test_closing_the_records_fails_on_every_process_or_on_none(other, tmp_path, monkeypatch):
  """On an object store metrics.jsonl is uploaded when it is closed: a close that fails on
  process 0 raises on every process (before, process 0 alone exited with an error), except on
  an error path, where process 0 closes alone."""
  other.codes = [0]
  logger = MetricsLogger(str(tmp_path), console=False)
  def lost():
    raise OSError('the upload failed')
  monkeypatch.setattr(logger._jsonl, 'close', lost)  # pylint: disable=protected-access
  other.codes = [0]
  with pytest.raises(OSError, match='the upload failed'):
    logger.close()
  with pytest.raises(OSError, match='the upload failed'):
    logger.close(agreed=False)  # nothing exchanged: no code of the other's is left to take
  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  other.codes = [-2]  # process 0's close failed
  follower = MetricsLogger.__new__(MetricsLogger)
  follower.model_dir, follower.enabled = str(tmp_path), False
  with pytest.raises(multihost.ProcessError,
                     match=r'^closing .*metrics.jsonl failed on process 0 \(its log says why\)'):
    follower.close()
  follower.close(agreed=False)  # nothing to close, nothing exchanged
  # A train record process 0 could not write (held) is raised at the close too, on every process.
  monkeypatch.setattr(jax, 'process_index', lambda: 0)
  other.codes = [0]
  logger = MetricsLogger(str(tmp_path / 'held'), console=False)
  logger._held = OSError('a train record was not written')  # pylint: disable=protected-access
  other.codes = [0]
  with pytest.raises(OSError, match='a train record was not written'):
    logger.close()
