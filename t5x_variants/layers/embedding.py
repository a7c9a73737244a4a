"""Token embedding table (vocab, embed), initialised N(0, std^2) (T5: std 1), optionally scaled by
sqrt(embed) on lookup (Vaswani et al. 2017, Sec. 3.4), with ``attend`` for tied output logits."""
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from t5x_variants.layers.dense import matmul_float32


class Embed(nn.Module):
  num_embeddings: int
  features: int
  dtype: Any = jnp.float32
  init_std: float = 1.0
  scale: bool = False

  def setup(self):
    self.embedding = self.param(
        'embedding', nn.with_logical_partitioning(nn.initializers.normal(self.init_std), ('vocab', 'embed')),
        (self.num_embeddings, self.features), jnp.float32)

  def table(self, dtype):
    """E in ``dtype``, laid out as without fsdp (gathered where fsdp splits embed; layers/dense.py
    says why)."""
    return nn.with_logical_constraint(self.embedding.astype(dtype), ('vocab', 'embed'))

  def __call__(self, ids):
    x = jnp.take(self.table(jnp.float32), ids, axis=0)
    return (x * self.features**0.5 if self.scale else x).astype(self.dtype)

  def attend(self, x):
    """x E^T (unscaled E): logits over the vocabulary from operands in the dtype of x, in float32
    (``dense.matmul_float32``)."""
    return matmul_float32(x, self.table(x.dtype).T)
