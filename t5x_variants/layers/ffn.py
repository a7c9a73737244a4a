"""Position-wise feed-forward network and its GLU variants (Shazeer 2020).

FFN(x) = (act_0(x W_0) * act_1(x W_1) * ...) W_2: one activation gives the two-matrix FFN
(ReLU, GELU, Swish), two give the gated three-matrix family (GLU, Bilinear, ReGLU, GEGLU,
SwiGLU). Parameter names follow T5X: ``wi`` (one activation) or ``wi_0``, ``wi_1``; ``wo``.
"""
import functools
from typing import Any, Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from t5x_variants.layers.dense import Dense
from t5x_variants.layers.norms import Norm

ACTIVATIONS = {
    'relu': nn.relu,
    'gelu': functools.partial(nn.gelu, approximate=True),  # tanh form, as in Mesh TF / T5
    'gelu_exact': functools.partial(nn.gelu, approximate=False),
    'swish': nn.swish,  # x * sigmoid(x), beta = 1 (SiLU)
    'sigmoid': nn.sigmoid,
    'tanh': jnp.tanh,
    'linear': lambda x: x,
}

FFN_VARIANTS = {
    'relu': ('relu',),
    'gelu': ('gelu',),
    'swish': ('swish',),
    'glu': ('sigmoid', 'linear'),
    'bilinear': ('linear', 'linear'),
    'reglu': ('relu', 'linear'),
    'geglu': ('gelu', 'linear'),
    'swiglu': ('swish', 'linear'),
}


def resolve_activations(ffn) -> Tuple[str, ...]:
  """Maps a variant name or an activation tuple to a validated activation tuple."""
  acts = FFN_VARIANTS.get(ffn) if isinstance(ffn, str) else tuple(ffn)
  if acts is None:
    raise ValueError(f'unknown ffn variant {ffn!r}; valid: {", ".join(FFN_VARIANTS)} '
                     'or a tuple of activations')
  bad = [a for a in acts if a not in ACTIVATIONS]
  if bad or not acts:
    raise ValueError(f'unknown activation(s) {bad} in ffn={ffn!r}; valid: {", ".join(ACTIVATIONS)}')
  return acts


class MlpBlock(nn.Module):
  """FFN with the given activation tuple; ``inner_norm`` adds Sub-LN's LN before ``wo``."""
  activations: Tuple[str, ...]
  d_ff: int
  init_scheme: str = 't5'
  gain: float = 1.0
  use_bias: bool = False
  inner_norm: Optional[str] = None
  norm_epsilon: float = 1e-6
  dropout_rate: float = 0.0
  dropout_broadcast_dims: Tuple[int, ...] = (-2,)
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    dense = functools.partial(Dense, init_scheme=self.init_scheme, gain=self.gain, t5_distribution='truncated_normal',
                              use_bias=self.use_bias, dtype=self.dtype)
    h = None
    for i, act in enumerate(self.activations):
      name = 'wi' if len(self.activations) == 1 else f'wi_{i}'
      a = ACTIVATIONS[act](dense((self.d_ff,), ('embed',), ('mlp',), name=name)(x))
      h = a if h is None else h * a
    h = checkpoint_name(h, 'mlp_hidden')
    h = nn.Dropout(self.dropout_rate, self.dropout_broadcast_dims)(h, deterministic=deterministic)
    if self.inner_norm:
      h = Norm(self.inner_norm, self.norm_epsilon, self.dtype, ('mlp',), name='inner_layer_norm')(h)
    return checkpoint_name(dense((x.shape[-1],), ('mlp',), ('embed',), name='wo')(h), 'mlp_out')
