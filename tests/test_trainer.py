"""The training loop end to end on a tiny model: resume (state and data position), restore onto
another device count, SIGTERM, non-finite steps, an unreadable checkpoint, two processes joined by
jax.distributed, and the run's files. Every run sees the same batches (``StepBatches``: batch i at
step i), so all of them are compared with one straight 4-step reference run."""
import contextlib
import functools
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import gin
import jax
import numpy as np
import pytest

from conftest import needs_data_layer, tiny
from t5x_variants import path_keys
from t5x_variants.train import checkpoints, optimizer, pretrained, trainer
from train_helpers import (StepBatches, records_of as records, run_train, saved_state, train_losses,
                           unreadable_state)

SCRIPT = os.path.join(os.path.dirname(__file__), 'trainer_subprocess.py')


@pytest.fixture
def subprocess_train():
  """Starts ``trainer_subprocess.py`` with the given arguments; kills what is left at the end."""
  procs = []

  def start(*args):
    procs.append(subprocess.Popen([sys.executable, SCRIPT, *map(str, args)], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs[-1]
  yield start
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


def wait_for_steps(model_dir, steps, procs, timeout=180):
  """Until ``model_dir``/metrics.jsonl has ``steps`` records; fails if a process ends first."""
  metrics, deadline = model_dir / 'metrics.jsonl', time.time() + timeout
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
    for p in procs:
      assert p.poll() is None and time.time() < deadline, p.communicate()[0][-3000:]
    time.sleep(0.05)


def finish(proc, timeout=240):
  out, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, out[-3000:]
  return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """(model_dir, {step: loss}, console output) of 4 straight steps on one device, checkpoints at
  steps 2 and 4."""
  model_dir = tmp_path_factory.mktemp('reference')
  console = io.StringIO()
  with contextlib.redirect_stdout(console):
    run_train(model_dir, 4)
  return model_dir, train_losses(model_dir), console.getvalue()


def test_resume_continues_with_the_same_state_and_data_position(reference, tmp_path):
  """2 steps, then a new ``train`` call to 4 in the same directory, logs exactly the losses of 4
  straight steps: the state and the iterator position (batch 3 next, not batch 1) are restored."""
  ref_dir, ref, _ = reference
  run_train(tmp_path, 2)
  assert (tmp_path / 'checkpoint_2' / 'data' / 'host-00000-of-00001').read_text() == '2'
  data = StepBatches()
  result = run_train(tmp_path, 4, batches=lambda: data)
  assert data.position == 4 and result['step'] == 4
  assert [r['step'] for r in records(tmp_path)] == [1, 2, 3, 4]  # steps 1-2 were not rerun
  assert train_losses(tmp_path) == ref
  assert len(set(ref.values())) == 4  # every step's batch differs, so a replay would show
  jax.tree_util.tree_map(np.testing.assert_array_equal, saved_state(tmp_path / 'checkpoint_4'),
                         saved_state(ref_dir / 'checkpoint_4'))


def test_a_relative_run_directory_saves_and_resumes(reference, tmp_path, monkeypatch):
  """A relative model directory trains, saves and resumes as an absolute one (orbax refuses a
  relative checkpoint path, and only at the first save)."""
  monkeypatch.chdir(tmp_path)
  run_train('runs/r', 2)
  run_train('runs/r', 4)
  assert train_losses(tmp_path / 'runs' / 'r') == reference[1]


@pytest.mark.slow
def test_a_checkpoint_of_8_devices_resumes_on_one(reference, tmp_path, subprocess_train):
  """2 steps on 8 host devices (replica=2 x data=2 x model=2, fsdp within each replica) in a
  subprocess, resumed here on one device: the parameters read back equal the single-device
  run's (no array of the state is split over 'replica'), and steps 3-4 continue its losses, as do
  those of a fine-tuning run started from its state (``init_optimizer``)."""
  ref_dir, ref, _ = reference
  finish(subprocess_train('mesh', tmp_path, 2))
  sharding = json.loads((tmp_path / 'checkpoint_2' / 'state' / '_sharding').read_text())
  specs = [json.loads(s) for s in sharding.values()]
  assert {tuple(s['shape']) for s in specs} == {(2, 2, 2)}
  axes = {a for s in specs for a in s['partition_spec'] if isinstance(a, str)}
  assert {'data', 'model'} <= axes and 'replica' not in axes
  ref_params = saved_state(ref_dir / 'checkpoint_2')['params']
  one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device), ref_params)
  params = pretrained.restore_params(tmp_path, abstract)
  jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
                         jax.tree_util.tree_map(np.asarray, params), ref_params)
  run_train(tmp_path, 4)
  losses = train_losses(tmp_path)
  np.testing.assert_allclose([losses[s] for s in range(1, 5)], [ref[s] for s in range(1, 5)],
                             rtol=1e-5)
  # fine-tuning from it with its optimizer state, onto one device: the reference's steps 3 and 4
  run_train(tmp_path / 'ft', 2, batches=_batches_after(2),
            init_checkpoint=str(tmp_path / 'checkpoint_2'), init_optimizer=True)
  np.testing.assert_allclose([train_losses(tmp_path / 'ft')[s] for s in (1, 2)], [ref[3], ref[4]],
                             rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('again', [False, True])
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, subprocess_train, again):
  """SIGTERM to a run of 1000 slow steps: it exits with status 0 after saving
  ``checkpoint_<k>`` for the step it stopped at (the only checkpoint: the period is 1000), and a
  resumed run starts at step k + 1 with data position k; also when another SIGTERM comes as that
  checkpoint commits (a sweep's Ctrl-C: the terminal's SIGINT, then the sweep's SIGTERM)."""
  proc = subprocess_train('slow', tmp_path, 1000, *(['again'] if again else []))
  wait_for_steps(tmp_path, 2, [proc])
  proc.send_signal(signal.SIGTERM)
  result = finish(proc)
  k = result['step']
  assert 2 <= k < 1000 and [r['step'] for r in records(tmp_path)] == list(range(1, k + 1))
  assert sorted(p.name for p in tmp_path.glob('checkpoint_*')) == [f'checkpoint_{k}']
  data = StepBatches()
  assert run_train(tmp_path, k + 1, period=1000, batches=lambda: data)['step'] == k + 1
  assert data.position == k + 1
  assert [r['step'] for r in records(tmp_path)] == list(range(1, k + 2))


SIGTERM_IN_THE_FINAL_EVAL = '''
import os, signal, sys
sys.path.insert(0, {tests!r})
from train_helpers import eval_batches, run_train, slow_commits
calls = [0]
def evals():  # evals at steps 2 and 4, then the final one at 5, which gets a SIGTERM
  calls[0] += 1
  batches = eval_batches()
  def signalled():
    os.kill(os.getpid(), signal.SIGTERM)
    yield from batches['synthetic']
  return {{'synthetic': signalled()}} if calls[0] == 3 else batches
slow_commits(2.0)  # checkpoint_5's commit still in flight when the signal comes
print(run_train(sys.argv[1], 5, period=2, eval_data=evals, eval_period=2)['step'])
'''


@pytest.mark.slow
def test_a_signal_during_the_final_eval_lets_the_last_checkpoint_commit(tmp_path):
  """A finished run's final eval ran with SIGTERM's default action: the signal killed it (143)
  with checkpoint_5 still a temporary directory, and the rerun trained from step 4 again."""
  tests = os.path.dirname(os.path.abspath(__file__))
  out = subprocess.run([sys.executable, '-c', SIGTERM_IN_THE_FINAL_EVAL.format(tests=tests),
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.split()[-1] == '5', out.stderr[-2000:]
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith('checkpoint_')) == [
      'checkpoint_2', 'checkpoint_4', 'checkpoint_5']
  assert [r['step'] for r in records(tmp_path, 'eval')] == [2, 4, 5]


SIGTERM_AFTER_THE_LAST_STEP = '''
import os, signal, sys
sys.path.insert(0, {tests!r})
from t5x_variants.train import trainer
from train_helpers import run_train
judge = trainer.NonFiniteGuard.check_run
def signalled(self, *args):  # judging the run: after its last step, between the steps and the save
  os.kill(os.getpid(), signal.SIGTERM)
  return judge(self, *args)
trainer.NonFiniteGuard.check_run = signalled
print(run_train(sys.argv[1], 3, period=2)['step'])
'''


@pytest.mark.slow
def test_a_signal_after_the_last_step_lets_the_last_checkpoint_commit(tmp_path):
  """A signal after the steps, before the last save: it fell between two Preemption contexts,
  so its default action killed the run (143) without checkpoint_3."""
  tests = os.path.dirname(os.path.abspath(__file__))
  out = subprocess.run([sys.executable, '-c', SIGTERM_AFTER_THE_LAST_STEP.format(tests=tests),
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.split()[-1] == '3', out.stderr[-2000:]
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith('checkpoint_')) == [
      'checkpoint_2', 'checkpoint_3']


def test_a_stop_at_the_last_step_commits_without_the_final_eval(tmp_path, monkeypatch):
  """A signal at the last step (not an eval step): its checkpoint commits with further signals
  noted, so the final eval is left to the rerun (else it would run where nothing can stop it);
  a finished run rerun evaluated its last step again before."""
  from t5x_variants.train import preemption  # pylint: disable=g-import-not-at-top
  from train_helpers import eval_batches  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(preemption.Preemption, 'reached', lambda self, step: step == 3)
  assert run_train(tmp_path, 3, period=10, eval_data=eval_batches, eval_period=2)['step'] == 3
  assert [r['step'] for r in records(tmp_path, 'eval')] == [2]
  assert sorted(p.name for p in tmp_path.glob('checkpoint_*')) == ['checkpoint_3']
  # The rerun does that eval, once: a rerun of the finished run does not log it again.
  for _ in range(2):
    assert run_train(tmp_path, 3, period=10, eval_data=eval_batches, eval_period=2)['step'] == 3
    assert [r['step'] for r in records(tmp_path, 'eval')] == [2, 3]


def test_infer_eval_adds_the_decoded_metrics_to_each_eval_and_needs_them(tmp_path):
  """``train.infer_eval``: each eval record holds ``decoded_metrics``' values beside the
  teacher-forced ones, computed from that step's parameters with ``infer_eval_examples``; off,
  it is not called; without it (pre-built batches) one error before the run directory exists."""
  from train_helpers import eval_batches  # pylint: disable=g-import-not-at-top
  calls = []

  def decoded(name, step, params, max_examples):
    calls.append((name, step, max_examples, float(sum(np.abs(x).sum() for x in jax.tree_util.tree_leaves(params)))))
    return {'accuracy': 50.0 + len(calls)}
  run_train(tmp_path / 'on', 4, period=10, eval_data=eval_batches, eval_period=2,
            decoded_metrics=decoded, infer_eval=True, infer_eval_examples=3)
  evals = records(tmp_path / 'on', 'eval')
  assert [(r['step'], r['accuracy']) for r in evals] == [(2, 51.0), (4, 52.0)], evals
  assert all('loss' in r and 'token_accuracy' in r for r in evals)
  assert [c[:3] for c in calls] == [('synthetic', 2, 3), ('synthetic', 4, 3)] and calls[0][3] != calls[1][3]
  run_train(tmp_path / 'off', 2, period=10, eval_data=eval_batches, eval_period=2,
            decoded_metrics=decoded)
  assert len(calls) == 2 and 'accuracy' not in records(tmp_path / 'off', 'eval')[0]
  with pytest.raises(ValueError, match=r'train.infer_eval = True decodes the eval tasks through the '
                                       r'data layer, which pre-built batches \(--batches_dir\) leave out'):
    run_train(tmp_path / 'prebuilt', 2, eval_data=eval_batches, eval_period=2, infer_eval=True)
  assert not (tmp_path / 'prebuilt').exists()


def test_a_variant_starts_from_another_variants_checkpoint_with_its_own_parameters_fresh(tmp_path):
  """Sub-LN from a Pre-LN run: the checkpoint lacks its inner norms, so starting from it is one
  error that names one and ``train.init_fresh``; with ``init_fresh=['inner_layer_norm',
  'logits_dense']`` every other parameter is the checkpoint's, and the inner norms and the
  output layer (which the checkpoint holds) are the model's own initialisation (T5X's
  assignment_map to None). With ``init_optimizer``, a path naming no parameter, no checkpoint or
  a bare string: one error each, before anything is written."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import flax  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import partitioning, sharded_model  # pylint: disable=g-import-not-at-top
  pre_ln = tiny(num_encoder_layers=1, num_decoder_layers=1)  # run_train's model
  run_train(tmp_path / 'pre', 2)
  subln = dataclasses.replace(pre_ln, placement='subln')
  start = dict(config=subln, init_checkpoint=str(tmp_path / 'pre'))
  with pytest.raises(checkpoints.CheckpointError, match=r'holds another model \(.*inner_layer_norm.*'
                                                        r'--gin.train.init_fresh'):
    run_train(tmp_path / 'refused', 1, **start)
  assert run_train(tmp_path / 'subln', 2, init_fresh=['inner_layer_norm'], **start)['step'] == 2

  model = sharded_model.ShardedModel.build(subln, partitioning.MeshConfig(), 0)
  begin = lambda run, *how: flax.traverse_util.flatten_dict(jax.tree_util.tree_map(np.asarray, model.restore_or_init(
      checkpoints.Checkpointer(str(tmp_path / run)), None, str(tmp_path / run), *how)[0].params), sep='/')
  started = begin('a', str(tmp_path / 'pre'), False, None, ['inner_layer_norm', 'logits_dense'])
  fresh = begin('b', None, False)
  saved = flax.traverse_util.flatten_dict(pretrained.read_on_host(str(tmp_path / 'pre')), sep='/')
  new = sorted(k for k in started if 'inner_layer_norm' in k)
  assert new and sorted(started.keys() - saved.keys()) == new and 'logits_dense/kernel' in saved
  for k, x in started.items():
    np.testing.assert_array_equal(x, fresh[k] if k in new or k.startswith('logits_dense') else saved[k],
                                  err_msg=k)
  assert not np.array_equal(fresh['logits_dense/kernel'], saved['logits_dense/kernel'])

  for settings, error in (
      (dict(init_fresh=['inner_layer_norm'], init_optimizer=True, **start),
       r"their optimizer statistics would be the checkpoint's .*--gin.train.init_optimizer=False"),
      (dict(init_fresh='inner_layer_norm', **start), r'expected a list of parameter paths'),
      (dict(init_fresh=['inner_norm'], **start), r"'inner_norm' is no path of this model's parameters"),
      (dict(init_fresh=['inner_layer_norm'], config=subln), r'train.init_checkpoint, which is not set')):
    with pytest.raises((ValueError, checkpoints.CheckpointError), match=error):
      run_train(tmp_path / 'bad', 1, **settings)
    assert not (tmp_path / 'bad').exists() or not any((tmp_path / 'bad').glob('checkpoint_*'))


def test_a_non_finite_step_stops_or_is_skipped(reference, tmp_path):
  """Batch 3 has a NaN loss weight. 'stop' raises NonFiniteLossError naming step 3 and leaves
  checkpoints 1-2 intact; 'skip' resumes from step 2, logs step 3 as skipped with its update not
  applied (checkpoint 3's parameters and optimizer statistics equal checkpoint 2's; the
  optimizer's step counts advance with the step, as the learning-rate schedule does) and
  finishes."""
  _, ref, _ = reference
  poisoned = functools.partial(StepBatches, poison=(3,))
  with pytest.raises(trainer.NonFiniteLossError, match=r'^non-finite from step 3: .*last: step 2'):
    run_train(tmp_path, 4, period=1, batches=poisoned, on_nonfinite='stop')
  assert sorted(p.name for p in tmp_path.glob('checkpoint_*')) == ['checkpoint_1', 'checkpoint_2']
  result = run_train(tmp_path, 4, period=1, batches=poisoned, on_nonfinite='skip')
  assert result['step'] == 4
  # the stopped session's record of step 3, superseded by the session resumed at step 2
  assert {'step': 2, 'kind': 'resumed'} in map(json.loads, open(tmp_path / 'metrics.jsonl'))
  logged = {r['step']: r for r in records(tmp_path)}
  assert [logged[s]['skipped'] for s in range(1, 5)] == [0, 0, 1, 0]
  assert [logged[s]['loss'] for s in (1, 2)] == [ref[1], ref[2]]
  assert logged[3]['loss'] is None and np.isfinite(logged[4]['loss'])  # NaN is written as null
  before, after = saved_state(tmp_path / 'checkpoint_2'), saved_state(tmp_path / 'checkpoint_3')
  assert (before['step'], after['step']) == (2, 3)
  jax.tree_util.tree_map(np.testing.assert_array_equal, after['params'], before['params'])
  counts = 0
  for (path, now), (_, was) in zip(*(jax.tree_util.tree_leaves_with_path(s['opt_state'])
                                     for s in (after, before))):
    counted = str(getattr(path[-1], 'key', path[-1])) == 'count'
    counts += counted
    np.testing.assert_array_equal(now, was + 1 if counted else was)
  assert counts
  assert not np.array_equal(
      saved_state(tmp_path / 'checkpoint_4')['params']['decoder']['layers']['mlp']['wi']['kernel'],
      before['params']['decoder']['layers']['mlp']['wi']['kernel'])


def test_skipped_steps_in_a_row_stop_the_run(tmp_path):
  """With train.max_skipped_in_a_row 3, steps 2-4 skipped stop the run naming step 2, after
  step 4 (steps 2 and 3 alone do not); a run whose every step is skipped never ends as done."""
  poisoned = functools.partial(StepBatches, poison=(2, 3, 5, 6, 7))
  with pytest.raises(trainer.NonFiniteLossError, match=r'^non-finite from step 5: 3 steps in a row '
                     r"had a non-finite loss or gradients \(the first's loss nan\); .*last: step 4"):
    run_train(tmp_path / 'a', 8, period=4, batches=poisoned, max_skipped_in_a_row=3)
  assert [r['step'] for r in records(tmp_path / 'a')] == [1, 2, 3, 4, 5, 6, 7]
  every = functools.partial(StepBatches, poison=(1, 2))
  for period in (4, 2):  # also where the last step is a checkpoint step
    with pytest.raises(trainer.NonFiniteLossError,
                       match=r'^non-finite from step 1: every step of this run \(1 to 2\)'):
      run_train(tmp_path / f'b{period}', 2, period=period, batches=every)
    assert not list((tmp_path / f'b{period}').glob('checkpoint_*'))


def test_a_resumed_run_is_judged_non_finite_as_the_uninterrupted_one(tmp_path, monkeypatch):
  """What the guard counted is kept with each checkpoint. Before, a session resumed at step 4
  whose steps 5-6 were skipped stopped as a run 'that applied no update' (at every rerun: the
  run could never finish), where the uninterrupted run finished; and a row of skipped steps
  3-5 began counting again at the resume, so max_skipped_in_a_row 3 never stopped it."""
  from t5x_variants.train import preemption  # pylint: disable=g-import-not-at-top
  reached = preemption.Preemption.reached
  for poison, kwargs in (((5, 6), {}), ((3, 4, 5), {'max_skipped_in_a_row': 3})):
    batches = functools.partial(StepBatches, poison=poison)
    outcomes = []
    for name in ('whole', 'resumed'):
      if name == 'resumed':  # a stop after step 4, then the same command
        monkeypatch.setattr(preemption.Preemption, 'reached', lambda self, step: step == 4)
        run_train(tmp_path / f'{poison}{name}', 6, period=2, batches=batches, **kwargs)
        monkeypatch.setattr(preemption.Preemption, 'reached', reached)
      try:
        outcomes.append(run_train(tmp_path / f'{poison}{name}', 6, period=2, batches=batches,
                                  **kwargs)['step'])
      except trainer.NonFiniteLossError as e:
        outcomes.append(str(e).split(';')[0])
    assert outcomes[0] == outcomes[1], outcomes
  assert outcomes[0].startswith('non-finite from step 3: 3 steps in a row')


def test_an_unreadable_latest_checkpoint_falls_back_to_the_previous_one(reference, tmp_path):
  """With checkpoint_4's state files overwritten by garbage, resuming moves it to
  ``checkpoint_4.unreadable``, restarts from checkpoint_2 (the next step logged is 3) and
  reproduces steps 3-4."""
  ref_dir, ref, _ = reference
  model_dir = tmp_path / 'run'
  shutil.copytree(ref_dir, model_dir)
  for name in ('_METADATA', 'manifest.ocdbt'):
    (model_dir / 'checkpoint_4' / 'state' / name).write_bytes(b'\0garbage')
  assert run_train(model_dir, 4)['step'] == 4
  unreadable = model_dir / 'checkpoint_4.unreadable' / 'state'
  assert (unreadable / '_METADATA').read_bytes() == b'\0garbage'
  assert [r['step'] for r in records(model_dir)] == [1, 2, 3, 4, 3, 4]
  assert [r['loss'] for r in records(model_dir)[4:]] == [ref[3], ref[4]]
  assert (model_dir / 'checkpoint_4' / 'state' / '_METADATA').read_bytes() != b'\0garbage'


def test_a_checkpoint_of_another_model_is_an_error_not_a_restart(reference, tmp_path):
  """Resuming with another d_ff raises CheckpointError naming the parameter that differs, and
  leaves the checkpoints and model-info.txt as they were (not moved aside as unreadable, with
  training restarted from scratch)."""
  ref_dir, _, _ = reference
  model_dir = tmp_path / 'run'
  shutil.copytree(ref_dir, model_dir)
  info = (model_dir / 'model-info.txt').read_text()
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"params/decoder/layers/mlp/wi/kernel: saved \(1, 32, 64\), this run "
                           r"\(1, 32, 128\)"):
    run_train(model_dir, 6, config=tiny(num_encoder_layers=1, num_decoder_layers=1, d_ff=128))
  assert sorted(p.name for p in model_dir.glob('checkpoint_*')) == ['checkpoint_2', 'checkpoint_4']
  assert (model_dir / 'model-info.txt').read_text() == info


def test_a_checkpoint_of_other_optimizer_settings_is_an_error_not_a_restart(reference, tmp_path):
  """Resuming with global-norm clipping added (another optimizer-state structure, same
  parameters) raises CheckpointError naming an optimizer-state entry that differs, and moves
  nothing aside."""
  ref_dir, _, _ = reference
  model_dir = tmp_path / 'run'
  shutil.copytree(ref_dir, model_dir)
  gin.bind_parameter('make_optimizer.global_norm_clip', 1.0)
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'optimizer state of other optimizer settings \(opt_state/1/.*: saved '
                           r'nothing, this run'):
    run_train(model_dir, 6)
  assert sorted(p.name for p in model_dir.glob('checkpoint_*')) == ['checkpoint_2', 'checkpoint_4']


def _batches_after(step):
  """StepBatches from step ``step`` + 1 on (a fine-tuning run's data, here the pretraining's)."""
  def batches():
    data = StepBatches()
    data.position = step
    return data
  return batches


def test_fine_tuning_with_init_optimizer_goes_on_with_the_pretrained_optimizer_state(
    reference, tmp_path):
  """``train.init_optimizer`` (T5X's fine-tuning): from checkpoint 2 of the reference run, 2
  steps on its batches 3 and 4 log its losses of steps 3 and 4 (Adafactor's statistics and their
  step count go on; the constant schedule is the same at any count), at steps 1 and 2; its
  parameters only (a fresh Adafactor) give other losses. With the embeddings frozen it reads the
  rest of the statistics."""
  ref_dir, ref, _ = reference
  init = str(ref_dir / 'checkpoint_2')
  run_train(tmp_path / 'ft', 2, batches=_batches_after(2), init_checkpoint=init,
            init_optimizer=True)
  np.testing.assert_allclose([train_losses(tmp_path / 'ft')[s] for s in (1, 2)], [ref[3], ref[4]],
                             rtol=1e-6)
  want, got = saved_state(ref_dir / 'checkpoint_4'), saved_state(tmp_path / 'ft' / 'checkpoint_2')
  jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7),
                         got['params'], want['params'])
  run_train(tmp_path / 'fresh', 2, batches=_batches_after(2), init_checkpoint=init)
  assert not np.allclose(train_losses(tmp_path / 'fresh')[2], ref[4], rtol=1e-4)
  assert _counts(got) == {2, 4}  # the schedule's count from 0, Adafactor's from the pretraining's 2
  gin.bind_parameter('make_optimizer.frozen', ['token_embedder'])
  run_train(tmp_path / 'frozen', 1, batches=_batches_after(2), init_checkpoint=init,
            init_optimizer=True)
  frozen = saved_state(tmp_path / 'frozen' / 'checkpoint_1')
  assert _counts(frozen) == {1, 3}
  np.testing.assert_array_equal(frozen['params']['token_embedder']['embedding'],
                                saved_state(init)['params']['token_embedder']['embedding'])


def _counts(state):
  """The distinct step counts in a saved optimizer state (optax's 'count' fields)."""
  return {int(np.max(x)) for p, x in jax.tree_util.tree_leaves_with_path(state['opt_state'])
          if path_keys(p)[-1] == 'count'}


def test_init_optimizer_from_parameters_only_starts_fresh_from_another_optimizer_is_an_error(
    reference, tmp_path, caplog):
  """A checkpoint of parameters only (t5xv-import's) starts a fresh optimizer state, saying so;
  one of another optimizer (Adam's moments where this run keeps Adafactor's) is one error naming
  a statistic and the setting that starts from its parameters alone; gradient clipping in one
  run only is named as such; another model is named as one."""
  ref_dir, ref, _ = reference
  params_only = tmp_path / 'imported'
  ckpt = checkpoints.Checkpointer(str(params_only), async_save=False)
  ckpt.save(0, {'params': saved_state(ref_dir / 'checkpoint_2')['params']}, force=True)
  ckpt.close()
  with caplog.at_level('INFO'):
    run_train(tmp_path / 'ft', 1, batches=_batches_after(2), init_checkpoint=str(params_only),
              init_optimizer=True)
  assert 'holds parameters only: the optimizer state starts fresh' in caplog.text
  gin.bind_parameter('make_optimizer.optimizer', optimizer.adam)
  run_train(tmp_path / 'adam', 1)
  gin.bind_parameter('make_optimizer.optimizer', optimizer.adafactor)
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'holds no opt_state/.* of shape .* \(saved: nothing\): .*'
                           r'--gin.train.init_optimizer=False') as error:
    run_train(tmp_path / 'ft2', 1, init_checkpoint=str(tmp_path / 'adam'), init_optimizer=True)
  assert 'combine_heads' not in str(error.value)  # another optimizer, not Adafactor's layout
  assert not list((tmp_path / 'ft2').glob('checkpoint_*'))
  gin.bind_parameter('make_optimizer.global_norm_clip', 1.0)  # statistics one level down
  init = str(ref_dir / 'checkpoint_2')
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'make_optimizer.global_norm_clip is set in one of the two runs only'
                           r'.*init_optimizer=False'):
    run_train(tmp_path / 'ft3', 1, init_checkpoint=init, init_optimizer=True)
  shared = tiny(num_encoder_layers=1, num_decoder_layers=1, shared_encoder_decoder=True)
  for init_optimizer in (False, True):  # a trained encoder is never dropped silently
    with pytest.raises(checkpoints.CheckpointError, match=r'holds encoder parameters this model has '
                       r'none of .*shared_encoder_decoder'):
      run_train(tmp_path / 'ft5', 1, init_checkpoint=init, init_optimizer=init_optimizer,
                config=shared)
  with pytest.raises(checkpoints.CheckpointError, match=r'holds another model \(.*mlp/wi/kernel'):
    run_train(tmp_path / 'ft4', 1, init_checkpoint=init, init_optimizer=True,
              config=tiny(num_encoder_layers=1, num_decoder_layers=1, d_ff=128))


def test_readable_parameters_with_an_unreadable_optimizer_state_are_damaged_not_another_run(
    reference, tmp_path, monkeypatch):
  """checkpoint_4's parameters read, its names and shapes are this run's, but the rest of its
  state does not read (as when a damaged file holds only optimizer-state arrays): it is moved
  aside as damaged, not refused as another run's, and steps 3-4 are reproduced from checkpoint_2."""
  ref_dir, ref, _ = reference
  model_dir = tmp_path / 'run'
  shutil.copytree(ref_dir, model_dir)
  unreadable_state([4], monkeypatch.setattr)
  assert run_train(model_dir, 4)['step'] == 4
  assert (model_dir / 'checkpoint_4.unreadable' / 'state').is_dir()
  assert [r['loss'] for r in records(model_dir)[4:]] == [ref[3], ref[4]]


def test_a_state_that_reads_without_its_data_position_is_an_error_not_a_fallback(
    reference, tmp_path):
  """checkpoint_4 without this host's data-position file (what a run with another number of
  processes finds): CheckpointError saying the data position cannot be restored, and nothing
  moved aside (the state itself is whole)."""
  ref_dir, _, _ = reference
  model_dir = tmp_path / 'run'
  shutil.copytree(ref_dir, model_dir)
  for host_file in (model_dir / 'checkpoint_4' / 'data').glob('host-*'):
    host_file.unlink()
  with pytest.raises(checkpoints.CheckpointError, match='readable state but this run cannot take '
                     'its data position .*rename checkpoint_4 to checkpoint_4.unreadable'):
    run_train(model_dir, 6)
  assert sorted(p.name for p in model_dir.glob('checkpoint_*')) == ['checkpoint_2', 'checkpoint_4']


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@needs_data_layer
@pytest.mark.slow
def test_two_processes_train_like_one_and_stop_together(reference, tmp_path, subprocess_train):
  """Two processes joined by jax.distributed (gloo CPU collectives, 2 devices each, a data=2 x
  model=2 mesh with fsdp), each feeding its half of every batch, log the single-process losses.
  SIGTERM to process 1 alone stops both after the same step k (jax's preemption sync point), both
  exit with status 0, and ``checkpoint_<k>`` holds both hosts' data positions."""
  _, ref, _ = reference
  port = _free_port()
  procs = [subprocess_train('process', tmp_path, 1000, port, i) for i in range(2)]
  wait_for_steps(tmp_path, 3, procs)
  procs[1].send_signal(signal.SIGTERM)
  k0, k1 = [finish(p)['step'] for p in procs]
  assert k0 == k1 and 3 <= k0 < 1000
  losses = train_losses(tmp_path)
  assert sorted(losses) == list(range(1, k0 + 1))
  np.testing.assert_allclose([losses[s] for s in (1, 2, 3)], [ref[s] for s in (1, 2, 3)],
                             rtol=1e-5)
  assert sorted(p.name for p in tmp_path.glob('checkpoint_*')) == [f'checkpoint_{k0}']
  data = tmp_path / f'checkpoint_{k0}' / 'data'
  assert [(data / f'host-0000{i}-of-00002').read_text() for i in range(2)] == [str(k0)] * 2


@needs_data_layer
@pytest.mark.slow
def test_a_data_position_one_process_cannot_read_stops_every_process(tmp_path, subprocess_train):
  """Each process reads its own data position. With process 1's file of the newest checkpoint
  damaged, both processes stop with the data-position error, none left waiting for the other,
  nothing moved aside."""
  port = _free_port()
  procs = [subprocess_train('process', tmp_path, 1000, port, i) for i in range(2)]
  wait_for_steps(tmp_path, 2, procs)
  procs[1].send_signal(signal.SIGTERM)
  k = [finish(p)['step'] for p in procs][0]
  (tmp_path / f'checkpoint_{k}' / 'data' / 'host-00001-of-00002').write_text('damaged')
  port = _free_port()
  procs = [subprocess_train('process', tmp_path, k + 3, port, i) for i in range(2)]
  for p in procs:
    out = p.communicate(timeout=150)[0]
    assert p.returncode != 0 and 'this run cannot take its data position' in out, out[-3000:]
  assert sorted(p.name for p in tmp_path.glob('checkpoint_*')) == [f'checkpoint_{k}']


@pytest.mark.slow
def test_a_data_position_one_process_cannot_write_stops_every_process_at_once(tmp_path,
                                                                             subprocess_train):
  """Process 1's disk full as it writes its data position at step 4: both processes stop within
  seconds with the save's error, checkpoint_2 the one listed (before, process 0 went on into
  orbax's barriers and both were aborted 300 s later by jax's shutdown barrier, rc -6)."""
  port = _free_port()
  procs = [subprocess_train('fulldisk', tmp_path, 6, port, i) for i in range(2)]
  outs = [p.communicate(timeout=200)[0] for p in procs]  # (the hang lasted 300 s)
  assert all(p.returncode == 1 for p in procs), outs[0][-3000:] + outs[1][-3000:]
  assert 'No space left on device' in outs[1] and 'failed on process 1' in outs[0], outs[0][-3000:]
  assert all('checkpoint_2 (and those before it) is intact' in out for out in outs)
  assert [p.name for p in checkpoints.list_checkpoints(str(tmp_path))] == ['checkpoint_2']


@pytest.mark.slow
def test_a_shard_write_failing_on_one_process_stops_both_at_the_next_save(tmp_path,
                                                                          subprocess_train):
  """Process 1's writes of its array shards of checkpoint_4 fail in orbax's background thread:
  both processes stop at the next save, within seconds, with that error (process 0 naming
  process 1), and checkpoint_2 is the one listed (before, process 0 waited for process 1's writes
  and process 1 for process 0 at its save's finalisation, each in orbax's barriers, for 20
  minutes)."""
  port = _free_port()
  procs = [subprocess_train('shardfail', tmp_path, 8, port, i) for i in range(2)]
  outs = [p.communicate(timeout=200)[0] for p in procs]
  assert all(p.returncode == 1 for p in procs), outs[0][-3000:] + outs[1][-3000:]
  assert 'No space left on device (injected)). checkpoint_2' in outs[1], outs[1][-3000:]
  assert 'failed on process 1 (its log says why)). checkpoint_2' in outs[0], outs[0][-3000:]
  assert 'step 6/8' in outs[0] and 'step 7/8' not in outs[0]
  assert [p.name for p in checkpoints.list_checkpoints(str(tmp_path))] == ['checkpoint_2']


@pytest.mark.slow
@pytest.mark.parametrize('failing', [1, 0])
def test_a_save_failing_as_it_starts_on_one_process_stops_both_at_once(tmp_path, subprocess_train,
                                                                     failing):
  """One process's save of checkpoint_4 raises in the trainer's own thread as it starts (before
  any background write): both processes stop within seconds, that one with its error and the
  other naming it, and checkpoint_2 is the one listed, whole, under keep 1 (before, the other
  waited in orbax's next barrier of that save, a device all-gather, until jax's shutdown barrier
  aborted both 300 s later; and a first fix left checkpoint_4 in orbax's listing in memory,
  where keep-N counted it and deleted checkpoint_2)."""
  port = _free_port()
  procs = [subprocess_train('syncfail', tmp_path, 8, port, i, failing) for i in range(2)]
  outs = [p.communicate(timeout=120)[0] for p in procs]
  assert all(p.returncode == 1 for p in procs), outs[0][-3000:] + outs[1][-3000:]
  other = 1 - failing
  assert 'Input/output error (injected, as the save starts)). checkpoint_2' in outs[failing], (
      outs[failing][-3000:])
  assert (f'failed on process {failing} (its log says why)). checkpoint_2' in outs[other]), (
      outs[other][-3000:])
  assert 'step 4/8' in outs[0] and 'step 5/8' not in outs[0], outs[0][-3000:]
  assert [p.name for p in checkpoints.list_checkpoints(str(tmp_path))] == ['checkpoint_2']
  assert (tmp_path / 'checkpoint_2' / 'state').is_dir()


@needs_data_layer
@pytest.mark.slow
def test_a_state_one_process_cannot_read_moves_it_aside_on_every_process(reference, tmp_path,
                                                                           subprocess_train):
  """Each process reads its own shards of the state. With process 1's read of checkpoint_3
  failing as a damaged array file does, both processes name that checkpoint unreadable (process 0
  pointing at process 1's log), move it aside once and resume from checkpoint_2 to the reference
  losses; none is left waiting at a barrier for the other (orbax's restore ends at one)."""
  _, ref, _ = reference
  for steps in (2, 3):
    port = _free_port()
    for p in [subprocess_train('process', tmp_path, steps, port, i) for i in range(2)]:
      finish(p)
  port = _free_port()
  procs = [subprocess_train('process', tmp_path, 4, port, 0),
           subprocess_train('process', tmp_path, 4, port, 1, 3)]
  outs = [p.communicate(timeout=150)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
  unreadable = f'checkpoint {tmp_path / "checkpoint_3"} cannot be read'
  assert f'{unreadable} (not readable on process 1: its log says why)' in outs[0], outs[0][-3000:]
  assert f'{unreadable} (ValueError: DATA_LOSS' in outs[1], outs[1][-3000:]
  assert sorted(p.name for p in tmp_path.glob('checkpoint_*')) == [
      'checkpoint_2', 'checkpoint_3.unreadable', 'checkpoint_4']
  losses = train_losses(tmp_path)
  np.testing.assert_allclose([losses[s] for s in (1, 2, 3, 4)], [ref[s] for s in (1, 2, 3, 4)],
                             rtol=1e-5)


@needs_data_layer
@pytest.mark.slow
def test_evaluation_data_that_differs_on_one_process_stops_both(tmp_path, subprocess_train):
  """Every process holds the evaluation batches whole. With process 1's copy one batch short,
  both stop at the step-2 eval with one error naming the batch, within seconds (before, process
  1 went back to training while process 0 waited in the eval step for it)."""
  port = _free_port()
  procs = [subprocess_train('diverge', tmp_path, 6, port, i) for i in range(2)]
  for p in procs:
    out = p.communicate(timeout=150)[0]
    assert p.returncode != 0 and (
        'ValueError: the processes disagree on the evaluation data of synthetic (batch 2): '
        'process 0 has one, process 1 has none;') in out, out[-3000:]
  assert not list(tmp_path.glob('checkpoint_*'))


def test_a_run_writes_its_record(reference):
  """metrics.jsonl (one record per logged step, with throughput), config.gin, model-info.txt, a
  TensorBoard event file and a console line with throughput and ETA."""
  ref_dir, _, console = reference
  logged = records(ref_dir)
  assert [r['step'] for r in logged] == [1, 2, 3, 4]
  assert all(r['tokens_per_second'] > 0 and r['learning_rate'] == pytest.approx(0.01)
             and 0 <= r['token_accuracy'] <= 1 for r in logged)
  assert "learning_rate_schedule.name = 'constant'" in (ref_dir / 'config.gin').read_text()
  assert 'architecture: encoder_decoder' in (ref_dir / 'model-info.txt').read_text()
  events = list((ref_dir / 'tensorboard').glob('events.out.tfevents.*'))
  assert len(events) == 1 and events[0].read_bytes().count(b'train/tokens_per_second') == 4
  line = [l for l in console.splitlines() if l.startswith('step 3/4 ')]
  assert len(line) == 1 and ' tok/s ' in line[0] and ' eta 0:00:' in line[0], console


def test_eval_at_start_evaluates_the_initial_parameters_once(tmp_path):
  """``train.eval_at_start``: a fresh run logs an eval at step 0 (the initial loss of an LR
  sensitivity), equal to evaluating the step-0 parameters; its resumption does not log it again."""
  from train_helpers import eval_batches
  run_train(tmp_path, 2, eval_data=eval_batches, eval_period=2, eval_at_start=True)
  evals = records(tmp_path, 'eval')
  assert [r['step'] for r in evals] == [0, 2]
  assert evals[0]['loss'] > evals[1]['loss']
  fresh = tmp_path / 'fresh'
  run_train(fresh, 1, eval_data=eval_batches, eval_period=1, eval_at_start=True)
  assert records(fresh, 'eval')[0] == {**evals[0], 'time': records(fresh, 'eval')[0]['time']}
  run_train(tmp_path, 4, eval_data=eval_batches, eval_period=2, eval_at_start=True)
  assert [r['step'] for r in records(tmp_path, 'eval')] == [0, 2, 4]


def test_a_directory_that_is_no_run_keeps_the_files_training_would_replace(tmp_path):
  """Was: a model_dir holding the user's own config.gin and vocab.model (no run's: no
  model-info.txt, no checkpoint) had both replaced, without a word."""
  mine = tmp_path / 'mine'
  mine.mkdir()
  (mine / 'config.gin').write_text('# my notes\n')
  (mine / 'vocab.model').write_bytes(b'my vocabulary')
  vocab = tmp_path / 'spm.model'
  vocab.write_bytes(b'the run vocabulary')
  with pytest.raises(ValueError, match=r'mine is no run directory \(no model-info.txt, no checkpoint\) '
                                       r'but holds config.gin and vocab.model, which training would'):
    run_train(mine, 2, files={'vocab.model': str(vocab)})
  assert (mine / 'config.gin').read_text() == '# my notes\n'
  assert (mine / 'vocab.model').read_bytes() == b'my vocabulary'
  assert sorted(p.name for p in mine.iterdir()) == ['config.gin', 'vocab.model']
  # the vocabulary given from that directory itself is not replaced by anything: trains
  (mine / 'config.gin').unlink()
  run_train(mine, 2, files={'vocab.model': str(mine / 'vocab.model')})
  assert (mine / 'vocab.model').read_bytes() == b'my vocabulary'
  # a run's own directory, stopped before its first checkpoint (its run files written), trains
  run = tmp_path / 'run'
  run_train(run, 2)
  for path in run.iterdir():
    if path.name not in ('config.gin', 'model-info.txt'):
      shutil.rmtree(path) if path.is_dir() else path.unlink()
  run_train(run, 2)
  assert [r['step'] for r in records(run)] == [1, 2]
