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
