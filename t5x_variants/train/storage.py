"""Run directories on any file system: local paths and URIs such as ``gs://bucket/run``.

Every file of a run directory (and the checkpoint, input and output paths of the commands) is read
and written through etils ``epath``, the path library orbax uses for the checkpoints, so a run on
Cloud TPU can write straight to a bucket. On ``gs://`` that is two clients, both set up here for
every process that imports this module, both reading the machine's Google credentials: fsspec's
gcsfs (the JSON API) for every file but the arrays, and tensorstore's gcs driver for orbax's
arrays. epath would pick TensorFlow's file system where TensorFlow is installed, whose endpoint is
compiled in (it cannot be pointed at a test server, so it is untested here): ``EPATH_USE_TF``
defaults to false. gcsfs's listing cache is off, so a checkpoint or metrics object another process
wrote is seen at the next listing (t5xv-eval beside a run), and its experimental bucket-layout
lookup (a gRPC control-plane call per operation where it fails) is off.

Object stores cannot append to an object (gcsfs's append mode silently replaces it): an
``AppendedFile`` there is one object per writer session (``metrics.<session>-<part>.jsonl``
beside ``metrics.jsonl``: a training run, a resumed run and a t5xv-eval running beside it each
write their own), kept in memory and rewritten whole on ``flush`` (the trainer's, at each
checkpoint), at the first record ``REMOTE_FLUSH_SECS`` or more after the last rewrite, and at
close; a next part is begun at ``ROLL_BYTES`` (so a long run uploads each byte a bounded number of
times, not a number growing with the run); ``read_appended`` reads them all back in order. A
local file is appended to and flushed at once.
TensorBoard event files on a store are rewritten whole in the same way (each writer has its own
file already), as tensorboardX's own gs:// writer does it. Only process 0 writes the shared files;
callers check.
"""
import contextlib
import hashlib
import io
import itertools
import os
import re
import tempfile
import time
import uuid
from typing import Optional, Union

from etils import epath

PathLike = Union[str, epath.Path]
REMOTE_FLUSH_SECS = 30.0  # how often an AppendedFile or an event file is rewritten on a store
ROLL_BYTES = 1 << 22  # the size at which such an object is left whole and the next part begun
_sessions = itertools.count()  # tells apart the sessions one process opens in the same second


def _configure_gcs_clients():
  """gs:// through gcsfs with listings always read from the server (see the module doc); a
  user's own setting of either environment variable wins."""
  os.environ.setdefault('EPATH_USE_TF', 'false')
  os.environ.setdefault('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'false')
  import fsspec.config  # pylint: disable=g-import-not-at-top
  fsspec.config.conf.setdefault('gcs', {}).setdefault('use_listings_cache', False)


_configure_gcs_clients()


def path(p: PathLike) -> epath.Path:
  """``p`` as a path; a local one made absolute (orbax refuses a relative checkpoint path, and
  only when it saves)."""
  return epath.Path(p if scheme(p) else os.path.abspath(p))


def scheme(p: PathLike) -> str:
  """'gs' of 'gs://bucket/x'; '' for a local path."""
  match = re.match(r'([a-zA-Z][a-zA-Z0-9+.-]*)://', str(p))
  return match.group(1) if match else ''


def join(p: PathLike, *names: str) -> str:
  """``p``/``names`` as a string; a URI stays one."""
  if scheme(p):
    return '/'.join([str(p).rstrip('/'), *names])
  return str(path(p).joinpath(*names))


def file_in_the_way(directory: PathLike) -> Optional[epath.Path]:
  """The file that ``directory`` or one of its parents is, which no directory can be made in
  (mkdir's bare 'File exists' or 'Not a directory'), else None."""
  found = next((p for p in (path(directory), *path(directory).parents) if p.exists()), None)
  return found if found is not None and not found.is_dir() else None


def write_text(p: PathLike, text: str):
  write_bytes(p, text.encode())


def write_bytes(p: PathLike, data: bytes):
  """Writes ``data`` to ``p`` (its parent made first), whole: a local file through a temporary
  file renamed over it (through a symlink, over its target) after its bytes reached the disk, so a
  process killed or a host crashed mid-write leaves the old file, never half a file; an object is
  written whole by the store (a rename there is a copy and a delete, not atomic), and a device or
  pipe (``/dev/stdout``) is written directly."""
  p = path(p)
  p.parent.mkdir(parents=True, exist_ok=True)
  if scheme(p) or (p.exists() and not p.is_file()):
    p.write_bytes(data)
    return
  target = path(os.path.realpath(p))
  tmp = target.with_name(f'.{target.name}.{os.getpid()}.tmp')
  try:
    tmp.write_bytes(data)
    _sync(tmp)  # on the disk before the rename: a host crash leaves the old file or the new one
    os.replace(tmp, target)
  finally:
    tmp.unlink(missing_ok=True)
  _sync(target.parent)  # the rename itself


def _sync(p: epath.Path):
  """fsync of a local file or directory."""
  fd = os.open(p, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def pattern_in_name(directory: PathLike):
  """Why an object-store run directory's name cannot be used, or None: the store's clients read
  '[', ']', '*' and '?' in a path they delete or rename (gcsfs's rm and mv, orbax's merge of its
  files) as a pattern, so a checkpoint of ``gs://b/run[1]`` deleted by keep-N took
  ``gs://b/run1``'s too."""
  if scheme(directory) and re.search(r'[][*?]', str(directory)):
    return (f'{directory}: a run directory on a bucket may not have [, ], * or ? in its path: the '
            "store reads them as a pattern when it deletes or renames, and would delete another "
            "run's checkpoints; name it without them")
  return None


def store_unusable(directory: PathLike):
  """Why this process cannot use the object-store directory ``directory`` (write, read, list and
  delete one small object there, its path no pattern: ``pattern_in_name``), or None: a missing
  bucket or missing permissions said in one line at start-up, not as a traceback at the first
  checkpoint. The clients have retried transient errors (5xx, timeouts) before this sees them."""
  pattern = pattern_in_name(directory)
  if pattern:
    return pattern
  bucket = str(directory).split('/')[2]
  probe = path(join(directory, f'.t5xv-access-check-{uuid.uuid4().hex}'))  # one per host
  try:
    probe.write_text('ok')
    probe.read_text()
    list(probe.parent.iterdir())
    probe.unlink(missing_ok=True)  # (a 404: a retried delete whose first answer was lost)
  except FileNotFoundError:
    return (f'bucket {bucket} does not exist (or these credentials cannot see it): create it, e.g. '
            f'gcloud storage buckets create {scheme(directory)}://{bucket}, or fix the path')
  except Exception as e:  # pylint: disable=broad-except  (the clients' own: gcsfs's HttpError for a 401, google.auth's RefreshError)
    if (isinstance(e, PermissionError) or type(e).__name__ == 'RefreshError'
        or re.search(r'Forbidden|Unauthorized|\b40[13]\b', str(e))):
      return (f'these credentials may not use bucket {bucket}: a run needs to create, read, list '
              'and delete objects there (storage.objects.create/get/list/delete, e.g. the role '
              'roles/storage.objectUser); grant them to the account of the Application Default '
              f'Credentials (gcloud auth application-default login, or the VM\'s service account) ({e})')
    return f'cannot be used: {type(e).__name__}: {e}'
  if scheme(directory) == 'gs':
    return _bucket_unreadable(directory, bucket)
  return None


def _bucket_unreadable(directory: PathLike, bucket: str):
  """Why orbax could not read the bucket's own metadata, or None: it does (google-cloud-storage's
  get_bucket, whether the bucket has hierarchical namespace) each time it lists the checkpoints,
  which needs storage.buckets.get, a permission the object roles lack."""
  from orbax.checkpoint._src.path import gcs_utils  # pylint: disable=g-import-not-at-top
  try:
    gcs_utils.is_hierarchical_namespace_enabled(str(directory))
  except Exception as e:  # pylint: disable=broad-except  (google.api_core's Forbidden, ...)
    return (f'these credentials may not read the metadata of bucket {bucket} '
            '(storage.buckets.get), which orbax reads to list the checkpoints: grant it as well '
            '(e.g. the role roles/storage.legacyBucketReader, beside roles/storage.objectUser) '
            f'({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""})')
  return None


def copy(src: PathLike, dst: PathLike):
  """``src``'s bytes to ``dst``, written whole (``write_bytes``)."""
  write_bytes(dst, path(src).read_bytes())


def local_copy(p: PathLike) -> str:
  """A local path to the contents of ``p``: ``p`` itself, or for an object a copy in the temporary
  directory named by its contents (for a reader of local files only: SentencePiece through seqio
  would read gs:// with TensorFlow's file system)."""
  if not scheme(p):
    return str(p)
  data = path(p).read_bytes()
  local = os.path.join(tempfile.gettempdir(),
                       f't5xv-{hashlib.sha256(data).hexdigest()[:16]}-{path(p).name}')
  if not _holds(local, data):  # (a file of that name left by anyone else is not trusted)
    write_bytes(local, data)  # whole: a reader in another process never sees half of it
  return local


def _holds(local: str, data: bytes) -> bool:
  try:
    with open(local, 'rb') as f:
      return f.read() == data
  except OSError:
    return False


@contextlib.contextmanager
def staged_write(prefix: PathLike):
  """A local path stem for a writer of local files only (tf.data's iterator checkpoint writes
  through TensorFlow's file system, which this project does not use for URIs): each file it writes
  as stem + suffix becomes ``prefix`` + suffix on the store when the block ends. A local
  ``prefix`` is given as it is."""
  if not scheme(prefix):
    yield str(prefix)
    return
  with tempfile.TemporaryDirectory(prefix='t5xv-staged-') as tmp:
    stem = os.path.join(tmp, 'x')
    yield stem
    for name in os.listdir(tmp):
      copy(os.path.join(tmp, name), f'{prefix}{name[1:]}')


@contextlib.contextmanager
def staged_read(prefix: PathLike):
  """A local path stem whose files (stem + suffix) are copies of the objects ``prefix`` + suffix,
  for a reader of local files only; a local ``prefix`` is given as it is."""
  if not scheme(prefix):
    yield str(prefix)
    return
  p = path(prefix)
  with tempfile.TemporaryDirectory(prefix='t5xv-staged-') as tmp:
    for obj in _children(p.parent, lambda name: name.startswith(p.name)):
      copy(obj, os.path.join(tmp, 'x' + obj.name[len(p.name):]))
    yield os.path.join(tmp, 'x')


def _children(directory: epath.Path, keep):
  """The entries of ``directory`` whose names ``keep`` accepts: listed and filtered here, since a
  glob on a store treats the whole path as its pattern ('[', '*' in a run directory's name)."""
  return [o for o in directory.iterdir() if keep(o.name)] if directory.exists() else []


def _session_objects(p: epath.Path):
  """The per-session objects of an AppendedFile ``p``, oldest first."""
  session = lambda name: name.startswith(f'{p.stem}.') and name.endswith(p.suffix) and name != p.name
  return sorted(_children(p.parent, session), key=lambda o: o.name)


def read_appended(p: PathLike) -> str:
  """The whole text of an AppendedFile: the local file, then any per-session objects."""
  p = path(p)
  parts = [p] if p.exists() else []
  return ''.join(o.read_text() for o in parts + _session_objects(p))


class AppendedFile:
  """A text file that grows by lines (``metrics.jsonl``): appended to locally, one object per
  writer session on an object store (see the module doc)."""

  def __init__(self, p: PathLike, flush_secs: float = REMOTE_FLUSH_SECS):
    self.path = path(p)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.remote = bool(scheme(p))
    self.flush_secs, self._flushed = flush_secs, time.time()
    if self.remote:
      # Sorted by name: the second, then this process's own order (padded: 10 after 9); the
      # random part keeps apart two hosts whose processes share a pid in the same second; then
      # the object's part (_RewrittenObject).
      session = (f'{time.strftime("%Y%m%d%H%M%S", time.gmtime())}-{os.getpid()}-'
                 f'{next(_sessions):06d}-{uuid.uuid4().hex[:8]}')
      p = self.path
      self._object = _RewrittenObject(
          lambda part: p.with_name(f'{p.stem}.{session}-{part:06d}{p.suffix}'))
    else:  # unbuffered: a write that fails (a full disk) raises once and leaves nothing to retry
      self._file = open(self.path, 'ab', buffering=0)  # pylint: disable=consider-using-with
      if self._file.tell():
        with self.path.open('rb') as f:
          f.seek(-1, os.SEEK_END)
          if f.read(1) != b'\n':  # the last line was cut mid-write (a full disk): a new line
            self._file.write(b'\n')

  def write(self, line: str):
    if self.remote:
      self._object.write(line.encode())
      if time.time() - self._flushed >= self.flush_secs:
        self.flush()
    else:
      data = line.encode()
      while data:
        data = data[self._file.write(data):]

  def flush(self):
    if self.remote:
      self._object.flush()
    self._flushed = time.time()

  def close(self):
    self.flush()
    if not self.remote:
      self._file.close()


class _RewrittenObject:
  """A growing object on a store (a store cannot append): held in memory and written whole at
  each flush with new bytes. Once it holds ``ROLL_BYTES`` it is left as it is and the writing goes
  on in object ``name(part)`` of the next part (names that sort in order), so a flush uploads at
  most that much, not everything written so far."""

  def __init__(self, name):
    self._name, self.part = name, 0
    self.path, self.buffer, self._dirty = path(name(0)), io.BytesIO(), False

  def write(self, data: bytes):
    self.buffer.write(data)
    self._dirty = True

  def flush(self):
    if not self._dirty:
      return
    self.path.write_bytes(self.buffer.getvalue())
    self._dirty = False
    if self.buffer.tell() >= ROLL_BYTES:
      self.part += 1
      self.path, self.buffer = path(self._name(self.part)), io.BytesIO()

  def close(self):
    self.flush()


class _EpathRecordWriters:
  """tensorboardX's writer factory for a URI scheme (its own gs:// one needs google-cloud-storage).
  An event file's later parts are ``<file>.000001`` ...: TensorBoard reads every file of a
  directory with 'tfevents' in its name, in name order."""

  def open(self, p: str):
    return _RewrittenObject(lambda part: f'{p}.{part:06d}' if part else p)

  def directory_check(self, p: str):
    path(p).mkdir(parents=True, exist_ok=True)


def tensorboard_dir(model_dir: PathLike):
  """(TensorBoard directory of ``model_dir`` as tensorboardX takes it, its flush period in
  seconds: 1 for a local event file, REMOTE_FLUSH_SECS for one rewritten whole on a store)."""
  s = scheme(model_dir)
  if s:
    from tensorboardX import record_writer  # pylint: disable=g-import-not-at-top
    record_writer.register_writer_factory(s, _EpathRecordWriters())
  return join(model_dir, 'tensorboard'), REMOTE_FLUSH_SECS if s else 1.0
