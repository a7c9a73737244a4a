"""Dense projection with logical axis names on its kernel (T5X DenseGeneral)."""
import math
import os
from typing import Any, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_variants.layers import fused_attention
from t5x_variants.layers import init as init_lib


# 'dot_general' or 'matmul' forces the contraction's form on every platform, to measure one
# against the other (scripts/gpu_bench.sh's d128); unset, a TPU contracts as laid out.
CONTRACTION = 'T5XV_DENSE_CONTRACTION'


def laid_out() -> bool:
  """Whether Dense contracts over the axes as they are (one dot_general) or as a 2-D matmul."""
  form = os.environ.get(CONTRACTION, '')
  if form not in ('', 'dot_general', 'matmul'):
    raise ValueError(f"{CONTRACTION}={form!r}: 'dot_general', 'matmul' or unset (the platform's)")
  return form == 'dot_general' if form else fused_attention.platform() == 'tpu'


@jax.custom_vjp
def matmul_float32(x, w):
  """x W for x (..., n) and W (n, m) in the compute dtype, accumulated and returned in float32:
  T5X's output logits (a float32 layer, whose operands a TPU rounds to bfloat16 at default
  precision), not rounded to bfloat16 before the softmax. The gradients are those of a
  compute-dtype result: the cotangent rounded once, both products on compute-dtype operands."""
  return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _matmul_float32_fwd(x, w):
  return matmul_float32(x, w), (x, w)


def _matmul_float32_bwd(saved, g):
  x, w = saved
  g = g.astype(x.dtype)
  rows = g.reshape(-1, g.shape[-1])  # as one 2-D matmul: the form measured fastest (Dense)
  return (jnp.dot(g, w.T).astype(x.dtype),
          jnp.dot(x.reshape(-1, x.shape[-1]).T, rows).astype(w.dtype))


matmul_float32.defvjp(_matmul_float32_fwd, _matmul_float32_bwd)


class Dense(nn.Module):
  """y = x W (+ b): contracts the last ``len(in_axes)`` dims of x with W[in..., out...].
  ``float32_result`` (one input and one output axis): y from ``matmul_float32``, b added in
  float32 (output logits and classifier scores)."""
  features: Tuple[int, ...]
  in_axes: Tuple[str, ...]
  out_axes: Tuple[str, ...]
  init_scheme: str = 't5'
  gain: float = 1.0
  t5_distribution: str = 'normal'
  use_bias: bool = False
  dtype: Any = jnp.float32
  float32_result: bool = False

  @nn.compact
  def __call__(self, x):
    n_in, n_out = len(self.in_axes), len(self.out_axes)
    initializer = init_lib.kernel_init(self.init_scheme, self.gain, tuple(range(n_in)),
                                       tuple(range(n_in, n_in + n_out)), self.t5_distribution)
    kernel = self.param('kernel',
                        nn.with_logical_partitioning(initializer, self.in_axes + self.out_axes),
                        x.shape[-n_in:] + tuple(self.features), jnp.float32)
    # Used as laid out without fsdp (the rules a step is traced under, train/partitioning.jit): an
    # fsdp-split weight is gathered in the compute dtype, where XLA would otherwise split the
    # matmul over embed and move the activations instead (the logits' all-reduce on v5p).
    kernel = nn.with_logical_constraint(kernel.astype(self.dtype), self.in_axes + self.out_axes)
    x = x.astype(self.dtype)
    n_rows = math.prod(kernel.shape[:n_in])
    if self.float32_result:
      if (n_in, n_out) != (1, 1):
        raise ValueError(f'float32_result needs one input and one output axis, not {self.in_axes} '
                         f'-> {self.out_axes}')
      y = matmul_float32(x, kernel)
    elif laid_out():
      # Contracted as laid out: the TPU compiler then writes each output in the layout its
      # consumer reads (q, k, v heads-first for the attention kernel, and their gradients
      # back), where a 2-D matmul's output must be transposed by a copy (T5-base on v5p-16,
      # fsdp, the cost model's estimate: 39.8 -> 34.3 ms, BENCHMARKS.md).
      contracted = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
      y = jax.lax.dot_general(x, kernel, (contracted, ((), ())))
    else:
      # As one 2-D matmul: with several batch-like dims the weight gradient contracts two of them,
      # which XLA CPU serves with transposed copies (measured: GEGLU FFN fwd+bwd 357 -> 209 ms);
      # on a GPU the only form measured.
      y = jnp.dot(x.reshape(-1, n_rows), kernel.reshape(n_rows, math.prod(self.features)))
      y = y.reshape(x.shape[:x.ndim - n_in] + tuple(self.features))
    if self.use_bias:
      bias = self.param('bias', nn.with_logical_partitioning(
          init_lib.bias_init(self.init_scheme, self.gain, n_rows), self.out_axes), tuple(self.features), jnp.float32)
      y = y + bias.astype(y.dtype)
    return y
