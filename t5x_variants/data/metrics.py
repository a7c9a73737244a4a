"""GLUE/SuperGLUE metrics on postprocessed (targets, predictions); every value is in percent.

Class ids come from the postprocessors, which map an unrecognised prediction to -1: it never
matches a labelled target, so it always counts as an error. (An unlabelled one, of a test split,
is -1 too: ``t5xv-eval`` refuses such a split.)
"""
import collections
import re
import string
from typing import Dict, Sequence

import numpy as np

_ARTICLES = re.compile(r'\b(a|an|the)\b')


def accuracy(targets, predictions) -> Dict[str, float]:
  return {'accuracy': 100 * float(np.mean(np.asarray(targets) == np.asarray(predictions)))}


def exact_match(targets, predictions) -> Dict[str, float]:
  """Share of predictions equal to their target (strings or ids)."""
  return {'exact_match': 100 * float(np.mean([t == p for t, p in zip(targets, predictions)]))}


def _binary_f1(targets, predictions) -> float:
  """F1 of class 1 = 2 TP / (2 TP + errors); an invalid (-1) prediction is one error either way."""
  t = np.asarray(targets)
  p = np.asarray(predictions)
  tp = np.sum((t == 1) & (p == 1))
  wrong = np.sum(t != p)
  return 100 * float(2 * tp / (2 * tp + wrong)) if tp + wrong else 0.0


def f1(targets, predictions) -> Dict[str, float]:
  return {'f1': _binary_f1(targets, predictions)}


def mean_multiclass_f1(targets, predictions, num_classes: int) -> Dict[str, float]:
  """Mean over classes 0..num_classes-1 of the one-vs-rest F1 (CB's 'F1')."""
  t = np.asarray(targets)
  p = np.asarray(predictions)
  scores = []
  for c in range(num_classes):
    tp = np.sum((t == c) & (p == c))
    errors = np.sum((t == c) != (p == c))
    scores.append(2 * tp / (2 * tp + errors) if tp + errors else 0.0)
  return {f'mean_{num_classes}class_f1': 100 * float(np.mean(scores))}


def matthews_corrcoef(targets, predictions) -> Dict[str, float]:
  """Matthews correlation (multiclass form of Gorodkin 2004; the usual one for two classes)."""
  classes, ids = np.unique(np.concatenate([targets, predictions]), return_inverse=True)
  n = len(targets)
  confusion = np.zeros((len(classes), len(classes)))
  np.add.at(confusion, (ids[:n], ids[n:]), 1)
  true_counts, pred_counts = confusion.sum(1), confusion.sum(0)
  covariance = np.trace(confusion) * n - true_counts @ pred_counts
  scale = np.sqrt((n ** 2 - pred_counts @ pred_counts) * (n ** 2 - true_counts @ true_counts))
  return {'matthews_corrcoef': 100 * float(covariance / scale) if scale else 0.0}


def pearson_corrcoef(targets, predictions) -> Dict[str, float]:
  import scipy.stats  # pylint: disable=g-import-not-at-top (1-2 s; only STS-B evaluates it)
  return {'pearson_corrcoef': 100 * float(scipy.stats.pearsonr(targets, predictions)[0])}


def spearman_corrcoef(targets, predictions) -> Dict[str, float]:
  import scipy.stats  # pylint: disable=g-import-not-at-top
  return {'spearman_corrcoef': 100 * float(scipy.stats.spearmanr(targets, predictions)[0])}


def multirc_f1a(targets, predictions) -> Dict[str, float]:
  """Binary F1 over every answer option (SuperGLUE's F1a, T5's ``f1``); items are {'group':
  question, 'value': 0/1/-1}."""
  return {'f1a': _binary_f1([t['value'] for t in targets], [p['value'] for p in predictions])}


def multirc_exact_match(targets, predictions) -> Dict[str, float]:
  """Share of questions whose answer options are all labelled correctly."""
  correct = collections.defaultdict(lambda: True)
  for t, p in zip(targets, predictions):
    correct[t['group']] &= t['value'] == p['value']
  return {'exact_match': 100 * float(np.mean(list(correct.values())))}


def normalize_answer(text: str) -> str:
  """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
  text = ''.join(c for c in text.lower() if c not in string.punctuation)
  return ' '.join(_ARTICLES.sub(' ', text).split())


def _token_f1(target: str, prediction: str) -> float:
  target_tokens = normalize_answer(target).split()
  prediction_tokens = normalize_answer(prediction).split()
  common = sum((collections.Counter(target_tokens) & collections.Counter(prediction_tokens)).values())
  if not common:
    return 0.0
  precision = common / len(prediction_tokens)
  recall = common / len(target_tokens)
  return 2 * precision * recall / (precision + recall)


def max_over_answers_em_f1(targets: Sequence[Sequence[str]], predictions: Sequence[str]) -> Dict[str, float]:
  """ReCoRD/SQuAD: each target is a list of gold answers; a prediction scores its best match."""
  em = [max((float(normalize_answer(a) == normalize_answer(p)) for a in answers), default=0.0)
        for answers, p in zip(targets, predictions)]
  token_f1 = [max((_token_f1(a, p) for a in answers), default=0.0) for answers, p in zip(targets, predictions)]
  return {'em': 100 * float(np.mean(em)), 'f1': 100 * float(np.mean(token_f1))}


def record_em_f1(targets, predictions) -> Dict[str, float]:
  """ReCoRD: ``max_over_answers_em_f1`` once per query, its first example's (a query makes one
  example per gold answer; T5's deduplicate_metric). Targets are {'group': query, 'value':
  answers}."""
  first = {}
  for t, p in zip(targets, predictions):
    first.setdefault(t['group'], (t['value'], p))
  kept = list(first.values())
  return max_over_answers_em_f1([a for a, _ in kept], [p for _, p in kept])
