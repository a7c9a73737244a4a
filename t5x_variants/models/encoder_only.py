"""Encoder-only (BERT-style) model with one of two heads (``TransformerConfig.head``):

- 'lm': the masked-LM head, logits = W_out Norm(gelu(W_t h)) at every position, BERT's transform
  (Devlin et al. 2019) with the configured norm and no output bias (T5 convention);
- 'classification': BERT's pooler and classifier on the first token's final hidden state h_0,
  logits = W_c dropout(tanh(W_p h_0)), (batch, 1, num_labels) float32 (one "token" per example;
  num_labels 1 is a regression output). The MLM head's parameters do not exist in this mode, and
  the head's (``CLASSIFICATION_PARAMS``) are initialised fresh when fine-tuning from an MLM
  checkpoint. Biases follow ``use_bias`` (none by default, as the rest of the model).
"""
import flax.linen as nn

from t5x_variants.layers.attention import pair_mask, segment_mask
from t5x_variants.layers.dense import Dense
from t5x_variants.layers.fused_attention import Segments
from t5x_variants.layers.norms import Norm
from t5x_variants.models.base import LanguageModel, default_positions, prefix_lengths
from t5x_variants.models.stack import Stack

CLASSIFICATION_PARAMS = ('pooler', 'classifier')  # the classification head's top-level names


class EncoderOnly(LanguageModel):

  def setup(self):
    super().setup()
    c = self.config
    self.encoder = Stack(c, 'encoder')
    if c.head == 'classification':
      self.pooler = Dense((c.d_model,), ('embed',), ('embed_out',), c.init_scheme,
                          use_bias=c.use_bias, dtype=c.compute_dtype)
      self.pooler_dropout = nn.Dropout(c.dropout_rate)
      self.classifier = Dense((c.num_labels,), ('embed',), ('labels',), c.init_scheme,
                              t5_distribution='truncated_normal', use_bias=c.use_bias,
                              dtype=c.compute_dtype, float32_result=True)
    else:
      self.mlm_transform = Dense((c.d_model,), ('embed',), ('embed_out',), c.init_scheme,
                                 use_bias=c.use_bias, dtype=c.compute_dtype)
      self.mlm_norm = Norm(c.norm, c.norm_epsilon, c.compute_dtype)

  def __call__(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None,
               enable_dropout: bool = False):
    """Logits (batch, length, vocab) at every position, or with the classification head
    (batch, 1, num_labels) of the first token; id 0 is padding."""
    valid = encoder_input_tokens > 0
    mask = pair_mask(valid, valid)
    if encoder_segment_ids is not None:
      mask = mask & segment_mask(encoder_segment_ids, encoder_segment_ids)
    n = prefix_lengths(valid, encoder_segment_ids)
    positions = default_positions(self.config, encoder_input_tokens, encoder_positions,
                                  encoder_segment_ids)
    x = self.encoder(self.token_embedder(encoder_input_tokens), positions, mask,
                     deterministic=not enable_dropout,
                     self_lengths=(n, n) if encoder_segment_ids is None else Segments(n, n))
    if self.config.head == 'classification':
      pooled = nn.tanh(self.pooler(x[:, :1]))
      pooled = self.pooler_dropout(pooled, deterministic=not enable_dropout)
      return self.classifier(pooled)
    return self.logits(self.mlm_norm(nn.gelu(self.mlm_transform(x))))
