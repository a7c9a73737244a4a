"""Exclusive locks held for a process's lifetime (``flock``: released when it exits or dies, even
by SIGKILL), so that two commands never train the same runs or rewrite each other's files: a
sweep directory's (``sweeps/runner.py``) and a run directory's (``cli/train.py``)."""
import fcntl
import hashlib
import os
import tempfile
from typing import IO, Optional

from t5x_variants.train import storage


def exclusive(lock_file: str) -> Optional[IO]:
  """The open ``lock_file`` (created, with its directory) holding an exclusive lock, or None when
  another process holds it; closing the file releases it."""
  os.makedirs(os.path.dirname(lock_file), exist_ok=True)
  handle = open(lock_file, 'w')  # pylint: disable=consider-using-with
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    handle.close()
    return None
  return handle


def host_file(prefix: str, directory: str) -> str:
  """A path of this host's temporary directory named after ``directory`` (its absolute path, or
  its URI on an object store, which cannot lock): where it is locked without writing into it."""
  name = directory if storage.scheme(directory) else os.path.abspath(directory)
  return os.path.join(tempfile.gettempdir(),
                      f'{prefix}-{hashlib.sha256(name.encode()).hexdigest()[:16]}')
