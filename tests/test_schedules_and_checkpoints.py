"""Learning-rate schedules against their closed forms (eagerly and under jit), and the
Checkpointer's period, force, keep-N and checkpoint listing on a tiny state."""
import functools
import re
import shutil
import subprocess
import sys
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import ON_GPU
from train_helpers import unreadable_state
from t5x_variants.train import (checkpoint_reads, checkpoints, fingerprints, multihost, optimizer,
                                pretrained, storage)

STEPS = np.arange(0, 1201, dtype=np.int32)


def closed_form(steps, name, base, warmup_steps=0, total_steps=None, decay_fraction=0.0):
  """The schedule in float64: base / sqrt(max(step, warmup)) or base, times
  clip((total - step) / (fraction * total), 0, 1) with a decay."""
  step = steps.astype(np.float64)
  lr = (base / np.sqrt(np.maximum(step, warmup_steps)) if name == 'rsqrt'
        else np.full_like(step, base))
  if decay_fraction:
    lr = lr * np.clip((total_steps - step) / (decay_fraction * total_steps), 0, 1)
  return lr


def float32_formula(step, name, base, warmup_steps=0, total_steps=None, decay_fraction=0.0):
  """The same formula in float32 jnp ops, as the schedule computed it before it was built from
  optax pieces: XLA rounds it a few ulps away from float64 (it divides by a constant as a
  multiplication by its reciprocal, and under jit a / sqrt(x) as a * rsqrt(x))."""
  step = jnp.asarray(step, jnp.float32)
  lr = (base / jnp.sqrt(jnp.maximum(step, warmup_steps)) if name == 'rsqrt'
        else jnp.full_like(step, base))
  if decay_fraction:
    lr = lr * jnp.clip((total_steps - step) / (decay_fraction * total_steps), 0.0, 1.0)
  return lr


CONFIGS = [
    dict(name='rsqrt', base=1.0, warmup_steps=100),
    dict(name='rsqrt', base=1.0, warmup_steps=100, total_steps=1000, decay_fraction=0.1),
    dict(name='rsqrt', base=0.7, warmup_steps=33, total_steps=1005, decay_fraction=0.37),
    dict(name='constant', base=1e-3),
    dict(name='constant', base=0.03, total_steps=1000, decay_fraction=0.1),
]


def as_f32(values, steps=STEPS):
  """A schedule's output over ``steps`` as float32 (a constant schedule gives one Python float)."""
  return np.broadcast_to(np.asarray(values, np.float32), steps.shape)


@pytest.mark.parametrize('config', CONFIGS, ids=lambda c: '-'.join(map(str, c.values())))
def test_schedules_equal_their_formulas_at_every_step(config):
  """The float32 formula to within an ulp or two (XLA may rewrite a division), eagerly and under
  jit with a traced int32 step (as the train step calls it); within float32 rounding of the
  float64 closed form, exactly 0 from ``total_steps`` on and positive before."""
  schedule = optimizer.learning_rate_schedule(**config)
  formula = functools.partial(float32_formula, **config)
  eager = as_f32(schedule(STEPS))
  np.testing.assert_allclose(eager, formula(STEPS), rtol=4e-7, atol=0)
  few = STEPS[::37]
  np.testing.assert_allclose(as_f32([schedule(int(s)) for s in few], few),
                             as_f32([formula(int(s)) for s in few], few), rtol=4e-7, atol=0)
  jitted = as_f32(jax.jit(jax.vmap(schedule))(jnp.asarray(STEPS)))
  np.testing.assert_allclose(jitted, jax.jit(jax.vmap(formula))(jnp.asarray(STEPS)), rtol=4e-7,
                             atol=0)
  want = closed_form(STEPS, **config)
  for got in (eager, jitted):
    np.testing.assert_allclose(got, want, rtol=4e-7, atol=0)
    np.testing.assert_array_equal(got == 0, want == 0)
  if config.get('total_steps'):
    assert not want[STEPS >= config['total_steps']].any()
    assert want[STEPS < config['total_steps']].all()


def test_schedule_landmarks():
  """The values named in the papers' and T5's settings, eagerly and under jit: exactly on the CPU,
  to a few float32 ulps on a GPU (its reciprocal square root is not correctly rounded)."""
  at = (lambda value: pytest.approx(np.float32(value), rel=1e-6)) if ON_GPU else np.float32
  rsqrt = optimizer.learning_rate_schedule('rsqrt', base=1.0, warmup_steps=100)
  glu = optimizer.learning_rate_schedule('rsqrt', base=1.0, warmup_steps=100, total_steps=1000,
                                         decay_fraction=0.1)
  for schedule in (rsqrt, jax.jit(rsqrt)):
    assert schedule(jnp.int32(0)) == at(0.1) == schedule(jnp.int32(100))
    assert schedule(jnp.int32(400)) == at(0.05)
  assert glu(400) == rsqrt(400) and glu(900) == rsqrt(900)  # the decay starts at 900
  assert glu(950) == at(1 / np.sqrt(np.float32(950)) * np.float32(0.5))
  for step in (1000, 1001, 5000):
    assert glu(step) == 0 and jax.jit(glu)(jnp.int32(step)) == 0
  t5 = optimizer.learning_rate_schedule('rsqrt', base=1.0, warmup_steps=10_000,
                                        total_steps=100_000, decay_fraction=0.1)
  for schedule in (t5, jax.jit(t5)):
    assert schedule(jnp.int32(0)) == at(0.01) == schedule(jnp.int32(10_000))
    assert schedule(jnp.int32(40_000)) == at(0.005)
    assert schedule(jnp.int32(95_000)) == at(0.5 / np.sqrt(95_000))
    assert schedule(jnp.int32(100_000)) == 0
  constant = optimizer.learning_rate_schedule('constant', base=1e-3)
  assert np.float32(constant(123)) == np.float32(1e-3) == jax.jit(constant)(jnp.int32(123))


def warmup_closed_form(steps, name, base, warmup_steps, total_steps=None, d_model=None, end_value=0.0):
  """The warmup schedules in float64 from their papers' formulas."""
  s = steps.astype(np.float64)
  if name == 'noam':  # Vaswani et al. 2017, Eq. 3 (peak-normalised without d_model)
    scale = d_model**-0.5 if d_model else np.sqrt(warmup_steps)
    return base * scale * np.minimum(np.maximum(s, 1) ** -0.5, s * warmup_steps**-1.5)
  progress = np.clip((s - warmup_steps) / (total_steps - warmup_steps), 0, 1)
  decay = 1 - progress if name == 'linear' else 0.5 * (1 + np.cos(np.pi * progress))
  return np.where(s < warmup_steps, base * s / max(warmup_steps, 1), end_value + (base - end_value) * decay)


WARMUP_CONFIGS = [
    dict(name='noam', base=2.0, warmup_steps=400, d_model=512),
    dict(name='noam', base=5e-4, warmup_steps=400),
    dict(name='linear', base=1e-3, warmup_steps=100, total_steps=1000),
    dict(name='linear', base=1e-3, warmup_steps=0, total_steps=1000, end_value=1e-5),
    dict(name='cosine', base=1e-3, warmup_steps=100, total_steps=1000),
    dict(name='cosine', base=1e-3, warmup_steps=100, total_steps=1000, end_value=1e-4),
]


@pytest.mark.parametrize('config', WARMUP_CONFIGS, ids=lambda c: '-'.join(map(str, c.values())))
def test_warmup_schedules_equal_their_formulas(config):
  """Noam, warmup + linear and warmup + cosine: the float64 formulas to float32 rounding, eagerly
  and under jit; 0 at step 0, the peak ``base`` at the end of the warmup (Noam with d_model:
  base * (d_model * warmup)^-0.5), ``end_value`` from ``total_steps`` on, never negative."""
  schedule = optimizer.learning_rate_schedule(**config)
  want = warmup_closed_form(STEPS, **config)
  for got in (as_f32(schedule(STEPS)), as_f32(jax.jit(jax.vmap(schedule))(jnp.asarray(STEPS)))):
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * config['base'])  # fp32 near 0
    assert (got >= 0).all()
  w = config['warmup_steps']
  peak = config['base'] * (config['d_model'] * w) ** -0.5 if config.get('d_model') else config['base']
  assert float(schedule(w)) == pytest.approx(peak, rel=1e-6)
  assert float(schedule(w)) == pytest.approx(want.max(), rel=1e-6)
  if w:
    assert float(schedule(0)) == 0
  if config.get('total_steps'):
    for step in (config['total_steps'], config['total_steps'] + 200):
      assert float(jax.jit(schedule)(jnp.int32(step))) == pytest.approx(config.get('end_value', 0.0), rel=1e-6)


def test_schedule_errors():
  with pytest.raises(ValueError, match="unknown schedule 'exp'; valid: rsqrt, constant, noam"):
    optimizer.learning_rate_schedule('exp')
  with pytest.raises(ValueError, match='with decay_fraction needs learning_rate_schedule.total_steps'):
    optimizer.learning_rate_schedule('rsqrt', decay_fraction=0.1)
  with pytest.raises(ValueError, match="'cosine' needs learning_rate_schedule.total_steps"):
    optimizer.learning_rate_schedule('cosine')
  with pytest.raises(ValueError, match=r'learning_rate_schedule.warmup_steps = 1000 must be in \[0, total_steps 1000\)'):
    optimizer.learning_rate_schedule('linear', warmup_steps=1000, total_steps=1000)
  for name in ('rsqrt', 'noam'):  # lr inf at the first step (rsqrt), a ZeroDivisionError (noam)
    with pytest.raises(ValueError, match=f"warmup_steps = 0: schedule '{name}' divides by"):
      optimizer.learning_rate_schedule(name, warmup_steps=0)
  with pytest.raises(ValueError, match="learning_rate_schedule.base = 'fast' is out of range: it "
                     'must be a number > 0'):
    optimizer.learning_rate_schedule('constant', base='fast')  # was optax's, naming nothing


@pytest.mark.parametrize('setting, message', [
    (dict(base=-1e-3), 'base = -0.001 is out of range: it must be a number > 0'),  # trained by
    (dict(base=0.0), 'base = 0.0 is out of range'),  # gradient ascent, or not at all, exit 0
    (dict(base=float('inf')), 'base = inf is out of range'),
    (dict(base=True), 'base = True is out of range'),
    (dict(end_value=-1e-5), 'end_value = -1e-05 is out of range: it must be a number >= 0'),
    (dict(decay_fraction=1.5), 'decay_fraction = 1.5 is out of range: it must be a number in'),
    (dict(warmup_steps=-5), 'warmup_steps = -5 is out of range: it must be an integer >= 0'),
    (dict(warmup_steps=2.5), 'warmup_steps = 2.5 is out of range'),
])
def test_a_schedule_setting_out_of_range_is_refused(setting, message):
  with pytest.raises(ValueError, match=f'learning_rate_schedule.{re.escape(message)}'):
    optimizer.learning_rate_schedule(**{'name': 'linear', 'total_steps': 100, **setting})
  optimizer.learning_rate_schedule('linear', total_steps=100, base=1e-3, end_value=0,
                                    decay_fraction=1, warmup_steps=10)  # the edges are in range


@pytest.mark.parametrize('loss,message', [
    (dict(label_smoothing=1.5), r'train.label_smoothing must be in \[0, 1\), not 1.5'),
    (dict(z_loss=-1e-4), 'train.z_loss must be a number >= 0, not -0.0001'),
    (dict(loss_normalizing_factor=0.0), "loss_normalizing_factor must be 'num_tokens', 'none', "
                                        "'average_per_sequence', None or a number > 0, not 0.0"),
    (dict(loss_normalizing_factor=-1.0), 'or a number > 0, not -1.0'),
    (dict(loss_normalizing_factor=True), 'or a number > 0, not True'),
    (dict(loss_normalizing_factor='tokens'), "or a number > 0, not 'tokens'"),
])
def test_a_loss_setting_out_of_range_is_refused_before_any_work(loss, message):
  """label_smoothing 1.5 made every step non-finite, and the error advised a lower learning rate;
  a loss_normalizing_factor of 0 did the same, a negative one trained by gradient ascent."""
  from t5x_variants.train import trainer  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=message):
    trainer.train(None, None, model_dir='/nonexistent', total_steps=1, **loss)


class State(flax.struct.PyTreeNode):
  step: jax.Array
  params: Any


def state(step):
  return State(step=jnp.int32(step), params={'w': jnp.full((2, 3), step, jnp.float32),
                                             'b': jnp.arange(3, dtype=jnp.int32) + step})


def names(paths):
  return [p.name for p in paths]


def test_checkpointer_saves_period_steps_and_forced_steps_once(tmp_path):
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=3, keep=None)
  saved = [step for step in range(1, 8) if ckpt.save(step, state(step))]
  assert saved == [3, 6]  # not step 1, although the run had no checkpoint yet
  assert ckpt.save(7, state(7), force=True)
  assert not ckpt.save(7, state(7), force=True)  # the final step saved again: refused
  assert not ckpt.save(6, state(6)) and not ckpt.save(6, state(6), force=True)
  ckpt.close()
  assert ckpt.steps() == [3, 6, 7]
  assert names(checkpoints.list_checkpoints(str(tmp_path))) == [
      'checkpoint_3', 'checkpoint_6', 'checkpoint_7']


def test_checkpointer_keeps_the_last_two_and_restores_the_newest(tmp_path):
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=1, keep=2)
  for step in range(1, 6):
    assert ckpt.save(step, state(step))
  ckpt.close()
  assert sorted(p.name for p in tmp_path.iterdir()) == ['checkpoint_4', 'checkpoint_5']
  resumed = checkpoints.Checkpointer(str(tmp_path), period=1, keep=2)
  restored, step = resumed.restore_latest(state(0))
  resumed.close()
  assert step == 5
  jax.tree_util.tree_map(np.testing.assert_array_equal, restored, state(5))


KILLED_WHILE_DELETING = '''
import os, signal, sys, threading
import jax.numpy as jnp
from t5x_variants.train import checkpoints
ckpt = checkpoints.Checkpointer(sys.argv[1], period=1, keep=1, async_save=False)
unlink = os.unlink
def unlink_then_die(*args, **kwargs):  # keep-N's deletion of checkpoint_1 killed after one file
  unlink(*args, **kwargs)
  if threading.current_thread().name == 'checkpoint-keep-n':  # (its thread, which save(2) starts)
    os.kill(os.getpid(), signal.SIGKILL)
os.unlink = unlink_then_die
for step in (1, 2):
  ckpt.save(step, {'params': {'w': jnp.full((2, 3), float(step))}})
ckpt.close()
'''


def test_a_run_killed_while_keep_n_deletes_a_checkpoint_leaves_only_whole_ones(tmp_path):
  """SIGKILL after the first file keep-N deletes: every listed checkpoint reads (orbax deleted in
  place, file by file, so a half-deleted checkpoint_1 stayed listed, and t5xv-eval over all
  checkpoints failed on it at every rerun); the next Checkpointer deletes what was left of it."""
  out = subprocess.run([sys.executable, '-c', KILLED_WHILE_DELETING, str(tmp_path)],
                       capture_output=True, text=True)
  assert out.returncode == -9, out.stderr
  assert names(checkpoints.list_checkpoints(str(tmp_path))) == ['checkpoint_2']
  np.testing.assert_array_equal(pretrained.read_on_host(str(tmp_path / 'checkpoint_2'))['w'],
                                np.full((2, 3), 2.0))
  assert (tmp_path / checkpoints.DELETED / 'checkpoint_1').exists()
  resumed = checkpoints.Checkpointer(str(tmp_path), period=1, keep=1, async_save=False)
  assert names(sorted(tmp_path.iterdir())) == ['checkpoint_2']
  assert resumed.save(3, {'params': {'w': jnp.full((2, 3), 3.0)}})
  resumed.close()
  assert names(sorted(tmp_path.iterdir())) == ['checkpoint_3']


def test_leftovers_that_cannot_be_deleted_at_start_up_are_a_warning(tmp_path, monkeypatch, caplog):
  """A killed keep-N's rest that process 0 cannot delete is unlisted: the run starts with a warning
  (an error on process 0 alone would leave the other processes waiting for it)."""
  (tmp_path / checkpoints.DELETED / 'checkpoint_1').mkdir(parents=True)

  def refused(path, missing_ok=False):
    raise PermissionError(f'cannot delete {path}')
  monkeypatch.setattr(type(storage.path(str(tmp_path))), 'rmtree', refused)
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=1, keep=1, async_save=False)
  assert 'could not delete what an interrupted keep-N left' in caplog.text
  monkeypatch.undo()
  assert ckpt.save(1, state(1))
  ckpt.close()


def test_what_the_non_finite_guard_counted_is_kept_with_a_checkpoint(tmp_path):
  """Restored into the resumed run's guard; a checkpoint saved without it (before it was kept)
  leaves the guard as it is."""
  from t5x_variants.train.nonfinite import NonFiniteGuard  # pylint: disable=g-import-not-at-top
  guard = NonFiniteGuard('skip', 5)
  for step, skipped in ((1, 0), (2, 1), (3, 1)):
    guard.check(step, {'skipped': skipped, 'loss': float('nan') if skipped else 1.0})
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=1, keep=None, async_save=False)
  ckpt.save(3, state(3), guard=guard)
  ckpt.save(4, state(4))
  ckpt.close()
  abstract = jax.tree_util.tree_map(lambda x: x, state(0))
  resumed = NonFiniteGuard('skip', 5)
  checkpoints.Checkpointer(str(tmp_path)).restore(3, abstract, guard=resumed)
  assert resumed.state() == guard.state() == {'skipped': 2, 'applied': True, 'first': [2, 'nan']}
  fresh = NonFiniteGuard('skip', 5)
  checkpoints.Checkpointer(str(tmp_path)).restore(4, abstract, guard=fresh)
  assert fresh.state() == {'skipped': 0, 'applied': False, 'first': None}
  # Damaged (not JSON, or JSON without its fields): a warning, the guard fresh, the checkpoint
  # used (it was moved aside over a counter file, or a bare KeyError stopped the start).
  shutil.rmtree(tmp_path / 'checkpoint_4')
  for damaged in ('{"skipp', '{"skipped": 1}'):
    for metadata in (tmp_path / 'checkpoint_3' / checkpoints.NONFINITE).iterdir():
      metadata.write_text(damaged)
    fresh = NonFiniteGuard('skip', 5)
    assert checkpoints.Checkpointer(str(tmp_path)).restore_latest(abstract, guard=fresh)[1] == 3
    assert fresh.state()['skipped'] == 0 and (tmp_path / 'checkpoint_3').is_dir()


def test_keep_n_counts_committed_checkpoints_and_deletes_none_at_start_up(tmp_path):
  """A save in flight is not one of the kept (its commit may fail: the one before must stay), and
  a Checkpointer that has saved nothing deletes nothing (a run refused at start-up, e.g. resumed
  with keep 1 or another vocabulary, loses no checkpoint)."""
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=1, keep=None, async_save=False)
  for step in (1, 2, 3):
    ckpt.save(step, state(step))
  ckpt.close()
  checkpoints.Checkpointer(str(tmp_path), period=1, keep=1).manager.close()
  assert names(sorted(tmp_path.iterdir())) == ['checkpoint_1', 'checkpoint_2', 'checkpoint_3']
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=1, keep=1)
  assert ckpt.save(4, state(4))
  ckpt._wait_for_deletions()  # pylint: disable=protected-access
  assert 'checkpoint_3' in names(checkpoints.list_checkpoints(str(tmp_path)))
  ckpt.close()
  assert names(sorted(tmp_path.iterdir())) == ['checkpoint_4']


def test_a_checkpoint_whose_bytes_decode_to_nan_is_damaged(tmp_path):
  """Flipped bytes that still decode (a NaN where a weight was): resuming moves it aside and reads
  the one before, as an unreadable one; evaluation's and export's reads refuse it, naming the
  array. Training never saves a non-finite value (such an update is skipped)."""
  from t5x_variants.train import pretrained  # pylint: disable=g-import-not-at-top
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=2, keep=None)
  damaged = state(4).replace(params={'w': jnp.full((2, 3), 4.0).at[1, 2].set(jnp.nan),
                                     'b': jnp.arange(3, dtype=jnp.int32)})
  assert ckpt.save(2, state(2)) and ckpt.save(4, damaged)
  ckpt.close()
  with pytest.raises(checkpoints.CheckpointError, match='params/w holds a NaN or an infinity'):
    pretrained.read_on_host(str(tmp_path / 'checkpoint_4'))
  resumed = checkpoints.Checkpointer(str(tmp_path), period=2, keep=None)
  restored, step = resumed.restore_latest(state(0))
  resumed.close()
  assert step == 2
  assert sorted(names(tmp_path.iterdir())) == ['checkpoint_2', 'checkpoint_4.unreadable']
  jax.tree_util.tree_map(np.testing.assert_array_equal, restored, state(2))


def test_a_parameters_only_checkpoint_is_refused_for_resuming_and_left_in_place(tmp_path):
  """A checkpoint of parameters alone (t5xv-import's) in a run's directory reads, but holds no
  step: one error that says to start from it with train.init_checkpoint, not a damaged checkpoint
  moved aside."""
  ckpt = checkpoints.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(0, {'params': state(0).params}, force=True)
  ckpt.close()
  resumed = checkpoints.Checkpointer(str(tmp_path))
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'checkpoint_0 holds params but no step \(as t5xv-import writes parameters '
                           r'only\): train from it in a new model_dir with --gin.train.init_checkpoint'):
    resumed.restore_latest(state(0))
  resumed.close()
  assert names(tmp_path.iterdir()) == ['checkpoint_0']


@pytest.mark.parametrize('error', [
    ValueError('UNAVAILABLE: HTTP response code: 503 (the bucket, after its retries)'),
    RuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB'),
    MemoryError(), ConnectionError('connection reset')])
def test_a_read_failing_outside_the_checkpoint_moves_nothing_aside(tmp_path, monkeypatch, error):
  """A bucket outage past its retries, or memory running out on a smaller mesh: one error, and
  every checkpoint stays where it is (moving them aside one by one would end in 'start from
  scratch')."""
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=1, async_save=False)
  for step in (1, 2):
    ckpt.save(step, state(step))
  ckpt.close()

  def fails(*args, **kwargs):
    raise error
  monkeypatch.setattr(ocp.StandardCheckpointHandler, 'restore', fails)
  resumed = checkpoints.Checkpointer(str(tmp_path))
  with pytest.raises(checkpoints.CheckpointError, match='checkpoint_2 could not be read .*, for a '
                     'cause outside it: nothing was moved aside; fix the cause'):
    resumed.restore_latest(state(0))
  resumed.close()
  assert names(sorted(tmp_path.iterdir())) == ['checkpoint_1', 'checkpoint_2']


def test_damaged_checkpoints_are_moved_aside_only_once_an_older_one_reads(tmp_path, monkeypatch):
  """checkpoint_2 and _3 unreadable: restoring reads checkpoint_1 and then moves both aside (the
  name of an earlier step 3 moved aside kept). With checkpoint_1 unreadable too, nothing reads:
  one error naming the newest's reason, and nothing is moved (a failure of every read may be the
  installation's, not the files')."""
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=1, keep=None, async_save=False)
  for step in (1, 2, 3):
    ckpt.save(step, state(step))
  ckpt.close()
  unreadable = {1, 2, 3}
  unreadable_state(unreadable, monkeypatch.setattr)
  resumed = checkpoints.Checkpointer(str(tmp_path))
  with pytest.raises(checkpoints.CheckpointError, match=(
      r'no checkpoint in .* can be read \(the newest, checkpoint_3: ValueError: DATA_LOSS: '
      r'reading .*checkpoint_3/state: unexpected end of file \(injected\)\); none was moved '
      r'aside')):
    resumed.restore_latest(state(0))
  resumed.close()
  assert names(sorted(tmp_path.iterdir())) == ['checkpoint_1', 'checkpoint_2', 'checkpoint_3']

  unreadable.remove(1)
  (tmp_path / 'checkpoint_3.unreadable').mkdir()  # moved aside by an earlier fallback
  resumed = checkpoints.Checkpointer(str(tmp_path))
  restored, step = resumed.restore_latest(state(0))
  resumed.close()
  assert step == 1
  jax.tree_util.tree_map(np.testing.assert_array_equal, restored, state(1))
  assert names(sorted(tmp_path.iterdir())) == [
      'checkpoint_1', 'checkpoint_2.unreadable', 'checkpoint_3.unreadable',
      'checkpoint_3.unreadable.1']
  assert (tmp_path / 'checkpoint_3.unreadable.1' / 'state').is_dir()


class Position:
  """A data iterator's position: ``restore`` raises ``error`` when given one."""

  def __init__(self, error=None):
    self.position, self.error = 0, error

  def save(self, prefix):
    with open(prefix, 'w') as f:
      f.write(str(self.position))

  def restore(self, prefix):
    if self.error:
      raise self.error
    with open(prefix) as f:
      self.position = int(f.read())


def test_a_read_that_failed_on_another_process_raises_on_this_one_too(monkeypatch):
  """Every process learns the outcome of all (an allgather, faked here for 2 processes): a read
  that succeeded here raises when process 1's failed, naming it; the worst outcome decides
  whether the cause is outside the checkpoint. Process 0's answers are taken by all."""
  other = {}
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(multihost.multihost_utils, 'process_allgather',
                      lambda x: np.asarray([int(x), other['outcome']]))
  other['outcome'] = 0
  assert checkpoint_reads.read_on_every_process('state', lambda: 'read') == 'read'
  other['outcome'] = 1
  with pytest.raises(checkpoint_reads.ReadError,
                     match=r'^not readable on process 1: its log says why$') as raised:
    checkpoint_reads.read_on_every_process('state', lambda: 'read')
  assert raised.value.part == 'state' and not raised.value.outside

  def damaged():
    raise ValueError('DATA_LOSS: truncated')
  other['outcome'] = 2
  with pytest.raises(checkpoint_reads.ReadError, match=r'^ValueError: DATA_LOSS: truncated; on another '
                     'process for a cause outside the checkpoint') as raised:
    checkpoint_reads.read_on_every_process('data', damaged)
  assert raised.value.part == 'data' and raised.value.outside
  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  answer = iter([np.asarray(5), np.frombuffer(b'false', np.uint8)])  # process 0's, as JSON
  monkeypatch.setattr(multihost.multihost_utils, 'broadcast_one_to_all', lambda x: next(answer))
  assert multihost.process0_says('x', lambda: True) is False


@pytest.mark.parametrize('error, message', [
    (ConnectionError('connection reset'), r'checkpoint_2 could not be read \(ConnectionError: '
                                          r'connection reset\), for a cause outside it: nothing was '
                                          'moved aside'),
    (ValueError('not a position'), r'checkpoint_2 has a readable state but this run cannot take its '
                                   r'data position \(ValueError: not a position\)')])
def test_a_data_position_that_fails_to_read_says_why_and_moves_nothing(tmp_path, error, message):
  """A data position that fails to read for a cause outside the checkpoint (the bucket, the
  network) or that this run cannot take: each its own line; nothing moved aside."""
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=1, async_save=False)
  for step in (1, 2):
    ckpt.save(step, state(step), Position())
  ckpt.close()
  resumed = checkpoints.Checkpointer(str(tmp_path))
  with pytest.raises(checkpoints.CheckpointError, match=message):
    resumed.restore_latest(state(0), Position(error))
  resumed.close()
  assert names(sorted(tmp_path.iterdir())) == ['checkpoint_1', 'checkpoint_2']


def test_a_fingerprint_is_its_closed_form_and_any_flipped_bit_changes_it():
  """F(x) = sum_i fmix32(w_i XOR i * 0x9E3779B9) mod 2^32 over x's bits as 32-bit words,
  row-major, in numpy; the two sign bits flipped (and x and -x swapped), which a sum of the words
  with odd weights missed, change it too."""
  rng = np.random.RandomState(0)
  arrays = {'f32': rng.randn(3, 5).astype(np.float32), 'i32': rng.randint(-9, 9, (4,), np.int32),
            'bf16': rng.randn(2, 3).astype(jnp.bfloat16), 'flag': np.array([True, False, True]),
            'scalar': np.float32(2.5)}
  def closed_form(x):
    words = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    h = np.asarray(x).view(words).ravel().astype(np.uint64)
    h ^= np.arange(h.size, dtype=np.uint64) * 0x9E3779B9 % 2**32
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, 1)):
      h = (h ^ (h >> shift)) * factor % 2**32
    return int(np.sum(h) % 2**32)
  want = {k: [str(x.dtype), closed_form(x)] for k, x in arrays.items()}
  finite, prints = fingerprints.summarize({k: jnp.asarray(x) for k, x in arrays.items()})
  assert all(finite.values()) and prints == want
  # on the host (an import's numpy arrays), one at a time: the same, with the devices' mixed in
  assert fingerprints.summarize({**arrays, 'f32': jnp.asarray(arrays['f32'])})[1] == want
  x = arrays['f32'][:2, :2]
  print_of = lambda a: fingerprints.summarize({'x': jnp.asarray(a)})[1]['x'][1]
  for i in range(x.size):
    for bit in range(32):
      flipped = x.copy().view(np.uint32)
      flipped.flat[i] ^= np.uint32(1 << bit)
      assert print_of(flipped.view(np.float32)) != print_of(x), (i, bit)
  assert print_of(x[::-1]) != print_of(x)  # values in other places
  assert print_of(-x) != print_of(x)  # every sign bit flipped
  assert print_of(np.array([[-x[0, 1], -x[0, 0]], x[1]])) != print_of(x)  # x, -x swapped


def test_parameters_whose_bytes_changed_are_refused_by_every_reader(tmp_path):
  """A checkpoint whose state/ holds another step's arrays (damaged bytes that decode: they
  were read as other values, silently): the run's restore and restore_params both name it."""
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=1, keep=None, async_save=False)
  for step in (1, 2):
    ckpt.save(step, state(step))
  ckpt.close()
  shutil.rmtree(tmp_path / 'checkpoint_2' / 'state')
  shutil.copytree(tmp_path / 'checkpoint_1' / 'state', tmp_path / 'checkpoint_2' / 'state')
  with pytest.raises(checkpoints.CheckpointError, match='checkpoint_2 .*params/.* does not read as '
                     'it was saved'):
    pretrained.restore_params(str(tmp_path), state(0).params)
  resumed = checkpoints.Checkpointer(str(tmp_path), period=1)
  restored, step = resumed.restore_latest(state(0))
  resumed.close()
  assert step == 1 and (tmp_path / 'checkpoint_2.unreadable').exists()
  jax.tree_util.tree_map(np.testing.assert_array_equal, restored, state(1))


def test_changed_bytes_that_decode_to_nan_are_named_as_changed(tmp_path):
  """Damaged bytes that decode to a NaN are changed bytes first: the fingerprint's line names
  them, whatever value they decoded to (the NaN check came first, and which line a flipped bit
  gave depended on where in orbax's data file it fell: CI's fault test got the NaN line once)."""
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=1, keep=None, async_save=False)
  ckpt.save(1, state(1))
  ckpt.save(2, state(2).replace(params={'w': jnp.full((2, 3), jnp.nan), 'b': state(2).params['b']}))
  ckpt.close()
  shutil.rmtree(tmp_path / 'checkpoint_1' / 'state')
  shutil.copytree(tmp_path / 'checkpoint_2' / 'state', tmp_path / 'checkpoint_1' / 'state')
  with pytest.raises(checkpoints.CheckpointError, match='checkpoint_1 .*params/.* does not read as '
                     'it was saved'):
    pretrained.restore_params(str(tmp_path / 'checkpoint_1'), state(0).params)


@pytest.mark.parametrize('damage', ['not JSON', 'another structure'])
def test_fingerprints_that_cannot_be_read_are_a_warning_and_the_arrays_are_used(
    tmp_path, damage, caplog):
  """As a damaged nonfinite/: the arrays may be whole (it made a good checkpoint unreadable)."""
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=1, async_save=False)
  ckpt.save(1, state(1))
  ckpt.close()
  (tmp_path / 'checkpoint_1' / fingerprints.ITEM / 'metadata').write_text('{"params/w": ' if damage == 'not JSON' else '{"params/w": 5}')
  resumed = checkpoints.Checkpointer(str(tmp_path), period=1)
  restored, step = resumed.restore_latest(state(0))
  resumed.close()
  assert step == 1 and 'are not checked against it' in caplog.text
  jax.tree_util.tree_map(np.testing.assert_array_equal, restored, state(1))


def test_fingerprints_are_taken_at_saves_only(tmp_path, monkeypatch):
  """The trainer offers every step to save(): fingerprinting each waited for it (the device
  queue drained at every step)."""
  calls = []
  summarize = fingerprints.summarize
  monkeypatch.setattr(fingerprints, 'summarize', lambda tree: calls.append(1) or summarize(tree))
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=5, async_save=False)
  for step in range(1, 11):
    ckpt.save(step, state(step))
  ckpt.save(10, state(10), force=True)  # saved already
  ckpt.save(11, state(11), force=True)
  ckpt.close()
  assert ckpt.steps() == [5, 10, 11] and len(calls) == 3


def test_listing_skips_unreadable_unfinished_and_stray_entries(tmp_path):
  ckpt = checkpoints.Checkpointer(str(tmp_path), period=2, keep=None)
  for step in (2, 4, 6):
    ckpt.save(step, state(step))
  ckpt.close()
  (tmp_path / 'checkpoint_7.unreadable' / 'state').mkdir(parents=True)
  (tmp_path / 'checkpoint_8.orbax-checkpoint-tmp-1234' / 'state').mkdir(parents=True)
  (tmp_path / 'checkpoint_x').write_text('')
  (tmp_path / 'checkpoint_9').write_text('')
  (tmp_path / 'checkpoint_10_old').mkdir()
  (tmp_path / 'checkpoint_3').mkdir()  # empty (an interrupted copy): t5xv-eval stopped at it
  (tmp_path / 'checkpoint_12').mkdir()  # and read it as the newest
  assert names(checkpoints.list_checkpoints(str(tmp_path))) == [
      'checkpoint_2', 'checkpoint_4', 'checkpoint_6']
  assert checkpoints.checkpoint_path(str(tmp_path)) == tmp_path / 'checkpoint_6'
  (tmp_path / 'checkpoint_3').rmdir()
  (tmp_path / 'checkpoint_12').rmdir()
  assert checkpoints.checkpoint_path(str(tmp_path / 'checkpoint_4')) == tmp_path / 'checkpoint_4'
  with pytest.raises(checkpoints.CheckpointError, match='checkpoint-tmp-1234 is a checkpoint whose '
                     'save did not finish .*give its run directory'):  # named, it was read
    checkpoints.checkpoint_path(str(tmp_path / 'checkpoint_8.orbax-checkpoint-tmp-1234'))
  reopened = checkpoints.Checkpointer(str(tmp_path), period=2)
  assert reopened.steps() == [2, 4, 6]
  reopened.close()
  # a trainer opening the directory deletes the unfinished save (of a step never saved again, it
  # stayed for good), nothing else
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      'checkpoint_10_old', 'checkpoint_2', 'checkpoint_4', 'checkpoint_6',
      'checkpoint_7.unreadable', 'checkpoint_9', 'checkpoint_x']
  params = pretrained.restore_params(str(tmp_path), state(0).params)
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, state(6).params)


@pytest.mark.parametrize('where', ['empty', 'missing', 'only_unreadable'])
def test_a_run_dir_without_checkpoints_is_a_clear_error(tmp_path, where):
  run_dir = tmp_path / 'run'
  if where != 'missing':
    run_dir.mkdir()
  if where == 'only_unreadable':
    (run_dir / 'checkpoint_7.unreadable' / 'state').mkdir(parents=True)
  assert checkpoints.list_checkpoints(str(run_dir)) == []
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'no checkpoint at .*run: expected a checkpoint_<step> directory'):
    checkpoints.checkpoint_path(str(run_dir))


def test_a_restore_without_target_shardings_fails_the_tests(tmp_path):
  """orbax warns that such a restore is unsafe on another topology; here, and in the processes
  the tests start, that warning is an error (the trainer always names the shardings)."""
  with ocp.PyTreeCheckpointer() as ckptr:
    ckptr.save(tmp_path / 'tree', {'x': jnp.arange(4.0)})
    with pytest.raises(UserWarning, match='Sharding info not provided'):
      ckptr.restore(tmp_path / 'tree')
  code = ('import orbax.checkpoint as ocp, sys\n'
          f'ocp.PyTreeCheckpointer().restore({str(tmp_path / "tree")!r})')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
  assert out.returncode != 0 and 'Sharding info not provided' in out.stderr


def test_every_process_takes_process_0s_checkpoint_steps(monkeypatch):
  """Beside a training run that saves and deletes, each process would list its own moment (and
  load its own 'newest'): process 0's steps are broadcast to process 1 (here), as JSON text in an
  array of its length's shape."""
  text = np.frombuffer(b'[10, 20]', np.uint8)
  process0 = iter([np.asarray(len(text)), text])  # its length, then its text
  shapes = []
  def broadcast(x):
    shapes.append(np.shape(x))
    return next(process0)
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  monkeypatch.setattr(multihost.multihost_utils, 'broadcast_one_to_all', broadcast)
  assert checkpoints._process0_steps(lambda: [10, 20, 30]) == [10, 20]  # pylint: disable=protected-access
  assert shapes == [(), (8,)]


def test_a_checkpoint_of_scanned_layers_read_by_unrolled_ones_names_scan_layers():
  """(it was told the checkpoint held encoder parameters the model had none of)"""
  saved = {'encoder/layers/mlp/wi/kernel': (2, 4, 8), 'token_embedder/embedding': (10, 4)}
  wanted = {'encoder/layers_0/mlp/wi/kernel': (4, 8), 'encoder/layers_1/mlp/wi/kernel': (4, 8),
            'token_embedder/embedding': (10, 4)}
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'saved with TransformerConfig.scan_layers=True; this model has scan_layers=False'):
    pretrained._new_params('ckpt', saved, wanted)  # pylint: disable=protected-access
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'scan_layers=False; this model has scan_layers=True'):
    pretrained._new_params('ckpt', wanted, saved)  # pylint: disable=protected-access


def test_an_unrolled_checkpoint_of_more_layers_is_another_model_not_a_shared_encoder():
  """(a 3-layer unrolled checkpoint read by a 2-layer model was said to hold encoder parameters
  the model had none of, a shared encoder-decoder's mistake)"""
  wanted = {f'{s}/layers_{i}/mlp/wi/kernel': (4, 8) for s in ('encoder', 'decoder') for i in range(2)}
  saved = {**wanted, 'decoder/layers_2/mlp/wi/kernel': (4, 8), 'encoder/layers_2/mlp/wi/kernel': (4, 8)}
  with pytest.raises(checkpoints.CheckpointError, match=r"holds another model \(decoder/layers_2/mlp/wi/"
                                                        r"kernel: saved \(4, 8\), this model nothing; 2 "):
    pretrained._new_params('ckpt', saved, wanted)  # pylint: disable=protected-access
  decoder_only = {k: v for k, v in saved.items() if k.startswith('decoder/')}
  with pytest.raises(checkpoints.CheckpointError, match='holds encoder parameters this model has none'):
    pretrained._new_params('ckpt', saved, decoder_only)  # pylint: disable=protected-access
