"""Token embedding table (vocab, embed), initialised N(0, 1) as in T5, with ``attend`` for tied
output logits."""
from typing import Any

import flax.linen as nn
import jax.numpy as jnp


class Embed(nn.Module):
  num_embeddings: int
  features: int
  dtype: Any = jnp.float32

  def setup(self):
    self.embedding = self.param(
        'embedding', nn.with_logical_partitioning(nn.initializers.normal(1.0), ('vocab', 'embed')),
        (self.num_embeddings, self.features), jnp.float32)

  def __call__(self, ids):
    return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)

  def attend(self, x):
    """x E^T: logits over the vocabulary, in the dtype of x."""
    return jnp.einsum('...d,vd->...v', x, self.embedding.astype(x.dtype))
