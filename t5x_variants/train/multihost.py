"""One outcome for every process of a multi-host run.

Each process reads its own copy of what a run starts from (its settings, its data, a results
file). Where one process fails or sees something else than the others and goes its own way, the
others wait for it in their next collective until jax's coordination service aborts the job
minutes later, its cause in one host's log; or, if their programs still pair up, they compute
with different batches. Every function here is called by every process at the same point, and
all return the same value or all raise: a process whose own part failed its own error, the others
a ProcessError naming it. With one process they exchange nothing.

The callables given here run between two collectives of one process and must hold none
themselves: a process that raised before reaching one would leave the others in it.
"""
import collections
import contextlib
import importlib
import json
import sys
import threading
import time
import zlib
from typing import Any, Callable, Iterable, Iterator, List, Optional

import jax
import numpy as np
from jax._src import distributed  # the coordination service's key-value store (as orbax reads it)
from jax.experimental import multihost_utils

_FAILED, _NONE = -2, -1  # the codes of a process whose call raised, or that had nothing


class ProcessError(RuntimeError):
  """Raised on the processes whose own part went well when another's did not."""


def outcomes(code: int) -> List[int]:
  """Every process's ``code`` (a non-negative int32 or one of the codes above), by process index."""
  if jax.process_count() == 1:
    return [code]
  return [int(c) for c in multihost_utils.process_allgather(np.asarray(code, np.int32))]


def _failed_elsewhere(what: str, codes: List[int], error: Optional[Exception]):
  """Raises this process's ``error``, or a ProcessError naming the processes whose call raised."""
  if error is not None:
    raise error
  failed = ', '.join(str(i) for i, c in enumerate(codes) if c == _FAILED)
  raise ProcessError(f'{what} failed on process {failed} (its log says why); every process '
                     'stopped here')


def agree(what: str, make: Callable[[], Any]) -> Any:
  """``make()`` on every process; its value if it returned on all, else this process's own error
  where it raised, a ProcessError where it did not. ``what`` names it in that error. The values
  may differ by process (``same`` with nothing compared)."""
  return same(what, make, key=None)


def process0_does(what: str, act: Callable[[], Any]):
  """``act()`` on process 0 alone (a write to the run directory), called by every process: if it
  raised there, its error there and a ProcessError on the others, instead of their going on
  without it."""
  agree(what, lambda: act() if jax.process_index() == 0 else None)


def fingerprint(value) -> int:
  """A 31-bit checksum of nested dicts, lists, arrays and scalars (numeric arrays by dtype, shape
  and bytes, arrays of objects such as strings by their items; dicts by sorted key); ``_NONE`` for
  None."""
  if value is None:
    return _NONE
  crc = 0

  def add(x):
    nonlocal crc
    if isinstance(x, dict):
      for k in sorted(x):
        crc = zlib.crc32(repr(k).encode(), crc)
        add(x[k])
    elif isinstance(x, (list, tuple)):
      crc = zlib.crc32(f'[{len(x)}'.encode(), crc)
      for item in x:
        add(item)
    elif isinstance(x, (np.ndarray, np.generic)):
      x = np.ascontiguousarray(x)
      crc = zlib.crc32(f'{x.dtype}{x.shape}'.encode(), crc)
      if x.dtype.hasobject:  # its bytes are the objects' addresses, which differ by process
        add(x.tolist())
      else:
        crc = zlib.crc32(x.tobytes(), crc)
    else:
      crc = zlib.crc32(repr(x).encode(), crc)
  add(value)
  return crc & 0x7FFFFFFF


def same(what: str, make: Callable[[], Any],
         key: Optional[Callable[[Any], Any]] = lambda value: value) -> Any:
  """``make()`` on every process, whose ``key`` (default: the value itself; None: nothing) must be
  the same on every process (None included). If it raised anywhere: this process's own error
  where it raised, a ProcessError where it did not; if the keys differ, a ValueError on every
  process naming the processes that differ from process 0."""
  try:
    value, error = make(), None
    code = 0 if key is None else fingerprint(key(value))
  except Exception as e:  # pylint: disable=broad-except  (re-raised, on every process)
    value, error, code = None, e, _FAILED
  codes = outcomes(code)
  if _FAILED in codes:
    _failed_elsewhere(what, codes, error)
  if len(set(codes)) > 1:
    has = lambda i, c: 'none' if c == _NONE else 'one' if i == 0 or codes[0] == _NONE else 'another'
    seen = [f'process {i} has {has(i, c)}' for i, c in enumerate(codes) if i == 0 or c != codes[0]]
    raise ValueError(f'the processes disagree on {what}: {", ".join(seen)}; every process must '
                     'read the same (check each host\'s copy of the data, its paths and settings)')
  return value


def same_batches(what: str, batches: Iterable) -> Iterator:
  """``batches`` (global batches that every process holds whole), each checked to be the same on
  every process (``same``), ending on all at once; a process whose batches end early, or differ,
  stops every process with one ValueError instead of leaving the others in the next step. Each
  check waits for the device to finish the batch before (its exchange is queued behind it)."""
  if jax.process_count() == 1:
    yield from batches
    return
  iterator, number = iter(batches), 1
  while True:
    batch = same(f'{what} (batch {number})', lambda: next(iterator, None))
    if batch is None:
      return
    yield batch
    number += 1


def process0_says(what: str, question: Callable[[], bool]) -> bool:
  """Process 0's answer to ``question`` (asked there alone), for every process: one decision where
  each process's own look at a shared store could differ. If it raised there, its error there and
  a ProcessError elsewhere."""
  return bool(process0_json(what, lambda: bool(question())))


def process0_json(what: str, make: Callable[[], Any]) -> Any:
  """``make()``'s value (JSON-serialisable), made by process 0 alone, for every process: one
  reading of a file that each host could see differently. If it raised there, its error there and
  a ProcessError elsewhere."""
  if jax.process_count() == 1:
    return make()
  text, error = b'', None
  if jax.process_index() == 0:
    try:
      text = json.dumps(make()).encode()
    except Exception as e:  # pylint: disable=broad-except  (re-raised, on every process)
      error = e
  size = int(multihost_utils.broadcast_one_to_all(
      np.asarray(_FAILED if error else len(text), np.int32)))
  if size == _FAILED:
    _failed_elsewhere(what, [_FAILED], error)
  data = np.zeros(size, np.uint8)
  data[:len(text)] = np.frombuffer(text, np.uint8)[:size]
  return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(data), np.uint8)))


class WriteBarrier:
  """The barrier at which orbax's background save threads wait for every process's writes
  (``AsyncOptions.barrier_sync_fn``), opened by a save that failed. With orbax's own, a process
  whose shard writes failed never arrives, the others wait there, and it waits at the next one of
  its save's finalisation for them: every process stays in its save until orbax's timeout (20
  minutes). Here each barrier is a counter in the coordination service's key-value store, which
  each process increments on arrival and then polls, with the failures marked there: one stops
  the waiting with a ProcessError naming its process. A process marks its failure (``fail``)
  when one of orbax's threads reaches a barrier with an error on its way out (orbax's save
  finalisation calls one in a ``finally``), and when a save raises in the trainer
  (``Checkpointer.save``, ``close``). Its keys are one counter per barrier passed, under the
  barrier's number: every process builds its Checkpointers in the same order."""

  POLL_S = 0.2  # the longest wait between two looks (the first after 5 ms, then doubling)
  _built = 0  # the WriteBarriers of this process so far

  def __init__(self):
    WriteBarrier._built += 1
    self._base = f't5xv_writes/{WriteBarrier._built}'
    self._calls = collections.Counter()  # orbax may reuse a key: each process counts its calls
    self._lock = threading.Lock()
    self._owner = threading.get_ident()  # the trainer's thread, which may call it in an except

  def __call__(self, *, key: str, timeout_ms: int):
    if jax.process_count() == 1:
      return
    leaving = sys.exc_info()[1]
    if (threading.get_ident() != self._owner and leaving is not None
        and not isinstance(leaving, ProcessError)):
      self.fail()  # (its error goes on: the trainer's save raises it)
      return
    self._wait(key, timeout_ms)

  @contextlib.contextmanager
  def orbax_syncs(self):
    """Orbax's own process barriers in this thread (``sync_global_processes``: the synchronous
    part of ``CheckpointManager.save``, a device all-gather without timeout each) pass here
    instead, where another process's failed save stops them: a save that raised on one process as
    it started left the others in the next of them, and jax aborted every process minutes later.
    Other threads' barriers (orbax's background threads) and those of a subset of processes keep
    orbax's."""
    orbax = importlib.import_module('orbax.checkpoint._src.multihost.multihost')  # (lazily)
    if not hasattr(orbax.sync_global_processes, 'orbax_own'):  # (its callers look it up there)
      orbax.sync_global_processes = _routed_syncs(orbax.sync_global_processes, orbax)
    previous, _routing.barrier = getattr(_routing, 'barrier', None), self
    try:
      yield
    finally:
      _routing.barrier = previous

  def _wait(self, key: str, timeout_ms: int):
    client = distributed.global_state.client
    with self._lock:
      self._calls[key] += 1
      counter = f'{self._base}/{key}/{self._calls[key]}'
    client.key_value_increment(counter, 1)
    deadline, wait = time.monotonic() + timeout_ms / 1000, 0.005
    while int(client.key_value_try_get(counter)) < jax.process_count():
      failed = sorted(int(k.rsplit('/', 1)[1]) for k, _ in client.key_value_dir_get(
          f'{self._base}/failed/'))
      if failed:
        raise ProcessError(f'saving the checkpoint failed on process '
                           f'{", ".join(map(str, failed))} (its log says why)')
      if time.monotonic() > deadline:  # (a ProcessError: no process is marked failed for it)
        raise ProcessError(f'the processes did not all finish writing a checkpoint within '
                           f'{timeout_ms / 1000:.0f} s (barrier {key})')
      time.sleep(wait)
      wait = min(2 * wait, self.POLL_S)

  def fail(self):
    """Marks this process's save failed: every process waiting for its writes stops."""
    if jax.process_count() > 1:
      distributed.global_state.client.key_value_set(
          f'{self._base}/failed/{jax.process_index()}', '', allow_overwrite=True)


_routing = threading.local()  # .barrier: the WriteBarrier that orbax's barriers of a thread pass


def _routed_syncs(orbax_own: Callable, orbax) -> Callable:
  """Orbax's ``sync_global_processes``, through the WriteBarrier of ``orbax_syncs`` where a thread
  has one."""
  def sync_global_processes(name, *, timeout=None, processes=None, barrier_sync_fn=None, **kwargs):
    barrier = getattr(_routing, 'barrier', None)
    if (barrier is None or processes is not None or barrier_sync_fn is not None
        or jax.process_count() == 1):
      return orbax_own(name, timeout=timeout, processes=processes,
                       barrier_sync_fn=barrier_sync_fn, **kwargs)
    # (orbax's device barrier had no timeout: a peer slow to reach it gets as long as orbax's
    # background barriers give one, 20 minutes, before this one stops)
    barrier._wait(f'orbax/{name}', 1000 * max(timeout or orbax.coordination_timeout(), 1200))
  sync_global_processes.orbax_own = orbax_own
  return sync_global_processes
