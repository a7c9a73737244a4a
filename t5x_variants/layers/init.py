"""Weight initialisation schemes.

- ``t5``: T5/T5X defaults, variance_scaling(1, fan_in) (normal for attention, truncated normal
  for the FFN and logits), multiplied by the placement's gain; biases 0.
- ``xavier``: xavier-normal, std = gain * sqrt(2 / (fan_in + fan_out)), as in the DeepNet
  (Wang et al. 2022) and Magneto (Wang et al. 2022) pseudocode; biases 0.
- ``torchscale``: the papers' released code (torchscale 0.3.0) as it runs: every projection keeps
  PyTorch's ``nn.Linear`` default, W ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (std 1/sqrt(3 fan_in))
  and b ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and then both W and b are multiplied by the gain.

Which projections receive the gain (beta for DeepNorm, gamma for Sub-LN, 1 otherwise) is decided
by the caller: FFN weights and the value and output projections get it, query and key get 1.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

INITS = ('t5', 'xavier', 'torchscale')


def kernel_init(scheme: str, gain: float = 1.0, in_axis=-2, out_axis=-1,
                t5_distribution: str = 'normal', batch_axis=()):
  """Initializer for a kernel whose fan-in axes are ``in_axis`` and fan-out axes ``out_axis``
  (``batch_axis``, e.g. heads of a per-head matrix, counts in neither fan)."""
  kw = dict(in_axis=in_axis, out_axis=out_axis, batch_axis=batch_axis)
  if scheme == 't5':
    return nn.initializers.variance_scaling(gain**2, 'fan_in', t5_distribution, **kw)
  if scheme == 'xavier':
    return nn.initializers.variance_scaling(gain**2, 'fan_avg', 'normal', **kw)
  if scheme == 'torchscale':  # U(+-sqrt(3 s / fan_in)) with s = gain^2 / 3: U(+-gain / sqrt(fan_in))
    return nn.initializers.variance_scaling(gain**2 / 3, 'fan_in', 'uniform', **kw)
  raise ValueError(f'unknown init {scheme!r}; valid: {", ".join(INITS)}')


def bias_init(scheme: str, gain: float, fan_in: int):
  """Initializer for the bias of a projection with ``fan_in`` inputs: 0, or under ``torchscale``
  U(-gain / sqrt(fan_in), gain / sqrt(fan_in)) (PyTorch's nn.Linear, then scaled)."""
  if scheme != 'torchscale':
    return nn.initializers.zeros
  bound = gain / fan_in**0.5

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return init
