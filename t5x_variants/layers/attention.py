"""Multi-head attention whose logits come from dot products, synthesizers or a mixture of them.

softmax(sum_i w_i S_i(X)) G(X) with w = softmax(learned mixture weights) (Tay et al. 2021, Sec. 3);
S = Q K^T / sqrt(d_h) for ``dot_product`` (Vaswani et al. 2017), and G(X) the shared value
projection; T5's relative position bias, when given, is added to the mixed logits. The dense
synthesizers' hidden layer is, by default, relu of the same scaled query Q / sqrt(d_h)
(``synthesizer_hidden``; layers/synthesizer.py), so a mixture with dot product creates one
query. Every matmul runs in the compute dtype (float32 accumulation is the hardware's), its result
too: in bfloat16 the logits are rounded to it, then their mixture, the bias and the softmax run
in float32 (T5X's default, ``float32_logits=False``, runs these in bfloat16 as well; the fused
kernels keep their scores in float32).

The dot-product path may instead run as one fused kernel (``kernel``: layers/fused_attention.py),
which takes the mask as sequence ``lengths`` and the module's ``causal`` flag rather than the
dense boolean ``mask``; both describe the same attention, and tests hold the two paths equal.

Decoding: with ``decode=True`` keys and values live in the ``cache`` collection. The first call
(during ``init``) creates the cache from the full-length input; every later call takes one token
(or a decoder-only model's prompts, the prefill), writes its keys and values from
``decode_position`` on and attends over the cache under the given mask. Cross-attention's keys
and values, of the encoder's output, are projected once where an ``apply`` made the cache
(``_keys_or_values``).
"""
import functools
from typing import Any, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from t5x_variants.layers import fused_attention
from t5x_variants.layers import synthesizer as synth
from t5x_variants.layers.dense import Dense
from t5x_variants.layers.norms import Norm

ATTENTION_COMPONENTS = ('dot_product',) + synth.SYNTHESIZERS
_NEG_INF = -1e10


class CacheWrite(NamedTuple):
  """Where a cached decoding call writes its keys and values: from position ``index`` (a scalar),
  except, in each row, the positions before ``keep`` (batch,): its prefilled prompt."""
  index: jnp.ndarray
  keep: jnp.ndarray


def resolve_components(self_attention) -> Tuple[str, ...]:
  comps = (self_attention,) if isinstance(self_attention, str) else tuple(self_attention)
  bad = [c for c in comps if c not in ATTENTION_COMPONENTS]
  if bad or not comps or len(set(comps)) != len(comps):
    raise ValueError(f'invalid self_attention {self_attention!r}: give one of '
                     f'{", ".join(ATTENTION_COMPONENTS)} or a tuple of distinct ones for a mixture')
  return comps


def causal_mask(q_index, k_index):
  """(batch|1, 1, q_len, k_len): key index <= query index. Indices are token order in the row,
  not position values, so restarting positions in a packed row cannot open the future."""
  return (k_index[:, None, :] <= q_index[:, :, None])[:, None]


def pair_mask(q_valid, k_valid):
  """(batch, 1, q_len, k_len) from per-token booleans or ids of queries and keys."""
  return (q_valid[:, :, None] & k_valid[:, None, :])[:, None]


def segment_mask(q_segments, k_segments):
  return (q_segments[:, :, None] == k_segments[:, None, :])[:, None]


def _batch_sum(x):
  """Sum over the leading axis by adding adjacent rows pairwise: elementwise adds that XLA CPU
  streams, where its reduce over a major axis is ~40x slower (measured: 8x8x512x512 fp32 in 2 ms
  vs 90 ms). Adjacent rows, not halves: with the batch split over devices (contiguous blocks),
  every add stays on its device until one row per device is left, where halves would move the
  whole (batch, heads, q, k) gradient between chips (the TPU cost model counted 38 GB of
  collective-permutes per T5-base step on v5p-16)."""
  while x.shape[0] > 1:
    half = x.shape[0] // 2
    pairs = x[:2 * half].reshape((half, 2) + x.shape[1:])
    total = pairs[:, 0] + pairs[:, 1]
    x = jnp.concatenate([total, x[2 * half:]]) if x.shape[0] % 2 else total
  return x


@jax.custom_vjp
def add_shared_bias(logits, bias):
  """logits + bias, with a bias of batch 1 shared by every example (the relative position bias)."""
  return _add_shared_bias_fwd(logits, bias)[0]


def _add_shared_bias_fwd(logits, bias):
  if bias.shape[0] != 1:
    raise ValueError(f'add_shared_bias takes a bias of batch 1, got shape {bias.shape}')
  return logits + bias, None


def _add_shared_bias_bwd(_, g):
  return g, _batch_sum(g)


add_shared_bias.defvjp(_add_shared_bias_fwd, _add_shared_bias_bwd)


def masked_softmax(logits, mask):
  """softmax(where(mask, logits, -1e10)) over the keys. Its backward, dS = P * (dP - sum_k dP P)
  at unmasked logits and 0 at masked ones, needs only P and the mask: the residuals kept per
  layer, where autodiff of the unfused form also keeps the logits, their exponentials and the
  mask broadcast to every head. Logits shared by the batch (a random synthesizer's (1, h, q, k))
  are broadcast to the mask's batch first, so their gradient is summed over it."""
  if mask is not None:
    logits = jnp.broadcast_to(logits, jnp.broadcast_shapes(logits.shape, mask.shape))
  return _masked_softmax(logits, mask)


@jax.custom_vjp
def _masked_softmax(logits, mask):
  return _masked_softmax_fwd(logits, mask)[0]


def _masked_softmax_fwd(logits, mask):
  if mask is not None:
    logits = jnp.where(mask, logits, _NEG_INF)
  probs = checkpoint_name(jax.nn.softmax(logits, axis=-1), 'attention_probs')
  return probs, (probs, mask)


def _masked_softmax_bwd(residuals, g):
  probs, mask = residuals
  d_logits = probs * (g - jnp.sum(g * probs, axis=-1, keepdims=True))
  return (d_logits if mask is None else jnp.where(mask, d_logits, 0.0)), None


_masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)


class Attention(nn.Module):
  """Q/K get gain 1; value and ``out`` get ``gain`` (DeepNet beta / Magneto gamma).

  ``inner_norm`` is Sub-LN's LN on the attention output, before the ``out`` projection.
  """
  num_heads: int
  head_dim: int
  components: Tuple[str, ...] = ('dot_product',)
  init_scheme: str = 't5'
  gain: float = 1.0
  use_bias: bool = False
  inner_norm: Optional[str] = None
  norm_epsilon: float = 1e-6
  dropout_rate: float = 0.0
  dropout_broadcast_dims: Tuple[int, ...] = ()  # (-2,): one mask for every query (T5X)
  max_length: int = 512
  synthesizer_factor: Optional[int] = None
  synthesizer_rank: int = 16
  synthesizer_shared_projection: bool = True
  synthesizer_hidden: str = 'query'
  kernel: str = 'xla'
  causal: bool = False
  cross: bool = False  # keys and values of the encoder's output (cached once in decoding)
  dtype: Any = jnp.float32

  def _cached(self, name, x, write: CacheWrite):
    initialized = self.has_variable('cache', name)
    var = self.variable('cache', name, jnp.zeros, x.shape, x.dtype)
    if not initialized:
      return x
    start = (0, write.index, 0, 0)
    kept = (write.index + jnp.arange(x.shape[1]))[None] < write.keep[:, None]
    x = jnp.where(kept[:, :, None, None], jax.lax.dynamic_slice(var.value, start, x.shape),
                  x.astype(var.value.dtype))
    var.value = jax.lax.dynamic_update_slice(var.value, x, start)
    return var.value

  def _keys_or_values(self, name, gain, x_kv, project, decode: bool, write: Optional[CacheWrite]):
    """The ``name`` ('key', 'value') projection of ``x_kv``. In decoding, self-attention's are
    written into the cache at ``write`` (None: the call that makes the cache). Cross-attention's
    (``cross``: ``x_kv`` is the encoder's output, the same at every step) are kept in the cache
    by an ``apply`` that makes it (train/decoding.py's, with the decoding's parameters and encoder
    output) and read from it at every step; a cache made by ``init`` (other parameters) has none,
    and its steps project them. They are kept once per input: an encoder output of batch B
    serves queries of batch B * beams, each input's beams consecutive rows (``_grouped``), and
    beam search leaves them in place."""
    if not decode:
      return project(name, gain, x_kv)
    if not self.cross:
      return self._cached(f'cached_{name}', project(name, gain, x_kv), write)
    if write is None:
      y = project(name, gain, x_kv)
      if not self.is_initializing():
        self.put_variable('cache', f'encoded_{name}', y)
      return y
    cached = self.get_variable('cache', f'encoded_{name}')
    return project(name, gain, x_kv) if cached is None else cached

  def _component(self, name):
    kw = dict(max_length=self.max_length, name=name)
    dense_kw = dict(init_scheme=self.init_scheme, use_bias=self.use_bias, dtype=self.dtype)
    return {
        'dense': lambda: synth.DenseSynthesizer(**kw, **dense_kw,
                                                shared_projection=self.synthesizer_shared_projection),
        'factorized_dense': lambda: synth.FactorizedDenseSynthesizer(
            **kw, **dense_kw, factor=self.synthesizer_factor),
        'random': lambda: synth.RandomSynthesizer(**kw, num_heads=self.num_heads),
        'fixed_random': lambda: synth.RandomSynthesizer(**kw, num_heads=self.num_heads, fixed=True),
        'factorized_random': lambda: synth.FactorizedRandomSynthesizer(
            **kw, num_heads=self.num_heads, rank=self.synthesizer_rank, dtype=self.dtype),
    }[name]()

  def _hidden(self, name, query, x_q, project):
    """The dense synthesizer ``name``'s hidden activations h (batch, q_len, heads, d_h).

    'query' (the authors' Mesh TensorFlow code): h = relu(x W_q / sqrt(d_h)), the dot product's
    own scaled query. There h = relu(q) with q = x W_q as it is: their default
    fold_scaling_into_initializer puts 1/sqrt(d_h) in W_q's init (std (d_model d_h)^-1/2) and
    never rescales q. Ours inits W_q at std d_model^-1/2 (T5) and divides by sqrt(d_h) at run
    time, so h takes the query after that division: the same scale as theirs. 'w1' (the paper's
    reading): h = relu(x W_1 + b_1) with a separate W_1 (``{name}_w1``) per dense synthesizer.
    """
    if self.synthesizer_hidden == 'query':
      return nn.relu(query)
    return nn.relu(project(f'{name}_w1', 1.0, x_q))

  @nn.compact
  def __call__(self, x_q, x_kv, q_positions, k_positions, mask=None, bias=None, lengths=None,
               decode: bool = False, decode_position=None, deterministic: bool = True):
    """``mask``: (batch|1, 1, q, k) booleans; ``lengths``: the same mask as (query lengths, key
    lengths) with ``causal``, each (batch,) or None, or None where it is not a prefix (packed)."""
    dense = functools.partial(Dense, init_scheme=self.init_scheme, use_bias=self.use_bias, dtype=self.dtype)
    project = lambda name, gain, x: checkpoint_name(
        dense((self.num_heads, self.head_dim), ('embed',), ('heads', 'kv'), gain=gain, name=name)(x),
        f'{name}_proj')
    value = self._keys_or_values('value', self.gain, x_kv, project, decode, decode_position)
    fused = fused_attention.choose(
        self.kernel, '/'.join(self.scope.path), x_q.shape[1], value.shape[1], bias is not None,
        components=self.components,
        dtype=self.dtype, head_dim=self.head_dim, lengths=lengths,
        dropout=self.dropout_rate > 0 and not deterministic)
    # One query for the dot product and, under synthesizer_hidden 'query', the dense synthesizers.
    uses_query = 'dot_product' in self.components or (self.synthesizer_hidden == 'query' and any(
        name in synth.DENSE_SYNTHESIZERS for name in self.components))
    query = project('query', 1.0, x_q) if uses_query else None
    if uses_query and not fused:
      # 1 / sqrt(d_h) on the queries: a pass over (batch, q, heads, d_h), not over the logits.
      query = query / jnp.sqrt(self.head_dim).astype(self.dtype)
    logits = []
    for name in self.components:
      if name == 'dot_product':
        key = self._keys_or_values('key', 1.0, x_kv, project, decode, decode_position)
        if fused:  # a cached decode step (one query) is causal through its key lengths
          group = lambda kv: jnp.repeat(kv, max(query.shape[0] // kv.shape[0], 1), 0)
          y = fused_attention.attend(query, group(key), group(value), bias, lengths,
                                     self.causal and x_q.shape[1] > 1, fused)
          return self._output(y, x_q.shape[-1], dense)
        # In the compute dtype, then float32: its backward (dQ, dK) is a compute-dtype matmul too.
        s = _grouped('bqhd,bkhd->bhqk', query, key)
      elif name in synth.DENSE_SYNTHESIZERS:
        s = self._component(name)(self._hidden(name, query, x_q, project), k_positions)
      else:
        s = self._component(name)(x_q, q_positions, k_positions)
      logits.append(s.astype(jnp.float32))
    if len(logits) == 1:
      s = logits[0]
    else:
      w = self.param('mixture_weights', nn.with_logical_partitioning(nn.initializers.zeros, ('mixture',)),
                     (len(logits),), jnp.float32)
      s = sum(wi * si for wi, si in zip(jax.nn.softmax(w), logits))
    if bias is not None:  # after mixing, as the Synthesizer authors' Mesh TensorFlow code
      s = add_shared_bias(s, bias.astype(jnp.float32))
    probs = masked_softmax(s, mask)
    if not deterministic and self.dropout_rate > 0 and probs.shape[0] < value.shape[0]:
      # one batch-shared row of probabilities (a random synthesizer's): a mask for each example
      probs = jnp.broadcast_to(probs, (value.shape[0], *probs.shape[1:]))
    probs = nn.Dropout(self.dropout_rate, self.dropout_broadcast_dims)(probs, deterministic=deterministic)
    y = _grouped('bhqk,bkhd->bqhd', probs.astype(self.dtype), value.astype(self.dtype))
    return self._output(y, x_q.shape[-1], dense)

  def _output(self, y, features: int, dense):
    """The ``out`` projection of the heads' outputs (after Sub-LN's inner LN)."""
    y = checkpoint_name(y, 'attention_out')
    if self.inner_norm:
      y = Norm(self.inner_norm, self.norm_epsilon, self.dtype, ('heads', 'kv'), name='inner_layer_norm')(y)
    return checkpoint_name(dense((features,), ('heads', 'kv'), ('embed',), gain=self.gain, name='out')(y),
                           'out_proj')


def _grouped(spec: str, x, kv):
  """``jnp.einsum(spec, x, kv)`` where each row of ``kv`` (keys or values) serves a group of
  consecutive rows of ``x``: one input's beams in decoding, over cross-attention keys and values
  kept once per input (train/decoding.py). Otherwise the plain einsum (a batch of 1 broadcasts:
  a random synthesizer's probabilities are one for every row)."""
  if x.shape[0] <= kv.shape[0]:
    return jnp.einsum(spec, x, kv)
  groups = x.shape[0] // kv.shape[0]
  lhs, rest = spec.split(',')
  out = jnp.einsum(f'bg{lhs[1:]},{rest.replace("->b", "->bg")}',
                   x.reshape(kv.shape[0], groups, *x.shape[1:]), kv)
  return out.reshape(x.shape[0], *out.shape[2:])
