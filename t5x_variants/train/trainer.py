"""The training loop (T5X's ``train.py``): pretraining and fine-tuning, resumable.

``train`` restores or initialises the train state, then per step: this host's next batch -> one
array over the mesh -> the jitted, sharded train step -> metrics; on their periods: log
(``metrics.jsonl``, TensorBoard, console; ``meter.py``), checkpoint, teacher-forced eval; and a
preemption check (``preemption.py``). At start it resumes from the newest readable checkpoint in
``model_dir`` (state and data position, onto whatever mesh this run has), or starts from
``init_checkpoint``'s parameters (fine-tuning; with ``init_optimizer`` its optimizer state too),
or from scratch. SIGTERM / SIGINT save a checkpoint and return; a non-finite loss is skipped or
stops the run, as ``on_nonfinite`` says, and ``max_skipped_in_a_row`` skipped steps in a row, or
a run that applied no update at all, stop it with an error (``NonFiniteGuard``).

The loop dispatches step N+1 before it reads step N's metrics (the step runs asynchronously), so
an accelerator is never idle while the host logs or fetches the next batch; the non-finite skip
happens on the device, inside the step. A step's time is the wall time between reading its
metrics and the previous step's, so it includes any input stall (tf.data prefetches batches in
the background) but not checkpoints or evals.
"""
import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import gin
import jax

from t5x_variants.models import losses
from t5x_variants.models.config import TransformerConfig
from t5x_variants.models.summary import model_info
from t5x_variants.train import (checkpoints, diagnostics, evaluation, multihost, partitioning,
                                preemption, storage, train_step)
from t5x_variants.train.meter import TrainMeter, host_tokens
from t5x_variants.train.metrics import MetricsLogger
from t5x_variants.train.nonfinite import NonFiniteGuard, NonFiniteLossError, NonFiniteStop
from t5x_variants.train.sharded_model import ShardedModel

log = logging.getLogger(__name__)


def _check_vocabulary(model_dir: str, files: Mapping[str, str], resumed: Callable[[], bool]):
  """ValueError (one line) when a run with checkpoints is resumed with another vocabulary than its
  ``vocab.model`` (another SentencePiece model, or none: bytes): the tokens would change meaning
  mid-run, silently. Process 0 decides (``resumed``: whether the run has checkpoints). A run
  without a ``vocab.model`` (bytes, or written before it was kept) is not compared."""
  saved, new = storage.path(model_dir) / 'vocab.model', files.get('vocab.model')

  def differs():
    if not resumed() or not saved.exists():
      return False
    return new is None or storage.path(new).read_bytes() != saved.read_bytes()
  if multihost.process0_says(f'comparing the vocabulary with {saved}', differs):
    now = f"this run's {new}" if new else "this run's, which has no SentencePiece file (bytes?)"
    raise ValueError(f'{model_dir} holds a run trained with another vocabulary (its vocab.model, '
                     f'not {now}); resume it with its own (--gin.vocabulary.kind="\'file\'" '
                     f'--gin.vocabulary.path="\'{saved}\'") or use a new model_dir')


def _check_run_directory(model_dir: str, files: Mapping[str, str]):
  """ValueError (one line) when ``model_dir`` holds files of the names a run writes there
  (``config.gin``, ``files``) but is no run's (no ``model-info.txt``, which every run and
  t5xv-import writes, and no checkpoint): training would replace them."""
  run = storage.path(model_dir)

  def clashes():
    if not run.is_dir() or (run / 'model-info.txt').exists() or any(
        p.name.startswith('checkpoint_') for p in run.iterdir()):
      return []
    return [name for name in ('config.gin', *files) if (run / name).exists()
            and str(run / name) != str(storage.path(files.get(name, '')))]  # (not its own source)
  found = multihost.process0_json(f'looking into {model_dir}', clashes)
  if found:
    raise ValueError(f'{model_dir} is no run directory (no model-info.txt, no checkpoint) but holds '
                     f'{" and ".join(found)}, which training would replace: move them away or use '
                     'another model_dir')


def _write_run_files(model_dir: str, config: TransformerConfig, files: Mapping[str, str]):
  """``config.gin`` (every binding of this run), ``model-info.txt`` and ``files`` (e.g. the
  vocabulary, which a later evaluation needs) into ``model_dir``, by process 0."""
  run = storage.path(model_dir)

  def write():
    storage.write_text(run / 'config.gin', gin.config_str())
    storage.write_text(run / 'model-info.txt', model_info(config) + '\n')
    for name, path in files.items():
      storage.copy(path, run / name)
  multihost.process0_does(f'writing the run files into {model_dir}', write)


@dataclasses.dataclass
class _Run:
  """A run between steps: its train state after ``step``, its data and checkpoints, and the step
  dispatched but not read yet. ``dispatch`` sends a step to the device, then reads the one before
  (``read``: to the meter and the guard), so the device queue stays full; a step whose state is
  used at once (checkpoint, eval, diagnostics, stop) is read before the next is dispatched."""
  state: train_step.TrainState
  step: int
  data: Iterator
  step_fn: Callable
  mesh: jax.sharding.Mesh
  rng: jax.Array
  ckpt: checkpoints.Checkpointer
  logger: MetricsLogger
  meter: TrainMeter
  guard: NonFiniteGuard
  pending: Optional[tuple] = None  # (step, device metrics, tokens, sequences)

  def dispatch(self, batch):
    """Dispatches a train step on this host's ``batch``, then reads the previous step."""
    self.state, metrics = self.step_fn(self.state, partitioning.global_batch(batch, self.mesh),
                                       self.rng)
    self.step += 1
    self.read()
    self.pending = (self.step, metrics, *host_tokens(batch))

  def read(self):
    """Waits for the pending step's metrics: the guard judges the step, the meter logs it."""
    if self.pending is None:
      return
    step, device_metrics, tokens, sequences = self.pending
    self.pending = None
    metrics = jax.tree_util.tree_map(float, partitioning.to_host(device_metrics))
    self.meter.add(metrics, tokens, sequences)
    self.guard.check(step, metrics)
    self.meter.log(step)

  def checkpoint(self, force: bool = False):
    """Saves the state and data position if ``step`` is a checkpoint step or ``force``, and with
    them the metric records so far (on an object store they are held in memory between rewrites),
    so a killed run keeps every record up to its newest checkpoint. A train record process 0
    could not write stops every process before the save (``MetricsLogger.check``)."""
    if force or self.step % self.ckpt.period == 0:
      self.logger.check()
    if self.ckpt.save(self.step, self.state, self.data, force=force, guard=self.guard):
      self.logger.flush()
      self.meter.resume()

  def close(self, agreed: bool = True):
    """Commits a checkpoint save in flight and closes the records (``MetricsLogger.close``). If
    the commit fails, the records are closed as on an error path and the commit's error is the one
    raised, not the close's own (a full disk fails both)."""
    try:
      self.ckpt.close()
    except BaseException:
      try:
        self.logger.close(agreed=False)
      except Exception as e:  # pylint: disable=broad-except
        log.warning('closing the records after the failed checkpoint commit: %s', e)
      raise
    self.logger.close(agreed)


class Evaluator:
  """Teacher-forced evaluation of each task of ``eval_data()`` (called anew at each eval), logged
  at a step; ``metric_fns`` ({task: functions of (targets, predictions)}) are applied to a
  classification head's predictions; ``decoded(task, step, params)``, if given, adds the task's
  metrics of decoded predictions (or scores) to its record."""

  def __init__(self, eval_step, mesh, logger: MetricsLogger, eval_data=None,
               metric_fns: Optional[Mapping[str, Sequence[Callable]]] = None,
               max_batches: Optional[int] = None,
               decoded: Optional[Callable[[str, int, Any], Mapping[str, float]]] = None):
    self.eval_step, self.mesh, self.logger, self.eval_data = eval_step, mesh, logger, eval_data
    self.metric_fns, self.max_batches, self.decoded = metric_fns or {}, max_batches, decoded

  def __call__(self, step: int, params):
    evals = multihost.same('the evaluation tasks', self.eval_data or dict, key=list)
    for name, batches in evals.items():
      metrics = evaluation.evaluate(self.eval_step, params, batches, self.mesh, self.max_batches,
                                    self.metric_fns.get(name, ()),
                                    name=f'the evaluation data of {name}')
      if self.decoded:
        metrics.update(self.decoded(name, step, params))
      self.logger.eval(step, name, metrics)


class _DiagnosticsLog:
  """The per-layer diagnostics of ``train/diagnostics.py``, logged at the first step (``begin``)
  and every ``period`` steps."""

  def __init__(self, diag: diagnostics.Diagnostics, period: int, logger: MetricsLogger):
    self.diag, self.period, self.logger = diag, period, logger

  def begin(self, step: int, params, batch, fresh: bool) -> bool:
    """Sets up the fixed batch (``Diagnostics.begin``) and logs ``step``'s diagnostics if the batch
    was made now, or if the step is due and has no record (a stop between its checkpoint and its
    diagnostics); True if logged."""
    made = self.diag.begin(params, batch, fresh=fresh)
    if made or (self.due(step) and multihost.process0_says(
        'reading metrics.jsonl', lambda: not self.logger.diagnosed(step))):
      self(step, params)
      return True
    return False

  def due(self, step: int) -> bool:
    return step % self.period == 0

  def __call__(self, step: int, params):
    self.logger.diagnostics(step, self.diag(params))


def _on_first_batch(run: _Run, batch, num_microbatches: int,
                    diag: Optional[_DiagnosticsLog], fresh: bool):
  """Before the first step compiles, a batch the mesh cannot split is one line; diagnostics begin
  (``fresh``: at step 0)."""
  partitioning.check_batch(len(next(iter(batch.values()))) * jax.process_count(), run.mesh,
                           num_microbatches)
  if diag and diag.begin(run.step, run.state.params, batch, fresh):
    run.meter.resume()


def _first_batch(data: Iterator):
  """This host's first batch of the run (None if its data is empty), read by every process at
  once: a read that fails, or data that is empty, on some hosts only stops every process with
  that error (a later step has no such check: a multi-host run's data repeats,
  ``DatasetConfig.num_epochs = None``)."""
  batch = multihost.agree('reading the training data', lambda: next(data, None))
  empty = [i for i, code in enumerate(multihost.outcomes(int(batch is None))) if code]
  if empty and len(empty) < jax.process_count():
    raise ValueError(f'the training data of process {", ".join(map(str, empty))} has no batch '
                     'while the others have one: check that every host can read its share of the '
                     'data')
  return batch


def _train_steps(run: _Run, preempt: preemption.Preemption, evaluator: Evaluator,
                 diag: Optional[_DiagnosticsLog], total_steps: int, eval_period: int,
                 num_microbatches: int) -> bool:
  """Steps ``run`` to ``total_steps``, or to the end of the data, or to a preemption (after saving
  its step); True if preempted."""
  start = run.step
  while run.step < total_steps:
    batch = _first_batch(run.data) if run.step == start else next(run.data, None)
    if batch is None:
      log.warning('the training data ran out after step %d', run.step)
      return False
    if run.step == start:
      _on_first_batch(run, batch, num_microbatches, diag, fresh=start == 0)
    run.dispatch(batch)
    stop = preempt.reached(run.step)
    evaluate = eval_period and run.step % eval_period == 0
    diagnose = diag and diag.due(run.step)
    last = run.step == total_steps
    if stop or evaluate or diagnose or last or run.step % run.ckpt.period == 0:
      run.read()  # a non-finite step stops the run before its state is saved
    if last:  # nor is the last step's state saved by a run that applied no update (it is not done)
      run.guard.check_run(start, run.step)
    run.checkpoint(force=stop)  # before eval, so a failing eval loses nothing
    if diagnose:
      diag(run.step, run.state.params)
      run.meter.resume()
    if stop:
      log.warning('%s: saving a checkpoint at step %d and stopping (a second signal does not '
                  'interrupt it); run the same command to resume', preempt.signal or 'preemption',
                  run.step)
      return True
    if evaluate:
      evaluator(run.step, run.state.params)
      run.meter.resume()
  return False


def _eval_due_at_start(start: int, total_steps: int, eval_period: int, eval_at_start: bool,
                       logger: MetricsLogger, tasks: Callable[[], Sequence[str]]) -> bool:
  """Whether to evaluate the parameters before the first step: a fresh run with
  ``eval_at_start``, or a run resumed at an eval step (or its last, ``total_steps``, which
  ``_finish`` evaluates) whose eval of one of ``tasks()`` is not in metrics.jsonl (a stop between
  the step's checkpoint, saved first, and the end of its eval). Process 0's answer, for all."""
  if start == 0:
    return eval_at_start
  if not eval_period or (start % eval_period and start != total_steps):
    return False
  return multihost.process0_says('reading metrics.jsonl',
                                 lambda: not logger.evaluated(start, tasks()))


def _stop(run: _Run, stop: NonFiniteStop, model_dir: str):
  """Logs the steps since the last log, closes the run's files and raises NonFiniteLossError."""
  run.meter.flush(stop.step)
  run.close()
  saved = run.ckpt.steps()
  raise NonFiniteLossError(
      f'{stop.message()}; the update was not applied and the checkpoints in {model_dir} (last: step '
      f'{saved[-1] if saved else "none"}) are intact. Lower the learning rate, add '
      f'train.z_loss or make_optimizer.global_norm_clip, {stop.remedy}.') from None


def _close_after(run: _Run):
  """Closes ``run`` after an error: a checkpoint save in flight is committed (a process that
  exited now would leave it uncommitted: lost) and the records so far reach the run directory (a
  store holds them in memory); an error of its own (a full disk) is dropped: the error raised is
  the first one."""
  try:
    run.close(agreed=False)
  except Exception:  # pylint: disable=broad-except
    pass


def _finish(run: _Run, evaluator: Evaluator, start: int, total_steps: int, eval_period: int,
            stopped: bool = False) -> dict:
  """Logs the steps since the last log (a stop between log periods), saves the last step, then
  evaluates it if it is ``total_steps``, no eval step and trained since ``start``, unless the run
  was ``stopped`` by a signal (a rerun of the finished run does that eval, ``_eval_due_at_start``),
  and closes the run's files."""
  run.meter.flush(run.step)
  try:
    run.logger.check()
    run.ckpt.save(run.step, run.state, run.data, force=True, guard=run.guard)
    if (eval_period and run.step % eval_period and run.step == total_steps and run.step > start
        and not stopped):
      evaluator(run.step, run.state.params)
  except BaseException:
    _close_after(run)
    raise
  run.close()
  return dict(run.meter.last, step=run.step)


@gin.configurable(denylist=['config', 'train_data', 'eval_data', 'eval_metric_fns', 'files',
                            'decoded_metrics'])
def train(config: TransformerConfig, train_data: Callable[[], Iterator], *,
          eval_data: Optional[Callable[[], Mapping[str, Iterable]]] = None,
          eval_metric_fns: Optional[Mapping[str, Sequence[Callable]]] = None,
          files: Mapping[str, str] = None,
          decoded_metrics: Optional[Callable[[str, int, Any, Optional[int]], Mapping[str, float]]] = None,
          model_dir: str = gin.REQUIRED, total_steps: int = gin.REQUIRED,
          mesh: Optional[partitioning.MeshConfig] = None, num_microbatches: int = 1,
          label_smoothing: float = 0.0, z_loss: float = 1e-4,
          loss_normalizing_factor='num_tokens', on_nonfinite: str = 'skip',
          max_skipped_in_a_row: int = 20,
          log_period: int = 100, eval_period: int = 1000, eval_batches: Optional[int] = None,
          eval_at_start: bool = False, init_checkpoint: Optional[str] = None,
          init_optimizer: bool = False, seed: int = 0, diagnostics_period: int = 0,
          infer_eval: bool = False, infer_eval_examples: Optional[int] = None,
          init_fresh: Sequence[str] = ()):
  """Trains to ``total_steps``; returns the last logged train metrics (with 'step').

  ``train_data()``: this host's iterator of numpy batches (with ``save``/``restore`` to make the
  data position part of checkpoints); ``eval_data()``: {name: finite iterable of global batches,
  the same on every process}; ``eval_metric_fns``: {name: the task's metric functions of
  (targets, predictions)}, applied to a classification head's predictions at each eval (GLUE's
  accuracy, F1, ...). ``mesh``: the gin-bound ``MeshConfig`` by default. Dropout is on
  when the config has any dropout. The optimizer and schedule are the gin-bound
  ``make_optimizer`` and ``learning_rate_schedule``. ``diagnostics_period`` > 0 logs the
  per-layer diagnostics of ``train/diagnostics.py`` at step 0 and every that many steps.
  ``init_checkpoint``: a run with no checkpoint of its own starts from that one's parameters
  (fine-tuning), and with ``init_optimizer`` from its optimizer state too, as T5X does (a
  checkpoint of parameters only still starts a fresh one); its steps count from 0. ``init_fresh``:
  parameter paths, matched by whole parts as ``make_optimizer.frozen`` (Sub-LN's
  'inner_layer_norm'), that start from this model's init whether ``init_checkpoint`` holds them
  or not, so a variant starts from another variant's checkpoint (T5X's ``assignment_map`` to
  None); refused with ``init_optimizer`` (the optimizer state starts fresh).
  ``eval_at_start``: a fresh run also evaluates its initial parameters, at step 0 (the initial
  loss of a learning-rate sensitivity, ``sweeps/stability.py``). Whatever it is, a run resumed at
  an eval step whose eval was lost to a stop evaluates that step first.
  ``infer_eval`` (T5X's ``infer_eval_dataset_cfg``): each eval also decodes every eval task that
  has metrics (with the gin-bound ``DecodeOptions``) and adds the task's metrics, of its first
  ``infer_eval_examples`` examples (None: all), as t5xv-eval computes them: ``decoded_metrics(task,
  step, params, infer_eval_examples)``, which t5xv-train builds from the data layer's tasks.
  Raises NonFiniteLossError at the first non-finite step (``on_nonfinite='stop'``), after
  ``max_skipped_in_a_row`` skipped ones in a row, or at the end if no step's update was applied.
  """
  if isinstance(label_smoothing, bool) or not (isinstance(label_smoothing, (int, float))
                                                and 0.0 <= label_smoothing < 1.0):
    raise ValueError(f'train.label_smoothing must be in [0, 1), not {label_smoothing!r} '
                     '(at 1 or more every step\'s loss is not finite)')
  if isinstance(z_loss, bool) or not (isinstance(z_loss, (int, float)) and z_loss >= 0.0):
    raise ValueError(f'train.z_loss must be a number >= 0, not {z_loss!r}')
  losses.check_normalizing_factor(loss_normalizing_factor)
  if infer_eval and eval_data and decoded_metrics is None:
    raise ValueError('train.infer_eval = True decodes the eval tasks through the data layer, which '
                     'pre-built batches (--batches_dir) leave out: set train.infer_eval = False, or '
                     'evaluate the checkpoints with t5xv-eval')
  if diagnostics_period and config.shared_encoder_decoder:
    raise ValueError('per-layer diagnostics read each stack\'s own parameters; a shared '
                     'encoder-decoder has one stack: set train.diagnostics_period = 0')
  guard = NonFiniteGuard(on_nonfinite, max_skipped_in_a_row)
  sharded = ShardedModel.build(config, mesh or partitioning.MeshConfig(), seed)
  sharded.check_init_fresh(init_fresh, init_checkpoint, init_optimizer)
  # First: missing data is one error before the run directory exists.
  data = multihost.agree('building the training data', train_data)
  _check_run_directory(model_dir, files or {})
  ckpt = checkpoints.Checkpointer(model_dir)
  _check_vocabulary(model_dir, files or {}, lambda: bool(ckpt.steps()))
  state, start = sharded.restore_or_init(ckpt, data, model_dir, init_checkpoint, init_optimizer,
                                         guard, init_fresh)
  _write_run_files(model_dir, config, files or {})  # after restoring: a refused resume keeps them
  loss = dict(label_smoothing=label_smoothing, z_loss=z_loss,
              loss_normalizing_factor=loss_normalizing_factor)
  logger = MetricsLogger(model_dir, total_steps, start_step=start)
  evaluator = Evaluator(sharded.make_eval_step(z_loss), sharded.mesh, logger, eval_data,
                        eval_metric_fns, eval_batches,
                        (lambda name, step, params: decoded_metrics(name, step, params,
                                                                    infer_eval_examples))
                        if infer_eval else None)
  diag = (_DiagnosticsLog(sharded.make_diagnostics(model_dir, **loss), diagnostics_period, logger)
          if diagnostics_period else None)
  run = _Run(state, start, data, sharded.make_train_step(num_microbatches, **loss), sharded.mesh,
             sharded.rng, ckpt, logger, TrainMeter(logger, start, log_period, total_steps), guard)
  # One Preemption from the first step to the end: a signal while the last checkpoint commits (a
  # stop's, or the finished run's while its final eval runs, or after an error) is noted, not
  # obeyed, so the commit finishes (the default action killed the run and its commit). Before the
  # first step (the eval at start) a signal stops the run at once: nothing is saved then.
  with contextlib.ExitStack() as signals:
    try:
      if eval_data and _eval_due_at_start(start, total_steps, eval_period, eval_at_start, logger,
                                          lambda: list(eval_data())):
        evaluator(start, state.params)
        run.meter.resume()
      preempt = signals.enter_context(preemption.Preemption(ckpt))
      preempted = _train_steps(run, preempt, evaluator, diag, total_steps, eval_period,
                               num_microbatches)
      run.read()
      if not preempted:  # a preempted run is judged when it resumes
        guard.check_run(start, run.step)
    except NonFiniteStop as stop:
      _stop(run, stop, model_dir)
    except BaseException:
      _close_after(run)
      raise
    return _finish(run, evaluator, start, total_steps, eval_period, stopped=preempted)
