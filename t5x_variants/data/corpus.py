"""Plain-text corpora: local files (a folder or glob of .txt / .jsonl) and the embedded default.

The embedded corpus is English prose harvested from the docstrings of the running Python's
standard library (parsed with ``ast``; nothing is imported or downloaded), one document per line,
built once and cached. Documents go to ``validation`` when crc32(text) % 100 < the validation
percentage, so the split is stable whatever order files are read in.
"""
import ast
import glob
import inspect
import json
import os
import sys
import sysconfig
import zlib
from typing import Iterator, List

import gin

from t5x_variants.data import cache

SPLITS = ('train', 'validation')
# Stdlib subtrees whose docstrings are tests, generated tables or GUI code, not prose.
_SKIP_DIRS = {'test', 'tests', 'idlelib', 'lib2to3', 'site-packages', 'dist-packages', 'turtledemo',
              'tkinter', 'encodings', 'pydoc_data', 'ensurepip', 'venv', '__pycache__'}


class CorpusError(ValueError):
  """A corpus location that holds no readable text."""


def _docstrings(path: str) -> Iterator[str]:
  try:
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read())
  except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
    return
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node)
      if doc:
        yield doc


def _is_prose(paragraph: str) -> bool:
  words = paragraph.split()
  letters = sum(c.isalpha() or c.isspace() for c in paragraph)
  return len(words) >= 8 and letters >= 0.8 * len(paragraph) and '>>>' not in paragraph


def harvest_stdlib_prose(stdlib_dir: str = None) -> List[str]:
  """Prose paragraphs of the standard library's docstrings, de-duplicated, in file order."""
  stdlib_dir = stdlib_dir or sysconfig.get_paths()['stdlib']
  seen, docs = set(), []
  for root, dirs, files in os.walk(stdlib_dir):
    dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
    for name in sorted(files):
      if not name.endswith('.py'):
        continue
      for doc in _docstrings(os.path.join(root, name)):
        for paragraph in inspect.cleandoc(doc).split('\n\n'):
          text = ' '.join(paragraph.split())
          if _is_prose(text) and text not in seen:
            seen.add(text)
            docs.append(text)
  return docs


def embedded_corpus_file() -> str:
  """Path of the cached embedded corpus (one document per line), building it on first use."""
  def build(tmp):
    docs = harvest_stdlib_prose()
    if not docs:
      raise CorpusError(f'no docstring prose found under {sysconfig.get_paths()["stdlib"]}')
    with open(tmp, 'w', encoding='utf-8') as f:
      f.write('\n'.join(docs) + '\n')
  tag = 'py{}.{}.{}'.format(*sys.version_info[:3])  # the stdlib, and so the corpus, of this release
  return cache.build_once(os.path.join(cache.cache_dir(), f'embedded_corpus_{tag}.txt'), build)


@gin.configurable
def local_corpus_files(pattern: str = gin.REQUIRED) -> List[str]:
  """The .txt / .jsonl files of ``pattern`` (a folder, a file or a glob), sorted."""
  if os.path.isdir(pattern):
    pattern = os.path.join(pattern, '**', '*')
  files = sorted(p for p in glob.glob(pattern, recursive=True)
                 if os.path.isfile(p) and p.endswith(('.txt', '.jsonl')))
  if not files:
    raise CorpusError(f'no .txt or .jsonl files match {pattern!r}; bind local_corpus_files.pattern '
                      'to a folder or glob of text files (one document per line, or JSONL with a '
                      '"text" field)')
  return files


def in_split(text: str, split: str, validation_percent: int) -> bool:
  is_validation = zlib.crc32(text.encode('utf-8')) % 100 < validation_percent
  return is_validation == (split == 'validation')


def read_documents(files: List[str], split: str, validation_percent: int = 5) -> Iterator[str]:
  """Non-empty documents of ``split`` from .txt (a line each) and .jsonl ("text" field) files."""
  if split not in SPLITS:
    raise CorpusError(f'unknown split {split!r}; valid: {", ".join(SPLITS)}')
  for path in files:
    try:
      with open(path, encoding='utf-8') as f:
        for number, line in enumerate(f, 1):
          text = line.strip()
          if text and path.endswith('.jsonl'):
            try:
              text = str(json.loads(text)['text']).strip()
            except (ValueError, KeyError, TypeError) as e:
              raise CorpusError(f'{path}:{number}: expected a JSON object with a "text" field') from e
          if text and in_split(text, split, validation_percent):
            yield text
    except (OSError, UnicodeDecodeError) as e:
      raise CorpusError(f'cannot read corpus file {path}: {e}') from e
