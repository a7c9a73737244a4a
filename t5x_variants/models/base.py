"""What the three architectures share: the token embedding and the output logits."""
import flax.linen as nn
import jax.numpy as jnp

from t5x_variants.layers.dense import Dense
from t5x_variants.layers.embedding import Embed
from t5x_variants.models.config import TransformerConfig


def token_index(tokens):
  """(1, length): each token's index in its row."""
  return jnp.arange(tokens.shape[-1], dtype=jnp.int32)[None]


def prefix_lengths(valid, segment_ids):
  """A row's mask for a fused attention kernel (layers/fused_attention.py): the (batch,) count of
  ``valid`` tokens, an unpacked row's padding mask as the length of its valid prefix (padding, id
  0, comes at the end); for a packed row (``segment_ids`` given) its segment ids, 0 at padding."""
  if segment_ids is not None:
    return jnp.where(valid, segment_ids, 0)
  return jnp.sum(valid, axis=-1, dtype=jnp.int32)


def default_positions(config: TransformerConfig, tokens, positions, segment_ids=None):
  """``positions``, else each token's index in its row. A synthesizer's table and learned or
  sinusoidal position embeddings are read at absolute positions, so packed rows (``segment_ids``)
  without theirs are refused: every segment after the first would read other positions (T5's
  relative bias needs none: a distance within a segment is the same either way)."""
  if positions is not None:
    return positions
  absolute = [what for what, used in (
      ('a synthesizer', set(config.attention_components) - {'dot_product'}),
      (f'{config.position_embedding} position embeddings',
       config.position_embedding in ('learned', 'sinusoidal'))) if used]
  if segment_ids is not None and absolute:
    raise ValueError(f'packed rows (segment ids) need their positions for {" and ".join(absolute)}, '
                     'read at each token\'s position in its segment: pass the positions (the data '
                     'pipeline\'s packing writes them)')
  return token_index(tokens)


class LanguageModel(nn.Module):
  """Embedding E (vocab, embed); logits x W_out (untied, T5 v1.1), or tied: x E^T / sqrt(d) (T5)
  or x E^T (fairseq, torchscale: ``scale_tied_logits=False``)."""
  config: TransformerConfig

  def setup(self):
    c = self.config
    self.token_embedder = Embed(c.vocab_size, c.d_model, c.compute_dtype, c.embedding_init_std,
                                 c.scale_embeddings)
    if not c.tie_embeddings and c.head == 'lm':  # a classification head has its own output
      # torchscale's output projection is N(0, 1/d): T5's normal fan-in scaling.
      code = c.init_scheme == 'torchscale'
      self.logits_dense = Dense((c.vocab_size,), ('embed',), ('vocab',), 't5' if code else c.init_scheme,
                                t5_distribution='normal' if code else 'truncated_normal',
                                dtype=c.compute_dtype, float32_result=True)

  def logits(self, x):
    """The output matmul on compute-dtype operands, its logits accumulated and returned in float32
    (``dense.matmul_float32``: T5X's float32 output layer), never rounded to the compute dtype
    before the softmax over the vocabulary."""
    if self.config.tie_embeddings:
      scale = self.config.d_model**-0.5 if self.config.scale_tied_logits else 1.0
      # Scaled in float32: d^-0.5 rounded to bfloat16 would bias every logit (by +0.13% at 768).
      x = self.token_embedder.attend((x.astype(jnp.float32) * scale).astype(self.config.compute_dtype))
    else:
      x = self.logits_dense(x.astype(self.config.compute_dtype))
    return x
