"""A stack of Transformer layers: position information (relative bias or absolute embedding),
layers (scanned or unrolled, with optional remat), final norm for Pre-LN / Sub-LN, and the
decode-time position counter.

Scanning stacks the layer parameters on a leading ``layers`` axis, so a 1000-layer model
compiles one layer body; the unrolled form names them ``layers_0``, ``layers_1``, ...
"""
import jax
import jax.numpy as jnp
import flax.linen as nn

from t5x_variants.layers import fused_attention
from t5x_variants.layers.attention import CacheWrite, causal_mask
from t5x_variants.layers.norms import Norm
from t5x_variants.layers.placement import has_final_norm
from t5x_variants.layers.position import AbsolutePositionEmbedding, RelativePositionBias
from t5x_variants.models.block import TransformerLayer
from t5x_variants.models.config import TransformerConfig

_names = jax.checkpoint_policies.save_only_these_names
# What each remat policy keeps for the backward pass; the rest of the layer is recomputed. Names
# are the layers' checkpoint_name tags: '{query,key,value}_proj', 'attention_out' (the heads'
# outputs), 'out_proj', 'mlp_hidden' (after the activation), 'mlp_out', 'attention_probs' (the
# XLA path's softmax).
REMAT_POLICIES = {
    'minimal': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # every projection
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots_and_probs': jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _names('attention_probs')),
    'save_qkv_attention': _names('query_proj', 'key_proj', 'value_proj', 'attention_out'),
    'save_attention_mlp': _names('query_proj', 'key_proj', 'value_proj', 'attention_out',
                                 'out_proj', 'mlp_hidden'),
}


class Stack(nn.Module):
  config: TransformerConfig
  stack: str  # 'encoder' or 'decoder'
  causal: bool = False
  cross_attention: bool = False

  def _decode_positions(self, x, positions, self_mask, self_lengths, prefilled):
    """In a cached decode step the query is the one token at the counter and the keys are the
    whole cache (its length fixed when ``init`` ran with ``decode=True``). A decoder-only
    model's prompts instead fill the cache in one call under the given mask (a prefix LM's fully
    visible one, T5X's prefill): ``prefilled`` is each row's prompt length, whose positions
    later steps leave as they are, and the counter moves to the shortest prompt's last position,
    where the steps resume (longer prompts go on through theirs with the other rows). Decoding
    past the cache length is undefined: callers stop at it."""
    initialized = self.has_variable('cache', 'position')
    counter = self.variable('cache', 'position', lambda: jnp.zeros((), jnp.int32))
    keys = self.variable('cache', 'key_positions', lambda: jnp.arange(x.shape[1], dtype=jnp.int32)[None])
    kept = self.variable('cache', 'prefilled', lambda: jnp.zeros((x.shape[0],), jnp.int32))
    if not initialized:
      return positions, positions, self_mask, self_lengths, None
    if prefilled is not None:
      kept.value = prefilled
      counter.value = jnp.min(prefilled) - 1
      pad = keys.value.shape[1] - x.shape[1]
      mask = jnp.pad(self_mask, ((0, 0), (0, 0), (0, 0), (0, pad)))
      # A causal LM's prefill as (all queries, the prompt's keys) with the causal flag; a prefix
      # LM's mask is no prefix of the keys (self_lengths None: the reference path).
      lengths = None if self_lengths is None else (None, prefilled)
      return positions, keys.value, mask, lengths, CacheWrite(jnp.zeros((), jnp.int32),
                                                              jnp.zeros_like(prefilled))
    if x.shape[1] != 1:
      raise ValueError(f'cached decoding takes one token per step, got {x.shape[1]} (prompts '
                       'fill the cache at once with their prefill lengths)')
    index = counter.value
    counter.value = index + 1
    q = jnp.reshape(index, (1, 1))
    seen = jnp.full((x.shape[0],), index + 1, jnp.int32)  # the causal mask as key lengths
    return q, keys.value, causal_mask(q, keys.value), (None, seen), CacheWrite(index, kept.value)

  @nn.compact
  def __call__(self, x, positions, self_mask, encoded=None, cross_mask=None,
               deterministic: bool = True, decode: bool = False, self_lengths=None,
               cross_lengths=None, prefilled=None, as_encoder: bool = False):
    """``self_lengths`` / ``cross_lengths``: the masks as (query, key) lengths for a fused
    attention kernel (layers/attention.py), None where they are not a prefix; ``prefilled``:
    the prompt lengths when prompts fill the cache (``_decode_positions``); ``as_encoder``: the
    decoder's parameters run as the encoder (``TransformerConfig.shared_encoder_decoder``)."""
    c = self.config
    stack, causal, cross = (('encoder', False, False) if as_encoder else
                            (self.stack, self.causal, self.cross_attention))
    q_positions = k_positions = positions
    decode_position = None
    if decode:
      q_positions, k_positions, self_mask, self_lengths, decode_position = self._decode_positions(
          x, positions, self_mask, self_lengths, prefilled)
    bias = None
    if c.position_embedding in ('sinusoidal', 'learned'):
      x = x + AbsolutePositionEmbedding(c.position_embedding, c.d_model, c.max_length(stack),
                                        name='position_embedding')(q_positions).astype(x.dtype)
    if c.relative_bias:
      # From token indices, not (packed) positions: within a segment both give the same distance,
      # across segments the mask applies, and the bias is then one (1, heads, q, k) for the whole
      # batch (as in T5X), not one per example (measured: 64 MB less temporary memory for a packed
      # T5-small batch of 8 x 512 on CPU).
      # A prefill's queries likewise (the caller's positions may have a batch axis); a decode
      # step's is the counter, its keys the cache's positions.
      index = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
      bias_q, bias_k = ((index, index) if decode_position is None else
                        (index, k_positions) if prefilled is not None else (q_positions, k_positions))
      bias = RelativePositionBias(c.num_heads, c.relative_attention_num_buckets,
                                  c.relative_attention_max_distance,
                                  bidirectional=c.bidirectional_buckets(causal),
                                  init_std=1.0 if c.init_scheme == 'torchscale' else None,
                                  name='relpos_bias')(bias_q, bias_k)
    x = nn.Dropout(c.dropout_rate, c.dropout_broadcast_dims)(x, deterministic=deterministic)

    layer = TransformerLayer
    remat = c.remat_policy(fused_attention.platform())
    if remat != 'none':
      layer = nn.remat(layer, policy=REMAT_POLICIES[remat], prevent_cse=not c.scan_layers)
    kwargs = dict(config=c, stack=stack, cross_attention=cross, causal=causal,
                  deterministic=deterministic, decode=decode)
    args = (q_positions, k_positions, self_mask, bias, encoded, cross_mask, decode_position,
            self_lengths, cross_lengths)
    if c.scan_layers:
      layer = nn.scan(layer, variable_axes={'params': 0, 'cache': 0, 'intermediates': 0},
                      split_rngs={'params': True, 'dropout': True}, in_axes=(nn.broadcast,) * len(args),
                      length=c.num_layers(stack), metadata_params={nn.PARTITION_NAME: 'layers'})
      x, _ = layer(**kwargs, name='layers')(x, *args)
    else:
      for i in range(c.num_layers(stack)):
        x, _ = layer(**kwargs, name=f'layers_{i}')(x, *args)

    if has_final_norm(c.placement):
      # Named by the parameters' stack: an encoder run on the decoder's shares its final norm.
      x = Norm(c.norm, c.norm_epsilon, c.compute_dtype, name=f'{self.stack}_norm')(x)
      x = nn.Dropout(c.dropout_rate, c.dropout_broadcast_dims)(x, deterministic=deterministic)
    self.sow('intermediates', 'output', x)  # when 'intermediates' is mutable (train/diagnostics.py)
    return x
