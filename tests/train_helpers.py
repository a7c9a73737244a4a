"""Synthetic batches and a tiny training setup shared by the trainer tests (no TensorFlow)."""
import errno
import json
import os
import time

import numpy as np
import orbax.checkpoint as ocp

from t5x_variants.models import build_model, init_inputs
from t5x_variants.train import checkpoints, optimizer, partitioning, pretrained, train_step
from conftest import tiny


def init_state(model, tx_fn, mesh, rules, rng, inputs):
  """(fresh sharded TrainState, its shardings, tx)."""
  layout = train_step.state_layout(model, tx_fn, mesh, rules, rng, inputs)
  return train_step.create_state(layout, model, rng, inputs), layout.shardings, layout.tx


def synthetic_batch(batch=8, length=8, seed=0):
  """A batch of the tiny encoder-decoder: ``length`` input and target tokens per row."""
  return train_step.synthetic_batch(tiny(), batch, {'inputs': length, 'targets': length}, seed)


def setup(mesh, config=None, lr=0.01, optimizer_fn=optimizer.adafactor, frozen=(), **step_kwargs):
  """(state, jitted step) of a tiny encoder-decoder on ``mesh`` with ``optimizer_fn`` (default
  Adafactor) at constant lr, ``frozen`` paths not trained."""
  import jax
  config = config or tiny()
  model = build_model(config)
  schedule = optimizer.learning_rate_schedule('constant', base=lr)
  tx_fn = lambda params: optimizer.make_optimizer(params, learning_rate=schedule, optimizer=optimizer_fn,
                                                  frozen=frozen)
  state, shardings, tx = init_state(model, tx_fn, mesh, partitioning.MeshConfig().rules(),
                                    jax.random.PRNGKey(0), init_inputs(config))
  step = train_step.make_train_step(shardings, mesh, model=model, config=config, tx=tx,
                                    schedule=schedule, **step_kwargs)
  return state, step


class StepBatches:
  """A deterministic, resumable iterator: step i's batch is ``synthetic_batch(rows, seed=i)``
  (different every step), of which this host yields its share of rows. ``save(prefix)`` writes
  the position to the file ``prefix``; ``restore`` reads it. ``poison``: the steps whose loss
  weights are NaN; ``delay``: seconds to wait for each batch (a slow input pipeline)."""

  def __init__(self, rows=4, host=0, hosts=1, poison=(), delay=0.0):
    self.rows, self.host, self.hosts, self.poison, self.delay = rows, host, hosts, poison, delay
    self.position = 0

  def __iter__(self):
    return self

  def __next__(self):
    time.sleep(self.delay)
    self.position += 1
    batch = step_batch(self.position, self.rows)
    if self.position in self.poison:
      batch['decoder_loss_weights'][0, 0] = np.nan
    share = self.rows // self.hosts
    return {k: v[self.host * share:(self.host + 1) * share] for k, v in batch.items()}

  def save(self, prefix):
    with open(prefix, 'w') as f:
      f.write(str(self.position))

  def restore(self, prefix):
    with open(prefix) as f:
      self.position = int(f.read())


class FullDisk(StepBatches):
  """Batches whose position cannot be written at step 4's checkpoint: the disk is full."""

  def save(self, prefix):
    if self.position == 4:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), prefix)
    super().save(prefix)


def step_batch(step, rows=4):
  """The global batch of ``step`` (1-based), with float loss weights."""
  batch = synthetic_batch(batch=rows, seed=step)
  batch['decoder_loss_weights'] = batch['decoder_loss_weights'].astype(np.float32)
  return batch


def run_train(model_dir, total_steps, period=2, batches=None, config=None, eval_period=0,
              keep=None, **kwargs):
  """``trainer.train`` of ``config`` (default: a 1-layer tiny model) at constant lr 0.01,
  logging every step and checkpointing every ``period`` steps (keeping ``keep``: None, all)."""
  import gin
  from t5x_variants.train import trainer
  gin.bind_parameter('learning_rate_schedule.name', 'constant')
  gin.bind_parameter('learning_rate_schedule.base', 0.01)
  gin.bind_parameter('Checkpointer.period', period)
  gin.bind_parameter('Checkpointer.keep', keep)
  return trainer.train(config or tiny(num_encoder_layers=1, num_decoder_layers=1),
                       batches or StepBatches, model_dir=str(model_dir), total_steps=total_steps,
                       log_period=1, eval_period=eval_period, **kwargs)


def eval_batches():
  """The held-out set of the fault tests: two batches unlike any step's."""
  return {'synthetic': [step_batch(1000), step_batch(1001)]}


def failing_eval_batches():
  """A held-out set whose reading raises (an unreadable file, found at the first eval)."""
  def batches():
    raise RuntimeError('the evaluation data cannot be read (injected)')
    yield  # pylint: disable=unreachable
  return {'synthetic': batches()}


def slow_commits(seconds):
  """Holds back each checkpoint's commit (the rename of its temporary directory) ``seconds``, so
  an error soon after a save starts finds the save in flight."""
  from orbax.checkpoint._src.path import atomicity
  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def slow_finalize(self, *args, **kwargs):
    time.sleep(seconds)
    await finalize(self, *args, **kwargs)
  atomicity.AtomicRenameTemporaryPath.finalize = slow_finalize


def kill_at(phase, at, model_dir):
  """Makes this process SIGKILL itself at step ``at`` in ``phase`` (tests/trainer_subprocess.py
  ``kill``), printing ``KILL phase at`` first. The save phases wrap the finalisation of orbax's
  temporary path, the commit of a checkpoint: the rename of its temporary directory on a local
  file system, the write of its commit_success.txt on a bucket; the
  eval phase waits for ``model_dir``/checkpoint_``at``'s commit (the step's save starts before
  its eval), so the eval is the only thing lost."""
  import signal
  from orbax.checkpoint._src.path import atomicity
  from t5x_variants.train import evaluation, trainer

  def kill():
    print(f'KILL {phase} {at}', flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

  if phase == 'step':
    dispatch = trainer._Run.dispatch
    def dispatch_then_kill(run, batch):
      dispatch(run, batch)
      if run.step == at:
        kill()
    trainer._Run.dispatch = dispatch_then_kill
  elif phase in ('save', 'committed'):
    def wrap(finalize):
      async def finalize_and_kill(self, *args, **kwargs):
        ours = self.get_final().name == f'checkpoint_{at}'
        if ours and phase == 'save':
          kill()
        await finalize(self, *args, **kwargs)
        if ours:
          kill()
      return finalize_and_kill
    for commit in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
      commit.finalize = wrap(commit.finalize)
  elif phase == 'eval':
    call, evaluate = trainer.Evaluator.__call__, evaluation.evaluate
    def evaluate_then_kill(eval_step, params, batches, *args, **kwargs):
      def first_then_kill():
        yield from batches[:1]
        while not os.path.isdir(os.path.join(model_dir, f'checkpoint_{at}')):
          time.sleep(0.05)
        kill()
      return evaluate(eval_step, params, first_then_kill(), *args, **kwargs)
    def call_and_kill(self, step, params):
      evaluation.evaluate = evaluate_then_kill if step == at else evaluate
      call(self, step, params)
    trainer.Evaluator.__call__ = call_and_kill
  else:
    raise ValueError(f'unknown phase {phase}')


def unreadable_state(steps, patch=setattr):
  """Makes this process's reads of the state of checkpoint_<s> for each s in ``steps`` (looked up
  at each read, so a test may change it) fail as a damaged array file does (tensorstore's
  DATA_LOSS), while other processes read their shards; ``patch``: setattr, or a test's
  ``monkeypatch.setattr`` to undo it after the test."""
  restore = ocp.StandardCheckpointHandler.restore

  def fail_at_step(self, directory, *args, **kwargs):
    if directory.parent.name in {f'checkpoint_{s}' for s in steps}:
      raise ValueError(f'DATA_LOSS: reading {directory}: unexpected end of file (injected)')
    return restore(self, directory, *args, **kwargs)
  patch(ocp.StandardCheckpointHandler, 'restore', fail_at_step)


def _writes_step(infos, step) -> bool:
  """Whether orbax's array write of ``infos`` goes to checkpoint_``step`` (or its temporary)."""
  return any(part.startswith(f'checkpoint_{step}.') or part == f'checkpoint_{step}'
             for part in infos[0].parent_dir.parts)


def failing_shard_writes(step):
  """Makes this process's writes of its array shards of checkpoint_``step`` fail in orbax's
  background save thread, as a full disk does (the other processes' writes succeed)."""
  from orbax.checkpoint._src.serialization import jax_array_handlers  # (the class orbax uses)
  serialize = jax_array_handlers.ArrayHandler.serialize

  class FullDiskWrite:
    def result(self, timeout=None):
      del timeout
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + ' (injected)')

  async def failing(self, values, infos, *args, **kwargs):
    futures = list(await serialize(self, values, infos, *args, **kwargs))
    return futures + [FullDiskWrite()] if _writes_step(infos, step) else futures
  jax_array_handlers.ArrayHandler.serialize = failing


def failing_save_start(step):
  """Makes this process's save of checkpoint_``step`` raise in the trainer's own thread, as orbax's
  ``save`` starts its array writes (before any background write), as a lost mount does: the
  other processes go on into orbax's next barrier of that save."""
  from orbax.checkpoint._src.serialization import jax_array_handlers  # (the class orbax uses)
  serialize = jax_array_handlers.ArrayHandler.serialize

  async def failing(self, values, infos, *args, **kwargs):
    if _writes_step(infos, step):
      raise OSError(errno.EIO, os.strerror(errno.EIO) + ' (injected, as the save starts)')
    return await serialize(self, values, infos, *args, **kwargs)
  jax_array_handlers.ArrayHandler.serialize = failing


def save_fresh_state(config, model_dir, seed, step=1):
  """A step-``step`` checkpoint of ``config`` freshly initialised with ``seed``; its parameters as
  numpy."""
  import jax
  mesh = partitioning.MeshConfig().mesh()
  tx_fn = lambda p: optimizer.make_optimizer(p, optimizer.learning_rate_schedule('constant', base=0.01))
  state, _, _ = init_state(build_model(config), tx_fn, mesh, partitioning.MeshConfig().rules(),
                           jax.random.PRNGKey(seed), init_inputs(config))
  ckpt = checkpoints.Checkpointer(str(model_dir), period=1)
  ckpt.save(step, state, force=True)
  ckpt.close()
  return jax.tree_util.tree_map(np.asarray, state.params)


def saved_state(checkpoint):
  """The TrainState tree of a checkpoint, as numpy."""
  return pretrained.read_on_host(str(checkpoint), part=None)


def records_of(model_dir, kind='train'):
  """The ``kind`` records of ``model_dir``/metrics.jsonl, in order."""
  with open(os.path.join(model_dir, 'metrics.jsonl')) as f:
    return [r for r in map(json.loads, f) if r['kind'] == kind]


def train_losses(model_dir):
  """{step: loss} of the train records in ``model_dir``/metrics.jsonl (the latest per step)."""
  return {r['step']: r['loss'] for r in records_of(model_dir)}
