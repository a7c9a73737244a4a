"""Decoder-only causal language model (GPT-style) on the same stack."""
from t5x_variants.layers.attention import causal_mask, segment_mask
from t5x_variants.layers.fused_attention import Segments
from t5x_variants.models.base import LanguageModel, default_positions, token_index
from t5x_variants.models.stack import Stack


class DecoderOnly(LanguageModel):

  def setup(self):
    super().setup()
    self.decoder = Stack(self.config, 'decoder', causal=True)

  def __call__(self, decoder_input_tokens, decoder_segment_ids=None, decoder_positions=None,
               enable_dropout: bool = False, decode: bool = False):
    """Logits (batch, length, vocab). With ``decode=True`` after cache init, one step."""
    positions = default_positions(decoder_input_tokens, decoder_positions)
    mask = causal_mask(token_index(decoder_input_tokens), token_index(decoder_input_tokens))
    if decoder_segment_ids is not None:
      mask = mask & segment_mask(decoder_segment_ids, decoder_segment_ids)
    x = self.decoder(self.token_embedder(decoder_input_tokens), positions, mask,
                     deterministic=not enable_dropout, decode=decode,
                     self_lengths=(None, None) if decoder_segment_ids is None
                     else Segments(decoder_segment_ids, decoder_segment_ids))
    return self.logits(x)
