"""The data position in a checkpoint: each host's input-pipeline iterator, saved beside the train
state as the checkpoint's ``data`` item (one file set per host, ``host-<i>-of-<n>``), so that a
resumed run reads exactly the batches it would have read."""
import dataclasses
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from t5x_variants.train import multihost, storage


def _host_file(directory) -> str:
  return str(storage.path(directory) / f'host-{jax.process_index():05d}-of-{jax.process_count():05d}')


class DataIteratorHandler(ocp.CheckpointHandler):
  """Saves / restores an iterator with ``save(prefix)`` and ``restore(prefix)`` methods, which
  write and read local files: on an object store they are staged through a local directory."""

  def save(self, directory: epath.Path, args: 'DataIteratorSave'):
    """Writes this host's file; every process agrees on the outcome (``multihost.agree``), so a
    write that fails on one (its disk full) fails the save on all, in this call: the others went
    on into orbax's barriers and waited there for it until jax's shutdown timeout (300 s) aborted
    both."""
    def write():
      directory.mkdir(parents=True, exist_ok=True)
      with storage.staged_write(_host_file(directory)) as prefix:
        args.iterator.save(prefix)
    multihost.agree(f'writing the data position into {directory}', write)

  def restore(self, directory: epath.Path, args: 'DataIteratorRestore'):
    """Reads this host's data position into ``args.iterator``."""
    with storage.staged_read(_host_file(directory)) as prefix:
      args.iterator.restore(prefix)


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True)
@dataclasses.dataclass
class DataIteratorSave(ocp.args.CheckpointArgs):
  iterator: Any


@ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)  # orbax's save wants both
@dataclasses.dataclass
class DataIteratorRestore(ocp.args.CheckpointArgs):
  iterator: Any


def resumable(iterator) -> bool:
  return hasattr(iterator, 'save') and hasattr(iterator, 'restore')
