"""Layer normalisation: LayerNorm (Ba et al. 2016) and RMSNorm (T5LayerNorm).

Statistics are always computed in float32, whatever the compute dtype.
"""
from typing import Any, Tuple

import flax.linen as nn
import jax.numpy as jnp

NORMS = ('rmsnorm', 'layernorm', 'layernorm_no_bias')


class Norm(nn.Module):
  """y = (x - mean) / sqrt(var + eps) * scale (+ bias) for LayerNorm;
  y = x / sqrt(mean(x^2) + eps) * scale for RMSNorm (no centring, no bias).

  Normalises over the last ``len(axes)`` dimensions (``axes`` are their logical names).
  """
  kind: str = 'rmsnorm'
  epsilon: float = 1e-6
  dtype: Any = jnp.float32
  axes: Tuple[str, ...] = ('embed',)

  @nn.compact
  def __call__(self, x):
    if self.kind not in NORMS:
      raise ValueError(f'unknown norm {self.kind!r}; valid: {", ".join(NORMS)}')
    reduce = tuple(range(-len(self.axes), 0))
    features = x.shape[-len(self.axes):]
    x32 = x.astype(jnp.float32)
    if self.kind != 'rmsnorm':
      x32 = x32 - jnp.mean(x32, reduce, keepdims=True)
    y = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, reduce, keepdims=True) + self.epsilon))
    scale = self.param('scale', nn.with_logical_partitioning(nn.initializers.ones, self.axes),
                       features, jnp.float32)
    y = y * scale
    if self.kind == 'layernorm':
      bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, self.axes),
                        features, jnp.float32)
      y = y + bias
    return y.astype(self.dtype)
