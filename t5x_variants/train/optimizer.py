"""Adafactor with T5's settings and the learning-rate schedules of the papers.

Adafactor (Shazeer & Stern 2018) as T5 used it: factored second moments, decay rate 0.8,
parameter-scaled relative steps, update clipping 1.0, no momentum. A scanned stack stores its
layers on a leading ``layers`` axis; each layer gets its own statistics (the optimizer is vmapped
over that axis), so the layers axis is never factored and parameter scale and clipping stay per
layer, as T5X's factor rules treat it. Parameters of a ``fixed_random`` synthesizer (and any
path listed in ``frozen``) get no update.
"""
from typing import Callable, Optional, Sequence

import gin
import jax
import jax.numpy as jnp
import optax

SCHEDULES = ('rsqrt', 'constant')


def _inverse_sqrt(base: float, warmup_steps: int):
  """base / sqrt(max(step, warmup_steps)) in float32: T5's schedule (constant during the warmup,
  then proportional to 1/sqrt(step)). optax has no inverse-square-root schedule."""
  return lambda step: base / jnp.sqrt(jnp.maximum(jnp.asarray(step, jnp.float32), warmup_steps))


@gin.configurable
def learning_rate_schedule(name: str = 'rsqrt', base: float = 1.0, warmup_steps: int = 10_000,
                           total_steps: Optional[int] = None, decay_fraction: float = 0.0):
  """lr(step). 'rsqrt': base / sqrt(max(step, warmup_steps)) (T5: 0.01 for 10k steps, then
  decaying); 'constant': base. With ``decay_fraction`` > 0 the rate is also multiplied by
  clip((total_steps - step) / (decay_fraction * total_steps), 0, 1): it falls linearly to 0 over
  the last ``decay_fraction * total_steps`` steps (the GLU-variants paper: the final 10%) and is
  0 from ``total_steps`` on. That factor is written out rather than taken from
  ``optax.linear_schedule``: its ``1 - count / transition_steps`` rounds differently in float32,
  and under jit (a division by a constant becomes a multiplication by its reciprocal) it leaves
  a factor of ~2.5e-8, not 0, at and after the last step."""
  if name not in SCHEDULES:
    raise ValueError(f'unknown schedule {name!r}; valid: {", ".join(SCHEDULES)}')
  if decay_fraction and not total_steps:
    raise ValueError('decay_fraction needs total_steps')
  lr = optax.constant_schedule(base) if name == 'constant' else _inverse_sqrt(base, warmup_steps)
  if not decay_fraction:
    return lr
  decay_steps = decay_fraction * total_steps

  def decayed(step):
    remaining = total_steps - jnp.asarray(step, jnp.float32)
    return lr(step) * jnp.clip(remaining / decay_steps, 0.0, 1.0)
  return decayed


def _per_layer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` applied independently to each slice of the leading (layers) axis."""
  return optax.GradientTransformation(
      jax.vmap(tx.init), lambda updates, state, params=None: jax.vmap(tx.update)(updates, state, params))


def param_labels(params, frozen: Sequence[str] = ()):
  """Per leaf: 'frozen', '<stack>/layers' for scanned layer stacks, or 'default'."""
  def label(path, _):
    keys = [str(getattr(k, 'key', k)) for k in path]
    if 'fixed_random' in keys or any(f in '/'.join(keys) for f in frozen):
      return 'frozen'
    if 'layers' in keys:
      return '/'.join(keys[:keys.index('layers') + 1])
    return 'default'
  return jax.tree_util.tree_map_with_path(label, params)


@gin.configurable
def adafactor(params, learning_rate=None, decay_rate: float = 0.8, clipping_threshold: float = 1.0,
              multiply_by_parameter_scale: bool = True, min_dim_size_to_factor: int = 128,
              global_norm_clip: Optional[float] = None, frozen: Sequence[str] = ()):
  """The optimizer for ``params`` (their tree decides which leaves are per-layer or frozen)."""
  learning_rate = learning_rate if learning_rate is not None else learning_rate_schedule()
  make = lambda: optax.adafactor(learning_rate, min_dim_size_to_factor=min_dim_size_to_factor,
                                 decay_rate=decay_rate, clipping_threshold=clipping_threshold,
                                 multiply_by_parameter_scale=multiply_by_parameter_scale,
                                 momentum=None, factored=True)
  labels = param_labels(params, frozen)
  names = set(jax.tree_util.tree_leaves(labels))
  transforms = {n: optax.set_to_zero() if n == 'frozen' else make() if n == 'default'
                else _per_layer(make()) for n in names}
  tx = optax.multi_transform(transforms, labels)
  return optax.chain(optax.clip_by_global_norm(global_norm_clip), tx) if global_norm_clip else tx


@gin.configurable
def make_optimizer(params, learning_rate, optimizer: Callable = adafactor):
  """The run's optimizer for ``params``, used by every command that builds a train step (T5X's
  ``OPTIMIZER``): ``make_optimizer.optimizer = @adafactor`` (the default), whose own settings are
  bound on it (``adafactor.decay_rate = 0.8``, ...)."""
  return optimizer(params, learning_rate=learning_rate)
