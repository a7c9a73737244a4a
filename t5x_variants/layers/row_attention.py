"""softmax(s Q K^T + B) V as a Pallas TPU kernel that holds whole rows: one grid step per
(head, example) computes every query against every key in VMEM, so no softmax statistics are
written for the backward pass (it recomputes the rows), and T5's relative position bias B is read
once per head for the whole batch, its gradient dB = sum over the batch of dS summed inside the
kernel (dS = P * (dP - rowsum(P * dP)), dP = dO V^T, P the softmax). For the short rows of T5
(512 x 512 at most: ``fits``); longer ones take JAX's flash kernel (layers/fused_attention.py).

Masks are sequence lengths (keys past a row's length get no weight, queries past it give zeros)
and a causal flag, and for packed rows segment ids (a query sees the keys of its own segment;
segment 0 is padding, whose queries give zeros). Inputs heads-first: q (batch, heads, q, d), k
and v (batch, heads, k, d), the bias (heads, q, k), q and k multiples of 128 (the caller pads
them); segment ids (batch, q, 1) and (batch, 1, k).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MAX_ROW_ELEMENTS = 512 * 512  # q x k per grid step; at 512 x 512 it compiles for v4, v5e, v5p, v6e
_MASKED = -1e30  # a logit no key past a length or above the diagonal can win against
_NT = (((1,), (1,)), ((), ()))  # contract the last dimensions: A B^T


def fits(queries: int, keys: int) -> bool:
  """Whether a (queries x keys) row block fits the kernel's VMEM budget."""
  return queries * keys <= MAX_ROW_ELEMENTS


def _probabilities(q_len, k_len, q, k, bias, segments, scale, causal):
  """(P, the query-row mask) of one (head, example): softmax over the valid keys, Eq. softmax(
  s Q K^T + B), float32. ``segments``: the example's (q, 1) and (1, k) segment ids, or None."""
  s = jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
  if bias is not None:
    s = s + bias.astype(jnp.float32)
  rows = jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
  keep = cols < k_len
  if causal:
    keep = jnp.logical_and(keep, cols <= rows)
  valid_query = jax.lax.broadcasted_iota(jnp.int32, (s.shape[0], 1), 0) < q_len
  if segments is not None:
    q_seg, k_seg = segments
    keep = jnp.logical_and(keep, q_seg == k_seg)
    valid_query = jnp.logical_and(valid_query, q_seg > 0)
  s = jnp.where(keep, s, _MASKED)
  p = jnp.exp(s - jnp.max(s, axis=1, keepdims=True))
  p = p / jnp.sum(p, axis=1, keepdims=True)
  return p, valid_query


def _inputs(refs, has_bias, has_segments):
  """(bias block or None, (q segments, k segments) or None, the rest) of a kernel's refs."""
  bias = refs[0][0] if has_bias else None
  refs = refs[has_bias:]
  segments = (refs[0][0], refs[1][0]) if has_segments else None
  return bias, segments, refs[2 * has_segments:]


def _forward_kernel(q_lens, k_lens, q_ref, k_ref, v_ref, *refs, scale, causal, has_bias,
                    has_segments):
  bias, segments, (o_ref,) = _inputs(refs, has_bias, has_segments)
  b = pl.program_id(1)
  p, valid_query = _probabilities(q_lens[b], k_lens[b], q_ref[0, 0], k_ref[0, 0], bias, segments,
                                  scale, causal)
  v = v_ref[0, 0]
  o = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  o_ref[0, 0] = jnp.where(valid_query, o, 0.0).astype(o_ref.dtype)


def _backward_kernel(q_lens, k_lens, q_ref, k_ref, v_ref, *refs, scale, causal, has_bias,
                     has_segments):
  bias, segments, refs = _inputs(refs, has_bias, has_segments)
  do_ref, dq_ref, dk_ref, dv_ref = refs[:4]
  dbias_ref = refs[4] if has_bias else None
  b = pl.program_id(1)
  q, k, v = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0]
  p, valid_query = _probabilities(q_lens[b], k_lens[b], q, k, bias, segments, scale, causal)
  do = jnp.where(valid_query, do_ref[0, 0], 0).astype(v.dtype)  # queries past a length: no output
  dv = jnp.dot(p.T.astype(v.dtype), do, preferred_element_type=jnp.float32)
  dp = jax.lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
  ds = p * (dp - jnp.sum(p * dp, axis=1, keepdims=True))
  dq = jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale
  dk = jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32) * scale
  dq_ref[0, 0] = dq.astype(dq_ref.dtype)
  dk_ref[0, 0] = dk.astype(dk_ref.dtype)
  dv_ref[0, 0] = dv.astype(dv_ref.dtype)
  if has_bias:  # dB = sum over the batch of dS: the block stays in VMEM while b runs
    @pl.when(b == 0)
    def _():
      dbias_ref[...] = jnp.zeros_like(dbias_ref)
    dbias_ref[0] += ds


def _specs(q, k, bias):
  """Block specs on the (head, example) grid: q-like, k-like, and the bias read per head."""
  _, _, nq, d = q.shape
  nk = k.shape[2]
  per_row = lambda n: pl.BlockSpec((1, 1, n, d), lambda h, b, *_: (b, h, 0, 0))
  per_head = pl.BlockSpec((1, nq, nk), lambda h, b, *_: (h, 0, 0))
  return per_row(nq), per_row(nk), ([per_head] if bias is not None else [])


def _segment_specs(segments):
  """The example's (1, q, 1) and (1, 1, k) segment-id blocks, or none."""
  if segments is None:
    return []
  return [pl.BlockSpec((1,) + ids.shape[1:], lambda h, b, *_: (b, 0, 0)) for ids in segments]


def _call(kernel, q, k, v, bias, segments, lengths, extra, out_specs, out_shape, semantics, cost):
  q_spec, k_spec, bias_spec = _specs(q, k, bias)
  in_specs = [q_spec, k_spec, k_spec] + bias_spec + _segment_specs(segments) + [q_spec] * len(extra)
  operands = ((q, k, v) + ((bias,) if bias is not None else ()) + tuple(segments or ())
              + tuple(extra))
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(q.shape[1], q.shape[0]), in_specs=in_specs,
          out_specs=out_specs),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      cost_estimate=cost,
  )(*lengths, *operands)


def _nbytes(*arrays) -> int:
  return sum(x.size * x.dtype.itemsize for x in arrays if x is not None)


def _forward(q, k, v, bias, segments, q_lens, k_lens, scale, causal):
  b, h, nq, d = q.shape
  nk = k.shape[2]
  kernel = functools.partial(_forward_kernel, scale=scale, causal=causal, has_bias=bias is not None,
                             has_segments=segments is not None)
  q_spec, _, _ = _specs(q, k, bias)
  out = jax.ShapeDtypeStruct(q.shape, q.dtype)
  cost = pl.CostEstimate(flops=4 * b * h * nq * nk * d, transcendentals=b * h * nq * nk,
                         bytes_accessed=_nbytes(q, k, v, bias, q, *(segments or ())) + 8 * b)
  return _call(kernel, q, k, v, bias, segments, (q_lens, k_lens), (), q_spec, out,
               ('parallel', 'parallel'), cost)


def _backward(q, k, v, bias, segments, q_lens, k_lens, do, scale, causal):
  b, h, nq, d = q.shape
  nk = k.shape[2]
  has_bias = bias is not None
  kernel = functools.partial(_backward_kernel, scale=scale, causal=causal, has_bias=has_bias,
                             has_segments=segments is not None)
  q_spec, k_spec, bias_spec = _specs(q, k, bias)
  out_specs = [q_spec, k_spec, k_spec]
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
  if has_bias:
    out_specs.append(bias_spec[0])
    out_shape.append(jax.ShapeDtypeStruct(bias.shape, jnp.float32))
  # The forward recomputed (2 matmuls), dV, dP, dQ, dK: 6 matmuls of 2 q k d FLOPs each.
  cost = pl.CostEstimate(
      flops=12 * b * h * nq * nk * d, transcendentals=b * h * nq * nk,
      bytes_accessed=_nbytes(q, k, v, bias, do, q, k, v, *(segments or ()))
      + (4 * bias.size if has_bias else 0) + 8 * b)
  grads = _call(kernel, q, k, v, bias, segments, (q_lens, k_lens), (do,), out_specs, out_shape,
                ('parallel', 'arbitrary'), cost)
  return tuple(grads) + ((None,) if not has_bias else ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def attention(q, k, v, bias, segments, q_lens, k_lens, scale: float, causal: bool):
  """(batch, heads, q, d) outputs; ``bias`` (heads, q, k) or None; ``segments``: packed rows'
  (batch, q, 1) and (batch, 1, k) int32 segment ids, or None; ``q_lens``, ``k_lens`` (batch,)
  int32."""
  return _forward(q, k, v, bias, segments, q_lens, k_lens, scale, causal)


def _attention_fwd(q, k, v, bias, segments, q_lens, k_lens, scale, causal):
  return (_forward(q, k, v, bias, segments, q_lens, k_lens, scale, causal),
          (q, k, v, bias, segments, q_lens, k_lens))


def _attention_bwd(scale, causal, residuals, do):
  q, k, v, bias, segments, q_lens, k_lens = residuals
  dq, dk, dv, dbias = _backward(q, k, v, bias, segments, q_lens, k_lens, do, scale, causal)
  if dbias is not None:
    dbias = dbias.astype(bias.dtype)
  return dq, dk, dv, dbias, None, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
