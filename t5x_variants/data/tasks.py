"""Registered seqio tasks: {c4, local, embedded} x {span_corruption, prefix_lm, lm, mlm},
GLUE/SuperGLUE, SQuAD.

Names: ``c4_span_corruption`` (T5 pretraining), ``c4_prefix_lm`` (T5's LM objective for
text-to-text models), ``c4_lm`` (decoder-only), ``c4_mlm`` (encoder-only), the same four for
``local_`` (files bound by ``local_corpus_files.pattern``) and
``embedded_`` (the embedded default corpus), plus the tasks and mixtures of data/glue.py,
data/classification.py and data/squad.py. ``register_tasks()`` registers them all with the
gin-bound vocabulary, and again when another one is bound (in one process: t5xv-quickstart's
steps, a notebook); tasks or mixtures registered outside it keep the vocabulary they were made
with.
"""
import contextlib
import functools
import inspect
import os
from typing import List, Mapping, Optional

import gin
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds
from tensorflow.python.autograph.core import config as autograph_config  # pylint: disable=g-direct-tensorflow-import

from t5x_variants.data import corpus, mlm, span_corruption, vocab

C4_TFDS_NAME = 'c4/en:3.1.0'
SOURCES = ('c4', 'local', 'embedded')
OBJECTIVES = ('span_corruption', 'prefix_lm', 'lm', 'mlm')


class DataNotFoundError(FileNotFoundError):
  """A TFDS dataset that is not prepared locally, with how to prepare it and the alternatives."""


def _text_source(files_fn) -> seqio.DataSource:
  """Documents of local files, read into memory at dataset time (so the tf.data iterator can be
  checkpointed); for corpora of many GB prepare a TFDS dataset instead. Shuffled, they come in a
  new order each epoch (seqio repeats the source), before they are concatenated into chunks: a
  permutation drawn from a seed that ``seed`` draws anew at each repetition, so the iterator's
  state holds that seed and a position, not a shuffle buffer."""
  def dataset_fn(split, shuffle_files, seed=None):
    docs = list(corpus.read_documents(files_fn(), split))
    if not docs:
      raise corpus.CorpusError(f'the {split} split of {files_fn()} holds no documents')
    texts = tf.constant(docs)
    if not shuffle_files:
      return tf.data.Dataset.from_tensor_slices({'text': texts})
    permutation = lambda s: tf.data.Dataset.from_tensor_slices(
        tf.random.experimental.stateless_shuffle(tf.range(len(docs)), seed=tf.stack([s, 0])))
    epoch_seed = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).take(1)
    return epoch_seed.flat_map(permutation).map(lambda i: {'text': tf.gather(texts, i)})
  return seqio.FunctionDataSource(dataset_fn, splits=corpus.SPLITS)


def _source(name: str) -> seqio.DataSource:
  if name == 'c4':
    return seqio.TfdsDataSource(C4_TFDS_NAME, read_only=True)
  if name == 'local':
    return _text_source(corpus.local_corpus_files)
  return _text_source(lambda: [corpus.embedded_corpus_file()])


def lm(dataset, sequence_length, output_features):
  """Causal LM as T5's ``full_lm``: EOS after each document, the documents joined into one token
  stream and cut into chunks of targets_length, so EOS marks where a document ends, never where
  a chunk was cut."""
  if sequence_length['targets'] < 2:
    raise ValueError(f"targets length {sequence_length['targets']} leaves no room for a row: one "
                     'needs 2 tokens (a token and the next, to predict)')
  eos = output_features['targets'].vocabulary.eos_id
  with_eos = dataset.map(lambda ex: dict(ex, targets=tf.concat([ex['targets'], [eos]], 0)),
                         num_parallel_calls=tf.data.AUTOTUNE)
  return span_corruption.split_tokens(with_eos, sequence_length['targets'])


def prefix_lm(dataset, sequence_length):
  """T5's LM objective for a model with inputs (Raffel et al. 2020, Sec. 3.2.3): a chunk of the
  document token stream cut at a random point, the inputs its first n tokens, the targets the rest.

  Chunks of L = inputs_length - 1 tokens (room for EOS), n uniform in [1, L - 1] (T5's
  ``random_prefix_noise_mask`` at noise density 0.5), so the targets take at most L - 1 tokens
  and EOS. T5 cuts each document on its own (short documents make short rows); here, as for span
  corruption, the documents are joined first, so every example holds L tokens.
  """
  length = sequence_length['inputs'] - 1
  if length < 2:
    raise ValueError(f"inputs length {sequence_length['inputs']} leaves no room to split a chunk "
                     'into inputs and targets (it needs 3: two tokens and EOS)')
  if sequence_length.get('targets', length) < length:
    raise ValueError(f"the prefix LM objective of {sequence_length['inputs']} inputs makes targets of "
                     f"up to {length} tokens (EOS included), but the targets length is "
                     f"{sequence_length['targets']}; set it to {length} or more")

  @seqio.map_over_dataset(num_seeds=1)
  def split(features, seed):
    tokens = features['targets']
    n = tf.random.stateless_uniform([], seed, minval=1, maxval=length, dtype=tf.int32)
    return {'inputs': tokens[:n], 'targets': tokens[n:]}

  return split(span_corruption.split_tokens(dataset, length))


def _task(name: str, source: str, objective: str, vocabulary: seqio.Vocabulary) -> seqio.Task:
  """text -> 'targets' tokens -> the objective -> EOS appended (after trimming to length; the
  causal LM's chunks have theirs where documents end)."""
  objective_fn = {'span_corruption': span_corruption.span_corruption, 'prefix_lm': prefix_lm,
                  'lm': lm, 'mlm': mlm.mlm}[objective]
  keys = ('targets',) if objective == 'lm' else ('inputs', 'targets')
  return seqio.Task(
      name, _source(source),
      output_features={k: seqio.Feature(vocabulary, add_eos=objective != 'lm') for k in keys},
      preprocessors=[functools.partial(seqio.preprocessors.rekey, key_map={'targets': 'text'}),
                     seqio.preprocessors.tokenize, objective_fn,
                     seqio.preprocessors.append_eos_after_trim],
      metric_fns=[])


# What register_tasks registered, and with which vocabulary (``_vocabulary_key``).
_registered = {'vocabulary': None, 'names': []}


def _vocabulary_key(vocabulary: seqio.Vocabulary) -> tuple:
  """A vocabulary's identity without reading its model (T5's may be out of reach)."""
  return (type(vocabulary).__name__, getattr(vocabulary, 'sentencepiece_model_file', None),
          getattr(vocabulary, 'extra_ids', None))


def _unregister_if_other(vocabulary: seqio.Vocabulary):
  """Removes what register_tasks registered with another vocabulary than ``vocabulary`` (in one
  process, a command after another that bound another one: its tasks kept the first one's)."""
  key = _vocabulary_key(vocabulary)
  if _registered['vocabulary'] not in (None, key):
    for name in _registered['names']:
      for registry in (seqio.MixtureRegistry, seqio.TaskRegistry):
        if name in registry.names():
          registry.remove(name)
    _registered['names'] = []
  _registered['vocabulary'] = key


@gin.configurable
def register_tasks(*, squad_dir: Optional[str] = None) -> List[str]:
  """Registers every task and mixture with the gin-bound vocabulary, again if they were registered
  with another (idempotent otherwise); returns the names registered by this call. The vocabulary
  is gin's alone: one passed here was replaced by gin's at the next task lookup, which registers
  again. ``squad_dir``: the original SQuAD files (default: env SQUAD_DIR)."""
  from t5x_variants.data import classification, glue, squad  # pylint: disable=g-import-not-at-top
  vocabulary = vocab.vocabulary()
  _unregister_if_other(vocabulary)
  names = lambda: set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names())
  before = names()
  try:
    for source in SOURCES:
      for objective in OBJECTIVES:
        name = f'{source}_{objective}'
        if name not in seqio.TaskRegistry.names():
          seqio.TaskRegistry.add_provider(name, _task(name, source, objective, vocabulary))
    features = {k: seqio.Feature(vocabulary, add_eos=True) for k in ('inputs', 'targets')}
    glue.register_glue_tasks(features)
    classification.register_classification_tasks(vocabulary)  # glue_<t>_cls (encoder-only)
    squad.register_squad_tasks(features, squad_dir=squad_dir)
  finally:  # (also what a call that failed part-way registered: replaced at the next switch)
    added = sorted(names() - before)
    _registered['names'] += added
  return added


def get_task_or_mixture(name: str):
  """The registered task or mixture ``name``, or one error listing the registered names."""
  register_tasks()
  known = sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))
  if name in known:
    return seqio.get_mixture_or_task(name)
  if '_local' in name:  # registered only where the files are said to be
    raise ValueError(f'unknown task or mixture {name!r}: a task of local files is registered when '
                     'the directory of its benchmark is set: GLUE_DIR, SUPER_GLUE_DIR, SQUAD_DIR '
                     '(all three for the mixture of the three), in the environment')
  raise ValueError(f'unknown task or mixture {name!r}; registered: {", ".join(known)}')


def _tfds_sources(task_or_mixture):
  tasks = getattr(task_or_mixture, 'tasks', [task_or_mixture])
  return [t.source for t in tasks if isinstance(t.source, seqio.TfdsDataSource)]


@contextlib.contextmanager
def explain_missing_data(task_or_mixture):
  """Turns a failure to read an unprepared TFDS dataset into one DataNotFoundError."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    missing = [s.tfds_dataset.name for s in _tfds_sources(task_or_mixture)
               if not tfds.builder(s.tfds_dataset.name, data_dir=s.tfds_dataset.data_dir).is_prepared()]
    if not missing:
      raise
    data_dir = os.environ.get('TFDS_DATA_DIR', '~/tensorflow_datasets')
    raise DataNotFoundError(
        f'TFDS dataset(s) {", ".join(missing)} not prepared in {data_dir} '
        '(set TFDS_DATA_DIR to where they are, e.g. a gs:// bucket on TPU). Prepare them with '
        '`tfds build <name> --data_dir=...` (C4 needs `tfds build c4/en` with Apache Beam, or a copy '
        'of a prepared c4/en:3.1.0). Offline alternatives: the embedded_* tasks (no download) or '
        'local_* tasks over your own files (local_corpus_files.pattern), and *_local GLUE/SuperGLUE/SQuAD '
        'tasks from the original distribution files (GLUE_DIR / SUPER_GLUE_DIR / SQUAD_DIR).') from e


def check_split(task_or_mixture, split: str):
  """One ValueError when no task of ``task_or_mixture`` has ``split`` (a local task's read failed
  with a bare KeyError; a mixture skips the tasks without it)."""
  try:
    splits = {s for t in getattr(task_or_mixture, 'tasks', [task_or_mixture]) for s in t.splits}
  except ValueError:  # a TFDS dataset whose splits are not known here: its read says what is missing
    return
  if not {part.split('[')[0] for part in split.split('+')} <= splits:  # (TFDS: 'train[:1%]+test')
    raise ValueError(f"{task_or_mixture.name} has no '{split}' split (its splits: "
                     f"{', '.join(sorted(splits))}): read one of those (train/DatasetConfig.split, "
                     'train_eval/DatasetConfig.split, EVAL_SPLIT, INFER_SPLIT), or another task')


@contextlib.contextmanager
def without_autograph():
  """Traces the tf.data map functions built inside as written, without autograph's source
  rewrite (about 0.1 s per function: 3-4 s of a tiny training process's start). The preprocessors
  here and seqio's are TensorFlow ops throughout but for seqio.utils' packing, which loops over
  a tensor and keeps autograph. TensorFlow's module rules (a private API) are restored after;
  TensorFlow remembers the functions it has already let through."""
  rules = autograph_config.CONVERSION_RULES
  autograph_config.CONVERSION_RULES = (
      autograph_config.Convert('seqio.utils'), autograph_config.DoNotConvert('seqio'),
      autograph_config.DoNotConvert('t5x_variants'),
      autograph_config.DoNotConvert('tensorflow_text')) + rules
  try:
    yield
  finally:
    autograph_config.CONVERSION_RULES = rules


def task_examples(task, split: str, lengths: Optional[Mapping[str, int]],
                  max_examples: Optional[int] = None, seed: int = 0) -> List[dict]:
  """A seqio task's preprocessed examples in order (tokens trimmed to ``lengths``; None: whole),
  as numpy; a random preprocessor (span corruption) seeded with ``seed``, so every call (and
  process) gets the same examples."""
  with explain_missing_data(task), without_autograph():
    check_split(task, split)
    ds = task.get_dataset(lengths, split=split, shuffle=False, seed=seed, num_epochs=1)
    if max_examples:
      ds = ds.take(max_examples)
    return list(ds.as_numpy_iterator())


def whole_lengths(task, split: str, max_examples: Optional[int] = None) -> dict:
  """{feature: the longest example of ``split`` (of its first ``max_examples``; None: all) in tokens,
  EOS included}: the lengths at which every example read is evaluated whole, as seqio's Evaluator
  measures them when it is given none (there over all of a mixture's tasks at once, here per
  task). ValueError for a task whose preprocessors
  cannot run without lengths (span corruption, the LM objectives: they cut the text to them)."""
  def needs_lengths(preprocessor):  # a sequence_length parameter without a default
    param = inspect.signature(preprocessor).parameters.get('sequence_length')
    return param is not None and param.default is param.empty
  needs = [getattr(p, 'func', p).__name__ for p in task.preprocessors if needs_lengths(p)]
  if needs:
    raise ValueError(f'{task.name} cannot be evaluated on whole examples: its preprocessor '
                     f'{needs[0]} cuts the text to the feature lengths; evaluate it at given '
                     "lengths (t5xv-eval's EVAL_FEATURE_LENGTHS: the run's TASK_FEATURE_LENGTHS "
                     'unless set)')
  longest = dict.fromkeys(task.output_features, 0)
  for example in task_examples(task, split, None, max_examples):
    for feature in longest:
      longest[feature] = max(longest[feature], len(example[feature]))
  if not all(longest.values()):
    raise ValueError(f'the {split} split of {task.name} has no example to measure')
  return longest


def output_vocabulary(task_or_mixture) -> seqio.Vocabulary:
  """The vocabulary of what the model writes: the targets', or the inputs' for a classification
  task (inputs only)."""
  features = task_or_mixture.output_features
  return features['targets' if 'targets' in features else 'inputs'].vocabulary


def text(x) -> str:
  """A pretokenized feature (bytes from tf.data) as str."""
  return x.decode() if isinstance(x, bytes) else str(x)
