"""The papers' optimizers as gin objects, and their learning-rate schedules.

- ``adafactor`` (Shazeer & Stern 2018) as T5 used it: factored second moments, decay rate 0.8,
  parameter-scaled relative steps, update clipping 1.0, no momentum; an attention projection
  seen as the (d_model, heads x head_dim) matrix T5 stored, so its moments factor as T5's did.
- ``adam`` / ``adamw`` (optax), as DeepNet, Magneto and Xiong et al. trained.

A scanned stack stores its layers on a leading ``layers`` axis; each layer gets its own
statistics (the optimizer is vmapped over that axis), so Adafactor never factors the layers axis
and its parameter scale and clipping stay per layer, as T5X's factor rules treat it; for the
elementwise Adam this changes nothing. Parameters of a ``fixed_random`` synthesizer (and any path
listed in ``make_optimizer.frozen``) get no update.
"""
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import gin
import jax
import jax.numpy as jnp
import optax

from t5x_variants import is_positive_number, path_keys, path_within

SCHEDULES = ('rsqrt', 'constant', 'noam', 'linear', 'cosine')


def _inverse_sqrt(base: float, warmup_steps: int):
  """base / sqrt(max(step, warmup_steps)) in float32: T5's schedule (constant during the warmup,
  then proportional to 1/sqrt(step)). optax has no inverse-square-root schedule."""
  return lambda step: base / jnp.sqrt(jnp.maximum(jnp.asarray(step, jnp.float32), warmup_steps))


def _noam(base: float, warmup_steps: int, d_model: Optional[int]):
  """base * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (Vaswani et al. 2017, Eq. 3);
  without d_model the factor is sqrt(warmup), so the peak at step = warmup is ``base`` (fairseq's
  inverse_sqrt, as DeepNet and Magneto ran it). ``step`` counts the updates done, as fairseq's
  num_updates (the first update gets 0); tensor2tensor's noam counts from 1, a step earlier."""
  scale = d_model**-0.5 if d_model else warmup_steps**0.5
  def lr(step):
    s = jnp.asarray(step, jnp.float32)
    return base * scale * jnp.minimum(jax.lax.rsqrt(jnp.maximum(s, 1.0)), s * warmup_steps**-1.5)
  return lr


def _warmup_linear(base: float, warmup_steps: int, total_steps: int, end_value: float):
  """0 -> base linearly over the warmup, then base -> end_value linearly at total_steps. Written
  out: optax's linear_schedule under jit ends at about -2e-11, not 0 (as noted below)."""
  def lr(step):
    s = jnp.asarray(step, jnp.float32)
    decay = jnp.clip((total_steps - s) / (total_steps - warmup_steps), 0.0, 1.0)
    return jnp.where(s < warmup_steps, base * s / max(warmup_steps, 1),
                     end_value + (base - end_value) * decay)
  return lr


@gin.configurable
def learning_rate_schedule(name: str = 'rsqrt', base: float = 1.0, warmup_steps: int = 10_000,
                           total_steps: Optional[int] = None, decay_fraction: float = 0.0,
                           d_model: Optional[int] = None, end_value: float = 0.0,
                           warmup_ramp: bool = True):
  """lr(step), where ``step`` counts the updates applied before this one (0 for the first).

  - 'rsqrt': base / sqrt(max(step, warmup_steps)) (T5: base 1, 0.01 for 10k steps, then decaying);
  - 'constant': base;
  - 'noam': linear warmup to step ``warmup_steps``, then inverse square root (``_noam``);
  - 'linear' / 'cosine': linear warmup from 0 to ``base`` over ``warmup_steps``, then linear or
    cosine (Loshchilov & Hutter 2017; optax's) decay to ``end_value`` at ``total_steps``, from the
    peak after the warmup (fairseq's polynomial_decay, Hugging Face's linear schedule; BERT's code
    decays base * (1 - step / total_steps) from step 0, the warmup overriding it).

  With ``warmup_ramp=False`` the rate is lr(max(step, warmup_steps)): the peak from the first step
  and the warmed-up schedule after ``warmup_steps``, a no-warmup arm at its twin's rate level
  (Xiong et al. 2020).

  With ``decay_fraction`` > 0 the rate is also multiplied by
  clip((total_steps - step) / (decay_fraction * total_steps), 0, 1): it falls linearly to 0 over
  the last ``decay_fraction * total_steps`` steps (the GLU-variants paper: the final 10%) and is
  0 from ``total_steps`` on. That factor is written out rather than taken from
  ``optax.linear_schedule``: its ``1 - count / transition_steps`` rounds differently in float32,
  and under jit (a division by a constant becomes a multiplication by its reciprocal) it leaves
  a factor of ~2.5e-8, not 0, at and after the last step."""
  if name not in SCHEDULES:
    raise ValueError(f'unknown schedule {name!r}; valid: {", ".join(SCHEDULES)}')
  zero_or_more = lambda v: is_positive_number(v) or (v == 0 and not isinstance(v, bool))
  valid = {'base': (base, is_positive_number(base), 'a number > 0'),  # (a negative rate trained
           'end_value': (end_value, zero_or_more(end_value), 'a number >= 0'),  # by gradient
           'decay_fraction': (decay_fraction, zero_or_more(decay_fraction) and decay_fraction <= 1,
                              'a number in [0, 1]'),  # ascent, silently; a string failed in optax)
           'warmup_steps': (warmup_steps, zero_or_more(warmup_steps)
                            and int(warmup_steps) == warmup_steps, 'an integer >= 0')}
  for field, (value, ok, what) in valid.items():
    if not ok:
      raise ValueError(f'learning_rate_schedule.{field} = {value!r} is out of range: it must be '
                       f'{what}')
  if (decay_fraction or name in ('linear', 'cosine')) and not total_steps:
    raise ValueError(f'schedule {name!r}' + (' with decay_fraction' if decay_fraction else '') +
                     ' needs learning_rate_schedule.total_steps')
  if name in ('linear', 'cosine') and not 0 <= warmup_steps < total_steps:
    raise ValueError(f'learning_rate_schedule.warmup_steps = {warmup_steps} must be in [0, '
                     f'total_steps {total_steps}) for schedule {name!r}: lower it (or train longer)')
  if name in ('rsqrt', 'noam') and warmup_steps < 1:  # 1/sqrt(0) at the first step: inf
    raise ValueError(f'learning_rate_schedule.warmup_steps = {warmup_steps}: schedule {name!r} '
                     'divides by the square root of the warmup; it must be at least 1')
  if name == 'constant':
    lr = optax.constant_schedule(base)
  elif name == 'rsqrt':
    lr = _inverse_sqrt(base, warmup_steps)
  elif name == 'noam':
    lr = _noam(base, warmup_steps, d_model)
  elif name == 'cosine':
    lr = optax.warmup_cosine_decay_schedule(0.0, base, warmup_steps, total_steps, end_value)
  else:
    lr = _warmup_linear(base, warmup_steps, total_steps, end_value)
  if not warmup_ramp:
    ramped = lr
    lr = lambda step: ramped(jnp.maximum(jnp.asarray(step, jnp.float32), warmup_steps))
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
    keys = path_keys(path)
    if 'fixed_random' in keys or any(path_within(keys, f) for f in frozen):
      return 'frozen'
    if 'layers' in keys:
      return '/'.join(keys[:keys.index('layers') + 1])
    return 'default'
  return jax.tree_util.tree_map_with_path(label, params)


class Optimizer(NamedTuple):
  """An optax transformation (``init``, ``update``) with its ``labels`` (``param_labels``)."""
  init: Callable
  update: Callable
  labels: Any

  def trained_norm(self, grads):
    """The global L2 norm of the trained parameters' gradients (a frozen path's are none of it)."""
    return optax.tree_utils.tree_norm(_trained(grads, self.labels))


def _trained(grads, labels):
  """``grads`` with a frozen path's zeroed: it updates nothing."""
  return jax.tree_util.tree_map(lambda g, label: jnp.zeros_like(g) if label == 'frozen' else g,
                                grads, labels)


# The attention projections, whose heads and head_dim axes T5 stored as one (``as_matrix``).
PROJECTIONS = ('query', 'key', 'value', 'out')


def as_matrix(path, shape: Tuple[int, ...]) -> Tuple[int, ...]:
  """The shape T5 stored a parameter of one layer in: an attention projection's heads and
  head_dim axes as one (Mesh TensorFlow's combined dims; T5X's factor rules make both one
  column), (d_model, heads x head_dim) for query / key / value and a dense synthesizer's W_1
  (``*_w1``) and (heads x head_dim, d_model) for out; any other parameter as it is."""
  keys = path_keys(path)
  if (len(shape) != 3 or len(keys) < 2 or keys[-1] != 'kernel'
      or not (keys[-2] in PROJECTIONS or str(keys[-2]).endswith('_w1'))):
    return shape
  return (shape[0] * shape[1], shape[2]) if keys[-2] == 'out' else (shape[0], shape[1] * shape[2])


def optimizer_hint(entry: str, reshaped: bool) -> str:
  """The setting that may make a saved optimizer state of other settings read, for the name of
  its first entry that differs ('opt_state/...'), ``reshaped`` if the checkpoint holds it with
  another shape (not another optimizer's statistic); '' if none is known."""
  projection = any(f'/{name}/kernel' in entry for name in PROJECTIONS)
  if reshaped and projection:  # Adafactor's layout of an attention projection's statistics
    return (' (an Adafactor state of the other attention layout: '
            '--gin.adafactor.combine_heads=False reads those saved before 49e9cc9, True those after)')
  if reshaped and '_w1/kernel' in entry:  # a dense synthesizer's W_1, factored since then
    return (" (Adafactor's statistics of a dense synthesizer's W_1, kept whole before they were "
            'factored as a query\'s: start from its parameters, with --gin.train.init_checkpoint '
            'and --gin.train.init_optimizer=False)')
  if entry.startswith('opt_state/1/'):  # optax.chain(clip, ...): the statistics one level down
    return (' (make_optimizer.global_norm_clip is set in one of the two runs only: set it as the '
            'checkpoint\'s run had)')
  return ''


def _on_matrices(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` seeing each parameter of a layer in its ``as_matrix`` shape (its state kept so)."""
  def matrices(tree):
    return None if tree is None else jax.tree_util.tree_map_with_path(
        lambda path, x: x.reshape(as_matrix(path, x.shape)), tree)

  def update(updates, state, params=None):
    new, state = tx.update(matrices(updates), state, matrices(params))
    return jax.tree_util.tree_map(lambda u, g: u.reshape(g.shape), new, updates), state
  return optax.GradientTransformation(lambda params: tx.init(matrices(params)), update)


@gin.configurable
def adafactor(learning_rate, decay_rate: float = 0.8, clipping_threshold: float = 1.0,
              multiply_by_parameter_scale: bool = True, min_dim_size_to_factor: int = 128,
              combine_heads: bool = True, momentum: Optional[float] = None,
              dtype_momentum: str = 'float32', weight_decay_rate: Optional[float] = None,
              factored: bool = True):
  """Adafactor (Shazeer & Stern 2018) as T5 ran it by default (factored, no momentum), with
  ``combine_heads`` on each layer's parameters as T5 stored them (``as_matrix``): its second
  moments of an attention projection factor over d_model and heads x head_dim (on (d_model,
  heads, head_dim) optax factors nothing below head_dim 128; False keeps that layout, of this
  project's checkpoints before 49e9cc9). A matrix whose smaller side is under
  ``min_dim_size_to_factor`` keeps its full second moments, as in Mesh TensorFlow; T5X's factor
  rules factor the attention kernels, and every kernel of a scanned stack, whatever their size
  (unrolled FFN and embedding matrices by the same 128 rule), so below d_model 128 (t5_tiny, the
  small-scale recipes) T5X would factor where this does not.

  T5X's other settings: ``momentum`` b1 (m <- b1 m + (1 - b1) u over the scaled updates u, no
  bias correction) kept in ``dtype_momentum``; ``weight_decay_rate`` w (the step is u + w theta,
  w not scaled by the learning rate); ``factored=False`` (whole moments). Not T5X's
  ``step_offset``: its decay 1 - (t - offset)^-decay_rate is not a number while t < offset."""
  tx = optax.adafactor(
      learning_rate, min_dim_size_to_factor=min_dim_size_to_factor, decay_rate=decay_rate,
      clipping_threshold=clipping_threshold, multiply_by_parameter_scale=multiply_by_parameter_scale,
      momentum=momentum, dtype_momentum=jnp.dtype(dtype_momentum), weight_decay_rate=weight_decay_rate,
      factored=factored)
  return _on_matrices(tx) if combine_heads else tx


@gin.configurable
def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8):
  """Adam (Kingma & Ba 2015); DeepNet, Magneto and fairseq's Transformers use b2 = 0.98."""
  return optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)


@gin.configurable
def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.01, decay_norms_and_biases: bool = True,
          bias_correction: bool = True):
  """AdamW (Loshchilov & Hutter 2019): decay lr * weight_decay * theta decoupled from the Adam
  step, on every trained parameter (as fairseq's and PyTorch's AdamW); with
  ``decay_norms_and_biases`` False not on the norms' parameters and the biases (BERT's
  ``exclude_from_weight_decay``), T5's relative position bias among them (as Hugging Face's
  Trainer leaves out T5's ``relative_attention_bias`` by its name). ``bias_correction`` False:
  the Adam step m_t / (sqrt(v_t) + eps) without dividing m_t and v_t by 1 - b^t, as BERT's
  released ``AdamWeightDecayOptimizer`` (its steps (1 - b1^t) / sqrt(1 - b2^t) times the corrected
  ones for a steady gradient: 6.5x at step 10 with b1 0.9, b2 0.999)."""
  decayed = None if decay_norms_and_biases else (lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: not _norm_or_bias(path_keys(path)), params))
  if bias_correction:
    return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                       mask=decayed)
  return optax.chain(_adam_uncorrected(b1, b2, eps),  # optax.adamw's chain, state and all
                     optax.add_decayed_weights(weight_decay, decayed),
                     optax.scale_by_learning_rate(learning_rate))


def _adam_uncorrected(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
  """m_t = b1 m + (1 - b1) g, v_t = b2 v + (1 - b2) g^2, step m_t / (sqrt(v_t) + eps): Adam's
  (Kingma & Ba 2015, Alg. 1) without the bias correction; kept in optax's ScaleByAdamState."""
  def init(params):
    zeros = lambda: jax.tree_util.tree_map(jnp.zeros_like, params)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros())

  def update(updates, state, params=None):
    del params
    mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
    nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
    step = jax.tree_util.tree_map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    return step, optax.ScaleByAdamState(optax.safe_int32_increment(state.count), mu, nu)
  return optax.GradientTransformation(init, update)


def _norm_or_bias(keys) -> bool:
  return keys[-1:] == ['bias'] or 'relpos_bias' in keys or any(k.endswith('norm') for k in keys)


@gin.configurable
def make_optimizer(params, learning_rate, optimizer: Callable = adafactor,
                   global_norm_clip: Optional[float] = None, frozen: Sequence[str] = ()):
  """The run's optimizer for ``params``, used by every command that builds a train step (T5X's
  ``OPTIMIZER``): ``make_optimizer.optimizer = @adafactor`` (the default), ``@adam`` or
  ``@adamw``, whose own settings are bound on them (``adam.b2 = 0.98``, ...).

  Each scanned layer stack gets the optimizer per layer (vmapped over the ``layers`` axis), the
  ``frozen`` paths no update, and with ``global_norm_clip`` the trained parameters' gradients are
  first clipped to that global norm (Pascanu et al. 2013; a frozen path's gradient is no part of
  the update, so none of its norm)."""
  if global_norm_clip is not None and not is_positive_number(global_norm_clip):  # a negative
    # one reversed every gradient
    raise ValueError(f'make_optimizer.global_norm_clip = {global_norm_clip!r} is out of range: it '
                     'must be a number > 0, or None for no clipping')
  labels = param_labels(params, frozen)
  # Sorted, not a set's order (Python's per-process hash seed): every process traces one program.
  transforms = {n: optax.set_to_zero() if n == 'frozen' else
                optimizer(learning_rate) if n == 'default' else _per_layer(optimizer(learning_rate))
                for n in sorted(set(jax.tree_util.tree_leaves(labels)))}
  tx = optax.multi_transform(transforms, labels)
  if global_norm_clip:
    clip = optax.clip_by_global_norm(global_norm_clip)
    tx = optax.chain(optax.GradientTransformation(
        clip.init, lambda grads, state, params=None: clip.update(_trained(grads, labels), state, params)), tx)
  return Optimizer(tx.init, tx.update, labels)
