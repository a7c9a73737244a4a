"""Encoder-only masked language model (BERT-style) with an MLM head:
logits = W_out Norm(gelu(W_t h)), BERT's transform (Devlin et al. 2019) with the configured norm
and no output bias (T5 convention)."""
import flax.linen as nn

from t5x_variants.layers.attention import pair_mask, segment_mask
from t5x_variants.layers.dense import Dense
from t5x_variants.layers.norms import Norm
from t5x_variants.models.base import LanguageModel, default_positions
from t5x_variants.models.stack import Stack


class EncoderOnly(LanguageModel):

  def setup(self):
    super().setup()
    c = self.config
    self.encoder = Stack(c, 'encoder')
    self.mlm_transform = Dense((c.d_model,), ('embed',), ('embed_out',), c.init_scheme,
                               use_bias=c.use_bias, dtype=c.compute_dtype)
    self.mlm_norm = Norm(c.norm, c.norm_epsilon, c.compute_dtype)

  def __call__(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None,
               enable_dropout: bool = False):
    """Logits (batch, length, vocab) at every position; id 0 is padding."""
    valid = encoder_input_tokens > 0
    mask = pair_mask(valid, valid)
    if encoder_segment_ids is not None:
      mask = mask & segment_mask(encoder_segment_ids, encoder_segment_ids)
    x = self.encoder(self.token_embedder(encoder_input_tokens),
                     default_positions(encoder_input_tokens, encoder_positions), mask,
                     deterministic=not enable_dropout)
    return self.logits(self.mlm_norm(nn.gelu(self.mlm_transform(x))))
