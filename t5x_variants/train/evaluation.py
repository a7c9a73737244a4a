"""Teacher-forced evaluation: loss, log-perplexity and token accuracy over a finite set of batches.

Sums over all batches are divided once at the end, so the result is the token-weighted mean over
the whole split, independent of how it was batched. ``loss`` includes the z-loss term the run
trains with; ``log_perplexity`` is the plain cross-entropy per target token.
"""
import itertools
from typing import Dict, Iterable, Optional

import jax
import numpy as np

from t5x_variants.train import partitioning
from t5x_variants.train.train_step import summed_loss


def make_eval_step(model, config, param_sharding, mesh, z_loss: float = 0.0):
  """Jitted (params, batch) -> sums of loss, z_loss, correct and num_tokens."""
  def step(params, batch):
    return summed_loss(model, config, params, batch, None, z_loss=z_loss)[1]
  return jax.jit(step, in_shardings=(param_sharding, partitioning.batch_sharding(mesh)))


def evaluate(eval_step, params, batches: Iterable[Dict[str, np.ndarray]], mesh,
             max_batches: Optional[int] = None) -> Dict[str, float]:
  """Token-weighted metrics over ``batches`` (at most ``max_batches``): global batches that every
  process holds whole; each feeds its own rows."""
  totals = None
  for batch in itertools.islice(batches, max_batches):
    sums = eval_step(params, partitioning.global_batch(partitioning.host_rows(batch, mesh), mesh))
    totals = sums if totals is None else jax.tree_util.tree_map(jax.numpy.add, totals, sums)
  if totals is None:
    raise ValueError('the evaluation data is empty')
  totals = jax.tree_util.tree_map(float, partitioning.to_host(totals))
  n = max(totals['num_tokens'], 1.0)
  return {'loss': totals['loss'] / n, 'log_perplexity': (totals['loss'] - totals['z_loss']) / n,
          'accuracy': totals['correct'] / n, 'num_tokens': totals['num_tokens']}
