"""From a registered task or mixture to this host's numpy batches, resumably.

Feature conversion follows the architecture: encoder-decoder (seqio.EncDecFeatureConverter),
decoder-only (seqio.LMFeatureConverter), T5's prefix LM (seqio.PrefixLMFeatureConverter: the
inputs then the targets in one row, ``decoder_causal_attention`` marking the fully visible part,
the loss on the targets, or on the whole row with ``DatasetConfig.loss_on_targets_only=False``)
or encoder-only MLM (``MLMFeatureConverter``: the loss sits on every position BERT selected,
also the 10% replaced at random and the 10% kept); a
classification task (data/classification.py, encoder-only only) has its own
``ClassificationFeatureConverter``. With ``pack=True`` several examples share a row, told apart by
``*_segment_ids`` and ``*_positions`` (never for classification: the head reads a row's first token).

``BatchIterator`` saves and restores its exact position with tf.data iterator checkpointing, so
a resumed run sees the same batches as an uninterrupted one.
"""
import json
import os
from typing import Dict, Iterator, Mapping, Optional

import numpy as np
import seqio
import tensorflow as tf

from t5x_variants.data import classification, mlm, tasks
from t5x_variants.data.config import DatasetConfig, check_loss_on_targets_only
from t5x_variants.features import DATA_ARCHITECTURES, check_batch_shapes


class MLMFeatureConverter(seqio.FeatureConverter):
  """inputs/targets/mlm_weights -> encoder_input_tokens, encoder_target_tokens,
  encoder_loss_weights (+ encoder_segment_ids / encoder_positions when packed)."""
  TASK_FEATURES = {
      'inputs': seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
      'targets': seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
      'mlm_weights': seqio.FeatureConverter.FeatureSpec(dtype=tf.float32),
  }
  MODEL_FEATURES = {
      'encoder_input_tokens': seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
      'encoder_target_tokens': seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
      'encoder_loss_weights': seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
  }
  PACKING_FEATURE_DTYPES = {'encoder_segment_ids': tf.int32, 'encoder_positions': tf.int32}

  def _convert_features(self, ds, task_feature_lengths):
    # Packing measures a sequence by its nonzero entries, so weights travel as 1 + w, padded to
    # the inputs' length (EOS included), and come back as w after packing.
    def shift(ex):
      w = tf.cast(ex['mlm_weights'], tf.int32) + 1
      pad = tf.shape(ex['inputs'])[0] - tf.shape(w)[0]
      return dict(ex, mlm_weights=tf.concat([w, tf.ones([pad], tf.int32)], 0))
    ds = self._pack_or_pad(ds.map(shift, num_parallel_calls=tf.data.AUTOTUNE), task_feature_lengths)

    def convert(ex):
      out = {'encoder_input_tokens': ex['inputs'], 'encoder_target_tokens': ex['targets'],
             'encoder_loss_weights': tf.maximum(ex['mlm_weights'] - 1, 0)}
      if self.pack:
        out['encoder_segment_ids'] = ex['inputs_segment_ids']
        out['encoder_positions'] = ex['inputs_positions']
      return out
    return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)

  def get_model_feature_lengths(self, task_feature_lengths):
    n = task_feature_lengths['inputs']
    names = list(self.MODEL_FEATURES) + (list(self.PACKING_FEATURE_DTYPES) if self.pack else [])
    return {name: n for name in names}


class ClassificationFeatureConverter(seqio.FeatureConverter):
  """inputs/label -> encoder_input_tokens (cut or zero-padded to the inputs length),
  classification_labels (int32 class ids, or float32 for regression) and classification_weights
  (int32, 0 for an unlabelled (test) example, whose label becomes 0). One example per row: no
  packing."""
  PACKING_FEATURE_DTYPES = {}

  def __init__(self, regression: bool = False):
    label = seqio.FeatureConverter.FeatureSpec(dtype=tf.float32 if regression else tf.int32, rank=0)
    self.TASK_FEATURES = {'inputs': seqio.FeatureConverter.FeatureSpec(dtype=tf.int32), 'label': label}
    self.MODEL_FEATURES = {
        'encoder_input_tokens': seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
        'classification_labels': label,
        'classification_weights': seqio.FeatureConverter.FeatureSpec(dtype=tf.int32, rank=0)}
    super().__init__(pack=False)

  def _convert_features(self, ds, task_feature_lengths):
    n = task_feature_lengths['inputs']

    def convert(ex):
      tokens = ex['inputs'][:n]
      tokens = tf.pad(tokens, [[0, n - tf.shape(tokens)[0]]])
      tokens.set_shape([n])
      labelled = ex['label'] >= 0
      return {'encoder_input_tokens': tokens,
              'classification_labels': tf.where(labelled, ex['label'], tf.zeros_like(ex['label'])),
              'classification_weights': tf.cast(labelled, tf.int32)}
    return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)

  def get_model_feature_lengths(self, task_feature_lengths):
    return {'encoder_input_tokens': task_feature_lengths['inputs'], 'classification_labels': 1,
            'classification_weights': 1}


def feature_converter(architecture: str, pack: bool,
                      loss_on_targets_only: bool = True) -> seqio.FeatureConverter:
  """``architecture``: one of features.DATA_ARCHITECTURES (TransformerConfig.data_architecture);
  ``loss_on_targets_only=False``: a prefix LM's loss on its inputs too (``DatasetConfig``)."""
  if architecture not in DATA_ARCHITECTURES:
    raise ValueError(f'unknown architecture {architecture!r}; valid: {", ".join(DATA_ARCHITECTURES)}')
  check_loss_on_targets_only(loss_on_targets_only, architecture)
  if architecture == 'prefix_lm':
    return seqio.PrefixLMFeatureConverter(pack=pack, loss_on_targets_only=loss_on_targets_only)
  return {'encoder_decoder': seqio.EncDecFeatureConverter, 'decoder_only': seqio.LMFeatureConverter,
          'encoder_only': MLMFeatureConverter}[architecture](pack=pack)


def _check_lengths(name: str, lengths: Mapping[str, int], features):
  """A length for each of the task's ``features`` read (a misspelled key, 'input', failed as a
  KeyError inside a preprocessor)."""
  missing = [f for f in features if f not in lengths]
  if missing:
    raise ValueError(f'the feature lengths {dict(lengths)} give none for {", ".join(missing)} of '
                     f'{name} (it reads: {", ".join(features)}): set TASK_FEATURE_LENGTHS '
                     'accordingly')


def _is_mlm(task) -> bool:
  """Whether a task's examples are BERT's masked tokens (data/mlm.py), what MLMFeatureConverter
  reads."""
  return any(getattr(p, 'func', p) is mlm.mlm for p in task.preprocessors)


def get_dataset(name: str, task_feature_lengths: Mapping[str, int], architecture: str,
                split: str = 'train', shuffle: bool = True, seed: Optional[int] = 0,
                num_epochs: Optional[int] = None, pack: bool = True, shard_index: int = 0,
                num_shards: int = 1, loss_on_targets_only: bool = True) -> tf.data.Dataset:
  """Model-ready examples of this shard (host) of a task or mixture, deterministic given seed.
  A classification task is never packed and uses only the 'inputs' length."""
  task = tasks.get_task_or_mixture(name)
  num_labels = classification.num_labels(task)
  if num_labels is not None:
    if architecture != 'encoder_only':
      raise ValueError(f'{name} is a classification task, for encoder-only models; {architecture} '
                       'models fine-tune on the text-to-text tasks (the name without _cls)')
    _check_lengths(name, task_feature_lengths, ['inputs'])
    task_feature_lengths = {'inputs': task_feature_lengths['inputs'], 'label': 1}
    converter = ClassificationFeatureConverter(regression=num_labels == 1)
  else:
    if architecture == 'decoder_only' and 'inputs' in task.output_features:
      raise ValueError(f'{name} has inputs, which a decoder-only language model would never read '
                       '(it trains on targets alone): make it a prefix LM '
                       '(gin/architectures/prefix_lm.gin) or a causal LM of its inputs then '
                       'targets (gin/architectures/language_model.gin), train an encoder-decoder on '
                       'it, or '
                       'train the language model on a task of targets only (e.g. c4_lm, embedded_lm)')
    if architecture == 'prefix_lm' and 'inputs' not in task.output_features:
      raise ValueError(f'{name} has targets only; a prefix LM reads inputs, then targets: train it '
                       'on a task with inputs (e.g. c4_span_corruption, a GLUE task), or a plain '
                       'decoder-only model (gin/architectures/decoder_only.gin) on this one')
    if architecture == 'encoder_only' and not all(map(_is_mlm, getattr(task, 'tasks', [task]))):
      raise ValueError(f'{name} is not a masked-language-modelling task, the one an encoder-only '
                       'model trains on without a head (its preprocessors end in data.mlm.mlm: '
                       'c4_mlm, embedded_mlm); to fine-tune it on a GLUE task give it a '
                       'classification head and the task\'s _cls form (glue_rte_cls: '
                       'gin/runs/finetune_classification.gin), or train another architecture on '
                       'this one')
    _check_lengths(name, task_feature_lengths, list(task.output_features))
    if architecture == 'encoder_only':  # the MLM weights are as long as the inputs
      task_feature_lengths = dict(task_feature_lengths, mlm_weights=task_feature_lengths['inputs'])
    converter = feature_converter(architecture, pack, loss_on_targets_only)
  with tasks.explain_missing_data(task), tasks.without_autograph():
    tasks.check_split(task, split)
    return seqio.get_dataset(task, task_feature_lengths, converter,
                             dataset_split=split, shuffle=shuffle, num_epochs=num_epochs,
                             shard_info=seqio.ShardInfo(shard_index, num_shards), seed=seed,
                             verbose=False)


def eval_batches(name: str, task_feature_lengths: Mapping[str, int], architecture: str,
                 batch_size: int, split: str = 'validation',
                 loss_on_targets_only: bool = True) -> Iterator[Dict[str, np.ndarray]]:
  """Every example of a split, unpacked and in order, in global batches that every process reads
  whole (no example dropped or seen twice). The last batch is padded with zero rows (zero loss
  weight) to ``batch_size``, so one compiled step serves them all."""
  ds = get_dataset(name, task_feature_lengths, architecture, split, shuffle=False, num_epochs=1,
                   pack=False, loss_on_targets_only=loss_on_targets_only)
  for batch in ds.batch(batch_size).as_numpy_iterator():
    n = len(next(iter(batch.values())))
    yield {k: np.concatenate([v, np.zeros((batch_size - n,) + v.shape[1:], v.dtype)])
           for k, v in batch.items()}


class BatchIterator(Iterator[Dict[str, np.ndarray]]):
  """Numpy batches of one host's share of the global batch; ``save``/``restore`` its position."""

  def __init__(self, dataset: tf.data.Dataset, global_batch_size: int, num_hosts: int = 1):
    if global_batch_size % num_hosts:
      raise ValueError(f'global batch size {global_batch_size} is not divisible by the '
                       f'{num_hosts} hosts')
    self.batch_size = global_batch_size // num_hosts
    # Prefetching prepares the next batches during the step; a checkpoint holds the prefetched ones.
    self._iterator = iter(dataset.batch(self.batch_size, drop_remainder=True).prefetch(2))
    self._checkpoint = tf.train.Checkpoint(iterator=self._iterator)

  def __next__(self) -> Dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in next(self._iterator).items()}

  def _shapes(self) -> Dict[str, list]:
    return {k: [v.dtype.name] + v.shape.as_list() for k, v in self._iterator.element_spec.items()}

  def save(self, prefix: str) -> str:
    """Writes the iterator position under ``prefix`` (a path stem), and beside it the batches'
    shapes (``restore`` compares them); returns the position's path."""
    with open(f'{prefix}.batches.json', 'w') as f:
      json.dump(self._shapes(), f)
    return self._checkpoint.write(prefix)

  def restore(self, prefix: str):
    """The position saved under ``prefix``; a ValueError, before anything is read, if the saved
    batches had other shapes (another batch size or feature lengths: tf.data would fail only at
    the first batch)."""
    if os.path.exists(f'{prefix}.batches.json'):  # written since the check exists
      with open(f'{prefix}.batches.json') as f:
        saved = json.load(f)
      check_batch_shapes(saved, self._shapes())
    self._checkpoint.read(prefix).assert_consumed()


def batches(name: str, task_feature_lengths: Mapping[str, int], architecture: str,
            global_batch_size: int, split: str = 'train', shuffle: bool = True, seed: int = 0,
            num_epochs: Optional[int] = None, pack: bool = True, host_index: int = 0,
            num_hosts: int = 1, loss_on_targets_only: bool = True) -> BatchIterator:
  """The iterator a trainer consumes: this host's batches of ``name``."""
  ds = get_dataset(name, task_feature_lengths, architecture, split, shuffle, seed, num_epochs, pack,
                   host_index, num_hosts, loss_on_targets_only)
  return BatchIterator(ds, global_batch_size, num_hosts)


def config_batches(config: DatasetConfig, architecture: str, host_index: int = 0,
                   num_hosts: int = 1) -> BatchIterator:
  """``batches`` of a DatasetConfig."""
  if not config.mixture_or_task_name or not config.task_feature_lengths:
    raise ValueError('DatasetConfig needs mixture_or_task_name and task_feature_lengths (gin: '
                     'MIXTURE_OR_TASK_NAME and TASK_FEATURE_LENGTHS)')
  return batches(config.mixture_or_task_name, config.task_feature_lengths, architecture,
                 config.batch_size, config.split, config.shuffle, config.seed, config.num_epochs,
                 config.pack, host_index, num_hosts, config.loss_on_targets_only)
