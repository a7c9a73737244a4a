"""GLUE as classification / regression tasks, for encoder-only (BERT-style) fine-tuning with a
classification head (``TransformerConfig.head = 'classification'``), as the encoder-only results
of DeepNet and Magneto (and BERT) are obtained; text-to-text stays the way for the other models.

``register_classification_tasks`` registers, for every GLUE task <t> of data/glue.py:
- ``glue_<t>_cls``: TFDS ``glue/<t>:2.*.*``;
- ``glue_<t>_cls_local``: the original files under ``glue_dir`` (default: env GLUE_DIR), if given.
'inputs' is T5's text-to-text input string ('<task> <field>: <text> ...') tokenized, with EOS;
'label' is the class id (int32; MNLI has 3 classes, the others 2) or STS-B's similarity score
(float32, regression: ``num_labels`` 1), -1 for unlabelled (test) examples. Their metrics are
the text-to-text tasks' (accuracy, F1, Matthews corr., Pearson/Spearman), applied by the
evaluation to the argmax (or the regression output) against the label. There is no mixture:
each task has its own number of labels and its labels their own meaning, so (as BERT) one model
is fine-tuned per task.
"""
import functools
import os
from typing import List, Mapping, Optional, Sequence

import seqio
import tensorflow as tf

from t5x_variants.data import glue

SUFFIX = '_cls'


class ClassificationTask(seqio.Task):
  """A seqio task whose examples are 'inputs' tokens and a 'label' for a ``num_labels``-way
  classification head (1: regression)."""

  def __init__(self, *args, num_labels: int, **kwargs):
    self.num_labels = num_labels
    super().__init__(*args, **kwargs)


@seqio.map_over_dataset
def to_classification(ex, regression: bool):
  """A text-to-text example -> its 'inputs' text and its 'label' (float32 for regression, else
  int32; -1: unlabelled)."""
  label = tf.cast(ex['label'], tf.float32 if regression else tf.int32)
  return {'inputs': ex['inputs'], 'label': label, 'idx': ex['idx']}


def _label_names(spec: glue.TaskSpec):
  """A GLUE task's class names, from its text-to-text step (None: STS-B's score)."""
  return spec.preprocessors[-1].keywords['label_names']


def _task(name: str, source: seqio.DataSource, spec: glue.TaskSpec, output_features) -> ClassificationTask:
  label_names = _label_names(spec)
  return ClassificationTask(
      name, source, output_features=output_features,
      preprocessors=[*spec.preprocessors, functools.partial(to_classification, regression=not label_names),
                     seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
      metric_fns=list(spec.metric_fns), num_labels=len(label_names) if label_names else 1)


def register_classification_tasks(vocabulary: seqio.Vocabulary, tfds_data_dir: Optional[str] = None,
                                  glue_dir: Optional[str] = None) -> List[str]:
  """Registers ``glue_<t>_cls`` (and ``glue_<t>_cls_local`` with ``glue_dir`` or GLUE_DIR), skipping
  names already registered; returns the names added."""
  specs = {f'glue_{t}{SUFFIX}': spec for t, spec in glue.GLUE_TASKS.items()}
  return glue.add_tasks(specs, {'inputs': seqio.Feature(vocabulary, add_eos=True)}, tfds_data_dir,
                        glue_dir or os.environ.get('GLUE_DIR'), glue.GLUE_HINT, make_task=_task)


def num_labels(task_or_mixture) -> Optional[int]:
  """The number of labels of a classification task (or of a mixture of them, which must agree);
  None for any other task."""
  tasks = getattr(task_or_mixture, 'tasks', [task_or_mixture])
  counts = {getattr(t, 'num_labels', None) for t in tasks}
  if len(counts) > 1:
    raise ValueError(f'{task_or_mixture.name} mixes tasks with different numbers of labels '
                     f'(or classification with other tasks): {sorted(counts, key=str)}')
  return counts.pop()


def check_model(task_or_mixture, config) -> Optional[int]:
  """ValueError unless ``config``'s head fits a registered task or mixture: a classification task
  needs an encoder-only model with head 'classification' and the task's num_labels, and that head
  needs a classification task. Returns the task's number of labels (None: not a classification
  task)."""
  name, n = task_or_mixture.name, num_labels(task_or_mixture)
  if n is None and config.head == 'classification':
    raise ValueError(f'{name} is not a classification task; a classification head trains on one '
                     f'such as glue_rte{SUFFIX} (or glue_rte{SUFFIX}_local)')
  if n is not None and (config.head != 'classification' or config.num_labels != n):
    raise ValueError(f'{name} is a {n}-label classification task: it needs TransformerConfig.'
                     f"architecture = 'encoder_only', head = 'classification' and num_labels = {n} "
                     f'(this model: {config.architecture}, head {config.head!r}, num_labels '
                     f'{config.num_labels})')
  return n


def metric_fns(tasks: Sequence[seqio.Task]) -> Mapping[str, tuple]:
  """{task name: its metric functions of (targets, predictions)} of ``tasks``."""
  return {t.name: tuple(t.predict_metric_fns) for t in tasks}
