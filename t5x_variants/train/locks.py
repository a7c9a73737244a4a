"""Exclusive locks held for a process's lifetime (``flock``: released when it exits or dies, even
by SIGKILL), so that two commands never train the same runs or rewrite each other's files: a
sweep directory's (``sweeps/runner.py``) and a run directory's (``cli/train.py``)."""
import fcntl
import hashlib
import os
import tempfile
from typing import IO, Optional

from t5x_variants.train import storage


def _open(lock_file: str) -> int:
  """A read-only descriptor of ``lock_file``, created if absent: read-only, so that a file another
  user created (mode 0644, in a sticky /tmp) locks as well."""
  while True:
    try:
      return os.open(lock_file, os.O_RDONLY)
    except FileNotFoundError:
      pass
    try:
      return os.open(lock_file, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:  # created meanwhile by another process: open that one
      continue


def exclusive(lock_file: str) -> Optional[IO]:
  """The open ``lock_file`` (created, with its directory) holding an exclusive lock, or None when
  another process holds it; closing the file releases it."""
  os.makedirs(os.path.dirname(lock_file), exist_ok=True)
  handle = open(_open(lock_file), 'rb')  # pylint: disable=consider-using-with
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    handle.close()
    return None
  return handle


def host_file(prefix: str, directory: str) -> str:
  """A path in this host's temporary directory named after ``directory`` (its URI on an object
  store, which cannot lock; else its real path, links resolved): where it is locked without
  writing into it. Processes with different temporary directories (``TMPDIR``) do not see it."""
  name = directory.rstrip('/') if storage.scheme(directory) else os.path.realpath(directory)
  return os.path.join(tempfile.gettempdir(),
                      f'{prefix}-{hashlib.sha256(name.encode()).hexdigest()[:16]}')
