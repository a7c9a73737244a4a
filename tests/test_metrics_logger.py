"""MetricsLogger's record read back as its readers see it: TensorBoard's own event reader and
metrics.jsonl."""
import json
import math
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

# TensorBoard reads event files with its TensorFlow stub when this module exists (its
# no_tensorflow build), so the reader here works the same with and without TensorFlow installed.
sys.modules.setdefault('tensorboard.compat.notf', types.ModuleType('tensorboard.compat.notf'))
from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top,wrong-import-position

from t5x_variants.train.metrics import MetricsLogger  # pylint: disable=wrong-import-position


def train_metrics(loss):
  return {'loss': loss, 'token_accuracy': 0.25, 'learning_rate': 0.01, 'tokens_per_second': 1234.0,
          'step_time': 0.125}


def read_events(model_dir):
  events = event_accumulator.EventAccumulator(str(model_dir / 'tensorboard'))
  events.Reload()
  return events


def scalars(events, tag):
  return [(e.step, e.value) for e in events.Scalars(tag)]


def f32(x):
  return float(np.float32(x))


def test_scalars_and_records(tmp_path, capsys):
  logger = MetricsLogger(str(tmp_path), total_steps=4)
  started = time.time()
  logger.train(2, train_metrics(2.718281828), 0, started)
  logger.eval(2, 'glue_cola', {'loss': float('nan'), 'accuracy': 0.6180339})
  logger.train(4, train_metrics(1.414213562), 0, started)
  logger.eval(4, 'glue_cola', {'loss': 3.0, 'accuracy': 0.7071067}, split='validation')
  logger.eval(4, 'glue_cola', {'loss': 5.0}, split='test')  # t5xv-eval on another split
  logger.close()

  events = read_events(tmp_path)
  assert sorted(events.Tags()['scalars']) == sorted(
      [f'train/{k}' for k in train_metrics(0)] +
      ['eval/glue_cola/loss', 'eval/glue_cola/accuracy', 'eval/glue_cola/test/loss',
       'eval/glue_cola/validation/loss', 'eval/glue_cola/validation/accuracy'])
  assert scalars(events, 'eval/glue_cola/test/loss') == [(4, 5.0)]
  assert scalars(events, 'train/loss') == [(2, f32(2.718281828)), (4, f32(1.414213562))]
  assert scalars(events, 'train/tokens_per_second') == [(2, 1234.0), (4, 1234.0)]
  # t5xv-eval's (with a split, validation too) apart from the run's own evals of the same step
  assert scalars(events, 'eval/glue_cola/accuracy') == [(2, f32(0.6180339))]
  assert scalars(events, 'eval/glue_cola/validation/accuracy') == [(4, f32(0.7071067))]
  (step2, nan), = scalars(events, 'eval/glue_cola/loss')
  assert step2 == 2 and math.isnan(nan)  # TensorBoard keeps NaN

  records = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert all(r.pop('time') >= started for r in records)
  assert records == [
      {'step': 2, 'kind': 'train', **train_metrics(2.718281828), 'start_step': 0},
      {'step': 2, 'kind': 'eval', 'task': 'glue_cola', 'loss': None, 'accuracy': 0.6180339},
      {'step': 4, 'kind': 'train', **train_metrics(1.414213562), 'start_step': 0},
      {'step': 4, 'kind': 'eval', 'task': 'glue_cola', 'split': 'validation', 'loss': 3.0,
       'accuracy': 0.7071067},
      {'step': 4, 'kind': 'eval', 'task': 'glue_cola', 'split': 'test', 'loss': 5.0}]
  console = capsys.readouterr().out.splitlines()
  assert console[0].startswith('step 2/4 loss 2.7183 token acc 0.2500 lr 1.00e-02 1,234 tok/s 125 ms/step')
  assert console[1] == 'eval glue_cola step 2: loss nan accuracy 0.6180'


def test_scalars_reach_the_disk_before_close(tmp_path):
  """A run that is killed keeps what it logged: the event file is flushed within seconds."""
  logger = MetricsLogger(str(tmp_path), console=False)
  logger.train(1, train_metrics(0.5), 0, time.time())
  deadline = time.time() + 10
  while 'train/loss' not in read_events(tmp_path).Tags()['scalars'] and time.time() < deadline:
    time.sleep(0.1)
  assert scalars(read_events(tmp_path), 'train/loss') == [(1, 0.5)]
  logger.close()


def test_a_quick_resume_keeps_both_event_files(tmp_path):
  for step in (1, 2):
    logger = MetricsLogger(str(tmp_path), console=False)
    logger.train(step, train_metrics(step / 4), 0, time.time())
    logger.close()
  assert len(list((tmp_path / 'tensorboard').iterdir())) == 2
  assert scalars(read_events(tmp_path), 'train/loss') == [(1, 0.25), (2, 0.5)]


def test_a_resumed_session_supersedes_the_earlier_records_of_later_steps(tmp_path):
  """Was: a session stopped at a non-finite step 6 (or killed after its checkpoint 4) left its
  record of step 6 in the resumed run's curve when the rerun, logging every 4 steps, never logged
  step 6 again; TensorBoard showed both sessions' points of the steps logged twice."""
  from t5x_variants.train.metrics import read_records  # pylint: disable=g-import-not-at-top
  first = MetricsLogger(str(tmp_path), console=False, start_step=0)
  for step, loss in ((4, 1.0), (5, 9.0), (6, float('nan'))):
    first.train(step, train_metrics(loss), 0, time.time())
  first.eval(4, 'cola', {'loss': 2.0})
  first.close()
  again = MetricsLogger(str(tmp_path), console=False, start_step=4)
  again.train(8, train_metrics(0.5), 4, time.time())
  again.close()
  assert [(r['kind'], r['step'], r.get('start_step')) for r in read_records(str(tmp_path))] == [
      ('train', 4, 0), ('eval', 4, None), ('train', 8, 4)]  # a train record names its session
  assert scalars(read_events(tmp_path), 'train/loss') == [(4, 1.0), (8, 0.5)]
  assert scalars(read_events(tmp_path), 'eval/cola/loss') == [(4, 2.0)]
  lines = (tmp_path / 'metrics.jsonl').read_text().splitlines()
  assert json.loads(lines[4]) == {'step': 4, 'kind': 'resumed'}
  # a session with nothing to supersede writes no such record
  MetricsLogger(str(tmp_path), console=False, start_step=8).close()
  assert len((tmp_path / 'metrics.jsonl').read_text().splitlines()) == len(lines)


def test_the_logger_does_not_import_tensorflow():
  code = "import sys, t5x_variants.train.metrics; assert 'tensorflow' not in sys.modules"
  subprocess.run([sys.executable, '-c', code], check=True)


def test_the_logger_does_not_load_torch_and_leaves_it_importable():
  """tensorboardX would import torch (seconds per training process); the logger hides it from that
  import only, so a later `import torch` (t5xv-bench --hf, t5xv-export) still works."""
  code = ('import sys, importlib.util; import t5x_variants.train.metrics; '
          "assert 'torch' not in sys.modules, 'torch loaded'; "
          "torch = importlib.util.find_spec('torch') and importlib.import_module('torch'); "
          "print('ok', bool(torch))")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
  assert out.returncode == 0 and out.stdout.startswith('ok'), out.stderr[-2000:]


def test_an_eval_step_is_evaluated_once_every_task_has_this_runs_record(tmp_path):
  """A resumed run redoes an eval step's eval unless each of its tasks has a record of the run's
  own: a stop between two tasks of a mixture, or t5xv-eval's records (with a split) beside it,
  do not count as the eval done."""
  logger = MetricsLogger(str(tmp_path), total_steps=4)
  logger.eval(4, 'cola', {'loss': 1.0})
  logger.eval(4, 'rte', {'loss': 2.0}, split='validation')  # t5xv-eval's
  logger.eval(2, 'rte', {'loss': 2.0})
  logger.close()
  reader = MetricsLogger(str(tmp_path), total_steps=4)
  assert reader.evaluated(4, ['cola']) and not reader.evaluated(4, ['cola', 'rte'])
  assert reader.evaluated(2, ['rte']) and not reader.evaluated(6, ['rte'])
  reader.close()


def test_a_log_window_averages_the_loss_over_steps_and_the_accuracy_over_tokens():
  """T5X's metrics: ``loss`` a mean over the steps, ``accuracy`` over the tokens (a step of 30
  tokens counts three times one of 10); a skipped step is left out of both."""
  from t5x_variants.train.meter import _summarize  # pylint: disable=g-import-not-at-top
  step = lambda loss, accuracy, tokens, skipped=0: (
      {'loss': loss, 'z_loss': 0.0, 'token_accuracy': accuracy, 'num_tokens': tokens, 'grad_norm': 1.0,
       'learning_rate': 0.01, 'param_norm': 2.0, 'skipped': skipped}, 100, 4, 0.5)
  summary = _summarize([step(3.0, 0.5, 30.0), step(6.0, 1.0, 10.0), step(float('nan'), 0.0, 50.0, 1)])
  assert summary['loss'] == 4.5 and summary['num_tokens'] == 20.0 and summary['skipped'] == 1
  assert summary['token_accuracy'] == 0.625


def test_a_pause_is_left_out_of_the_step_times(monkeypatch):
  """A checkpoint, eval or diagnostics between two steps (``resume`` after it) is not the next
  step's time: two 1-second steps around a 10-second pause log 1 s per step, 2 steps' tokens in
  2 s (without ``resume``: 6 s per step)."""
  from t5x_variants.train import meter  # pylint: disable=g-import-not-at-top
  now = [100.0]
  monkeypatch.setattr(meter.time, 'time', lambda: now[0])
  logged = []
  logger = types.SimpleNamespace(train=lambda step, summary, *_: logged.append((step, summary)))
  step = {'loss': 1.0, 'z_loss': 0.0, 'token_accuracy': 0.5, 'num_tokens': 8.0, 'grad_norm': 1.0,
          'learning_rate': 0.01, 'param_norm': 2.0, 'skipped': 0}
  m = meter.TrainMeter(logger, start=0, log_period=2, total_steps=4)
  now[0] = 101.0
  m.add(step, 100, 4)
  m.log(1)
  now[0] = 111.0  # a checkpoint's save ends
  m.resume()
  now[0] = 112.0
  m.add(step, 100, 4)
  m.log(2)
  assert [s for s, _ in logged] == [2]
  assert logged[0][1]['step_time'] == 1.0 and logged[0][1]['tokens_per_second'] == 100.0


@pytest.mark.parametrize('code', [28, 5])
def test_a_tensorboard_write_that_fails_on_its_thread_stops_the_logger_not_hangs_it(tmp_path, code):
  """tensorboardX writes on its own thread: one failed flush there (a bucket past its retries, a
  full disk) ended it, and the next record's scalars waited forever on its full queue. The error
  raised is the thread's: a full disk's errno (the command's line says so: it said only 'the
  error is above', and a full-disk run's line depended on which write failed first)."""
  import threading  # pylint: disable=g-import-not-at-top

  logger = MetricsLogger(str(tmp_path), console=False)
  worker = logger._tensorboard_worker()  # pylint: disable=protected-access

  def failing_flush():
    raise OSError(code, f'{os.strerror(code)} (injected)')
  worker._record_writer.flush = failing_flush  # pylint: disable=protected-access
  errors = []

  def log():
    try:
      for step in range(1, 50):
        logger.train(step, {'loss': 1.0, 'token_accuracy': 0.5}, 0, time.time())
        time.sleep(0.05)
    except OSError as e:
      errors.append(e)
  thread = threading.Thread(target=log, daemon=True)
  thread.start()
  thread.join(30)
  assert not thread.is_alive() and errors, 'the logger hung on the dead writer thread'
  if code == 28:
    assert errors[0].errno == 28 and errors[0].strerror == 'No space left on device (injected)'
    assert errors[0].filename == f'the TensorBoard events of {tmp_path}'
  else:
    assert str(errors[0]).startswith(f'writing the TensorBoard events of {tmp_path} failed (OSError: '
                                     '[Errno 5] Input/output error (injected)): fix its cause')
  with pytest.raises(OSError):
    logger.close()


def test_records_of_other_types_than_the_loggers_write_are_skipped(tmp_path):
  """Was: a record with "loss": "oops" crashed t5xv-report with a TypeError traceback."""
  from t5x_variants.train.metrics import read_records  # pylint: disable=g-import-not-at-top
  lines = [{'step': 1, 'kind': 'train', 'loss': 2.0}, {'step': 2, 'kind': 'train', 'loss': 'oops'},
           {'step': '3', 'kind': 'train', 'loss': 1.0}, [4], {'step': 5, 'kind': 'eval', 'task': 7},
           {'step': 6, 'kind': 'train', 'loss': True}, {'step': 7, 'kind': 'eval', 'task': 't',
                                                          'loss': None, 'split': 'test'}]
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in lines))
  assert [r['step'] for r in read_records(str(tmp_path))] == [1, 7]


def test_json_lines_write_a_non_finite_number_as_null_at_any_depth():
  """(json.dumps writes NaN / -Infinity, which is not JSON: a diverged run's loss, a beam's score)"""
  from t5x_variants.train.metrics import json_line  # pylint: disable=g-import-not-at-top
  line = json_line({'loss': float('nan'), 'predictions': [{'score': float('-inf')}, {'score': -1.5}]})
  assert json.loads(line) == {'loss': None, 'predictions': [{'score': None}, {'score': -1.5}]}
  assert line.endswith('\n') and line.count('\n') == 1
