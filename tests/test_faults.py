"""The fault matrix: a run killed or corrupted at one phase, then rerun with the same command,
ends with exactly the losses of an uninterrupted run, or stops with one clear line; no completed
checkpoint or metric record is lost. Each test is one row of the README's reliability table.

Every run sees the same batches (``StepBatches``: batch i at step i) and logs every step, so each
is compared with one straight 6-step reference run (checkpoints at steps 2, 4 and 6)."""
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import needs_data_layer, tiny
from t5x_variants.cli import eval as eval_cli
from t5x_variants.sweeps.runs import read_run
from t5x_variants.train import checkpoints, pretrained
from train_helpers import FullDisk, StepBatches, eval_batches, run_train, saved_state, train_losses
from test_trainer import finish, subprocess_train, wait_for_steps  # noqa: F401 (a fixture)

STEPS = 6


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """(model_dir, {step: loss}) of 6 straight steps on one device, with evals every 2 steps."""
  model_dir = tmp_path_factory.mktemp('reference')
  run_train(model_dir, STEPS, eval_data=eval_batches, eval_period=2)
  return model_dir, train_losses(model_dir)


def complete_records(model_dir):
  """The metric records of ``model_dir`` whose line was written whole (not a line cut short)."""
  records = []
  for line in (model_dir / 'metrics.jsonl').read_text().splitlines(keepends=True):
    try:
      records.append(json.loads(line) if line.endswith('\n') else None)
    except json.JSONDecodeError:
      pass
  return [r for r in records if r is not None]


def committed(model_dir):
  return [p.name for p in checkpoints.list_checkpoints(str(model_dir))]


def assert_nothing_lost(model_dir, before_checkpoints, before_records, ref):
  """The rerun's losses are the reference's, step for step (the latest record of each step), and
  every checkpoint and whole metric record there before the rerun is still there."""
  assert read_run(str(model_dir)).step == STEPS
  assert {r['step']: r['loss'] for r in read_run(str(model_dir)).train} == ref
  assert set(before_checkpoints) <= set(committed(model_dir))
  after = complete_records(model_dir)
  assert all(r in after for r in before_records)


@pytest.mark.slow
@pytest.mark.parametrize('phase, at, resumes_from', [
    ('step', 3, (0, 2)),        # step 3 dispatched; checkpoint_2's asynchronous save may be unfinished
    ('save', 4, (2,)),          # checkpoint_4 written to its temporary directory, not committed
    ('committed', 4, (4,)),     # just after checkpoint_4's commit
    ('eval', 4, (4,)),          # mid-eval at step 4, after checkpoint_4's commit: the eval redone
])
def test_sigkill_then_rerun_resumes_exactly(phase, at, resumes_from, reference, tmp_path,
                                            subprocess_train):
  _, ref = reference
  proc = subprocess_train('kill', tmp_path, STEPS, phase, at)
  out, _ = proc.communicate(timeout=240)
  assert proc.returncode == -signal.SIGKILL and f'KILL {phase} {at}' in out, out[-3000:]
  before_checkpoints, before_records = committed(tmp_path), complete_records(tmp_path)
  resumed = max([int(n.split('_')[1]) for n in before_checkpoints] or [0])
  assert resumed in resumes_from
  if phase == 'save':  # the half-written save is on disk, but no listing or restore reads it
    assert list(tmp_path.glob(f'checkpoint_{at}.orbax-checkpoint-tmp*'))
    assert before_checkpoints == ['checkpoint_2']
  run_train(tmp_path, STEPS, eval_data=eval_batches, eval_period=2)
  assert_nothing_lost(tmp_path, before_checkpoints, before_records, ref)
  assert not list(tmp_path.glob('*.orbax-checkpoint-tmp*'))  # the rerun deleted the unfinished save
  steps = [r['step'] for r in complete_records(tmp_path) if r['kind'] == 'train']
  assert steps[len(steps) - (STEPS - resumed):] == list(range(resumed + 1, STEPS + 1))
  evals = {r['step'] for r in complete_records(tmp_path) if r['kind'] == 'eval'}
  assert evals == {2, 4, 6}  # an eval lost after its step's checkpoint is redone on resuming
  if phase == 'eval':
    assert 4 not in {r['step'] for r in before_records if r['kind'] == 'eval'}


@pytest.mark.slow
def test_a_metrics_line_cut_mid_write_is_left_and_the_next_record_starts_a_new_line(
    reference, tmp_path, subprocess_train):
  """Killed after checkpoint_4's commit, with the last line of metrics.jsonl then cut in half (a
  write that hit a full disk): the rerun appends on a new line, so only the cut record is
  unreadable, kept as it was; every whole record and the reference losses are there."""
  _, ref = reference
  proc = subprocess_train('kill', tmp_path, STEPS, 'committed', 4)
  proc.communicate(timeout=240)
  metrics = tmp_path / 'metrics.jsonl'
  text = metrics.read_text()
  cut = text[:len(text) - len(text.splitlines()[-1]) // 2 - 1]
  metrics.write_text(cut)
  before = complete_records(tmp_path)
  run_train(tmp_path, STEPS, eval_data=eval_batches, eval_period=2)
  lines = metrics.read_text().splitlines()
  assert metrics.read_text().startswith(cut)
  unreadable = []
  for line in lines:
    try:
      json.loads(line)
    except json.JSONDecodeError:
      unreadable.append(line)
  assert unreadable == [cut.splitlines()[-1]]
  assert_nothing_lost(tmp_path, ['checkpoint_2', 'checkpoint_4'], before, ref)


@pytest.mark.parametrize('damage', ['truncated', 'deleted', 'a bit flipped'])
def test_a_damaged_file_in_the_newest_checkpoint_falls_back_and_keeps_it(
    damage, reference, tmp_path, caplog):
  """The largest array file of checkpoint_6 truncated to half, deleted, or with one bit flipped
  (which still decodes: it was restored with other values, silently): the rerun says which
  checkpoint it cannot read and why, moves it aside as ``checkpoint_6.unreadable`` with every file
  it had (nothing deleted), resumes from checkpoint_4 and logs the reference losses of steps 5-6."""
  ref_dir, ref = reference
  model_dir = tmp_path / 'run'
  shutil.copytree(ref_dir, model_dir)
  files = [p for p in (model_dir / 'checkpoint_6' / 'state').rglob('*') if p.is_file()]
  largest = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(largest.read_bytes())
  if damage == 'truncated':
    largest.write_bytes(data[:len(data) // 2])
  elif damage == 'deleted':
    largest.unlink()
  else:  # in the middle of the largest file of array data (in a d/ folder, not metadata)
    held = max((p for p in files if p.parent.name == 'd'), key=lambda p: p.stat().st_size)
    data = bytearray(held.read_bytes())
    data[len(data) // 2] ^= 0x10
    held.write_bytes(data)
  kept = sorted(str(p.relative_to(model_dir / 'checkpoint_6'))
                for p in (model_dir / 'checkpoint_6').rglob('*'))
  run_train(model_dir, STEPS)
  assert f'checkpoint {model_dir / "checkpoint_6"} cannot be read' in caplog.text
  assert 'falling back to the previous one' in caplog.text
  if damage == 'a bit flipped':
    assert 'does not read as it was saved (its fingerprint differs' in caplog.text
  aside = model_dir / 'checkpoint_6.unreadable'
  assert sorted(str(p.relative_to(aside)) for p in aside.rglob('*')) == kept
  assert [r['step'] for r in read_run(str(model_dir)).train] == list(range(1, STEPS + 1))
  assert train_losses(model_dir) == ref
  assert committed(model_dir) == ['checkpoint_2', 'checkpoint_4', 'checkpoint_6']


@pytest.mark.parametrize('where', ['a file written at save', 'the asynchronous commit'])
def test_a_full_disk_at_save_stops_with_one_line_and_keeps_the_previous_checkpoint(
    where, reference, tmp_path, monkeypatch):
  """checkpoint_4 cannot be written: our data-position file raises OSError(ENOSPC) in the save
  call, or the state's asynchronous commit raises tensorstore's ValueError on orbax's thread (it
  reaches the trainer at the next save). One line says checkpoint_2 is intact; the rerun is
  exact."""
  _, ref = reference
  batches = StepBatches
  if where == 'a file written at save':
    batches = FullDisk
  else:
    from orbax.checkpoint._src.path import atomicity
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def full(self, *args, **kwargs):
      if self.get_final().name == 'checkpoint_4':
        raise ValueError('Error writing local file ".../d/1e9f": No space left on device [OS error: 28]')
      await finalize(self, *args, **kwargs)
    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, 'finalize', full)
  with pytest.raises(checkpoints.CheckpointError) as error:
    run_train(tmp_path, STEPS, batches=batches)
  message = str(error.value).split('\n  In call to configurable')[0]  # gin's note, as the CLI
  assert '\n' not in message
  assert message.startswith(f'saving a checkpoint in {tmp_path} failed (')
  assert 'No space left on device' in message
  assert 'checkpoint_2 (and those before it) is intact' in message
  assert 'rerun the same command to resume from step 2' in message
  assert committed(tmp_path) == ['checkpoint_2']
  monkeypatch.undo()
  before = complete_records(tmp_path)
  run_train(tmp_path, STEPS)
  assert_nothing_lost(tmp_path, ['checkpoint_2'], before, ref)


@pytest.fixture
def small_disk(tmp_path):
  """A 4 MB tmpfs at ``tmp_path/disk`` (a real file system that fills up); skipped where this
  user may not mount one."""
  disk = tmp_path / 'disk'
  disk.mkdir()
  mount = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=4m', 'tmpfs', str(disk)],
                         capture_output=True, text=True, check=False)
  if mount.returncode:
    pytest.skip(f'cannot mount a tmpfs here: {mount.stderr.strip()}')
  try:
    yield disk
  finally:
    subprocess.run(['umount', '-l', str(disk)], check=False)


def test_a_real_full_disk_stops_with_one_line_and_the_rerun_is_exact(reference, small_disk, capsys):
  """Steps 5-6 on a file system with 64 KB left: the save of checkpoint_6 fails, and so does the
  close of the records after it (tensorboard's flush). The command's line is the save's (before,
  the close's OSError replaced it, and gin's copy of that error had lost its errno: a bare
  '[Errno 28]'), or, where tensorboardX's writer thread found the disk full first (a race: one
  run in four here), that thread's full disk (it said only 'the error is above'); checkpoint_4
  is intact and, with space freed, the rerun is exact."""
  from t5x_variants.cli import common  # pylint: disable=g-import-not-at-top
  _, ref = reference
  run = small_disk / 'run'
  run_train(run, 4, eval_data=eval_batches, eval_period=2)
  free = os.statvfs(small_disk)
  filler = small_disk / 'filler'
  filler.write_bytes(b'\0' * (free.f_bavail * free.f_frsize - 64 * 1024))
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_:
    with common.clear_errors('t5xv-train'):
      run_train(run, STEPS, eval_data=eval_batches, eval_period=2)
  line = capsys.readouterr().err.strip().splitlines()[-1]
  assert exit_.value.code == 2 and 'No space left on device' in line, line
  assert (line.startswith(f't5xv-train: error: saving a checkpoint in {run} failed (') and (
      'checkpoint_4 (and those before it) is intact' in line)) or line.startswith(
          f't5xv-train: error: No space left on device writing the TensorBoard events of {run}: '
          'free space and rerun the same command'), line
  assert committed(run) == ['checkpoint_2', 'checkpoint_4']
  filler.unlink()
  before = complete_records(run)
  run_train(run, STEPS, eval_data=eval_batches, eval_period=2)
  assert_nothing_lost(run, ['checkpoint_2', 'checkpoint_4'], before, ref)


@pytest.mark.slow
def test_an_error_mid_run_waits_for_the_checkpoint_being_saved(tmp_path, subprocess_train):
  """The first eval (step 2) raises just after checkpoint_2's asynchronous save started (its
  commit held back 2 s): the process exits with that error once the save has committed; before,
  it exited at once and checkpoint_2 stayed in its temporary directory, never read: lost."""
  proc = subprocess_train('evalfail', tmp_path, STEPS)
  out, _ = proc.communicate(timeout=240)
  assert proc.returncode == 1 and 'the evaluation data cannot be read (injected)' in out, out[-3000:]
  assert sorted(p.name for p in tmp_path.glob('checkpoint_*')) == ['checkpoint_2'], out[-3000:]


@pytest.mark.slow
def test_a_checkpoint_of_one_device_resumes_on_8(reference, tmp_path, subprocess_train):
  """checkpoint_2 of the single-device reference, resumed on 8 host devices (replica=2 x data=2 x
  model=2, fsdp) in a subprocess, continues with the reference losses (the reverse of
  test_trainer's 8 -> 1)."""
  ref_dir, ref = reference
  shutil.copytree(ref_dir / 'checkpoint_2', tmp_path / 'checkpoint_2')
  assert finish(subprocess_train('mesh', tmp_path, STEPS))['step'] == STEPS
  losses = train_losses(tmp_path)
  assert sorted(losses) == list(range(3, STEPS + 1))
  np.testing.assert_allclose([losses[s] for s in range(3, STEPS + 1)],
                             [ref[s] for s in range(3, STEPS + 1)], rtol=1e-5)
  sharding = json.loads((tmp_path / f'checkpoint_{STEPS}' / 'state' / '_sharding').read_text())
  assert {tuple(json.loads(s)['shape']) for s in sharding.values()} == {(2, 2, 2)}


# An orbax restore that fails because the checkpoint is deleted under it leaves its other reads
# behind: coroutines closed unfinished when collected, and thread-pool reads that post to orbax's
# already closed event loop ('Event loop is closed'); Python ignores both. Harmless: the checkpoint
# is skipped. They are collected before the test ends, so that the filter below is theirs.
@needs_data_layer
@pytest.mark.slow
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_eval_all_beside_a_training_run_never_reads_a_half_written_checkpoint(
    reference, tmp_path, monkeypatch, subprocess_train):
  """t5xv-eval --gin.EVAL_ALL=True in a loop beside a run that saves every step and keeps 2 (so
  its saves and deletions race the evaluation's listing and reads), the run then SIGKILLed (most
  likely mid-save): no evaluation fails (a half-written checkpoint would fail to read and stop
  it), each reads a whole checkpoint or skips one that vanished, and after the kill the newest
  committed checkpoint is evaluated."""
  ref_dir, _ = reference
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                                    saved_state(ref_dir / 'checkpoint_2')['params'])

  class Params:
    def __init__(self, config, **kwargs):
      del config, kwargs

    def check_run(self, run_dir):  # (no model-info.txt here)
      del run_dir

    def load(self, path):
      self.params = pretrained.restore_params(path, abstract)
      return self

  monkeypatch.setattr(eval_cli, 'Predictor', Params)
  monkeypatch.setattr(eval_cli, 'teacher_forced', lambda predictor, *a, **k: {
      'loss': float(np.abs(np.asarray(jax.tree_util.tree_leaves(predictor.params)[0])).sum())})
  from t5x_variants.cli import common
  common.import_data_layer()
  evaluate = lambda: eval_cli.evaluate_checkpoints(
      tiny(vocab_size=4224), checkpoint_path=str(tmp_path), all_checkpoints=True,
      mixture_or_task_name='embedded_span_corruption',
      task_feature_lengths={'inputs': 64, 'targets': 16}, inference=False)
  proc = subprocess_train('churn', tmp_path, 10000)
  wait_for_steps(tmp_path, 3, [proc])
  evaluated = {}
  deadline = time.time() + 20
  while time.time() < deadline:
    evaluated.update(evaluate())
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert len(evaluated) >= 3
  evaluate()
  newest = committed(tmp_path)[-1].split('_')[1]
  assert newest in eval_cli.read_results(tmp_path / eval_cli.RESULTS)['validation']
  gc.collect()


SWEEP_SCRIPT = '''
import os, signal, sys
from t5x_variants.sweeps import grid, runner
sweep_dir, base, variants, trainer, kill_between = sys.argv[1:]
sweep = grid.Sweep.build(sweep_dir, [base], [variants], 1)
sweep.merge_previous()
def say(line):
  print(line, flush=True)
  if kill_between == 'yes' and ': done in' in line:  # the first run done, the second not started
    os.kill(os.getpid(), signal.SIGKILL)
print(runner.run_sweep(sweep, [sys.executable, trainer], say=say))
'''

# t5xv-train's stand-in: the tiny run of run_train (0.2 s per batch) in the sweep's MODEL_DIR.
TRAINER_SCRIPT = '''
import functools, os, sys
sys.path.insert(0, {tests!r})
from t5x_variants.sweeps import runner
from train_helpers import StepBatches, run_train
runner.stop_with_sweep()  # as t5xv-train does first
model_dir = next(a.split('=', 1)[1].strip("'") for a in sys.argv if a.startswith('--gin.MODEL_DIR='))
open(os.path.join(model_dir, 'pid'), 'w').write(str(os.getpid()))
run_train(model_dir, {steps}, batches=functools.partial(StepBatches, delay=0.2))
with open(os.path.join(model_dir, 'config.gin'), 'a') as f:
  f.write('TRAIN_STEPS = {steps}\\n')  # as t5xv-train's config.gin says it: the run's length
'''


def exited(pid):
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().split(') ')[1][0] in 'ZX'
  except FileNotFoundError:
    return True


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='the sweep uses PR_SET_PDEATHSIG')
@pytest.mark.parametrize('when', ['between runs', 'mid-run'])
def test_a_sweep_killed_then_rerun_trains_every_run_once_to_the_reference(
    when, reference, tmp_path):
  """t5xv-sweep SIGKILLed between its two runs or in the middle of the first: its trainer gets
  SIGTERM (``runner.stop_with_sweep``: it saves a checkpoint and stops, instead of training on beside
  the rerun's), and the rerun sweep resumes the interrupted run and trains the other: both end
  with the reference losses, every record and checkpoint of before kept."""
  _, ref = reference
  tests = os.path.dirname(__file__)
  (tmp_path / 'trainer.py').write_text(TRAINER_SCRIPT.format(tests=tests, steps=STEPS))
  (tmp_path / 'sweep.py').write_text(SWEEP_SCRIPT)
  for name in ('base', 'a', 'b'):
    (tmp_path / f'{name}.gin').write_text('')
  sweep_dir = tmp_path / 'sweep'
  command = [sys.executable, str(tmp_path / 'sweep.py'), str(sweep_dir), str(tmp_path / 'base.gin'),
             f'{tmp_path / "a.gin"},{tmp_path / "b.gin"}', str(tmp_path / 'trainer.py')]
  first = sweep_dir / 'a-seed0'
  proc = subprocess.Popen([*command, 'yes' if when == 'between runs' else 'no'], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  if when == 'mid-run':
    wait_for_steps(first, 3, [proc])
    proc.send_signal(signal.SIGKILL)
  out, _ = proc.communicate(timeout=240)
  assert proc.returncode == -signal.SIGKILL, out[-3000:]
  pid = int((first / 'pid').read_text())
  deadline = time.time() + 60
  while not exited(pid):
    assert time.time() < deadline, 'the trainer of a killed sweep went on'
    time.sleep(0.1)
  logged = read_run(str(first)).step
  assert logged < STEPS if when == 'mid-run' else logged == STEPS
  assert committed(first)[-1] == f'checkpoint_{logged}'  # SIGTERM's save of the step it reached
  before = committed(first), complete_records(first)
  out = subprocess.run([*command, 'no'], text=True, capture_output=True, timeout=240)
  assert out.returncode == 0 and "{'done': 2}" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
  assert_nothing_lost(first, *before, ref)
  assert_nothing_lost(sweep_dir / 'b-seed0', [], [], ref)
  assert {r['name']: r['status'] for r in json.loads((sweep_dir / 'sweep.json').read_text())['runs']} \
      == {'a-seed0': 'done', 'b-seed0': 'done'}
