"""Teacher-forced evaluation: loss, log-perplexity and token accuracy over a finite set of batches.

Sums over all batches are divided once at the end, so the result is the token-weighted mean over
the whole split, independent of how it was batched. ``loss`` includes the z-loss term the run
trains with; ``log_perplexity`` is the plain cross-entropy per target token.

A classification head counts examples where a language model counts tokens, and its per-example
predictions (argmax, or the regression output) are also gathered, so that the task's own metrics
(GLUE's accuracy, F1, Matthews corr., Pearson/Spearman: functions of (targets, predictions)) are
computed over the labelled examples. ``token_accuracy`` (a fraction of target tokens, or of
examples for a head) is kept apart from those metrics' ``accuracy`` (percent), as from the decoded
metrics of text-to-text tasks. A regression head reports no token accuracy or log-perplexity: its
'loss' is the mean squared error.
"""
import itertools
import math
from typing import Callable, Dict, Iterable, Optional, Sequence

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from t5x_variants.train import multihost, partitioning
from t5x_variants.train.train_step import summed_loss


def make_eval_step(model, config, param_sharding, mesh, z_loss: float = 0.0):
  """Jitted (params, batch) -> sums of loss, z_loss, correct and num_tokens (and a classification
  head's per-example 'rows'), replicated on every device. The loss is the cross-entropy plus the
  z-loss, without label smoothing (T5X's eval loss includes it): with ``train.label_smoothing``
  the train and eval losses are on different scales; ``log_perplexity`` is the cross-entropy."""
  def step(params, batch):
    return summed_loss(model, config, params, batch, None, z_loss=z_loss, rows=True)[1]
  return partitioning.jit(step, mesh, in_shardings=(param_sharding, partitioning.batch_sharding(mesh)),
                          out_shardings=NamedSharding(mesh, PartitionSpec()))


def evaluate(eval_step, params, batches: Iterable[Dict[str, np.ndarray]], mesh,
             max_batches: Optional[int] = None, metric_fns: Sequence[Callable] = (),
             name: str = 'the evaluation data') -> Dict[str, float]:
  """Token-weighted metrics over ``batches`` (at most ``max_batches``): global batches that every
  process holds whole (checked: ``multihost.same_batches``; ``name`` names them in its error);
  each feeds its own rows. ``metric_fns``: applied to a classification head's (labels,
  predictions) of the examples with weight > 0."""
  sums, rows = [], []
  for batch in multihost.same_batches(name, itertools.islice(batches, max_batches)):
    sums.append(eval_step(params, partitioning.global_batch(partitioning.host_rows(batch, mesh),
                                                            mesh)))
    if 'rows' in sums[-1]:
      rows.append(partitioning.to_host(sums[-1].pop('rows')))
  if not sums:
    raise ValueError('the evaluation data is empty')
  # Added on the host, exactly rounded: float32 totals stop counting tokens exactly past 2**24.
  sums = [partitioning.to_host(s) for s in sums]
  totals = {k: math.fsum(float(s[k]) for s in sums) for k in sums[0]}
  n = max(totals['num_tokens'], 1.0)
  out = {'loss': totals['loss'] / n, 'log_perplexity': (totals['loss'] - totals['z_loss']) / n,
         'token_accuracy': totals['correct'] / n, 'num_tokens': totals['num_tokens']}
  if rows:
    cat = lambda k: np.concatenate([r[k] for r in rows])
    keep = cat('weights') > 0  # not the padding rows, nor unlabelled (test) examples
    labels, predictions = cat('labels')[keep], cat('predictions')[keep]
    if np.issubdtype(predictions.dtype, np.floating):  # regression
      del out['token_accuracy'], out['log_perplexity']
    if keep.any():
      for fn in metric_fns:
        out.update({k: float(v) for k, v in fn(labels.tolist(), predictions.tolist()).items()})
  return out
