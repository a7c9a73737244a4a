"""Reading a checkpoint's parts on every process at once: each process reads its own shards or
file, then all agree on the outcome, so one that fails never leaves the others waiting at orbax's
barrier; a read that failed is told apart as damage to the checkpoint or a cause outside it (the
bucket, the network, memory), which decides whether a checkpoint may be moved aside
(``checkpoints.Checkpointer.restore_latest``) or only reported (``pretrained``).
"""
import logging
import re

import orbax.checkpoint as ocp
from etils import epath

from t5x_variants.train import fingerprints, multihost

log = logging.getLogger(__name__)

# Status words of a read that failed outside the checkpoint (tensorstore's and XLA's errors):
# the bucket or the network, its permissions, memory. A restore failing so moves nothing aside.
_NOT_DAMAGE = re.compile(r'\b(UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|PERMISSION_DENIED|'
                         r'UNAUTHENTICATED)\b|[Oo]ut of memory')


class ReadError(RuntimeError):
  """A part of a checkpoint (``part``: 'metadata', 'state', 'data', 'nonfinite', 'fingerprints')
  that some process could not read, raised on every process (``read_on_every_process``);
  ``outside`` when a process's read failed for a cause outside the checkpoint."""

  def __init__(self, part: str, reason: str, outside: bool):
    super().__init__(reason)
    self.part, self.outside = part, outside


def read_on_every_process(part: str, read):
  """``read()``, called by every process at the same point, each reading its own shards or file
  of ``part``; if it raised on any process, a ReadError on every one (this process's error, else
  naming the processes whose logs hold theirs). Orbax's own restore ends at a barrier of every
  process, which a process that raised never reaches: the others would wait there for it."""
  try:
    value, error = read(), None
  except Exception as e:  # pylint: disable=broad-except  (orbax, tensorstore, the iterator)
    value, error = None, e
  # 0: read; 1: not readable (damaged, or not by this run); 2: a cause outside the checkpoint.
  outcome = 0 if error is None else 2 if outside_cause(error) else 1
  outcomes = multihost.outcomes(outcome)
  if max(outcomes):
    failed = ', '.join(str(i) for i, o in enumerate(outcomes) if o)
    reason = error_reason(error) if error else f'not readable on process {failed}: its log says why'
    if outcome < max(outcomes) == 2:
      reason += '; on another process for a cause outside the checkpoint (its log says why)'
    raise ReadError(part, reason, outside=max(outcomes) == 2) from error
  return value


def intact(tree, path: epath.Path):
  """``tree``, the arrays read from checkpoint ``path``, if each has the fingerprint saved with it
  (``fingerprints``; a checkpoint saved before they were has none, and one whose fingerprints
  cannot be read is used unchecked, with a warning) and every floating one is finite; else a
  ReadError naming the first that does not: damaged bytes that decoded (a step whose update is
  not finite is skipped, so no run saves one). Changed bytes are named as such first, whether or
  not they decoded to a NaN. The same answer on every process."""
  finite, read = fingerprints.summarize(tree)
  saved = json_item(path, fingerprints.ITEM, fingerprints.parse,
                    f'the arrays read from {path} are not checked against it')
  changed = fingerprints.changed(saved, read) if saved is not None else []
  if changed:
    raise ReadError('state', f'{changed[0]} does not read as it was saved (its fingerprint '
                    f'differs from the one saved with it; {len(changed)} array(s) differ): '
                    'damaged bytes', outside=False)
  bad = next((name for name, ok in finite.items() if not ok), None)
  if bad:
    raise ReadError('state', f'{bad} holds a NaN or an infinity, which training never saves',
                    outside=False)
  return tree


def json_item(path: epath.Path, item: str, parse, unread: str):
  """``parse`` of the JSON item ``item`` of checkpoint ``path``, read (and parsed) by every
  process; None where the checkpoint has none, or where it cannot be read for a cause inside
  it: then a warning saying so and ``unread`` (what follows; the rest of the checkpoint may be
  whole, so it is used)."""
  where = path / item
  if not multihost.process0_says(f'looking for {where}', where.exists):
    return None
  try:
    return read_with(ocp.JsonCheckpointHandler(), item,
                     lambda handler: parse(handler.restore(where)))
  except ReadError as e:
    if e.outside:
      raise
    log.warning('%s cannot be read (%s): %s', where, e, unread)
    return None


def read_with(handler, part: str, read):
  """``read(handler)`` on every process (``read_on_every_process``), ``handler`` (an orbax
  handler) closed after it."""
  try:
    return read_on_every_process(part, lambda: read(handler))
  finally:
    handler.close()


def outside_cause(e: Exception) -> bool:
  """Whether a read failed for a cause outside the checkpoint (memory, the network, permissions)."""
  if isinstance(e, ReadError):
    return e.outside
  return isinstance(e, (MemoryError, ConnectionError, TimeoutError, PermissionError)) or bool(
      _NOT_DAMAGE.search(str(e)))


def error_reason(e: Exception, limit: int = 300) -> str:
  """'<type>: <first line>' of an exception, at most ``limit`` characters (tensorstore's messages
  carry whole object reprs and long paths): its start and its end, where the OS's reason is ('No
  space left on device'); a ReadError's own message, which is one already; of orbax's wrapper of
  an array read, its cause's (which names the array and what failed)."""
  if isinstance(e, ReadError):
    return str(e)
  if str(e).startswith('Encountered error while reading') and e.__cause__ is not None:
    return error_reason(e.__cause__, limit)
  first = str(e).splitlines()[0] if str(e) else ''
  reason = f'{type(e).__name__}: {first}' if first else type(e).__name__
  tail = limit // 3
  return reason if len(reason) <= limit else f'{reason[:limit - tail - 5]} ... {reason[-tail:]}'


def saved_tree(path: epath.Path):
  """The metadata tree of the state saved in checkpoint ``path`` (orbax's), read by every process
  (``read_on_every_process``: a ReadError on all if any could not), its arrays' names and shapes
  the same on every process (``multihost.same``: what each decides from it is)."""
  tree = read_with(ocp.PyTreeCheckpointHandler(), 'metadata',
                   lambda handler: handler.metadata(path / 'state').tree)
  return multihost.same(f'the arrays saved in {path}', lambda: tree, key=array_shapes)


def array_shapes(tree):
  """{'a/b/c': shape} of ``tree``'s arrays, named as orbax saves them (``named_arrays``)."""
  return {name: tuple(x.shape) for name, x in fingerprints.named_arrays(tree)}
