"""The run's record: ``metrics.jsonl`` (one JSON object per logged train step and per eval),
TensorBoard scalars and a console progress line with throughput and ETA. Only process 0 writes,
to a local run directory or an object store (``storage``). A write that fails there stops every
process at a record that all log together (an eval, the diagnostics, a checkpoint's flush, the
check before a checkpoint is saved, the close); a train step's record is not agreed at each log
step, which would hold the host until the device has run the step: a failure to write one is held
on process 0 until the next of those."""
import errno
import itertools
import json
import math
import os
import sys
import threading
import time
import weakref
from typing import Mapping, Optional, Sequence

import jax

# tensorboardX imports torch, where installed, only to accept torch tensors (about 3 s in every
# training process; a run logs floats): torch is hidden from that import unless already loaded.
_HIDE_TORCH = 'torch' not in sys.modules
if _HIDE_TORCH:
  sys.modules['torch'] = None  # `import torch` raises ImportError
try:
  import tensorboardX  # pylint: disable=g-import-not-at-top
finally:
  if _HIDE_TORCH:
    del sys.modules['torch']

from t5x_variants.train import multihost, storage

RESUMED = 'resumed'  # the kind of a trainer session's record of the step it resumed at (read_records)
# The error that ended a thread (tensorboardX's writer's: its trace goes to stderr, and nothing is
# raised where the scalars are logged), noted by the process's thread excepthook.
_thread_errors = weakref.WeakKeyDictionary()
_previous_excepthook = threading.excepthook


def _note_thread_error(args):
  if args.thread is not None:
    _thread_errors[args.thread] = args.exc_value
  _previous_excepthook(args)


threading.excepthook = _note_thread_error

# Numbers each writer of this process: tensorboardX names its file by host and second only and
# opens it with 'wb', so a logger reopened in the same second (a quick resume) would truncate it.
_writer_ids = itertools.count()


def format_duration(seconds: float) -> str:
  seconds = int(seconds)
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


_NAMES = ('kind', 'task', 'split')  # a record's values that are text; the rest are numbers or null


def _whole(record) -> bool:
  """A record as the loggers write it: an integer step, text names, numbers or null."""
  return (isinstance(record, dict) and type(record.get('step')) is int
          and isinstance(record.get('kind'), str)
          and all(isinstance(v, str) if k in _NAMES else
                  v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
                  for k, v in record.items() if k != 'step'))


def read_records(model_dir: str):
  """The records of a run directory's ``metrics.jsonl`` (every writer session's, in order), without
  a line that is not a whole record (being written as we read, cut by a full disk, or edited: not
  JSON, or values of other types than the loggers write). A ``RESUMED``
  record at step S (a trainer resumed there) drops the records before it of steps after S: an
  earlier session's steps that its checkpoints did not keep (a stop at a non-finite step, a
  kill), which the resumed session may not log again."""
  records = []
  for line in storage.read_appended(storage.join(model_dir, 'metrics.jsonl')).splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if not _whole(record):
      continue
    if record.get('kind') == RESUMED:
      records = [r for r in records if r['step'] <= record['step']]
    else:
      records.append(record)
  return records


def json_line(value) -> str:
  """``value`` as one line of valid JSON: a non-finite float (a diverged run's loss or score) as
  null, in nested lists and dicts too."""
  def finite(v):
    if isinstance(v, float) and not math.isfinite(v):
      return None
    if isinstance(v, dict):
      return {k: finite(x) for k, x in v.items()}
    return [finite(x) for x in v] if isinstance(v, (list, tuple)) else v
  return json.dumps(finite(value)) + '\n'


class MetricsLogger:
  """``train(step, metrics)`` and ``eval(step, name, metrics)`` append to ``metrics.jsonl``,
  TensorBoard (tags ``train/<metric>``, ``eval/<name>/<metric>``) and the console;
  ``diagnostics(step, values)`` to the first two (``diagnostics/<key>``). ``start_step``: the
  trainer's, the step its session resumed at (0: a fresh start); the earlier sessions' records
  of later steps are superseded, in ``metrics.jsonl`` by a ``RESUMED`` record and in TensorBoard
  by its purge from step ``start_step + 1``."""

  def __init__(self, model_dir: str, total_steps: Optional[int] = None, console: bool = True,
               start_step: Optional[int] = None):
    self.model_dir = model_dir
    self.enabled = jax.process_index() == 0
    self.total_steps = total_steps
    self.console = console
    self._held = None  # process 0's error writing a train record, until every process learns it

    def open_files():
      self._jsonl = storage.AppendedFile(storage.join(model_dir, 'metrics.jsonl'))
      # tensorboardX writes from a queue on a thread and flush() does not drain that queue, so its
      # thread flushes every second instead (on an object store, every REMOTE_FLUSH_SECS): a
      # killed run loses at most its last second of scalars.
      logdir, flush_secs = storage.tensorboard_dir(model_dir)
      self._tb = tensorboardX.SummaryWriter(
          logdir, flush_secs=flush_secs, filename_suffix=f'.{os.getpid()}.{next(_writer_ids)}',
          purge_step=None if start_step is None else start_step + 1)
      if start_step is not None and any(r['step'] > start_step for r in read_records(model_dir)):
        self._jsonl.write(json.dumps({'step': start_step, 'kind': RESUMED}) + '\n')
    multihost.process0_does(f'opening {model_dir}/metrics.jsonl', open_files)

  def _write(self, record: Mapping, tags: Mapping[str, float]):
    self._jsonl.write(json_line(record))
    for tag, value in tags.items():
      self._tensorboard_writing()
      self._tb.add_scalar(tag, float(value), record['step'])

  def _tensorboard_worker(self):
    """tensorboardX's writer thread; None once the writer is closed."""
    writer = self._tb.file_writer
    return writer and writer.event_writer._worker  # pylint: disable=protected-access

  def _tensorboard_writing(self):
    """Raises if tensorboardX's writer thread has ended: an error there (a bucket past its
    retries, a full disk) ends it with a trace on stderr and nothing raised here, and the scalars
    after it would wait forever on its full queue (every process with them, in the next step)."""
    worker = self._tensorboard_worker()
    if worker is not None and not worker.is_alive():
      cause = _thread_errors.get(worker)
      if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk
        raise OSError(cause.errno, cause.strerror, cause.filename or
                      f'the TensorBoard events of {self.model_dir}') from cause
      why = f'{type(cause).__name__}: {cause}' if cause else 'the error is above'
      raise OSError(f'writing the TensorBoard events of {self.model_dir} failed ({why}): fix its '
                    'cause and rerun the same command to resume from the last checkpoint')

  def train(self, step: int, metrics: Mapping[str, float], start_step: int, start_time: float):
    """Logs a train step; the ETA extrapolates the speed since ``start_step``."""
    if not self.enabled or self._held:
      return
    # start_step names the session: its first record's window holds the step's compilation
    record = {'step': step, 'kind': 'train', **{k: float(v) for k, v in metrics.items()},
              'time': time.time(), 'start_step': start_step}
    try:
      self._write(record, {f'train/{k}': v for k, v in metrics.items()})
    except Exception as e:  # pylint: disable=broad-except  (the file system's or the bucket's)
      if jax.process_count() == 1:
        raise
      # Raised here, on process 0 alone, it would leave the others waiting for it in the next
      # step: held until the next record every process logs, or ``check``.
      self._held = e
      return
    if self.console:
      elapsed = time.time() - start_time
      eta = ''
      if self.total_steps and step > start_step:
        eta = f' eta {format_duration(elapsed / (step - start_step) * (self.total_steps - step))}'
      total = f'/{self.total_steps}' if self.total_steps else ''
      print(f'step {step}{total} loss {metrics["loss"]:.4f} token acc {metrics["token_accuracy"]:.4f} '
            f'lr {metrics["learning_rate"]:.2e} {metrics["tokens_per_second"]:,.0f} tok/s '
            f'{metrics["step_time"] * 1000:.0f} ms/step elapsed {format_duration(elapsed)}{eta}',
            flush=True)

  def eval(self, step: int, name: str, metrics: Mapping[str, float], split: Optional[str] = None):
    """Logs an eval of task ``name``; t5xv-eval's (``split``, validation too) is recorded with its
    split and tagged ``eval/<name>/<split>/<metric>``, apart from the run's own evals (of a few
    batches, where t5xv-eval reads the whole split). Every process calls it (a write that fails
    stops them all: ``multihost.process0_does``)."""
    record = {'step': step, 'kind': 'eval', 'task': name, **({'split': split} if split else {}),
              **{k: float(v) for k, v in metrics.items()}, 'time': time.time()}
    tag = name if split is None else f'{name}/{split}'

    def write():
      self._write(record, {f'eval/{tag}/{k}': v for k, v in metrics.items()})
      if self.console:
        print(f'eval {tag} step {step}: ' + ' '.join(f'{k} {v:.4f}' for k, v in metrics.items()),
              flush=True)
    self._agreed(f'logging the eval of {tag} at step {step}', write)

  def evaluated(self, step: int, tasks: Sequence[str]) -> bool:
    """Whether the run directory holds this run's eval record of ``step`` for each of ``tasks``
    (a record with a split is ``t5xv-eval``'s, run beside it)."""
    done = {r.get('task') for r in read_records(self.model_dir)
            if r.get('kind') == 'eval' and r.get('step') == step and 'split' not in r}
    return set(tasks) <= done

  def diagnosed(self, step: int) -> bool:
    """Whether the run directory holds a diagnostics record of ``step``."""
    return any(r.get('kind') == 'diagnostics' and r.get('step') == step
               for r in read_records(self.model_dir))

  def diagnostics(self, step: int, values: Mapping[str, float]):
    """Logs the per-layer diagnostics of ``train/diagnostics.py`` (every process calls it)."""
    record = {'step': step, 'kind': 'diagnostics', **values, 'time': time.time()}
    self._agreed(f'logging the diagnostics of step {step}', lambda: self._write(
        record, {f'diagnostics/{k}': v for k, v in values.items()}))

  def flush(self):
    """Writes the records so far to the run directory now (on an object store: rewrites this
    session's object); every process calls it."""
    self._agreed(f'writing {self.model_dir}/metrics.jsonl', lambda: self._jsonl.flush())

  def check(self):
    """Raises the error of a train record that process 0 could not write, on every process
    (which all call this together: before a checkpoint is saved)."""
    self._agreed('writing a train record to metrics.jsonl', lambda: None)

  def _agreed(self, what: str, write):
    """``write()`` by process 0, after any train record's error held there, for every process."""
    def act():
      if self._held:
        raise self._held
      write()
    multihost.process0_does(what, act)

  def close(self, agreed: bool = True):
    """Closes the files on process 0 (on an object store: their last upload). Every process calls
    it, so a close that fails there raises on all; on an error path (``agreed=False``), where
    another process may never come here, process 0 closes them alone."""
    def close_files():
      try:
        self._jsonl.close()
      finally:
        worker = self._tensorboard_worker()
        if worker is None or worker.is_alive():  # a dead one's close would wait on its queue
          self._tb.close()
      self._tensorboard_writing()
      if self._held:  # a train record it could not write
        raise self._held
    if agreed:
      multihost.process0_does(f'closing {self.model_dir}/metrics.jsonl', close_files)
    elif self.enabled:
      close_files()
