"""Weight initialisation schemes.

- ``t5``: T5/T5X defaults, variance_scaling(1, fan_in) (normal for attention, truncated normal
  for the FFN and logits), multiplied by the placement's gain.
- ``xavier``: xavier-normal, std = gain * sqrt(2 / (fan_in + fan_out)), as in the DeepNet
  (Wang et al. 2022) and Magneto (Wang et al. 2022) pseudocode.

Which projections receive the gain (beta for DeepNorm, gamma for Sub-LN, 1 otherwise) is decided
by the caller: FFN weights and the value and output projections get it, query and key get 1.
"""
import flax.linen as nn

INITS = ('t5', 'xavier')


def kernel_init(scheme: str, gain: float = 1.0, in_axis=-2, out_axis=-1,
                t5_distribution: str = 'normal', batch_axis=()):
  """Initializer for a kernel whose fan-in axes are ``in_axis`` and fan-out axes ``out_axis``
  (``batch_axis``, e.g. heads of a per-head matrix, counts in neither fan)."""
  if scheme == 't5':
    return nn.initializers.variance_scaling(gain**2, 'fan_in', t5_distribution, in_axis=in_axis,
                                            out_axis=out_axis, batch_axis=batch_axis)
  if scheme == 'xavier':
    return nn.initializers.variance_scaling(gain**2, 'fan_avg', 'normal', in_axis=in_axis,
                                            out_axis=out_axis, batch_axis=batch_axis)
  raise ValueError(f'unknown init {scheme!r}; valid: {", ".join(INITS)}')
