"""Running a sweep (grid.py) on this host: each unfinished run's ``t5xv-train`` in its own process,
``parallel`` at a time, its outcome recorded in sweep.json as it ends (done, diverged at a step,
failed with its error line, interrupted), under an exclusive lock on the sweep directory; a
trainer started by a sweep stops when the sweep process dies.
"""
import collections
import ctypes
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Sequence

from t5x_variants.sweeps import runs as run_records
from t5x_variants.sweeps.grid import FINISHED, Run, Sweep, SweepError
from t5x_variants.train import locks, nonfinite, storage
from t5x_variants.train.metrics import format_duration

SWEEP_PID_ENV = 'T5XV_SWEEP_PID'  # tells a trainer which sweep process started it
RAN_OUT = re.compile(r'the training data ran out after step \d+')  # train/trainer.py's warning


def _outcome(run: Run, returncode: int, finished: bool, log_file: str, log_start: int):
  """Sets the run's status from its exit status, whether it reached its last step (a trainer
  stopped by a signal saves a checkpoint and exits 0; one stopped while it starts exits 130 on
  Ctrl-C or dies of SIGTERM: interrupted too) and the last error line this attempt wrote to its
  log (from byte ``log_start``). A trainer whose data ran out before its last step (a finite
  ``DatasetConfig.num_epochs``) exits 0 with a warning: failed, with that line."""
  with open(log_file, errors='replace') as f:
    f.seek(log_start)
    lines = [l.strip() for l in f]
  ran_out = [m.group(0) for m in map(RAN_OUT.search, lines) if m]
  if returncode in (0, 130, -signal.SIGTERM, -signal.SIGINT) and (finished or not ran_out):
    run.status, run.reason, run.diverged_step = 'done' if finished else 'interrupted', None, None
    return
  errors = [l for l in lines if 'error:' in l]
  if ran_out and not errors:
    errors = [f'{ran_out[-1]}, before its last step: the dataset is finite '
              '(DatasetConfig.num_epochs); bind num_epochs = None or train fewer steps']
  run.reason = errors[-1] if errors else f'exit status {returncode} (see {log_file})'
  run.diverged_step = nonfinite.diverged_step(run.reason)
  run.status = 'failed' if run.diverged_step is None else 'diverged'


def trainer_executable() -> List[str]:
  """``t5xv-train`` of this Python's environment (its launcher sets up huge pages on CPU)."""
  script = os.path.join(os.path.dirname(sys.executable), 't5xv-train')
  return [script] if os.path.isfile(script) else [sys.executable, '-m', 't5x_variants.cli.train']


def stop_with_sweep():
  """Called by a trainer at its start: if ``t5xv-sweep`` started it (``SWEEP_PID_ENV`` set;
  Linux), the kernel sends it SIGTERM when the sweep process dies, even by SIGKILL
  (``PR_SET_PDEATHSIG``; at once if the sweep is gone already), so it saves a checkpoint and stops
  instead of training on unrecorded beside a rerun sweep's trainer of the same run."""
  sweep = os.environ.get(SWEEP_PID_ENV)
  if not sweep or not sys.platform.startswith('linux'):
    return
  ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  if os.getppid() != int(sweep):
    os.kill(os.getpid(), signal.SIGTERM)


def _local_dir(sweep_dir: str) -> str:
  """Where the sweep's lock and its trainers' logs are written as they grow: the sweep directory,
  or for one on an object store (which cannot lock or append) a directory of this host's named
  after it; each log is copied to its run directory when its trainer ends."""
  return locks.host_file('t5xv-sweep', sweep_dir) if storage.scheme(sweep_dir) else sweep_dir


def lock(sweep_dir: str):
  """An exclusive lock on the sweep directory for this process's lifetime and its trainers' (two
  sweeps on one directory would train the same runs, or one rewrite the other's sweep.json),
  taken before sweep.json is read. A sweep on an object store is locked on this host only."""
  handle = locks.exclusive(os.path.join(_local_dir(sweep_dir), '.lock'))
  if handle is None:
    raise SweepError(f'another t5xv-sweep (or a trainer it started) is running in {sweep_dir}; '
                     'wait for it or stop it')
  return handle


@dataclasses.dataclass
class _Attempt:
  """One run's trainer process."""
  run: Run
  proc: subprocess.Popen
  log_file: str
  log_start: int
  start: float
  seconds_before: float  # the run's seconds in earlier attempts


def _start(sweep: Sweep, run: Run, executable: Sequence[str], held, shared: bool) -> _Attempt:
  """Starts ``run``'s trainer; ``shared``: beside others, so JAX takes device memory as needed
  instead of most of it at start (unless the environment says otherwise)."""
  env = dict(os.environ, **{SWEEP_PID_ENV: str(os.getpid())})
  if shared:
    env.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  log_dir = os.path.join(_local_dir(sweep.sweep_dir), run.name)
  os.makedirs(log_dir, exist_ok=True)
  log_file = os.path.join(log_dir, 'train.log')
  run.status = 'running'
  sweep.save()
  with open(log_file, 'a') as log:
    log_start = log.tell()
    # The trainer holds the sweep's lock too (pass_fds): a rerun sweep waits until it is gone.
    proc = subprocess.Popen(sweep.command(run, executable), stdout=log, stderr=subprocess.STDOUT,
                            env=env, pass_fds=(held.fileno(),))
  return _Attempt(run, proc, log_file, log_start, time.time(), run.seconds or 0)


def _end(sweep: Sweep, attempt: _Attempt, returncode: int, interrupted: bool) -> float:
  """Records the run's outcome in sweep.json (again, if a signal cut the first time short);
  returns its seconds."""
  run, seconds = attempt.run, time.time() - attempt.start
  run.seconds = attempt.seconds_before + seconds
  finished = run_records.read_run(sweep.model_dir(run)).finished()
  _outcome(run, returncode, finished, attempt.log_file, attempt.log_start)
  if storage.scheme(sweep.sweep_dir):
    storage.copy(attempt.log_file, storage.join(sweep.model_dir(run), 'train.log'))
  if interrupted and not finished:  # (a divergence at that moment is found again when resumed)
    run.status, run.reason, run.diverged_step = 'interrupted', None, None
  sweep.save()
  return seconds


def run_sweep(sweep: Sweep, executable: Sequence[str], say: Callable[[str], None] = print,
              parallel: int = 1, held=None) -> Dict:
  """Trains every unfinished run of the grid in order, ``parallel`` at a time (each its own
  trainer process), saving sweep.json around each; a failed or diverged run does not stop the
  others. SIGINT and SIGTERM are passed on to the trainers as SIGTERM (they save a checkpoint),
  and then raise KeyboardInterrupt; a second one while they stop records them interrupted without
  waiting. ``held``: the sweep directory's ``lock`` if the caller took it (else taken here).
  Returns {status: count}."""
  held = held or lock(sweep.sweep_dir)
  sweep.update_from_run_dirs()
  todo = [r for r in sweep.runs if r.status not in FINISHED]
  durations, running, started = [], [], 0
  previous_sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
  try:
    while todo[started:] or running:
      while todo[started:] and len(running) < parallel:
        run = todo[started]
        started += 1
        left = len(todo) - started + 1
        eta = (f'sweep eta {format_duration(sum(durations) / len(durations) * left / parallel)}'
               if durations else 'sweep eta: after the first run')
        say(f'[{started}/{len(todo)}] {run.variant} seed {run.seed}: training in '
            f'{sweep.model_dir(run)} ({eta})')
        running.append(_start(sweep, run, executable, held, parallel > 1))
      done = _wait_any(running)
      durations.append(_end(sweep, done, done.proc.returncode, interrupted=False))
      running.remove(done)  # (after its record: a signal in _end records it again)
      run = done.run
      say(f'[{todo.index(run) + 1}/{len(todo)}] {run.variant} seed {run.seed}: {run.status} in '
          f'{format_duration(durations[-1])}' + (f': {run.reason}' if run.reason else ''))
  except KeyboardInterrupt:  # while waiting, or saving sweep.json, or copying a log to a bucket
    _stop(sweep, running)
    raise
  finally:
    signal.signal(signal.SIGTERM, previous_sigterm)
    held.close()
  return dict(collections.Counter(r.status for r in sweep.runs))


def _stop(sweep: Sweep, running: List[_Attempt]):
  """Passes a signal on to the trainers still running as SIGTERM (a background job's SIGINT is
  ignored until the trainer sets its handler) and records every attempt's outcome (one that had
  ended as its own); a second signal while they stop stops the waiting. Any run still 'running'
  then (its record cut short, or a trainer still saving: it holds the lock, so a rerun is refused
  until it ends) is recorded interrupted."""
  ended = [attempt.proc.poll() is not None for attempt in running]
  for attempt, gone in zip(running, ended):
    if not gone:
      attempt.proc.send_signal(signal.SIGTERM)
  try:
    for attempt, gone in zip(running, ended):
      _end(sweep, attempt, attempt.proc.wait(), interrupted=not gone)
  except KeyboardInterrupt:
    pass
  for run in sweep.all_runs():
    if run.status == 'running':
      run.status = 'interrupted'
  sweep.save()


def _wait_any(running: List[_Attempt]) -> _Attempt:
  """The first of ``running`` whose process has ended."""
  if len(running) == 1:
    running[0].proc.wait()
    return running[0]
  while True:
    for attempt in running:
      if attempt.proc.poll() is not None:
        return attempt
    time.sleep(0.2)
