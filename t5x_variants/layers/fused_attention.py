"""softmax(Q K^T / sqrt(d_h) + B) V in one fused kernel (``jax.nn.dot_product_attention``):
cuDNN's flash attention on NVIDIA GPUs, which never writes the (batch, heads, q, k) logits or
probabilities to memory and returns the bias gradient dB itself.

Which kernel runs is ``TransformerConfig.attention_kernel``:
- ``'xla'``: the project's reference path in layers/attention.py (float32 logits and softmax,
  a dense boolean mask); the only path for synthesizers and mixtures.
- ``'cudnn'``: this module wherever the kernel can serve, the reference path elsewhere, each
  place it cannot serve named once in a warning.
- ``'auto'``: ``'cudnn'`` on a GPU with a 16-bit compute dtype, ``'xla'`` otherwise, silently.

Masks reach the kernel as sequence lengths (valid queries and keys are a prefix of each row, as
for unpacked T5 rows whose padding is id 0 at the end) and a causal flag; a packed row (segment
ids) is not a prefix, so packed batches take the reference path. T5's relative position bias
enters in the compute dtype with shape (1, heads, q, k): one for the batch, its gradient summed
over the batch inside the kernel.
"""
import warnings
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

KERNELS = ('auto', 'xla', 'cudnn')
# What jax.nn.dot_product_attention is asked for under each kernel (tests on a CPU map 'cudnn' to
# jax's own XLA implementation to check everything but the kernel itself).
IMPLEMENTATIONS = {'cudnn': 'cudnn'}
_warned = set()


def unsupported(components, lengths, dropout: bool) -> Optional[str]:
  """Why no fused call can compute this attention (None when one can)."""
  if tuple(components) != ('dot_product',):
    return 'synthesizer logits have no fused kernel'
  if lengths is None:
    return 'packed segments are not a prefix of the row (no sequence lengths)'
  if dropout:
    return 'dropout on the attention probabilities'
  return None


def cudnn_unsupported(dtype, head_dim: int) -> Optional[str]:
  """Why cuDNN's kernel itself cannot (None when it can)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f'cuDNN attention needs a 16-bit compute dtype, not {jnp.dtype(dtype).name}'
  if head_dim % 8 or head_dim > 128:
    return f'head_dim {head_dim} (cuDNN: a multiple of 8, at most 128)'
  return None


def choose(kernel: str, where: str, queries: int, components, lengths, dropout: bool, dtype,
           head_dim: int) -> Optional[str]:
  """The ``jax.nn.dot_product_attention`` implementation for ``kernel`` at ``where`` (the
  module's path), or None for the reference path. Under 'auto' a single query (a cached decode
  step: no (q, k) matrix to spare) keeps the reference path; 'cudnn' fuses it too."""
  if kernel == 'xla' or (kernel == 'auto' and (queries == 1 or jax.default_backend() != 'gpu')):
    return None
  implementation = IMPLEMENTATIONS['cudnn']
  if implementation == 'cudnn' and jax.default_backend() != 'gpu':
    raise ValueError(f"attention_kernel 'cudnn' needs an NVIDIA GPU; JAX runs on "
                     f"{jax.default_backend()}: use 'auto' (cuDNN where it can serve) or 'xla'")
  reason = unsupported(components, lengths, dropout) or (
      cudnn_unsupported(dtype, head_dim) if implementation == 'cudnn' else None)
  if reason is None:
    return implementation
  if kernel == 'cudnn' and (where, reason) not in _warned:
    _warned.add((where, reason))
    warnings.warn(f'attention_kernel cudnn: the XLA path for the {where}: {reason}', stacklevel=2)
  return None


def attend(query, key, value, bias=None, lengths: Tuple = (None, None), causal: bool = False,
           implementation: str = 'cudnn'):
  """(batch, q, heads, d_h) outputs of queries (batch, q, heads, d_h) over keys and values
  (batch, k, heads, d_h), all in the compute dtype. ``bias``: (1, heads, q, k) or None;
  ``lengths``: (query lengths, key lengths), each (batch,) int32 or None for every position;
  ``causal``: key index <= query index. Rows past a query length come out as zeros."""
  q_lengths, k_lengths = (None if n is None else n.astype(jnp.int32) for n in lengths)
  return jax.nn.dot_product_attention(
      query, key, value, bias=None if bias is None else bias.astype(query.dtype),
      scale=query.shape[-1] ** -0.5, is_causal=causal, query_seq_lengths=q_lengths,
      key_value_seq_lengths=k_lengths, implementation=implementation)
