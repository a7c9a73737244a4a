"""Synthesizer attention logits (Tay et al. 2021, Sec. 3), per head, without query-key products.

Each module maps integer positions of the queries (batch|1, q_len) and keys (batch|1, k_len), and
the dense forms their hidden activations h (batch, q_len, heads, head_dim), to float32 logits
(batch, heads, q_len, k_len). Keys are addressed by position, so full-sequence, packed and cached
step-by-step calls share one code path. ``max_length`` is the paper's l: a sequence longer than l
is an error, never a truncation (position values, which restart in packed rows, are below the row
length and so below l).

- dense:             B = W_2 h + b_2 with the paper's h = relu(W_1 x + b_1), W_1: d x d (split over
                     heads). The caller (layers/attention.py, ``synthesizer_hidden``) computes h:
                     by default as the authors' Mesh TensorFlow code (``synthetic_attention``,
                     ``dense_minus`` and ``dense_plus(_alpha)``), relu of the attention's own
                     scaled query, h = relu(x W_q / sqrt(d_h)): W_q plays W_1 and, mixed with
                     dot-product attention, one query serves both; 'w1': a separate W_1 (the
                     paper's reading). W_2: d_h x l, one for all heads as that code (``pi``) or,
                     ``shared_projection=False``, one per head (the paper's count d^2 + d l)
- random:            B = R, R: l x l per head, trained
- fixed_random:      B = R, R: l x l per head, never trained (a stop-gradient parameter). R starts
                     near 0 (std 1/sqrt(l)); the authors' code leaves it to TF's glorot-uniform
                     default, smaller still (std 0.0027 for [l, heads, l] = [512, 12, 512], 16x
                     less), so in both its attention is close to uniform: a fixed random
                     synthesizer is nearly mean pooling over the keys, here as there.
- factorized_dense:  B = H_A(A) * H_B(B), A = W_A h, B = W_B h, a x b = l, h as for dense
- factorized_random: B = R_1 R_2^T, R_1, R_2: l x k per head (the code's ``factorized_dim`` k = 16)
"""
import functools
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_variants.layers import init as init_lib

SYNTHESIZERS = ('dense', 'random', 'fixed_random', 'factorized_dense', 'factorized_random')
DENSE_SYNTHESIZERS = ('dense', 'factorized_dense')  # those computed from hidden activations h
# Where the dense synthesizers' h comes from: the attention's query projection (the authors' code)
# or a separate W_1 (the paper's reading). TransformerConfig.synthesizer_hidden.
HIDDEN = ('query', 'w1')


def check_length(k_len: int, max_length: int):
  if k_len > max_length:
    raise ValueError(f'sequence length {k_len} exceeds the synthesizer maximum length {max_length}; '
                     'raise TransformerConfig.encoder_max_length / decoder_max_length (they size '
                     'the synthesizer parameters) or shorten the inputs')


def factor_pair(length: int, a: Optional[int] = None):
  """(a, b) with a * b = length and neither 1 (a x 1 would make B = H_A(A) * H_B(B) a dense
  synthesizer's l logits times one scale per query: nothing factorized); a defaults to the
  divisor of length nearest sqrt(length)."""
  if a is None:
    divisors = [d for d in range(2, length) if length % d == 0]
    if not divisors:
      raise ValueError(f'the synthesizer length {length} has no divisor but 1 and itself, so '
                       'factorized_dense cannot factor it as a x b with a, b > 1: give the stack '
                       'another length (encoder_max_length / decoder_max_length, e.g. a power of 2)')
    a = min(divisors, key=lambda d: abs(d - math.sqrt(length)))
  if not 1 < a < length or length % a:
    raise ValueError(f'synthesizer_factor {a} does not divide the synthesizer length {length} into '
                     'a x b with a, b > 1: give a divisor of it other than 1 and itself, or None '
                     '(the divisor nearest its square root)')
  return a, length // a


def _per_head(module, name, shape, axes, init):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


def _at(table, index):
  """``table[index]``, NaN at a position of l or more (as ``_gather_keys``), not clamped to l - 1."""
  return table.at[index].get(mode='fill', fill_value=jnp.nan)


def _gather_keys(table, k_positions):
  """table (batch, heads, q_len, l) -> (batch, heads, q_len, k_len) at key positions (NaN at a
  position of l or more: packed rows without positions, or a cache decoded past its length)."""
  b = max(table.shape[0], k_positions.shape[0])
  idx = jnp.broadcast_to(k_positions[:, None, None, :], (b,) + table.shape[1:3] + k_positions.shape[-1:])
  return jnp.take_along_axis(jnp.broadcast_to(table, (b,) + table.shape[1:]), idx, axis=-1)


class _PerHeadProjection(nn.Module):
  """W h + b with a separate (head_dim, out) matrix per head, or one for all heads (``shared``):
  (batch, heads, q_len, out)."""
  features: int
  init_scheme: str
  use_bias: bool
  dtype: Any
  shared: bool = False

  @nn.compact
  def __call__(self, h):
    heads, head_dim = h.shape[-2:]
    if self.shared:
      w = _per_head(self, 'kernel', (head_dim, self.features), ('kv', 'length'),
                    init_lib.kernel_init(self.init_scheme, 1.0, 0, 1))
      y = jnp.einsum('bqhd,dl->bhql', h, w.astype(self.dtype)).astype(jnp.float32)
      bias_shape, bias_axes = (1, self.features), ('length',)
    else:
      w = _per_head(self, 'kernel', (heads, head_dim, self.features), ('heads', 'kv', 'length'),
                    init_lib.kernel_init(self.init_scheme, 1.0, 1, 2, batch_axis=0))
      y = jnp.einsum('bqhd,hdl->bhql', h, w.astype(self.dtype)).astype(jnp.float32)
      bias_shape, bias_axes = (heads, self.features), ('heads', 'length')
    if self.use_bias:
      bias = _per_head(self, 'bias', bias_shape[-len(bias_axes):], bias_axes, nn.initializers.zeros)
      y = y + jnp.reshape(bias, (1, -1, 1, self.features))
    return y


class DenseSynthesizer(nn.Module):
  """B = W_2 h + b_2 from the hidden activations h (batch, q_len, heads, head_dim)."""
  max_length: int
  init_scheme: str = 't5'
  use_bias: bool = False
  dtype: Any = jnp.float32
  shared_projection: bool = True

  @nn.compact
  def __call__(self, h, k_positions):
    check_length(k_positions.shape[-1], self.max_length)
    table = _PerHeadProjection(self.max_length, self.init_scheme, self.use_bias, self.dtype,
                               self.shared_projection, name='w2')(h)
    return _gather_keys(table, k_positions)


class FactorizedDenseSynthesizer(nn.Module):
  """C_ij = A_i[j mod a] * B_i[j div a]: H_A tiles A b times, H_B repeats each B entry a times;
  A = W_A h, B = W_B h from the hidden activations h (batch, q_len, heads, head_dim)."""
  max_length: int
  factor: Optional[int] = None
  init_scheme: str = 't5'
  use_bias: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, h, k_positions):
    check_length(k_positions.shape[-1], self.max_length)
    a, b = factor_pair(self.max_length, self.factor)
    proj = functools.partial(_PerHeadProjection, init_scheme=self.init_scheme, use_bias=self.use_bias, dtype=self.dtype)
    return (_gather_keys(proj(a, name='w_a')(h), k_positions % a) *
            _gather_keys(proj(b, name='w_b')(h), k_positions // a))


class RandomSynthesizer(nn.Module):
  """Input-independent logits R[h, i, j]; ``fixed`` keeps R at its random initial value."""
  num_heads: int
  max_length: int
  fixed: bool = False

  @nn.compact
  def __call__(self, x, q_positions, k_positions):
    check_length(k_positions.shape[-1], self.max_length)
    l = self.max_length
    r = _per_head(self, 'random_logits', (self.num_heads, l, l), ('heads', 'length', 'key_length'),
                  nn.initializers.variance_scaling(1.0, 'fan_in', 'normal', 2, 1, batch_axis=0))
    if self.fixed:
      r = jax.lax.stop_gradient(r)
    logits = _at(r, (slice(None), q_positions[:, :, None], k_positions[:, None, :]))  # (h, b, q, k)
    return jnp.transpose(logits, (1, 0, 2, 3))


class FactorizedRandomSynthesizer(nn.Module):
  num_heads: int
  max_length: int
  rank: int = 16
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, q_positions, k_positions):
    check_length(k_positions.shape[-1], self.max_length)
    shape = (self.num_heads, self.max_length, self.rank)
    init = nn.initializers.variance_scaling(1.0, 'fan_in', 'normal', 2, 1, batch_axis=0)
    r1 = _per_head(self, 'random_factor_1', shape, ('heads', 'length', 'rank'), init)
    r2 = _per_head(self, 'random_factor_2', shape, ('heads', 'length', 'rank'), init)
    return jnp.einsum('hbqr,hbkr->bhqk', _at(r1, (slice(None), q_positions)).astype(self.dtype),
                      _at(r2, (slice(None), k_positions)).astype(self.dtype)).astype(jnp.float32)
