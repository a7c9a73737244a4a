"""Pre-built batches: a run's data written once on a host with the data layer (TensorFlow, seqio)
and read back, batch for batch, on an accelerator host without it.

``t5xv-train --batches_dir=ROOT --write_batches`` writes the batches the run would read (its
``train.total_steps`` training batches and each eval task's, all or at most
``train.eval_batches``) to ``ROOT/<key>``; ``t5xv-train --batches_dir=ROOT`` trains from them
and imports no TensorFlow. The key is a hash of everything that decides the batches (the train and eval ``DatasetConfig``, the architecture,
the number of steps and eval batches, the initial checkpoint), so runs that read the same data (the rates of a learning
rate sweep, the variants of one seed) share one directory, and a run whose data differs finds
none. The data layer's own bindings (vocabulary, local corpus, task directories, span
corruption's noise) are not in the key, since a reader without the data layer cannot see them:
the writer records them and refuses to reuse batches written with others. Each feature is one ``.npy`` file of shape (batches, batch size, length), read memory
mapped; ``data.json`` records every split's files and shapes, and a reader refuses a directory
that no longer holds them (a file deleted or cut short). One process only: a multi-host run reads
its data through the data layer.
"""
import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import tempfile
from typing import Callable, Dict, Iterable, Iterator, Mapping, Optional

import numpy as np

from t5x_variants.features import check_batch_shapes
from t5x_variants.train import storage

META = 'data.json'


def local_root(root: str) -> str:
  """``root`` if it is a local directory (the batches are memory-mapped files), else ValueError."""
  if storage.scheme(root):
    raise ValueError(f'--batches_dir={root}: pre-built batches are read memory-mapped from local '
                     'files; give a local directory (copy them there from the bucket)')
  return root


def key(description: Mapping) -> str:
  """The directory name of the batches that ``description`` (JSON-able) decides."""
  text = json.dumps(description, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def description(train_cfg, eval_cfg, architecture: str, total_steps: int,
                eval_batches: Optional[int], init_checkpoint: Optional[str] = None) -> dict:
  """What decides a run's batches: its train/eval ``DatasetConfig`` (dataclasses), architecture,
  number of training batches, the most eval batches read per task and the initial checkpoint (a
  fine-tuning run tokenizes with its pretrained run's vocabulary). A ``vocabulary`` binding is
  not part of it: the reader cannot see the data layer's bindings."""
  return {'train': dataclasses.asdict(train_cfg),
          'eval': dataclasses.asdict(eval_cfg) if eval_cfg.mixture_or_task_name else None,
          'architecture': architecture, 'total_steps': total_steps, 'eval_batches': eval_batches,
          'init_checkpoint': init_checkpoint}


def _write_split(directory: str, batches: Iterable[Mapping[str, np.ndarray]],
                 count: Optional[int]) -> int:
  """The first ``count`` batches as one .npy per feature, written straight into memory-mapped
  files (training); ``count=None``: all of them, stacked at the end (an eval split). Returns how
  many were written."""
  arrays, n = {}, 0
  for n, batch in enumerate(itertools.islice(batches, count), 1):
    for name, value in batch.items():
      if name not in arrays:
        if count is None:  # an eval split: its length is known at the end
          arrays[name] = []
        else:
          arrays[name] = np.lib.format.open_memmap(os.path.join(directory, f'{name}.npy'), 'w+',
                                                   value.dtype, (count,) + value.shape)
      if count is None:
        arrays[name].append(value)
      else:
        arrays[name][n - 1] = value
  if count is not None and n < count:
    raise ValueError(f'the data ended after {n} of the {count} training batches the run needs; '
                     'let the training data repeat (num_epochs = None) or train fewer steps')
  for name, value in arrays.items():
    if count is None:
      np.save(os.path.join(directory, f'{name}.npy'), np.stack(value))
    else:
      value.flush()
  return n


def write(root: str, desc: Mapping, train: Callable[[], Iterator],
          evals: Callable[[], Mapping[str, Iterable]], files: Mapping[str, str],
          vocabulary_size: Optional[int], data_layer: Optional[Mapping] = None) -> str:
  """Writes the first ``desc['total_steps']`` batches of ``train()``, each of ``evals()``' tasks'
  batches (at most ``desc['eval_batches']``) and ``files`` ({name: path}, e.g. the vocabulary;
  with the data's number of token ids, which a reader's model must cover) under
  ``root/key(desc)``, through a temporary directory renamed at the end (a stopped write leaves
  nothing); returns the directory. Batches already there are kept (the data is not built) if
  they were written with the same ``data_layer`` bindings ({configurable: {parameter: value}})."""
  target = os.path.join(root, key(desc))
  # (a configurable with no binding is left out: one the data layer gained since is no change)
  bound = lambda layer: {k: v for k, v in layer.items() if v}
  data_layer = json.loads(json.dumps(bound(data_layer or {}), sort_keys=True, default=str))
  if os.path.exists(os.path.join(target, META)):
    with open(os.path.join(target, META)) as f:
      written = json.load(f).get('data_layer', data_layer)  # (not recorded before: not compared)
    if bound(written) != data_layer:
      raise ValueError(f'{target} holds this run\'s batches written with other data-layer bindings '
                       f'({written}; this run: {data_layer}), which the key cannot hold (a reader '
                       'cannot see them): use another --batches_dir')
    return target
  os.makedirs(root, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=root, prefix='.tmp-')
  try:
    os.makedirs(os.path.join(tmp, 'train'))
    _write_split(os.path.join(tmp, 'train'), train(), desc['total_steps'])
    counts = {}
    eval_sets = evals()
    for i, (name, batches) in enumerate(eval_sets.items()):
      os.makedirs(os.path.join(tmp, f'eval{i}'))
      counts[name] = _write_split(os.path.join(tmp, f'eval{i}'),
                                  itertools.islice(batches, desc['eval_batches']), None)
      if not counts[name]:
        raise ValueError(f'the evaluation data of {name} is empty (its split holds no whole '
                         'example at these lengths): evaluate on another task or split, or set '
                         'train.eval_period = 0')
    for name, path in files.items():
      shutil.copyfile(path, os.path.join(tmp, name))
    meta = dict(desc, eval_tasks=list(eval_sets), eval_counts=counts, files=sorted(files),
                vocabulary_size=vocabulary_size, data_layer=data_layer,
                features={split: _features(_load(os.path.join(tmp, split)))
                          for split in ['train', *(f'eval{i}' for i in range(len(eval_sets)))]})
    with open(os.path.join(tmp, META), 'w') as f:
      json.dump(meta, f, indent=1, sort_keys=True, default=str)
    os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would hide it from other users
    try:
      os.replace(tmp, target)
    except OSError:
      if not os.path.exists(os.path.join(target, META)):  # else another writer was first
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return target


def _load(directory: str) -> Dict[str, np.ndarray]:
  return {name[:-len('.npy')]: np.load(os.path.join(directory, name), mmap_mode='r')
          for name in sorted(os.listdir(directory)) if name.endswith('.npy')}


def _features(arrays: Mapping[str, np.ndarray]) -> Dict[str, list]:
  """{feature: [dtype, shape...]} of a split's arrays, as data.json records them."""
  return {name: [a.dtype.name, *a.shape] for name, a in arrays.items()}


def _damaged(directory: str, why: str) -> ValueError:
  root = os.path.dirname(os.path.normpath(directory))
  return ValueError(f'the pre-built batches in {root} are damaged ({why}): remove that directory and '
                    'write them again with the same t5xv-train command and --write_batches')


class PrebuiltBatches(Iterator[Dict[str, np.ndarray]]):
  """The training batches of a pre-built directory, in order; ``save``/``restore`` the position
  (a checkpoint holds it, as it holds a tf.data iterator's). ``features``: what data.json
  recorded of them (None: written before it did), which they must still be."""

  def __init__(self, directory: str, features: Optional[Mapping[str, list]] = None):
    try:
      self.arrays, self.position = _load(directory), 0
    except (OSError, ValueError) as e:  # a file cut short, or not an .npy
      raise _damaged(directory, f'{type(e).__name__}: {e}') from None
    found = _features(self.arrays)
    lengths = {a.shape[0] for a in self.arrays.values()}
    if features is not None and found != features:
      missing = sorted(set(features) - set(found))
      raise _damaged(directory, f'{os.path.basename(directory)}/{missing[0]}.npy is missing' if missing
                     else f'{os.path.basename(directory)} holds {found}, not the {features} written')
    if len(lengths) != 1:
      raise _damaged(directory, f'{os.path.basename(directory)} has features of different lengths')
    self.length = lengths.pop()

  def __next__(self) -> Dict[str, np.ndarray]:
    if self.position >= self.length:
      raise StopIteration
    self.position += 1
    return {name: np.asarray(a[self.position - 1]) for name, a in self.arrays.items()}

  def _shapes(self) -> Dict[str, list]:
    return {name: [a.dtype.name] + list(a.shape[1:]) for name, a in self.arrays.items()}

  def save(self, prefix: str) -> str:
    """Writes the position, and the batches' shapes that ``restore`` compares."""
    storage.write_text(f'{prefix}.json', json.dumps({'position': self.position,
                                                     'shapes': self._shapes()}))
    return f'{prefix}.json'

  def restore(self, prefix: str):
    """The saved position; a ValueError if the saved batches had other shapes."""
    saved = json.loads(storage.path(f'{prefix}.json').read_text())
    if 'shapes' in saved:  # written since the check exists
      check_batch_shapes(saved['shapes'], self._shapes())
    self.position = saved['position']


class Prebuilt:
  """A run's pre-built batches, found under ``root`` by the run's description."""

  def __init__(self, root: str, desc: Mapping):
    self.directory = os.path.join(root, key(desc))
    meta_path = os.path.join(self.directory, META)
    if not os.path.exists(meta_path):
      raise FileNotFoundError(
          f'no pre-built batches for this run\'s data in {root} (expected {self.directory}); '
          'write them on a host with the data layer (TensorFlow, seqio): the same t5xv-train '
          'command with --write_batches')
    try:
      with open(meta_path) as f:
        self.meta = dict(json.load(f))
    except (ValueError, TypeError) as e:  # cut short or edited
      raise _damaged(os.path.join(self.directory, 'train'),
                     f'{META}: {type(e).__name__}: {e}') from None

  def _split(self, split: str) -> PrebuiltBatches:
    return PrebuiltBatches(os.path.join(self.directory, split),
                           self.meta.get('features', {}).get(split))

  def train(self) -> PrebuiltBatches:
    return self._split('train')

  def evals(self) -> Dict[str, Iterable[Dict[str, np.ndarray]]]:
    """{task: its eval batches}, read anew at each call."""
    return {name: self._split(f'eval{i}') for i, name in enumerate(self.meta['eval_tasks'])}

  def files(self) -> Dict[str, str]:
    return {name: os.path.join(self.directory, name) for name in self.meta['files']}
