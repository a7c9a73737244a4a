"""The training loop (T5X's ``train.py``): pretraining and fine-tuning, resumable.

Per step: this host's next batch -> one array over the mesh -> the jitted, sharded train step ->
metrics. On their periods: log (``metrics.jsonl``, TensorBoard, console), teacher-forced eval,
checkpoint. At start it resumes from the newest readable checkpoint in ``model_dir`` (state and
data position, onto whatever mesh this run has), or starts from ``init_checkpoint``'s parameters
(fine-tuning: fresh optimizer state), or from scratch. SIGTERM / SIGINT save a checkpoint and
return; a non-finite loss is skipped or stops the run, as ``on_nonfinite`` says, and
``max_skipped_in_a_row`` skipped steps in a row, or a run that applied no update at all, stop it
with an error.

The loop dispatches step N+1 before it reads step N's metrics (the step runs asynchronously), so
an accelerator is never idle while the host logs or fetches the next batch; the non-finite skip
happens on the device, inside the step. A step's time is the wall time between reading its
metrics and the previous step's, so it includes any input stall (tf.data prefetches batches in
the background) but not checkpoints or evals.
"""
import functools
import logging
import os
import signal
import time
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence, Tuple

import gin
import jax
import numpy as np

from t5x_variants.models import build_model, fresh_head_params, init_inputs
from t5x_variants.models.config import TransformerConfig
from t5x_variants.models.summary import model_info
from t5x_variants.train import (checkpoints, diagnostics, evaluation, optimizer, partitioning,
                                storage, train_step)
from t5x_variants.train.metrics import MetricsLogger

NONFINITE = ('skip', 'stop')
TOKEN_FEATURES = ('encoder_input_tokens', 'decoder_target_tokens')  # what tokens/s counts
log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
  """Training stopped at a step whose loss or gradients were not finite."""


class _Preemption:
  """Set by SIGTERM or SIGINT. With several processes, all of them must stop after the same step:
  jax's preemption sync point decides (asked through orbax's checkpoint manager). It hears of
  SIGTERM through the handler jax.distributed registers, so SIGTERM is left to that handler and
  SIGINT is passed on to it as a SIGTERM."""

  def __init__(self, ckpt: checkpoints.Checkpointer):
    self.signal = None
    self.ckpt = ckpt
    self.multiprocess = jax.process_count() > 1

  def __enter__(self):
    signals = (signal.SIGINT,) if self.multiprocess else (signal.SIGTERM, signal.SIGINT)
    self._previous = {s: signal.signal(s, self._handle) for s in signals}
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)

  def _handle(self, signum, frame):
    del frame
    self.signal = signal.Signals(signum).name
    if self.multiprocess:
      os.kill(os.getpid(), signal.SIGTERM)

  def reached(self, step: int) -> bool:
    if self.multiprocess:
      return self.ckpt.manager.reached_preemption(step)
    return self.signal is not None


def _write_run_files(model_dir: str, config: TransformerConfig, files: Mapping[str, str]):
  """``config.gin`` (every binding of this run), ``model-info.txt`` and ``files`` (e.g. the
  vocabulary, which a later evaluation needs) into ``model_dir``; process 0 only."""
  if jax.process_index() != 0:
    return
  run = storage.path(model_dir)
  storage.write_text(run / 'config.gin', gin.config_str())
  storage.write_text(run / 'model-info.txt', model_info(config) + '\n')
  for name, path in files.items():
    storage.copy(path, run / name)


def _host_tokens(batch) -> Tuple[int, int]:
  """(tokens, sequences) of a host batch: input plus target positions, padding included."""
  tokens = sum(int(np.prod(batch[k].shape)) for k in TOKEN_FEATURES if k in batch)
  return tokens or int(np.prod(next(iter(batch.values())).shape)), len(next(iter(batch.values())))


@gin.configurable(denylist=['config', 'train_data', 'eval_data', 'eval_metric_fns', 'files'])
def train(config: TransformerConfig, train_data: Callable[[], Iterator], *,
          eval_data: Optional[Callable[[], Mapping[str, Iterable]]] = None,
          eval_metric_fns: Optional[Mapping[str, Sequence[Callable]]] = None,
          files: Mapping[str, str] = None,
          model_dir: str = gin.REQUIRED, total_steps: int = gin.REQUIRED,
          mesh: Optional[partitioning.MeshConfig] = None, num_microbatches: int = 1,
          label_smoothing: float = 0.0, z_loss: float = 1e-4,
          loss_normalizing_factor='num_tokens', on_nonfinite: str = 'skip',
          max_skipped_in_a_row: int = 20,
          log_period: int = 100, eval_period: int = 1000, eval_batches: Optional[int] = None,
          init_checkpoint: Optional[str] = None, seed: int = 0, diagnostics_period: int = 0):
  """Trains to ``total_steps``; returns the last logged train metrics (with 'step').

  ``train_data()``: this host's iterator of numpy batches (with ``save``/``restore`` to make the
  data position part of checkpoints); ``eval_data()``: {name: finite iterable of global batches,
  the same on every process}; ``eval_metric_fns``: {name: the task's metric functions of
  (targets, predictions)}, applied to a classification head's predictions at each eval (GLUE's
  accuracy, F1, ...). ``mesh``: the gin-bound ``MeshConfig`` by default. Dropout is on
  when the config has any dropout. The optimizer and schedule are the gin-bound
  ``make_optimizer`` and ``learning_rate_schedule``. ``diagnostics_period`` > 0 logs the
  per-layer diagnostics of ``train/diagnostics.py`` at step 0 and every that many steps.
  Raises NonFiniteLossError at the first non-finite step (``on_nonfinite='stop'``), after
  ``max_skipped_in_a_row`` skipped ones in a row, or at the end if no step's update was applied.
  """
  if on_nonfinite not in NONFINITE:
    raise ValueError(f'unknown on_nonfinite {on_nonfinite!r}; valid: {", ".join(NONFINITE)}')
  mesh_config = mesh or partitioning.MeshConfig()
  mesh = mesh_config.mesh()
  model = build_model(config)
  rng = jax.random.PRNGKey(seed)
  inputs = init_inputs(config)
  schedule = optimizer.learning_rate_schedule()
  layout = train_step.state_layout(
      model, functools.partial(optimizer.make_optimizer, learning_rate=schedule), mesh,
      mesh_config.rules(), rng, inputs)
  ckpt = checkpoints.Checkpointer(model_dir)
  data = train_data()
  restored = ckpt.restore_latest(layout.abstract, data)
  if restored:
    state, start = restored
    log.info('resumed from step %d in %s', start, model_dir)
  else:
    params = (checkpoints.restore_params(init_checkpoint, layout.abstract.params,
                                         fresh=fresh_head_params(config))
              if init_checkpoint else None)
    state, start = train_step.create_state(layout, model, rng, inputs, params), 0
  _write_run_files(model_dir, config, files or {})  # after restoring: a refused resume keeps them
  step_fn = train_step.make_train_step(
      layout.shardings, mesh, model=model, config=config, tx=layout.tx, schedule=schedule,
      num_microbatches=num_microbatches, label_smoothing=label_smoothing, z_loss=z_loss,
      loss_normalizing_factor=loss_normalizing_factor, dropout=config.uses_dropout)
  eval_step = evaluation.make_eval_step(model, config, layout.shardings.params, mesh, z_loss)
  logger = MetricsLogger(model_dir, total_steps)
  diag = diagnostics.Diagnostics(
      model_dir, model, config, layout.shardings.params, mesh, label_smoothing=label_smoothing,
      z_loss=z_loss, loss_normalizing_factor=loss_normalizing_factor) if diagnostics_period else None
  step, last, window, pending = start, {}, [], None
  skipped = []  # the skipped steps since the last applied one: (step, loss)
  applied, preempted = 0, False
  started = clock = time.time()  # clock: when the last step was read (or a pause ended)

  def run_eval(step):
    for name, batches in (eval_data() if eval_data else {}).items():
      logger.eval(step, name, evaluation.evaluate(eval_step, state.params, batches, mesh, eval_batches,
                                                  (eval_metric_fns or {}).get(name, ())))

  def log_diagnostics(step):
    nonlocal clock
    logger.diagnostics(step, diag(state.params))
    clock = time.time()

  def stop_nonfinite(at_step: int, what: str, remedy: str):
    """Logs the steps since the last log, closes the run's files and raises."""
    if window:
      logger.train(at_step, _summarize(at_step, window), start, started)
    ckpt.close()
    logger.close()
    raise NonFiniteLossError(
        f'{what}; the update was not applied and the checkpoints in {model_dir} (last: step '
        f'{ckpt.steps()[-1] if ckpt.steps() else "none"}) are intact. Lower the learning rate, add '
        f'train.z_loss or make_optimizer.global_norm_clip, {remedy}.')

  def read(pending):
    """Waits for a dispatched step's metrics, applies ``on_nonfinite`` and logs on its period."""
    nonlocal clock, last, window, applied
    read_step, device_metrics, tokens, sequences = pending
    metrics = jax.tree_util.tree_map(float, partitioning.to_host(device_metrics))
    now = time.time()
    window.append((metrics, tokens, sequences, now - clock))
    clock = now
    if not metrics['skipped']:
      skipped.clear()
      applied += 1
    elif on_nonfinite == 'stop':
      stop_nonfinite(read_step, f'the loss or gradients at step {read_step} are not finite (loss '
                     f'{metrics["loss"]})', "or set train.on_nonfinite='skip'")
    else:
      skipped.append((read_step, metrics['loss']))
      if len(skipped) >= max_skipped_in_a_row:
        stop_nonfinite(read_step, f'{len(skipped)} steps in a row had a non-finite loss or gradients, the '
                       f'first at step {skipped[0][0]} (loss {skipped[0][1]})',
                       'or check the data against the model (e.g. its vocab_size); '
                       'train.max_skipped_in_a_row sets how many are tolerated')
      log.warning('step %d: non-finite loss or gradients, update skipped', read_step)
    if read_step % log_period == 0 or read_step == total_steps:
      last = _summarize(read_step, window)
      logger.train(read_step, last, start, started)
      window = []

  # The device queue stays full: step N's metrics are read after step N+1 is dispatched. Only a
  # step whose state is used at once (checkpoint, eval, stop) is read before the next dispatch.
  with _Preemption(ckpt) as preemption:
    while step < total_steps:
      batch = next(data, None)
      if batch is None:
        log.warning('the training data ran out after step %d', step)
        break
      if step == start:  # before the step compiles: a batch the mesh cannot split is one line
        partitioning.check_batch(len(next(iter(batch.values()))) * jax.process_count(), mesh,
                                 num_microbatches)
      if diag and step == start and diag.begin(state.params, batch, fresh=start == 0):
        log_diagnostics(step)
      state, metrics = step_fn(state, partitioning.global_batch(batch, mesh), rng)
      step += 1
      if pending:
        read(pending)
      pending = (step, metrics, *_host_tokens(batch))
      stop = preemption.reached(step)
      evaluate = eval_period and step % eval_period == 0
      diagnose = diag and step % diagnostics_period == 0
      if stop or evaluate or diagnose or step % ckpt.period == 0:
        read(pending)  # a non-finite step stops the run before its state is saved
        pending = None
      if ckpt.save(step, state, data, force=stop):  # before eval, so a failing eval loses nothing
        clock = time.time()
      if diagnose:
        log_diagnostics(step)
      if stop:
        log.warning('%s: saved a checkpoint at step %d; run the same command to resume',
                    preemption.signal or 'preemption', step)
        preempted = True
        break
      if evaluate:
        run_eval(step)
        clock = time.time()
  if pending:
    read(pending)
  if step > start and not applied and not preempted:  # a preempted run is judged when resumed
    stop_nonfinite(step, f'every step of this run ({start + 1} to {step}) had a non-finite loss or '
                   f'gradients, the first with loss {skipped[0][1]}', 'or check the data')
  if window:  # steps since the last log (a stop between log periods)
    last = _summarize(step, window)
    logger.train(step, last, start, started)
  if eval_period and step % eval_period and step == total_steps:
    run_eval(step)
  ckpt.save(step, state, data, force=True)
  ckpt.close()
  logger.close()
  return dict(last, step=step)


def _summarize(step: int, window) -> dict:
  """Means over the steps since the last log, skipped (non-finite) ones left out unless all were;
  learning rate and parameter norm: the latest."""
  seconds = sum(w[3] for w in window)
  applied = [w[0] for w in window if not w[0]['skipped']] or [w[0] for w in window]
  mean = lambda k: float(np.mean([m[k] for m in applied]))
  latest = window[-1][0]
  return {'loss': mean('loss'), 'z_loss': mean('z_loss'), 'token_accuracy': mean('token_accuracy'),
          'learning_rate': latest['learning_rate'], 'grad_norm': mean('grad_norm'),
          'param_norm': latest['param_norm'], 'skipped': sum(w[0]['skipped'] for w in window),
          'tokens_per_second': sum(w[1] for w in window) * jax.process_count() / seconds,
          'sequences_per_second': sum(w[2] for w in window) * jax.process_count() / seconds,
          'step_time': seconds / len(window), 'num_tokens': mean('num_tokens')}
