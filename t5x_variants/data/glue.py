"""GLUE and SuperGLUE as T5's text-to-text seqio tasks (Raffel et al. 2020, Appendix D).

``register_glue_tasks`` registers, for every task <t>:
- ``glue_<t>`` / ``super_glue_<t>``: TFDS ``glue/<t>:2.*.*`` / ``super_glue/<t>:1.0.*``;
- ``glue_<t>_local`` / ``super_glue_<t>_local``: the original distribution files under
  ``glue_dir`` / ``super_glue_dir`` (default: env GLUE_DIR / SUPER_GLUE_DIR), only when given;
- mixtures ``glue_proportional``, ``super_glue_proportional`` (and ``*_local``): examples-proportional
  with T5's cap K = 2**19, without WNLI and the diagnostic sets (``UNMIXED``).
The diagnostic sets (GLUE's ``ax``, SuperGLUE's ``axb`` and ``axg``) have a test split only.
Both sources yield TFDS's raw features, so one preprocessor serves both. Inputs are
'<task> <field>: <text> ...', targets the label's name (STS-B: the score rounded to 0.2).
"""
import csv
import dataclasses
import functools
import os
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import seqio
import tensorflow as tf

from t5x_variants.data import metrics
from t5x_variants.data import super_glue as sg

NO_LABEL = sg.NO_LABEL
MIXING_MAXIMUM = 2 ** 19
GLUE_HINT = 'get the GLUE data from https://gluebenchmark.com/tasks and pass glue_dir (or set GLUE_DIR)'
SUPER_GLUE_HINT = ('get the SuperGLUE data from https://super.gluebenchmark.com/tasks and pass '
                   'super_glue_dir (or set SUPER_GLUE_DIR)')
_COLA_COLUMNS = ('source', 'label', 'original_label', 'sentence')  # CoLA train/dev have no header


@seqio.map_over_dataset
def text_to_text(ex, prefix: str, fields: Sequence[str], label_names: Optional[Sequence[str]] = None):
  """'<prefix> <field>: <text> ...' -> the label's name, or with no label_names (STS-B) the score
  rounded to the nearest 0.2 ('3.8'). Unlabelled (test) examples get NO_LABEL."""
  inputs = tf.strings.join([prefix] + [s for f in fields for s in (f + ':', ex[f])], separator=' ')
  label = ex['label']
  if label_names:
    name = tf.gather(tf.constant(label_names), tf.maximum(label, 0))
  else:
    name = tf.strings.as_string(tf.round(label * 5) / 5, precision=1)
  targets = tf.where(label < 0, NO_LABEL, name)
  return {'inputs': inputs, 'targets': targets, 'idx': ex['idx'], 'label': label}


def label_postprocess(output: str, label_names: Sequence[str], example=None, is_target: bool = False) -> int:
  """A label name -> its class id; anything else -> -1."""
  del example, is_target
  return label_names.index(output) if output in label_names else -1


def float_postprocess(output: str, example=None, is_target: bool = False) -> float:
  """'3.8' -> 3.8; not a number -> -1."""
  del example, is_target
  try:
    return float(output)
  except ValueError:
    return -1.0


def _tsv_reader(columns: Mapping[str, str], label_column: str, label_names: Optional[Sequence[str]],
                fixed_header: Optional[Sequence[str]] = None):
  """Reader of a GLUE TSV: ``columns`` maps raw feature -> column; ``fixed_header`` names the
  columns of headerless train/dev files. idx is the row number, as in TFDS."""
  def read(path, split):
    with open(path, encoding='utf-8-sig', newline='') as f:
      rows = csv.reader(f, delimiter='\t', quoting=csv.QUOTE_NONE)
      header = fixed_header if fixed_header and not split.startswith('test') else next(rows)
      for n, row in enumerate(rows):
        record = dict(zip(header, row))
        ex = {feature: record.get(column) for feature, column in columns.items()}
        label = record.get(label_column)
        if None in ex.values() or (label_column in header and not label):  # a short, corrupt row
          continue
        if label is None:  # test files have no label column
          ex['label'] = -1
        elif label_names is None:
          ex['label'] = float(label)
        else:
          ex['label'] = label_names.index(label) if label in label_names else int(label)
        ex['idx'] = n
        yield ex
  return read


def _signature(strings: Sequence[str], label=tf.int64, ints: Sequence[str] = (), idx=None) -> Dict[str, Any]:
  """Raw features as TFDS yields them: text scalars, int32 idx (or a dict of them), int64 class ids."""
  sig = {k: tf.TensorSpec([], tf.string) for k in strings}
  sig.update({k: tf.TensorSpec([], tf.int32) for k in ints})
  sig['idx'] = {k: tf.TensorSpec([], tf.int32) for k in idx} if idx else tf.TensorSpec([], tf.int32)
  if label is not None:
    sig['label'] = tf.TensorSpec([], label)
  return sig


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """One task: its sources, its text-to-text preprocessors, postprocessor and metrics."""
  tfds_name: str
  preprocessors: Tuple[Callable, ...]
  postprocess_fn: Callable
  metric_fns: Tuple[Callable, ...]
  signature: Dict[str, Any]
  folder: str
  read: Callable[[str, str], Iterator[dict]]
  files: Mapping[str, str]
  tfds_splits: Optional[Mapping[str, str]] = None
  # The training examples a raw train row (a tf.data element) makes: 0 drops it (WSC's wrong
  # referents), ReCoRD's rows make one per gold answer; None: one each. A source's
  # num_input_examples('train') counts these, for the mixing rate (other splits count rows).
  train_examples: Optional[Callable] = None


_GLUE_FILES = {'train': 'train.tsv', 'validation': 'dev.tsv', 'test': 'test.tsv'}
_MNLI_FILES = {'train': 'train.tsv', 'validation': 'dev_matched.tsv', 'validation_matched': 'dev_matched.tsv',
               'validation_mismatched': 'dev_mismatched.tsv', 'test_matched': 'test_matched.tsv',
               'test_mismatched': 'test_mismatched.tsv'}
_SUPER_GLUE_FILES = {'train': 'train.jsonl', 'validation': 'val.jsonl', 'test': 'test.jsonl'}
_ACC = (metrics.accuracy,)
_F1_ACC = (metrics.f1, metrics.accuracy)


def _glue(name, fields, label_names, metric_fns, folder, columns=None, label_column='label', *,
          fixed_header=None, files=_GLUE_FILES, tfds_splits=None, tfds=None) -> TaskSpec:
  """A GLUE task (TFDS ``glue/<tfds or name>``, its inputs prefixed ``name``); ``columns`` maps
  raw feature -> TSV column where the names differ."""
  return TaskSpec(
      tfds_name=f'glue/{tfds or name}:2.*.*',
      preprocessors=(functools.partial(text_to_text, prefix=name, fields=fields, label_names=label_names),),
      postprocess_fn=(functools.partial(label_postprocess, label_names=label_names) if label_names
                      else float_postprocess),
      metric_fns=metric_fns, signature=_signature(fields, tf.int64 if label_names else tf.float32),
      folder=folder, read=_tsv_reader(columns or {f: f for f in fields}, label_column, label_names, fixed_header),
      files=files, tfds_splits=tfds_splits)


GLUE_TASKS = {
    'cola': _glue('cola', ('sentence',), ('unacceptable', 'acceptable'), (metrics.matthews_corrcoef,), 'CoLA',
                  fixed_header=_COLA_COLUMNS),
    'sst2': _glue('sst2', ('sentence',), ('negative', 'positive'), _ACC, 'SST-2'),
    'mrpc': _glue('mrpc', ('sentence1', 'sentence2'), ('not_equivalent', 'equivalent'), _F1_ACC, 'MRPC',
                  {'sentence1': '#1 String', 'sentence2': '#2 String'}, 'Quality'),
    'qqp': _glue('qqp', ('question1', 'question2'), ('not_duplicate', 'duplicate'), _F1_ACC, 'QQP',
                 label_column='is_duplicate'),
    'stsb': _glue('stsb', ('sentence1', 'sentence2'), None, (metrics.pearson_corrcoef, metrics.spearman_corrcoef),
                  'STS-B', label_column='score'),
    'mnli': _glue('mnli', ('hypothesis', 'premise'), ('entailment', 'neutral', 'contradiction'), _ACC, 'MNLI',
                  {'hypothesis': 'sentence2', 'premise': 'sentence1'}, 'gold_label', files=_MNLI_FILES,
                  tfds_splits={**{s: s for s in _MNLI_FILES}, 'validation': 'validation_matched'}),
    # MNLI's mismatched validation set as a task of its own (T5's glue_mnli_mismatched): evaluated
    # in the mixtures, never trained on (no train split).
    'mnli_mismatched': _glue('mnli', ('hypothesis', 'premise'), ('entailment', 'neutral', 'contradiction'),
                             _ACC, 'MNLI', {'hypothesis': 'sentence2', 'premise': 'sentence1'}, 'gold_label',
                             files={'validation': 'dev_mismatched.tsv', 'test': 'test_mismatched.tsv'},
                             tfds_splits={'validation': 'validation_mismatched', 'test': 'test_mismatched'}),
    'qnli': _glue('qnli', ('question', 'sentence'), ('entailment', 'not_entailment'), _ACC, 'QNLI'),
    'rte': _glue('rte', ('sentence1', 'sentence2'), ('entailment', 'not_entailment'), _ACC, 'RTE'),
    'wnli': _glue('wnli', ('sentence1', 'sentence2'), ('not_entailment', 'entailment'), _ACC, 'WNLI'),
    # The diagnostic set (a test split, unlabelled), cast as MNLI as T5's glue_ax_v002: for the
    # leaderboard's predictions of an MNLI model; the file is the one GLUE's download script writes.
    'ax': _glue('mnli', ('hypothesis', 'premise'), ('entailment', 'neutral', 'contradiction'), (),
                'diagnostic', {'hypothesis': 'sentence2', 'premise': 'sentence1'},
                files={'test': 'diagnostic.tsv'}, tfds='ax'),
}


def _super_glue(name, fields, label_names, metric_fns, folder, ints=(), *, read=None,
                preprocessors=(), postprocess_fn=None, idx=None) -> TaskSpec:
  """A SuperGLUE classification task; ``preprocessors`` run before the text-to-text step."""
  return TaskSpec(
      tfds_name=f'super_glue/{name}:1.0.*',
      preprocessors=(*preprocessors,
                     functools.partial(text_to_text, prefix=name, fields=fields, label_names=label_names)),
      postprocess_fn=postprocess_fn or functools.partial(label_postprocess, label_names=label_names),
      metric_fns=metric_fns, signature=_signature(fields, ints=ints, idx=idx), folder=folder,
      read=read or sg.flat_reader(fields + ints, label_names), files=_SUPER_GLUE_FILES)


def _rte_diagnostic(name: str, folder: str, premise: str, hypothesis: str, metric_fns) -> TaskSpec:
  """A SuperGLUE diagnostic set (a test split) cast as RTE, as T5's super_glue_<name>_v102: its
  ``premise`` and ``hypothesis`` fields read 'rte hypothesis: ... premise: ...'. T5 gives it no
  metric; its metrics here score it where its labels are present (the original files have them)."""
  rte = ('entailment', 'not_entailment')
  rekey = {'premise': premise, 'hypothesis': hypothesis, 'label': 'label', 'idx': 'idx'}
  return TaskSpec(
      tfds_name=f'super_glue/{name}:1.0.*',
      preprocessors=(functools.partial(seqio.preprocessors.rekey, key_map=rekey),
                     functools.partial(text_to_text, prefix='rte', fields=('hypothesis', 'premise'),
                                       label_names=rte)),
      postprocess_fn=functools.partial(label_postprocess, label_names=rte), metric_fns=metric_fns,
      signature=_signature((premise, hypothesis)), folder=folder,
      read=sg.flat_reader((premise, hypothesis), rte), files={'test': f'{folder}.jsonl'})


_BOOL = ('False', 'True')
SUPER_GLUE_TASKS = {
    'boolq': _super_glue('boolq', ('passage', 'question'), _BOOL, _ACC, 'BoolQ'),
    'cb': _super_glue('cb', ('hypothesis', 'premise'), ('entailment', 'contradiction', 'neutral'),
                      (functools.partial(metrics.mean_multiclass_f1, num_classes=3), metrics.accuracy), 'CB'),
    'copa': _super_glue('copa', ('choice1', 'choice2', 'premise', 'question'), ('choice1', 'choice2'), _ACC,
                        'COPA'),
    'multirc': _super_glue('multirc', ('question', 'answer', 'paragraph'), _BOOL,
                           (metrics.multirc_f1a, metrics.multirc_exact_match), 'MultiRC', read=sg.read_multirc,
                           preprocessors=(sg.multirc_markup,), postprocess_fn=sg.multirc_postprocess,
                           idx=('paragraph', 'question', 'answer')),
    'record': TaskSpec(
        tfds_name='super_glue/record:1.0.*', preprocessors=(sg.record,), postprocess_fn=sg.record_postprocess,
        metric_fns=(metrics.record_em_f1,), folder='ReCoRD', read=sg.read_record,
        files=_SUPER_GLUE_FILES, train_examples=sg.record_examples,
        signature={**_signature(('passage', 'query'), label=None, idx=('passage', 'query')),
                   'entities': tf.TensorSpec([None], tf.string), 'answers': tf.TensorSpec([None], tf.string)}),
    'rte': _super_glue('rte', ('hypothesis', 'premise'), ('entailment', 'not_entailment'), _ACC, 'RTE'),
    'wic': _super_glue('wic', ('sentence1', 'sentence2', 'word'), _BOOL, _ACC, 'WiC',
                       ints=('start1', 'start2', 'end1', 'end2')),
    'wsc': TaskSpec(
        tfds_name='super_glue/wsc.fixed:1.0.*', preprocessors=(sg.wsc,), postprocess_fn=sg.wsc_postprocess,
        metric_fns=_ACC, folder='WSC', files=_SUPER_GLUE_FILES, train_examples=sg.wsc_correct_referent,
        signature=_signature(('text', 'span1_text', 'span2_text'), ints=('span1_index', 'span2_index')),
        read=sg.flat_reader(('text', 'span1_index', 'span2_index', 'span1_text', 'span2_text'))),
    # The broad-coverage (AX-b: Matthews correlation, the leaderboard's) and Winogender (AX-g:
    # accuracy; the leaderboard's gender parity needs its pairs, not read here) diagnostics.
    'axb': _rte_diagnostic('axb', 'AX-b', 'sentence1', 'sentence2', (metrics.matthews_corrcoef,)),
    'axg': _rte_diagnostic('axg', 'AX-g', 'premise', 'hypothesis', _ACC),
}

# T5's GLUE mixture leaves WNLI out (T5 trained on WSC instead; Raffel et al. 2020, 2.3); glue_wnli
# stays a task of its own, as do the diagnostic sets, which have a test split only (T5's mixtures
# hold them at rate 0, for decoding the leaderboard's test splits).
UNMIXED = ('glue_wnli', 'glue_ax', 'super_glue_axb', 'super_glue_axg')
# In the mixtures at rate 0: evaluated with them, never trained on (as T5's GLUE mixture).
EVAL_ONLY = ('glue_mnli_mismatched',)


def _filter_train(ds, split: str, train_examples: Optional[Callable]):
  """The train split without its rows that make no example."""
  return ds.filter(lambda ex: train_examples(ex) > 0) if train_examples and split == 'train' else ds


def _train_count(ds, train_examples: Callable) -> int:
  """The training examples the rows of ``ds`` make (read once)."""
  return int(ds.reduce(tf.constant(0, tf.int64), lambda n, ex: n + tf.cast(train_examples(ex), tf.int64)))


class _CountedTfdsSource(seqio.TfdsDataSource):
  """A TFDS source whose train split counts ``train_examples`` of each row (read once) and keeps
  only the rows that make one."""

  def __init__(self, train_examples: Callable, **kwargs):
    self._train_examples = train_examples
    self._train_count = None
    super().__init__(**kwargs)

  def get_dataset(self, split='train', *args, **kwargs):
    return _filter_train(super().get_dataset(split, *args, **kwargs), split, self._train_examples)

  def num_input_examples(self, split: str) -> int:
    if split != 'train':
      return super().num_input_examples(split)
    if self._train_count is None:
      self._train_count = _train_count(self.get_dataset('train', shuffle=False), self._train_examples)
    return self._train_count


def _columns(examples: List[dict], signature) -> Dict[str, Any]:
  """Examples (dicts matching ``signature``) as one tensor per feature; lists become ragged."""
  if isinstance(signature, dict):
    return {k: _columns([ex[k] for ex in examples], spec) for k, spec in signature.items()}
  if signature.shape.rank == 0:
    return tf.constant(examples, signature.dtype, shape=[len(examples)])
  return tf.ragged.constant(examples, signature.dtype, ragged_rank=1)


class _LocalSource(seqio.FunctionDataSource):
  """A task's original distribution files, read by a python generator into TFDS's raw features."""

  def __init__(self, spec: TaskSpec, root: str, hint: str):
    self._spec, self._root, self._hint = spec, root, hint
    self._counts = {}
    super().__init__(self._dataset, splits=tuple(spec.files))

  def _path(self, split: str) -> str:
    path = os.path.join(self._root, self._spec.folder, self._spec.files[split])
    if not os.path.isfile(path):
      raise FileNotFoundError(f'{path} does not exist: {self._hint}')
    return path

  def _dataset(self, split, shuffle_files, seed=None):
    """The file read into memory (a GLUE file is small), so tf.data can checkpoint the iterator."""
    del shuffle_files, seed  # one file per split; seqio shuffles the examples
    examples = list(self._spec.read(self._path(split), split))
    ds = tf.data.Dataset.from_tensor_slices(_columns(examples, self._spec.signature))
    return _filter_train(ds, split, self._spec.train_examples)

  def num_input_examples(self, split: str) -> int:
    """Counted by reading the file once (for the mixing rate and seqio's in-memory caching)."""
    if split not in self._counts:
      per_row = self._spec.train_examples if split == 'train' else None
      self._counts[split] = (sum(1 for _ in self._spec.read(self._path(split), split)) if per_row is None
                             else _train_count(self._dataset(split, False), per_row))
    return self._counts[split]


def _task(name: str, source: seqio.DataSource, spec: TaskSpec, output_features) -> seqio.Task:
  return seqio.Task(
      name, source, output_features=output_features,
      preprocessors=[*spec.preprocessors, seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
      postprocess_fn=spec.postprocess_fn, metric_fns=list(spec.metric_fns))


def _tfds_source(spec: TaskSpec, data_dir: Optional[str]) -> seqio.TfdsDataSource:
  kwargs = dict(tfds_name=spec.tfds_name, tfds_data_dir=data_dir, splits=spec.tfds_splits,
                read_only=True)  # never download at run time
  if spec.train_examples:
    return _CountedTfdsSource(spec.train_examples, **kwargs)
  return seqio.TfdsDataSource(**kwargs)


def add_tasks(specs: Mapping[str, TaskSpec], output_features: Mapping[str, seqio.Feature],
              tfds_data_dir: Optional[str] = None, root: Optional[str] = None, hint: str = '',
              make_task: Callable[..., seqio.Task] = None) -> List[str]:
  """Registers each ``name: spec`` from TFDS and, when ``root`` is given, ``<name>_local`` from the
  original files under it (``hint``: how to get them), skipping names already registered; returns
  the names added. ``make_task(name, source, spec, output_features)`` builds each task (default:
  the text-to-text one)."""
  make_task = make_task or _task
  added = []
  for name, spec in specs.items():
    for task_name, local in ((name, False), (f'{name}_local', True)):
      if (root or not local) and task_name not in seqio.TaskRegistry.names():
        source = _LocalSource(spec, root, hint) if local else _tfds_source(spec, tfds_data_dir)
        seqio.TaskRegistry.add_provider(task_name, make_task(task_name, source, spec, output_features))
        added.append(task_name)
  return added


def add_proportional_mixture(name: str, task_names: Sequence[str],
                             mixing_maximum: int = MIXING_MAXIMUM) -> List[str]:
  """Registers mixture ``name`` unless registered (then returns []): examples-proportional mixing, each
  task's rate its number of train examples capped at K = ``mixing_maximum`` (Raffel et al. 2020, 3.5.2);
  an ``EVAL_ONLY`` task's rate 0."""
  if name in seqio.MixtureRegistry.names():
    return []
  tasks = [(t, 0.0) if t.removesuffix('_local') in EVAL_ONLY else t for t in task_names]
  seqio.MixtureRegistry.add(name, tasks,
                            default_rate=functools.partial(seqio.mixing_rate_num_examples, maximum=mixing_maximum))
  return [name]


def register_glue_tasks(output_features: Mapping[str, seqio.Feature], tfds_data_dir: Optional[str] = None,
                        glue_dir: Optional[str] = None, super_glue_dir: Optional[str] = None, *,
                        mixing_maximum: int = MIXING_MAXIMUM) -> List[str]:
  """Registers the tasks and mixtures (skipping names already registered); returns the names added.

  mnli's TFDS splits are train, validation (= validation_matched), validation_matched,
  validation_mismatched, test_matched and test_mismatched; the local files map the same way.
  """
  benchmarks = (('glue', GLUE_TASKS, glue_dir or os.environ.get('GLUE_DIR'), GLUE_HINT),
                ('super_glue', SUPER_GLUE_TASKS, super_glue_dir or os.environ.get('SUPER_GLUE_DIR'),
                 SUPER_GLUE_HINT))
  added = []
  for benchmark, specs, root, hint in benchmarks:
    names = {f'{benchmark}_{t}': s for t, s in specs.items()}
    added += add_tasks(names, output_features, tfds_data_dir, root, hint)
    mixed = [n for n in names if n not in UNMIXED]
    added += add_proportional_mixture(f'{benchmark}_proportional', mixed, mixing_maximum)
    if root:
      added += add_proportional_mixture(f'{benchmark}_proportional_local', [f'{n}_local' for n in mixed],
                                        mixing_maximum)
  return added
