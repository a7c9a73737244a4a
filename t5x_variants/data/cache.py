"""Where built artefacts (the embedded corpus, the local SentencePiece model) are cached.

``$T5XV_CACHE_DIR`` if set, else ``~/.cache/t5x_variants``. Files are written to a temporary
name and renamed, so a crash or a concurrent process never leaves a half-written file behind.
"""
import os
import tempfile


def cache_dir() -> str:
  path = os.environ.get('T5XV_CACHE_DIR') or os.path.join(os.path.expanduser('~'), '.cache',
                                                          't5x_variants')
  os.makedirs(path, exist_ok=True)
  return path


def build_once(path: str, build) -> str:
  """Returns ``path``, first calling ``build(tmp_path)`` and renaming if it does not exist."""
  if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix='.tmp-')
    os.close(fd)
    try:
      build(tmp)
      os.chmod(tmp, 0o644)  # readable by every user of a shared cache (mkstemp's is 0o600)
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  return path
