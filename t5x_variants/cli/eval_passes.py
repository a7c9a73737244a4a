"""The evaluation passes beside the teacher-forced one, shared by t5xv-eval and a training run's
own decoding evals (``train.infer_eval``): a task's metrics of decoded predictions, of scores and
of prompted continuations, over whole questions, and the examples' prediction files (T5X's
inference_eval files). No gin configurables: t5xv-train imports it before parsing its gin files.
"""
import functools
from typing import Any, Callable, Optional

from etils import epath
import numpy as np

from t5x_variants.train import multihost, storage
from t5x_variants.train.metrics import json_line
from t5x_variants.train.predictor import (continuation_length, decode_examples, prompted,
                                          score_examples, until_eos)

def _target_text(task, example) -> str:
  """An example's target as text: its pretokenized feature, else its tokens decoded (as seqio's
  Evaluator)."""
  from t5x_variants.data import tasks  # pylint: disable=g-import-not-at-top
  if 'targets_pretokenized' in example:
    return tasks.text(example['targets_pretokenized'])
  return task.output_features['targets'].vocabulary.decode(until_eos(example['targets']))


def _input_text(task, example) -> str:
  """An example's input as text: its pretokenized feature, else its tokens decoded."""
  from t5x_variants.data import tasks  # pylint: disable=g-import-not-at-top
  if 'inputs_pretokenized' in example:
    return tasks.text(example['inputs_pretokenized'])
  return task.output_features['inputs'].vocabulary.decode(until_eos(example['inputs']))


def _write_rows(path: Optional[epath.Path], rows):
  """``rows`` as JSON lines at ``path`` (None: not written), by process 0."""
  if path is not None:
    text = ''.join(json_line(r) for r in rows)
    multihost.process0_does(f'writing {path}', lambda: storage.write_text(path, text))


def inference_metrics(predictor, task, split: str, lengths, batch_size: int,
                      max_examples: Optional[int], predictions: Optional[epath.Path] = None):
  """The task's own metrics of greedy (or DecodeOptions) predictions, after its postprocessor;
  with ``predictions`` each example's input, target and prediction text written there as JSON
  lines (T5X's inference_eval files)."""
  examples = _examples(task, split, lengths, max_examples, functools.partial(_group, task))
  vocab = task.output_features['targets'].vocabulary
  decoded = decode_examples(predictor, vocab, examples, lengths['inputs'], lengths['targets'],
                            batch_size)
  _write_rows(predictions, ({'inputs': _input_text(task, ex), 'targets': _target_text(task, ex),
                             'prediction': ex['prediction']} for ex in decoded))
  targets = [task.postprocess_fn(_target_text(task, ex), example=ex, is_target=True)
             for ex in decoded]
  predictions = [task.postprocess_fn(ex['prediction'], example=ex, is_target=False) for ex in decoded]
  metrics = {}
  for fn in task.predict_metric_fns:
    metrics.update(fn(targets, predictions))
  return {k: float(v) for k, v in metrics.items()}


def scores_metrics(predictor, task, split: str, lengths, batch_size: int,
                   max_examples: Optional[int], predictions: Optional[epath.Path] = None):
  """The task's metrics of scores (seqio's ``score_metric_fns``, e.g. rank classification's): each
  example's log p(targets | inputs) summed over its target tokens with EOS (``Predictor.score``,
  seqio's score), beside its postprocessed target, in the split's order; with ``predictions``
  each example's input, target and log-likelihood written there as JSON lines."""
  examples = _examples(task, split, lengths, max_examples, _choices_question)
  scored = score_examples(predictor, examples, lengths['inputs'], lengths['targets'], batch_size)
  _write_rows(predictions, ({'inputs': _input_text(task, ex), 'targets': _target_text(task, ex),
                             'log_likelihood': ex['log_likelihood']} for ex in scored))
  targets = [task.postprocess_fn(_target_text(task, ex), example=ex, is_target=True)
             for ex in scored]
  scores = np.array([ex['log_likelihood'] for ex in scored])
  metrics = {}
  for fn in task.score_metric_fns:
    metrics.update(fn(targets, scores))
  return {k: float(v) for k, v in metrics.items()}


def _examples(task, split: str, lengths, max_examples: Optional[int],
              question: Callable[[dict], Any]):
  """The examples of ``split`` the same on every process, the first ``max_examples`` less a
  question cut short (``whole_questions``); one ValueError if that leaves none."""
  from t5x_variants.data import tasks  # pylint: disable=g-import-not-at-top
  examples = multihost.same(f'the {split} examples of {task.name}', lambda: whole_questions(
      tasks.task_examples(task, split, lengths, max_examples and max_examples + 1), max_examples,
      question))
  if max_examples and not examples:
    raise ValueError(f'{task.name}: max_examples {max_examples} holds no whole question (the rows '
                     'its metric judges together); raise it')
  return examples


def whole_questions(examples, limit: Optional[int], question: Callable[[dict], Any]):
  """The first ``limit`` examples (None: all), less a question cut short: its rows, of one
  ``question(example)`` (None: a row of its own), scored or judged together by the task's metric
  (read one row past the limit to see)."""
  if limit is None or len(examples) <= limit:
    return examples
  cut = question(examples[limit])
  return [ex for ex in examples[:limit] if cut is None or question(ex) != cut]


def _choices_question(example):
  """Rank classification's question: the first entry of its rows' ``idx`` (one per choice)."""
  return np.ravel(example['idx'])[0] if np.size(example.get('idx', ())) > 1 else None


def _group(task, example):
  """The group of the predictions a task's metric judges together (MultiRC's answer options of
  one question, ReCoRD's rows of one query, one per gold answer): its postprocessed target's
  ``group``."""
  target = task.postprocess_fn(_target_text(task, example), example=example, is_target=True)
  return target.get('group') if isinstance(target, dict) else None


def check_labelled(task, split: str, lengths):
  """One ValueError if ``split`` of ``task`` holds no labels (GLUE's and SuperGLUE's test splits:
  their class ids -1, their targets NO_LABEL or WSC's span text): its metrics would compare the
  predictions with a placeholder (an unparseable prediction matched NO_LABEL: accuracy 100)."""
  from t5x_variants.data import super_glue, tasks  # pylint: disable=g-import-not-at-top
  first = tasks.task_examples(task, split, lengths, 1)
  if not first:
    return
  label = first[0].get('label')  # (WSC's test targets are its span's text, its label -1)
  if ((label is not None and float(np.ravel(label)[0]) < 0) or
      ('targets' in task.output_features and _target_text(task, first[0]) == super_glue.NO_LABEL)):
    raise ValueError(f'{task.name}: its {split} examples have no labels (as GLUE\'s and '
                     "SuperGLUE's test splits), so no metric of them means anything: evaluate a "
                     'split with labels (validation), or write predictions with t5xv-infer')


def unscored(task, config) -> Optional[str]:
  """Why the task's metrics of scores cannot be computed for this model, None if they can."""
  if config.architecture == 'encoder_only':
    return 'an encoder-only model does not score targets'
  if 'inputs' not in task.output_features:
    return 'its examples have no inputs to score the targets given'
  return None


def inference_passes(task, config, inference: bool, prompt_length: Optional[int]) -> tuple:
  """The passes beside the teacher-forced one that evaluate ``task``: 'predict' (decoded text and
  the task's metrics of it), else 'continuation' (a decoder-only model prompted with the first
  ``prompt_length`` target tokens of a language-modelling task), and 'scores' (its metrics of
  scores). None (an empty tuple) without ``inference``."""
  if not inference:
    return ()
  passes = []
  if task.predict_metric_fns and config.architecture != 'encoder_only':
    passes.append('predict')
  elif prompt_length and config.architecture == 'decoder_only' and 'inputs' not in task.output_features:
    passes.append('continuation')
  if task.score_metric_fns and not unscored(task, config):
    passes.append('scores')
  return tuple(passes)


def predictions_file(directory, task: str, step: int, split: str, kind: str = '') -> epath.Path:
  """Where an evaluation writes its examples' predictions (or scores, ``kind`` '-scores'):
  ``directory``/<task>-<split>-<step>[-scores].jsonl; t5xv-eval's directory is
  RUN/inference_eval, a training run's own evals' RUN/inference_eval/train."""
  return storage.path(directory) / f'{task}-{split}-{step:06d}{kind}.jsonl'


def pass_metrics(predictor, task, passes, split: str, lengths, batch_size: int,
                 max_examples: Optional[int], prompt_length: Optional[int] = None,
                 predictions_dir=None, step: int = 0):
  """The metrics of ``task``'s ``passes`` (``inference_passes``) beside the teacher-forced ones,
  over its first ``max_examples`` examples of ``split`` (None: all); with ``predictions_dir``
  the examples' predictions and scores of ``step`` go to its ``predictions_file``s (the
  continuation pass writes none)."""
  metrics = {}
  where = lambda kind='': predictions_dir and predictions_file(predictions_dir, task.name, step,
                                                               split, kind)
  if 'predict' in passes:
    metrics.update(inference_metrics(predictor, task, split, lengths, batch_size, max_examples,
                                     where()))
  if 'continuation' in passes:
    metrics.update(continuation_metrics(predictor, task, split, lengths, prompt_length, batch_size,
                                        max_examples))
  if 'scores' in passes:
    metrics.update(scores_metrics(predictor, task, split, lengths, batch_size, max_examples,
                                  where('-scores')))
  return metrics


def continuation_metrics(predictor, task, split: str, lengths, prompt_length: int, batch_size: int,
                         max_examples: Optional[int]):
  """A decoder-only model prompted with the first ``prompt_length`` target tokens of each example:
  exact match (percent) of its greedy continuation, and the log-perplexity of the reference."""
  from t5x_variants.data import tasks  # pylint: disable=g-import-not-at-top
  examples = multihost.same(f'the {split} examples of {task.name}', lambda: prompted(
      tasks.task_examples(task, split, lengths, max_examples), prompt_length, task.name))
  if not examples:
    raise ValueError(f'no example of {task.name} ({split}) is longer than PROMPT_LENGTH {prompt_length}')
  target_length = continuation_length(lengths['targets'], prompt_length)
  decoded = decode_examples(predictor, task.output_features['targets'].vocabulary, examples,
                            prompt_length, target_length, batch_size)
  scored = score_examples(predictor, decoded, prompt_length, target_length, batch_size)
  exact = [ex['prediction_ids'] == until_eos(ex['targets']) for ex in scored]
  return {'continuation_exact_match': 100.0 * float(np.mean(exact)),
          'continuation_log_perplexity': -sum(ex['log_likelihood'] for ex in scored) /
                                         sum(ex['num_target_tokens'] for ex in scored)}
