"""softmax(Q K^T / sqrt(d_h) + B) V in one fused kernel that never writes the (batch, heads, q, k)
logits or probabilities to memory and returns the bias gradient dB itself: cuDNN's flash
attention on NVIDIA GPUs (``jax.nn.dot_product_attention``); on TPUs a Pallas kernel over whole
rows (layers/row_attention.py) where they fit, JAX's Pallas flash attention
(``jax.experimental.pallas.ops.tpu``) where they do not.

Which kernel runs is ``TransformerConfig.attention_kernel``:
- ``'xla'``: the project's reference path in layers/attention.py (float32 logits and softmax,
  a dense boolean mask); the only path for synthesizers and mixtures.
- ``'cudnn'`` / ``'pallas'``: that kernel wherever it can serve, the reference path elsewhere,
  each place it cannot serve named once in a warning.
- ``'auto'``: cuDNN on a GPU with a 16-bit compute dtype, Pallas on a TPU, the reference path
  otherwise and for a single query (a cached decode step), silently.

The platform is the one the step is compiled for: the mesh it is traced under
(``partitioning.jit``), so a TPU slice compiled from a CPU or GPU host gets the TPU kernel.

Masks reach a kernel as sequence lengths (valid queries and keys are a prefix of each row, as
for unpacked T5 rows whose padding is id 0 at the end) and a causal flag, or for a packed row as
its segment ids (``Segments``: a query sees the keys of its own segment, 0 being padding), which
the TPU kernels take and cuDNN's call through ``jax.nn.dot_product_attention`` does not: packed
batches run the TPU kernels on a TPU and the reference path on a GPU. T5's relative position bias
enters in the compute dtype with shape (1, heads, q, k). cuDNN and the row kernel sum its gradient
over the batch inside the kernel; JAX's flash kernel takes one bias per example, so there it is
broadcast over the batch and its per-example gradients summed after the kernel.
"""
import warnings
from typing import NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash
from jax.sharding import PartitionSpec as P

from t5x_variants.layers import row_attention

KERNELS = ('auto', 'xla', 'cudnn', 'pallas')
PLATFORMS = {'cudnn': 'gpu', 'pallas': 'tpu'}
# The implementation each kernel runs: tests on a CPU map 'cudnn' to jax.nn.dot_product_attention's
# own XLA implementation, to check everything but the kernel itself.
IMPLEMENTATIONS = {'cudnn': 'cudnn', 'pallas': 'pallas'}
_TPU_BLOCK = 128  # the Pallas kernel's tile along q and k
_warned = set()


class Segments(NamedTuple):
  """A packed batch's mask for a kernel: the segment ids of the queries' and of the keys' rows,
  each (batch, length) int32, 0 for padding."""
  q: jnp.ndarray
  k: jnp.ndarray


def cross_segments(q_segments, k_segments) -> Segments:
  """Packed cross-attention's ``Segments``: a query whose example has no key (a packed example
  without inputs) gets segment 0, so the kernels give it zeros (``attend``). Built once per model
  call; in self-attention every query has its own key."""
  has_key = (q_segments[:, :, None] == k_segments[:, None, :]).any(-1)
  return Segments(jnp.where(has_key, q_segments, 0), k_segments)


def platform() -> str:
  """The platform of the mesh being traced (``partitioning.jit``), else JAX's default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, 'abstract_device', None)
  return jax.default_backend() if device is None else device.platform


def unsupported(components, lengths, dropout: bool, implementation: str) -> Optional[str]:
  """Why no fused call of ``implementation`` can compute this attention (None when one can)."""
  if tuple(components) != ('dot_product',):
    return 'synthesizer logits have no fused kernel'
  if lengths is None:
    return ("a mask that is neither lengths nor segments (a prefix LM's, or packed rows without "
            "both sides' segment ids)")
  if isinstance(lengths, Segments) and implementation != 'pallas':
    return 'packed segments (jax.nn.dot_product_attention takes sequence lengths only)'
  if dropout:
    return 'dropout on the attention probabilities'
  return None


def cudnn_unsupported(dtype, head_dim: int, queries: int, keys: int, biased: bool) -> Optional[str]:
  """Why cuDNN's kernel itself cannot (None when it can). Its training kernel takes even lengths
  only: JAX refuses odd ones where there is a bias, and passes a placeholder bias where there is
  none, so with or without one (``biased`` makes no difference); more than one query may be a
  training step."""
  del biased
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f'cuDNN attention needs a 16-bit compute dtype, not {jnp.dtype(dtype).name}'
  if head_dim % 8 or head_dim > 128:
    return f'head_dim {head_dim} (cuDNN: a multiple of 8, at most 128)'
  if queries > 1 and (queries % 2 or keys % 2):
    return f'{queries} queries x {keys} keys (cuDNN\'s training kernel: even lengths)'
  return None


def pallas_unsupported(dtype, head_dim: int, queries: int, keys: int, biased: bool) -> Optional[str]:
  """Why the TPU Pallas kernels cannot (None when they can): one query is a cached decode step;
  rows too long for the row kernel go to JAX's flash kernel, which takes a head_dim of at most 128
  or a multiple of 128."""
  del dtype, biased
  if queries == 1:
    return 'a single query (a cached decode step)'
  if not row_attention.fits(_tiled(queries), _tiled(keys)) and head_dim > 128 and head_dim % 128:
    return (f'head_dim {head_dim} (JAX\'s flash kernel, for rows of {queries} x {keys}: at most '
            '128 or a multiple of 128)')
  return None


LIMITS = {'cudnn': cudnn_unsupported, 'pallas': pallas_unsupported}


def choose(kernel: str, where: str, queries: int, keys: int, biased: bool, components, lengths,
           dropout: bool, dtype, head_dim: int) -> Optional[str]:
  """The fused implementation for ``kernel`` at ``where`` (the module's path): 'cudnn' or
  'pallas' (or what IMPLEMENTATIONS maps them to), or None for the reference path."""
  if kernel == 'xla':
    return None
  target = platform()
  chosen = kernel
  if kernel == 'auto':
    chosen = {'gpu': 'cudnn', 'tpu': 'pallas'}.get(target)
    if chosen is None or queries == 1:
      return None
  elif IMPLEMENTATIONS[kernel] == kernel and target != PLATFORMS[kernel]:
    raise ValueError(f"attention_kernel {kernel!r} needs a {PLATFORMS[kernel].upper()}; the step "
                     f"is compiled for {target}: use 'auto' (the platform's kernel where it can "
                     f"serve) or 'xla'")
  implementation = IMPLEMENTATIONS[chosen]
  reason = unsupported(components, lengths, dropout, implementation) or (
      LIMITS[chosen](dtype, head_dim, queries, keys, biased) if implementation == chosen else None)
  if reason is None:
    return implementation
  if kernel != 'auto' and (where, reason) not in _warned:
    _warned.add((where, reason))
    warnings.warn(f'attention_kernel {kernel}: the XLA path for the {where}: {reason}', stacklevel=2)
  return None


def attend(query, key, value, bias=None, lengths: Tuple = (None, None), causal: bool = False,
           implementation: str = 'cudnn'):
  """(batch, q, heads, d_h) outputs of queries (batch, q, heads, d_h) over keys and values
  (batch, k, heads, d_h), all in the compute dtype. ``bias``: (1, heads, q, k) or None;
  ``lengths``: (query lengths, key lengths), each (batch,) int32 or None for every position, or
  a packed row's ``Segments`` (the TPU kernels only); ``causal``: key index <= query index. Rows
  past a query length, and queries of segment 0, come out as zeros, and so do the queries of an
  example with no valid key (an all-padding input under cross-attention; a packed example
  without inputs when its ``Segments`` come from ``cross_segments``): the kernels leave softmax
  over an empty set undefined (cuDNN's gradient there was garbage on an H100 and an H200), so
  such an example's query length is set to 0. The reference path gives those queries the mean of
  the values instead; no loss reaches them unless an example has targets but no inputs."""
  if bias is not None and bias.shape[0] != 1:  # one bias for every example (the row kernel's)
    raise ValueError(f'attend: bias of shape {bias.shape}: one (1, heads, q, k) for every example')
  bias = None if bias is None else bias.astype(query.dtype)
  if isinstance(lengths, Segments):
    return _tpu_flash(query, key, value, bias, None, None, causal, lengths)
  q_lengths, k_lengths = (None if n is None else n.astype(jnp.int32) for n in lengths)
  if k_lengths is not None:
    q_lengths = jnp.where(k_lengths == 0, 0, query.shape[1] if q_lengths is None else q_lengths)
  if implementation == 'pallas':
    return _tpu_flash(query, key, value, bias, q_lengths, k_lengths, causal)
  return jax.nn.dot_product_attention(
      query, key, value, bias=bias, scale=query.shape[-1] ** -0.5, is_causal=causal,
      query_seq_lengths=q_lengths, key_value_seq_lengths=k_lengths, implementation=implementation)


def _tiled(n: int) -> int:
  """``n`` rounded up to the TPU kernels' tile."""
  return -(-n // _TPU_BLOCK) * _TPU_BLOCK


def _lengths(lengths, batch: int, n: int):
  """(batch,) int32 valid positions of each row: ``n`` for every row when ``lengths`` is None."""
  return jnp.full((batch,), n, jnp.int32) if lengths is None else jnp.minimum(lengths, n)


def _tpu_flash(query, key, value, bias, q_lengths, k_lengths, causal, segments=None):
  """The Pallas TPU kernels, q and k padded to a multiple of 128 (the padding masked as a row's
  own, or as segment 0 of packed rows, ``segments``): layers/row_attention.py where its whole
  rows fit (T5's lengths), else JAX's flash attention, which tiles q and k by 128 (its default;
  it needs k tiles of 128 with segment ids), takes Q pre-scaled by 1/sqrt(d_h), the mask as
  segment ids (a row's lengths as ids 1 then 0) and one bias per example (broadcast over the
  batch, its gradient summed after). Per device under ``shard_map`` when traced on a mesh
  (``partitioning.jit``): the batch and the heads over the mesh axes their logical-axis rules
  name (the heads where they divide)."""
  b, q, h, d = query.shape
  k = key.shape[1]
  pq, pk = _tiled(q), _tiled(k)
  if segments is None:
    q_mask, k_mask = _lengths(q_lengths, b, q), _lengths(k_lengths, b, k)
  else:  # padding gets segment 0, its own: its queries come out as zeros
    q_mask, k_mask = (jnp.pad(ids.astype(jnp.int32), [(0, 0), (0, n - ids.shape[1])])
                      for ids, n in ((segments.q, pq), (segments.k, pk)))
  pad = lambda x, n: jnp.pad(x, [(0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)])
  query, key, value = pad(query, pq), pad(key, pk), pad(value, pk)
  if bias is not None:
    bias = jnp.pad(bias, [(0, 0), (0, 0), (0, pq - q), (0, pk - k)])
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)

  def row_kernel(qs, ks, vs, qm, km, ab):
    rows = qs.shape[0]
    if qm.ndim == 2:  # segment ids: every position is in range, the segments mask
      segments = (qm[:, :, None], km[:, None, :])
      qm, km = jnp.full((rows,), pq, jnp.int32), jnp.full((rows,), pk, jnp.int32)
    else:
      segments = None
    out = row_attention.attention(heads_first(qs), heads_first(ks), heads_first(vs),
                                  None if ab is None else ab[0], segments, qm, km, d ** -0.5, causal)
    return heads_first(out)

  def flash_kernel(qs, ks, vs, qm, km, ab):
    t = _TPU_BLOCK
    blocks = tpu_flash.BlockSizes(
        block_q=t, block_k_major=t, block_k=t, block_b=1, block_q_major_dkv=t,
        block_k_major_dkv=t, block_k_dkv=t, block_q_dkv=t, block_k_major_dq=t, block_k_dq=t,
        block_q_dq=t)
    qi, ki = (m if m.ndim == 2 else (jnp.arange(n)[None, :] < m[:, None]).astype(jnp.int32)
              for n, m in ((pq, qm), (pk, km)))
    if ab is not None:
      ab = jnp.broadcast_to(ab, (qs.shape[0],) + ab.shape[1:])
    out = tpu_flash.flash_attention(
        heads_first(qs / jnp.sqrt(d).astype(qs.dtype)), heads_first(ks), heads_first(vs), ab,
        tpu_flash.SegmentIds(qi, ki), causal=causal, sm_scale=1.0, block_sizes=blocks)
    return heads_first(out) * (qi > 0)[:, :, None, None].astype(out.dtype)

  kernel = row_kernel if row_attention.fits(pq, pk) else flash_kernel
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.size > 1:
    batch_axis, _, heads_axis = nn.logical_to_mesh_axes(('batch', 'length', 'heads'))
    if heads_axis is not None and h % mesh.shape[heads_axis]:
      heads_axis = None
    rows, heads = P(batch_axis), P(batch_axis, None, heads_axis)
    kernel = jax.shard_map(kernel, mesh=mesh, check_vma=False,
                           in_specs=(heads, heads, heads, rows, rows,
                                     None if bias is None else P(None, heads_axis)),
                           out_specs=heads)
  return kernel(query, key, value, q_mask, k_mask, bias)[:, :q]
