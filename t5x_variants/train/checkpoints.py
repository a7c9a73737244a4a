"""Orbax checkpoints of the train state and of every host's data-iterator position.

A checkpoint is ``MODEL_DIR/checkpoint_<step>/`` holding ``state`` (the sharded TrainState,
written asynchronously; each process writes its own shards), ``data`` (one file set per host,
written by the iterator's own ``save(prefix)``, e.g. tf.data iterator checkpointing:
``data_position``), ``nonfinite`` (the trainer's NonFiniteGuard's counts, JSON) and
``fingerprints`` (each array's, JSON: ``fingerprints.py``), so that a resumed run continues with
exactly the batches it would have seen, judged as it would have been, from the state as it was.
Orbax writes into a temporary directory and renames it when complete (on gs:// it writes
``commit_success.txt`` last), so a crash never leaves a half-written checkpoint listed, and keep-N
takes one out of the listing before it deletes it (``Checkpointer._delete_old``). A checkpoint
that still cannot be read is moved aside (never deleted) once an older one has read, and that one
is used. Every process reads its own part of each checkpoint, then all agree on the outcome
(``checkpoint_reads``), so one that fails never leaves the others waiting for it.
"""
import logging
import re
import threading
from typing import Callable, List, NamedTuple, Optional, Sequence

import gin
import jax
import orbax.checkpoint as ocp
from etils import epath

from t5x_variants.train import data_position, fingerprints, multihost, optimizer, storage
from t5x_variants.train.checkpoint_reads import (ReadError, array_shapes, error_reason, intact,
                                                 json_item, read_on_every_process, read_with,
                                                 saved_tree)

PREFIX = 'checkpoint'
# Where keep-N moves a checkpoint on a file system before deleting it (Checkpointer._delete_old).
DELETED = 'deleted_checkpoints'
COMMITTED = 'commit_success.txt'  # orbax's last object of a save on a store: listed only with it
NONFINITE = 'nonfinite'  # the item of what the trainer's NonFiniteGuard has counted (JSON)
log = logging.getLogger(__name__)
# Orbax's own step naming: finds and builds ``checkpoint_<step>`` names (a regex on the whole name,
# committed directories only), for the manager and for the functions below alike.
_NAME_FORMAT = ocp.step.standard_name_format(step_prefix=PREFIX)
# Orbax's temporary directory of a save to a file system, renamed to its step's name at commit.
_UNFINISHED = re.compile(PREFIX + r'_\d+' + re.escape(ocp.step.TMP_DIR_SUFFIX) + '.*')


class CheckpointError(RuntimeError):
  """No usable checkpoint where one was asked for."""


def abstract_arrays(tree):
  """ShapeDtypeStructs with the shardings of arrays or abstract arrays: every restore names its
  target shardings, so a checkpoint restores safely onto another mesh or topology."""
  def leaf(x):
    if getattr(x, 'sharding', None) is None:
      raise ValueError(f'restoring needs the target sharding of every array; {x} has none')
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return jax.tree_util.tree_map(leaf, tree)


@gin.configurable
class Checkpointer:
  """Periodic, asynchronous, keep-N checkpoints in ``model_dir``.

  ``period``: save every ``period`` steps (and always on request: the final step, SIGTERM).
  ``keep``: how many recent checkpoints to keep (None: all).

  Orbax decides the period steps with ``FixedIntervalPolicy`` alone: its default policy for
  ``save_interval_steps`` also saves the first step of a run without checkpoints and any step
  jax's preemption sync point names, which are not period steps (the trainer finishes a period
  step before saving it, and handles preemption itself through ``force``).
  """

  def __init__(self, model_dir: str, period: int = 1000, keep: Optional[int] = 5,
               async_save: bool = True):
    self.period, self.keep, self.async_save = period, keep, async_save
    pattern = storage.pattern_in_name(model_dir)
    if pattern:
      raise ValueError(pattern)
    self.model_dir = storage.path(model_dir)
    self._writes = multihost.WriteBarrier()
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(period),
        step_name_format=_NAME_FORMAT, create=True, enable_async_checkpointing=async_save,
        async_options=ocp.AsyncOptions(barrier_sync_fn=self._writes))
    self.manager = ocp.CheckpointManager(self.model_dir, options=options)
    # The steps keep-N deleted and those whose save raised: the manager's steps in memory keep
    # them (orbax lists a save as it starts, and a barrier of it that another process's failure
    # stopped leaves it listed), so keep-N would count a save that never finished.
    self._deleted = set()
    self._deleting = None  # the thread deleting them
    if jax.process_index() == 0:
      try:
        self._delete_leftovers()
      except Exception as e:  # pylint: disable=broad-except  (process 0 alone: others would wait)
        log.warning('could not delete what an interrupted keep-N left in %s (%s); it is unlisted, '
                    'and tried again at the next start', self.model_dir, error_reason(e))

  def steps(self):
    return sorted(s for s in self.manager.all_steps() if s not in self._deleted)

  def save(self, step: int, state, data_iterator=None, force: bool = False, guard=None) -> bool:
    """Starts saving ``state`` at ``step`` if it is a period step or ``force``; True if started.
    A step already saved is not saved again (orbax refuses it unless forced, and then raises).
    ``guard``: the trainer's NonFiniteGuard, whose ``state()`` is kept with it."""
    if force and step in self.manager.all_steps():
      return False
    if not (force or self.manager.should_save(step)):  # (the trainer asks at every step)
      return False
    items = {'state': ocp.args.StandardSave(state),
             fingerprints.ITEM: ocp.args.JsonSave(fingerprints.summarize(state)[1])}
    if data_position.resumable(data_iterator):
      items['data'] = data_position.DataIteratorSave(data_iterator)
    if guard is not None:
      items[NONFINITE] = ocp.args.JsonSave(guard.state())
    try:
      # the previous save's error first (as orbax raises it), before any barrier of this one sees
      # its mark; then orbax's barriers of this save in the WriteBarrier (``orbax_syncs``)
      self._marked(self.manager.wait_until_finished)
      with self._writes.orbax_syncs():
        started = self._marked(
            lambda: self.manager.save(step, args=ocp.args.Composite(**items), force=force))
    except Exception as e:  # pylint: disable=broad-except  (this save's, or the previous one's)
      self._deleted.add(step)
      raise self._failed(e) from e
    if started:  # (the saves before it committed, or it raised; once per checkpoint)
      self._delete_old(unfinished=step if self.async_save else None)
    return started

  def close(self):
    try:
      self._marked(self.manager.wait_until_finished)
    except Exception as e:  # pylint: disable=broad-except  (the last asynchronous save's)
      raise self._failed(e) from e
    self.manager.close()
    self._delete_old()
    self._wait_for_deletions()

  def _marked(self, act: Callable):
    """``act()``; if it raised, first marked as this process's failed save for the others, whose
    background saves wait for its writes (``multihost.WriteBarrier``): they stop too. Where
    another process's failure stopped it (a ProcessError), this process's own background writes
    of that save are cancelled: they may wait for files of the failed process (orbax's
    non-primary processes wait up to 10 minutes for process 0's ``array_metadatas``), and the
    process could not exit before them."""
    try:
      return act()
    except Exception as e:
      if not isinstance(e, multihost.ProcessError):  # (another's failure, which stopped this one)
        try:
          self._writes.fail()
        except Exception as mark:  # pylint: disable=broad-except  (the coordination service gone)
          log.warning('could not tell the other processes that this save failed: %s', mark)
      else:  # (orbax has no public way to stop a save's background writes)
        checkpointer = self.manager._checkpointer  # pylint: disable=protected-access
        if isinstance(checkpointer, ocp.AsyncCheckpointer):
          checkpointer.cancel()
      raise

  def _commit_file(self) -> bool:
    """Whether orbax marks this directory's saves committed by ``COMMITTED`` (on gs://), rather
    than by renaming a temporary directory."""
    return storage.scheme(self.model_dir) == 'gs'

  def _delete_leftovers(self):
    """Deletes what a killed keep-N or save left, never a checkpoint: on a file system ``DELETED``
    and orbax's temporary directories of unfinished saves (none is in flight: t5xv-train holds the
    run directory's lock, t5xv-import writes a new one); on gs:// the ``checkpoint_<step>``
    directories without ``COMMITTED`` older than the newest committed one: an unfinished save's,
    which its error message names, is newer than that one until the run has passed its step
    again."""
    if not self._commit_file():
      (self.model_dir / DELETED).rmtree(missing_ok=True)
      for path in self.model_dir.iterdir():
        if _UNFINISHED.fullmatch(path.name) and path.is_dir():
          path.rmtree(missing_ok=True)
      return
    committed = self.steps()
    for path in self.model_dir.iterdir() if committed else []:
      step = re.fullmatch(PREFIX + r'_(\d+)', path.name)
      if step and int(step[1]) < committed[-1] and int(step[1]) not in committed:
        path.rmtree(missing_ok=True)

  def _delete_old(self, unfinished: Optional[int] = None):
    """Keep-N, on process 0, in a thread (as orbax's deletion ran in its commit's): deletes the
    checkpoints older than the newest ``keep`` committed ones (``unfinished``, a save in flight,
    not counted). Never at start-up: a run refused then (another vocabulary or configuration)
    loses nothing. Each leaves the listing before any file of it is deleted: on gs:// its
    ``COMMITTED`` goes first, elsewhere it is renamed into ``DELETED``. Orbax's keep-N deleted in
    place, file by file, so a kill in the middle left a listed checkpoint that no longer read
    (t5xv-eval over all checkpoints failed on it). A kill now leaves the rest of one unlisted (in
    ``DELETED``; on gs://, objects without ``COMMITTED``), which the next run deletes. A deletion
    that fails is logged and tried again at the next call: the listed checkpoints are whole, and
    an error on process 0 alone would leave the others waiting."""
    if jax.process_index() != 0:
      return
    self._wait_for_deletions()
    committed = [s for s in self.steps() if s != unfinished]
    old = committed[:-self.keep] if self.keep else []
    if old:
      self._deleting = threading.Thread(target=self._delete, args=(old,), daemon=True,
                                        name='checkpoint-keep-n')
      self._deleting.start()

  def _wait_for_deletions(self):
    if self._deleting is not None:
      self._deleting.join()
      self._deleting = None

  def _delete(self, steps: Sequence[int]):
    moved = self.model_dir / DELETED
    try:
      for step in steps:
        path = ocp.step.build_step_path(self.model_dir, _NAME_FORMAT, step)
        if self._commit_file():
          (path / COMMITTED).unlink(missing_ok=True)
          path.rmtree(missing_ok=True)
        elif path.exists():  # (unless deleted by hand meanwhile)
          moved.mkdir(exist_ok=True)
          path.rename(moved / path.name)
          moved.rmtree()
        self._deleted.add(step)
    except Exception as e:  # pylint: disable=broad-except
      log.warning('keep-N (Checkpointer.keep = %s) could not delete the checkpoints before the '
                  'newest in %s (%s); every listed checkpoint is whole, and the deletion is tried '
                  'again at the next checkpoint', self.keep, self.model_dir, error_reason(e))

  def _failed(self, e: Exception) -> CheckpointError:
    """A save that could not be written (a full disk, a lost mount: an OSError from our writes, a
    ValueError from tensorstore's; on a bucket an error its client no longer retries), as one line
    saying what is intact. The unfinished save stays in its temporary directory (on a bucket: its
    directory, without the commit_success.txt orbax writes last), which no listing or restore
    reads."""
    steps = self.steps()
    store = storage.scheme(self.model_dir)
    cause = 'the bucket, its permissions' if store else 'free space, the mount'
    intact = (f'checkpoint_{steps[-1]} (and those before it) is intact: fix the cause ({cause}) '
              f'and rerun the same command to resume from step {steps[-1]}' if steps
              else 'there is no earlier checkpoint: fix the cause and rerun to start again')
    unfinished = (f'the unfinished save is the {PREFIX}_<step> without a commit_success.txt' if store
                  else f'the unfinished save, in {PREFIX}_*.orbax-checkpoint-tmp*, is deleted '
                  'when the run resumes')
    reason = error_reason(e)
    return CheckpointError(f'saving a checkpoint in {self.model_dir} failed ({reason}). {intact}; '
                           f'{unfinished}')

  def restore_latest(self, abstract_state, data_iterator=None, guard=None):
    """(state, step) of the newest readable checkpoint, laid out as ``abstract_state`` says (its
    shardings may differ from the saving run's: another mesh or device count); None if there is no
    checkpoint. A checkpoint of another run configuration raises CheckpointError: other parameter
    names or shapes, another optimizer state (other optimizer settings), or a state that reads
    with a data position this run cannot take (another number of processes or data pipeline), a
    checkpoint of parameters only (t5xv-import's). A read that fails for a cause outside the
    checkpoint (memory, the network, the bucket's permissions) raises CheckpointError too, moving
    nothing. Any other that cannot be read is taken as damaged and the one before is tried; once
    one reads, the damaged ones are renamed ``<name>.unreadable``. If none reads, nothing is moved
    (a read that fails on every checkpoint may be this installation's, not the files')."""
    steps, damaged = _process0_steps(self.steps), []  # one listing for every process
    wanted = set(ocp.tree.serialize_tree(abstract_state, keep_empty_nodes=True))
    retry = (f'Resume with those settings (its config.gin: '
             f'--gin_file={storage.join(self.model_dir, "config.gin")}), or start a new model_dir '
             'with train.init_checkpoint pointing at it.')
    for step in reversed(steps):
      path = ocp.step.build_step_path(self.model_dir, _NAME_FORMAT, step)
      saved = None
      try:
        saved = saved_tree(path)
        mismatch = _saved_mismatch(saved, abstract_state, 'params')
        if mismatch:
          raise CheckpointError(f'{path} holds another model ({mismatch}); resume with the '
                                'configuration it was trained with, or use a new model_dir')
        if wanted - set(saved):
          raise CheckpointError(
              f'{path} holds {", ".join(sorted(saved))} but no '
              f'{", ".join(sorted(wanted - set(saved)))} (as t5xv-import writes parameters only): '
              f'train from it in a new model_dir with --gin.train.init_checkpoint="\'{path}\'"')
        state = self.restore(step, abstract_state, data_iterator, guard)
      except ReadError as e:  # on every process at once
        if e.outside:
          raise _outside_error(path, str(e)) from e
        if e.part == 'data':
          raise CheckpointError(
              f'{path} has a readable state but this run cannot take its data position ({e}): '
              'another number of processes, other data settings, or pre-built batches '
              '(--batches_dir) where the run that wrote it read the data layer (or the reverse)? '
              f'{retry} (If its data file is damaged, rename {path.name} to '
              f'{path.name}.unreadable to resume from the checkpoint before it.)') from e
        mismatch = saved is not None and _saved_mismatch(saved, abstract_state, 'opt_state')
        if mismatch:
          hint = optimizer.optimizer_hint(mismatch.entry, mismatch.saved is not None)
          raise CheckpointError(f'{path} holds the optimizer state of other optimizer settings '
                                f'({mismatch}). {retry}{hint}') from e
        logging.error('checkpoint %s cannot be read (%s); falling back to the previous one', path,
                      e)
        damaged.append((path, e))
        continue
      self._move_aside([p for p, _ in damaged])
      return state, step
    if damaged:
      path, e = damaged[0]
      raise CheckpointError(
          f'no checkpoint in {self.model_dir} can be read (the newest, {path.name}: {e}); none '
          'was moved aside. If every one fails alike, suspect this installation (its orbax or '
          'tensorstore) before the files; if they are damaged, rename them (or use a new '
          'model_dir) to start from scratch.')
    return None

  def _move_aside(self, paths):
    """Renames damaged checkpoints ``<name>.unreadable`` (``.unreadable.<n>`` if that is taken:
    kept, never listed or read again) on process 0; a rename that fails raises on every
    process."""
    if not paths:
      return
    error = None

    def rename() -> bool:
      nonlocal error
      try:
        for path in paths:
          aside, n = storage.path(f'{path}.unreadable'), 1
          while aside.exists():
            aside, n = storage.path(f'{path}.unreadable.{n}'), n + 1
          path.rename(aside)
      except Exception as e:  # pylint: disable=broad-except  (the file system's or the bucket's)
        error = e
      return error is None
    if not multihost.process0_says('moving unreadable checkpoints aside', rename):
      reason = error_reason(error) if error else "process 0's log says why"
      raise CheckpointError(f'could not move the unreadable {", ".join(p.name for p in paths)} '
                            f'aside ({reason}): rename them yourself and rerun') from error
    self.manager.reload()

  def restore(self, step: int, abstract_state, data_iterator=None, guard=None):
    """The state of checkpoint ``step``, then its data position into ``data_iterator`` and what
    its NonFiniteGuard had counted into ``guard`` (``load``; a checkpoint saved before that was
    kept leaves it as it is); a part that any process could not read raises ReadError on every
    process."""
    path = ocp.step.build_step_path(self.model_dir, _NAME_FORMAT, step)
    target = ocp.args.StandardRestore(abstract_arrays(abstract_state))
    state = intact(read_with(ocp.StandardCheckpointHandler(), 'state',
                             lambda handler: handler.restore(path / 'state', args=target)), path)
    if data_position.resumable(data_iterator):
      read_on_every_process('data', lambda: data_position.DataIteratorHandler().restore(
          path / 'data', args=data_position.DataIteratorRestore(data_iterator)))
    counts = None if guard is None else json_item(
        path, NONFINITE, guard.parse,
        'the non-finite steps are counted from this resume on; the checkpoint is used')
    if counts is not None:
      guard.load(counts)
    return state


def _outside_error(path, reason: str) -> CheckpointError:
  return CheckpointError(f'{path} could not be read ({reason}), for a cause outside it: nothing '
                         'was moved aside; fix the cause (memory, the network, the bucket or its '
                         'permissions) and rerun')


def _saved_steps(run_dir) -> List[int]:
  """The steps of the finished ``checkpoint_<step>`` directories in ``run_dir`` that hold a
  ``state`` (an empty one, e.g. of an interrupted copy, is none), as this process sees them."""
  return sorted(m.step for m in _NAME_FORMAT.find_all(run_dir) if (m.path / 'state').exists())


def list_checkpoints(run_dir: str):
  """The ``checkpoint_<step>`` directories in ``run_dir``, oldest first (not ``*.unreadable``
  ones, unfinished saves, directories without a ``state`` or stray files); process 0's listing for
  every process (beside a training run that saves and deletes, each would list its own moment)."""
  steps = _process0_steps(lambda: _saved_steps(run_dir))
  return [ocp.step.build_step_path(storage.path(run_dir), _NAME_FORMAT, step) for step in steps]


def _process0_steps(steps: Callable[[], Sequence[int]]) -> List[int]:
  """The checkpoint steps ``steps()`` lists on process 0, for every process (which all call this
  together)."""
  return multihost.process0_json('listing the checkpoints', lambda: [int(s) for s in steps()])


class _Mismatch(NamedTuple):
  """An array named as orbax saves it ('opt_state/...'), its shape in a checkpoint and in this
  run, None where it has none."""
  entry: str
  saved: Optional[tuple]
  wanted: Optional[tuple]

  def __str__(self):
    shape = lambda x: 'nothing' if x is None else x
    return f'{self.entry}: saved {shape(self.saved)}, this run {shape(self.wanted)}'


def _saved_mismatch(tree, abstract_state, part: str) -> Optional[_Mismatch]:
  """The first array of ``part`` ('params', 'opt_state') whose shape in a checkpoint's metadata
  ``tree`` (``saved_tree``'s) differs from ``abstract_state``'s (or that only one of them has);
  None if they agree or either has no ``part``."""
  if part not in tree or not hasattr(abstract_state, part):
    return None
  saved = array_shapes(tree[part])
  wanted = array_shapes(getattr(abstract_state, part))
  for key in sorted(saved.keys() | wanted.keys()):
    if saved.get(key) != wanted.get(key):
      return _Mismatch(f'{part}/{key}', saved.get(key), wanted.get(key))
  return None


def checkpoint_path(path: str) -> epath.Path:
  """A checkpoint directory: ``path`` itself, or the newest ``checkpoint_<step>`` inside it."""
  path = storage.path(path)
  if multihost.process0_says(f'looking for {path}', (path / 'state').exists):
    if not multihost.process0_says(f'checking that {path} was finished',
                                   lambda: ocp.step.is_checkpoint_finalized(path)):
      raise CheckpointError(f'{path} is a checkpoint whose save did not finish (the run stopped '
                            'while writing it; on a bucket it has no commit_success.txt): give its '
                            'run directory, whose newest finished checkpoint is read, or another '
                            f'{PREFIX}_<step>')
    return path
  latest = _process0_steps(lambda: _saved_steps(path)[-1:])
  if not latest:
    raise CheckpointError(f'no checkpoint at {path}: expected a {PREFIX}_<step> directory or a '
                          f'directory containing them')
  return ocp.step.build_step_path(path, _NAME_FORMAT, latest[0])


