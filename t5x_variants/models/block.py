"""One Transformer layer: self-attention, optional cross-attention, FFN, each wrapped in the
configured residual placement (layers/placement.py).

Cross-attention is always dot-product. Under DeepNorm its value and output projections get the
decoder's beta and query/key 1, as in self-attention (DeepNet's code). Under Sub-LN it is plain
by default, no inner LN and gain 1, as in Magneto's code (the extra LN and gamma sit in the
self-attention and FFN only); ``subln_cross_attention`` gives it both.
"""
import functools

import flax.linen as nn
import jax.numpy as jnp

from t5x_variants.layers.attention import Attention
from t5x_variants.layers.ffn import MlpBlock
from t5x_variants.layers.norms import Norm
from t5x_variants.layers.placement import normalizes_input, residual
from t5x_variants.models.config import TransformerConfig


class TransformerLayer(nn.Module):
  """Returns (x, None) so it can be the body of ``nn.scan``."""
  config: TransformerConfig
  stack: str  # 'encoder' or 'decoder'
  cross_attention: bool = False
  causal: bool = False
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x, q_positions, k_positions, self_mask, self_bias, encoded, cross_mask,
               decode_position, self_lengths=None, cross_lengths=None):
    c = self.config
    alpha, gain = c.residual_constants()[self.stack]
    dtype = c.compute_dtype
    prefix = 'pre' if normalizes_input(c.placement) else 'post'
    inner = c.norm if c.placement == 'subln' else None
    norm = lambda name: Norm(c.norm, c.norm_epsilon, dtype, name=f'{prefix}_{name}_layer_norm')
    drop = lambda y: nn.Dropout(c.dropout_rate, c.dropout_broadcast_dims)(y, deterministic=self.deterministic)
    attn = functools.partial(Attention, c.num_heads, c.head_dim, init_scheme=c.init_scheme, gain=gain,
                             use_bias=c.use_bias, inner_norm=inner, norm_epsilon=c.norm_epsilon,
                             dropout_rate=c.rate('attention'),
                             dropout_broadcast_dims=c.dropout_broadcast_dims, kernel=c.attention_kernel,
                             dtype=dtype)
    add = functools.partial(residual, placement=c.placement, alpha=alpha)

    self_attention = attn(components=c.attention_components, max_length=c.max_length(self.stack),
                          synthesizer_factor=c.synthesizer_factor,
                          synthesizer_rank=c.synthesizer_rank,
                          synthesizer_shared_projection=c.synthesizer_shared_projection,
                          synthesizer_hidden=c.synthesizer_hidden,
                          causal=self.causal, name='self_attention')
    x = add(x, lambda h: drop(self_attention(
        h, h, q_positions, k_positions, self_mask, self_bias, self_lengths, decode=self.decode,
        decode_position=decode_position, deterministic=self.deterministic)), norm('attention'))
    if self.cross_attention:
      plain = c.placement == 'subln' and not c.subln_cross_attention  # Magneto's code
      cross = attn(name='encoder_decoder_attention', cross=True,
                   **(dict(gain=1.0, inner_norm=None) if plain else {}))
      x = add(x, lambda h: drop(cross(h, encoded, None, None, cross_mask, lengths=cross_lengths,
                                      decode=self.decode, decode_position=decode_position,
                                      deterministic=self.deterministic)),
              norm('cross_attention'))
    mlp = MlpBlock(c.activations, c.ffn_hidden_dim, c.init_scheme, gain, c.use_bias, inner,
                   c.norm_epsilon, c.rate('activation'), c.dropout_broadcast_dims, dtype, name='mlp')

    def stream(y):  # train/diagnostics.py: each position's mean square of the residual stream
      if self.is_mutable_collection('intermediates'):
        self.sow('intermediates', 'residual_mean_square', jnp.mean(jnp.square(y.astype(jnp.float32)), -1))
      return y
    last_norm = norm('mlp')
    if normalizes_input(c.placement):
      x = stream(add(x, lambda h: drop(mlp(h, self.deterministic)), last_norm))
    else:  # Post-LN and DeepNorm end the layer with a norm: the stream is what enters it
      x = add(x, lambda h: drop(mlp(h, self.deterministic)), lambda y: last_norm(stream(y)))
    return x, None
