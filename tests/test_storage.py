"""Run-directory files on a local file system: written whole or not at all, appended in place,
URIs kept as URIs. On a bucket the same functions are tested against a GCS API server
(tests/test_gcs.py)."""
import pytest
from etils import epath

from t5x_variants.train import storage


def test_a_local_appended_file_is_appended_to_in_place(tmp_path):
  local = tmp_path / 'local.jsonl'
  for text in ('a\n', 'b\n'):
    f = storage.AppendedFile(str(local))
    f.write(text)
    f.close()
  assert storage.read_appended(str(local)) == local.read_text() == 'a\nb\n'


def test_scheme_and_join_keep_uris():
  assert storage.scheme('gs://b/run') == 'gs' and storage.scheme('/tmp/gs://x') == ''
  assert storage.join('gs://b/run/', 'tensorboard') == 'gs://b/run/tensorboard'
  assert storage.join('/tmp/run', 'a', 'b') == '/tmp/run/a/b'


def test_write_text_replaces_a_file_whole_or_not_at_all(tmp_path, monkeypatch):
  """A write that dies half-way (a kill, a full disk) leaves the previous eval_results.json or
  config.gin as it was, and its temporary file is removed."""
  target = tmp_path / 'eval_results.json'
  storage.write_text(target, '{"10": {}}')
  real = epath.Path.write_bytes

  def half_then_fail(self, data, *args, **kwargs):
    real(self, data[:len(data) // 2])
    raise OSError(28, 'No space left on device')
  monkeypatch.setattr(epath.Path, 'write_bytes', half_then_fail)
  with pytest.raises(OSError):
    storage.write_text(target, '{"10": {}, "20": {}}')
  assert target.read_text() == '{"10": {}}'
  assert [p.name for p in tmp_path.iterdir()] == ['eval_results.json']
  monkeypatch.undo()
  storage.write_text(target, '{"20": {}}')
  assert target.read_text() == '{"20": {}}'
  assert [p.name for p in tmp_path.iterdir()] == ['eval_results.json']


def test_a_copy_is_written_whole_and_a_cached_file_is_readable_by_others(tmp_path, monkeypatch):
  """storage.copy goes through write_bytes (a killed copy leaves the old file); a file the cache
  builds is readable by every user of a shared cache, not mkstemp's owner-only 0o600."""
  import os  # pylint: disable=g-import-not-at-top
  from t5x_variants.data import cache  # pylint: disable=g-import-not-at-top
  (tmp_path / 'src').write_bytes(b'new')
  (tmp_path / 'dst').write_bytes(b'old')
  writes = []
  monkeypatch.setattr(storage, 'write_bytes', lambda p, data: writes.append((str(p), data)))
  storage.copy(tmp_path / 'src', tmp_path / 'dst')
  assert writes == [(str(tmp_path / 'dst'), b'new')]
  built = cache.build_once(str(tmp_path / 'c' / 'f'), lambda p: open(p, 'w').write('x'))
  assert os.stat(built).st_mode & 0o777 == 0o644


def test_the_sessions_one_process_opens_sort_in_their_order(monkeypatch):
  """Object names sorted as text: session 10 came before session 2."""
  import re  # pylint: disable=g-import-not-at-top
  opened = []
  monkeypatch.setattr(storage, 'path', lambda p: epath.Path(str(p).replace('gs://', '/tmp/')))
  monkeypatch.setattr(epath.Path, 'mkdir', lambda self, **kwargs: None)
  for _ in range(12):
    opened.append(storage.AppendedFile('gs://b/run/metrics.jsonl')._object.path.name)
  assert all(re.fullmatch(r'metrics\.\d{14}-\d+-\d{6}-[0-9a-f]{8}-000000\.jsonl', n) for n in opened)
  counters = [n.split('-')[2] for n in opened]
  assert sorted(counters) == counters


def test_a_growing_object_goes_on_in_a_next_part_so_each_upload_is_bounded(tmp_path, monkeypatch):
  """An object is rewritten whole at each flush (a store cannot append): without parts, a long
  run's metrics object was uploaded again in full every 30 s, bytes growing with the square of
  the run. Past ROLL_BYTES the next part begins; the parts read back as one text in order, and
  an event file's parts keep 'tfevents' in their names (TensorBoard reads them in name order)."""
  monkeypatch.setattr(storage, 'path', lambda p: epath.Path(str(p).replace('gs://b', str(tmp_path))))
  monkeypatch.setattr(storage, 'ROLL_BYTES', 100)
  uploads = []
  real = epath.Path.write_bytes
  monkeypatch.setattr(epath.Path, 'write_bytes',
                      lambda self, data: (uploads.append(len(data)), real(self, data))[1])
  f = storage.AppendedFile('gs://b/run/metrics.jsonl', flush_secs=0)  # a rewrite at every line
  lines = [f'{{"step": {i:04d}}}\n' for i in range(60)]  # 15 bytes each
  for line in lines:
    f.write(line)
  f.close()
  assert max(uploads) <= 100 + 15 and sum(uploads) < 60 * 15 * 5  # (without parts: 27,450 bytes)
  parts = sorted(p.name for p in (tmp_path / 'run').iterdir())
  assert len(parts) == 9 and [p.rsplit('-', 1)[1] for p in parts] == [f'{k:06d}.jsonl' for k in range(9)]
  assert storage.read_appended('gs://b/run/metrics.jsonl') == ''.join(lines)
  writers = storage._EpathRecordWriters()
  writers.directory_check('gs://b/run/tb')
  events = writers.open('gs://b/run/tb/events.out.tfevents.1.host')
  for _ in range(3):
    events.write(b'x' * 60)
    events.flush()
  assert sorted(p.name for p in (tmp_path / 'run' / 'tb').iterdir()) == [
      'events.out.tfevents.1.host', 'events.out.tfevents.1.host.000001']


def test_a_replacing_write_reaches_the_disk_before_its_rename(tmp_path, monkeypatch):
  """(a host that crashed after the rename but before the page cache was written could leave an
  empty config.gin or eval_results.json)"""
  import os  # pylint: disable=g-import-not-at-top
  calls, real_fsync, real_replace = [], os.fsync, os.replace
  monkeypatch.setattr(os, 'fsync', lambda fd: (
      calls.append(('fsync', os.readlink(f'/proc/self/fd/{fd}'))), real_fsync(fd))[1])
  monkeypatch.setattr(os, 'replace', lambda a, b: (calls.append(('replace', str(b))), real_replace(a, b))[1])
  storage.write_text(tmp_path / 'config.gin', 'x = 1\n')
  assert calls == [('fsync', str(tmp_path / f'.config.gin.{os.getpid()}.tmp')),
                   ('replace', str(tmp_path / 'config.gin')), ('fsync', str(tmp_path))]


def test_a_local_copy_of_an_object_does_not_trust_a_file_already_named_so(tmp_path, monkeypatch):
  """The copy is named by the object's contents in the shared temporary directory: a file of
  that name with other bytes (another user's, a damaged disk) is replaced, not read."""
  import hashlib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(storage, 'path', lambda p: epath.Path(str(p).replace('gs://b', str(tmp_path))))
  monkeypatch.setattr(storage.tempfile, 'gettempdir', lambda: str(tmp_path / 'tmp'))
  (tmp_path / 'run').mkdir()
  (tmp_path / 'run' / 'spm.model').write_bytes(b'model')
  planted = tmp_path / 'tmp' / f't5xv-{hashlib.sha256(b"model").hexdigest()[:16]}-spm.model'
  planted.parent.mkdir()
  planted.write_bytes(b'other')
  assert storage.local_copy('gs://b/run/spm.model') == str(planted)
  assert planted.read_bytes() == b'model'


def test_a_bucket_run_directory_whose_path_is_a_pattern_is_refused():
  """gcsfs's rm and mv read '[', ']', '*', '?' as a pattern: keep-N deleting gs://b/run[1]'s
  checkpoint_2 deleted gs://b/run1's too (audit). Local paths are literal."""
  from t5x_variants.train import checkpoints  # pylint: disable=g-import-not-at-top
  for name in ('gs://b/run[1]', 'gs://b/runs/a*', 'gs://b/r?n'):
    assert 'may not have [, ], * or ? in its path' in storage.pattern_in_name(name)
    with pytest.raises(ValueError, match=r'would delete another run.s checkpoints; name it without'):
      checkpoints.Checkpointer(name)
  assert storage.pattern_in_name('gs://b/run1') is None
  assert storage.pattern_in_name('/tmp/run[1]') is None
