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
    opened.append(storage.AppendedFile('gs://b/run/metrics.jsonl').path.name)
  assert all(re.fullmatch(r'metrics\.\d{14}-\d+-\d{6}-[0-9a-f]{8}\.jsonl', n) for n in opened)
  counters = [n.split('-')[2] for n in opened]
  assert sorted(counters) == counters
