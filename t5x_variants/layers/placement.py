"""Norm placement: where LayerNorm sits around each residual sublayer, and its constants.

- ``post`` (Vaswani et al. 2017):        x <- LN(x + f(x))
- ``pre``  (Xiong et al. 2020):          x <- x + f(LN(x)), final LN on the stack
- ``deepnorm`` (DeepNet, Wang et al. 2022): x <- LN(alpha * x + f(x)), with init gain beta
- ``subln`` (Magneto, Wang et al. 2022): x <- x + f(LN(x)) where f also has an LN before
  its output projection (attention ``out``, FFN ``wo``), final LN on the stack, init gain gamma.
"""
import math
from typing import Callable, Dict, Tuple

import jax.numpy as jnp

from t5x_variants.features import STACKS

PLACEMENTS = ('post', 'pre', 'deepnorm', 'subln')


def normalizes_input(placement: str) -> bool:
  """Whether the sublayer sees LN(x) (pre, subln) rather than x (post, deepnorm)."""
  return placement in ('pre', 'subln')


def has_final_norm(placement: str) -> bool:
  return normalizes_input(placement)


def residual(x, f: Callable, norm: Callable, placement: str, alpha: float = 1.0):
  """Applies one residual sublayer ``f`` to ``x`` with the given placement."""
  if placement in ('pre', 'subln'):
    return x + f(norm(x))
  if placement == 'post':
    return norm(x + f(x))
  if placement == 'deepnorm':  # alpha x in float32 (alpha in bfloat16 is up to 0.4% off)
    return norm((alpha * x.astype(jnp.float32)).astype(x.dtype) + f(x))
  raise ValueError(f'unknown placement {placement!r}; valid: {", ".join(PLACEMENTS)}')


def deepnorm_constants(architecture: str, n: int, m: int,
                       code: bool = False) -> Dict[str, Tuple[float, float]]:
  """The DeepNet paper's table: {stack: (alpha, beta)} for N encoder and M decoder layers.

  With ``code``, the encoder-decoder encoder's beta is the released code's (torchscale divides by
  (N^4 M)^(1/16) / 1.15, i.e. beta = 1.15 (N^4 M)^(-1/16)) instead of the paper's 0.87 (...)."""
  if architecture == 'encoder_only':
    return {'encoder': ((2 * n)**0.25, (8 * n)**-0.25)}
  if architecture == 'decoder_only':
    return {'decoder': ((2 * m)**0.25, (8 * m)**-0.25)}
  return {'encoder': (0.81 * (n**4 * m)**(1 / 16), (1.15 if code else 0.87) * (n**4 * m)**(-1 / 16)),
          'decoder': ((3 * m)**0.25, (12 * m)**-0.25)}


def subln_gammas(architecture: str, n: int, m: int) -> Dict[str, float]:
  """Magneto Sec. 2.2: {stack: gamma} for N encoder and M decoder layers."""
  if architecture == 'encoder_only':
    return {'encoder': math.sqrt(math.log(2 * n))}
  if architecture == 'decoder_only':
    return {'decoder': math.sqrt(math.log(2 * m))}
  return {'encoder': math.sqrt(math.log(3 * m) * math.log(2 * n) / 3),
          'decoder': math.sqrt(math.log(3 * m))}


def residual_constants(placement: str, architecture: str, n: int, m: int,
                       code: bool = False) -> Dict[str, Tuple[float, float]]:
  """{stack: (alpha, init gain)}: alpha scales the residual branch x, the gain scales the
  FFN / value / output initialisation (beta for DeepNorm, gamma for Sub-LN, 1 otherwise);
  ``code``: DeepNorm's beta as the released code computes it (deepnorm_constants)."""
  if placement == 'deepnorm':
    return deepnorm_constants(architecture, n, m, code)
  if placement == 'subln':
    return {s: (1.0, g) for s, g in subln_gammas(architecture, n, m).items()}
  if placement in PLACEMENTS:
    return {s: (1.0, 1.0) for s in STACKS[architecture]}
  raise ValueError(f'unknown placement {placement!r}; valid: {", ".join(PLACEMENTS)}')
