"""What the three architectures share: the token embedding and the output logits."""
import flax.linen as nn
import jax.numpy as jnp

from t5x_variants.layers.dense import Dense
from t5x_variants.layers.embedding import Embed
from t5x_variants.models.config import TransformerConfig


def token_index(tokens):
  """(1, length): each token's index in its row."""
  return jnp.arange(tokens.shape[-1], dtype=jnp.int32)[None]


def default_positions(tokens, positions):
  return token_index(tokens) if positions is None else positions


class LanguageModel(nn.Module):
  """Embedding E (vocab, embed); logits x W_out (untied, T5 v1.1) or x E^T / sqrt(d) (tied, T5)."""
  config: TransformerConfig

  def setup(self):
    c = self.config
    self.token_embedder = Embed(c.vocab_size, c.d_model, c.compute_dtype, c.embedding_init_std,
                                 c.scale_embeddings)
    if not c.tie_embeddings and c.head == 'lm':  # a classification head has its own output
      self.logits_dense = Dense((c.vocab_size,), ('embed',), ('vocab',), c.init_scheme,
                                t5_distribution='truncated_normal', dtype=jnp.float32)

  def logits(self, x):
    """Float32 logits whatever the compute dtype (as T5X), for a stable softmax over the vocab."""
    x = x.astype(jnp.float32)
    if self.config.tie_embeddings:
      return self.token_embedder.attend(x * self.config.d_model**-0.5)
    return self.logits_dense(x)
