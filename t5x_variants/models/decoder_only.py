"""Decoder-only causal language model (GPT-style) on the same stack, T5's prefix LM, or T5's causal
LM of the prefix LM's rows (its inputs then targets, ``inputs_bidirectional_attention`` False)."""
from t5x_variants.layers.attention import causal_mask, pair_mask, segment_mask
from t5x_variants.layers.fused_attention import Segments
from t5x_variants.models.base import LanguageModel, default_positions, token_index
from t5x_variants.models.stack import Stack


class DecoderOnly(LanguageModel):

  def setup(self):
    super().setup()
    self.decoder = Stack(self.config, 'decoder', causal=True)

  def __call__(self, decoder_input_tokens, decoder_segment_ids=None, decoder_positions=None,
               decoder_causal_attention=None, enable_dropout: bool = False, decode: bool = False,
               prefill_lengths=None):
    """Logits (batch, length, vocab). With ``decode=True`` after cache init, one step, or with
    ``prefill_lengths`` (batch,) the prompts filling the cache at once (models/stack.py).
    ``decoder_causal_attention`` (batch, length): 1 where a prefix LM's mask is fully visible
    (Raffel et al. 2020, Fig. 3: query i sees key j when j <= i, or when both are in the prefix);
    a model whose inputs are causal (``inputs_bidirectional_attention`` False) ignores it."""
    if not self.config.inputs_bidirectional_attention:
      decoder_causal_attention = None
    positions = default_positions(self.config, decoder_input_tokens, decoder_positions,
                                  decoder_segment_ids)
    index = token_index(decoder_input_tokens)
    mask = causal_mask(index, index)
    if decoder_causal_attention is not None:
      prefix = decoder_causal_attention > 0
      mask = mask | pair_mask(prefix, prefix)
    if decoder_segment_ids is not None:
      mask = mask & segment_mask(decoder_segment_ids, decoder_segment_ids)
    # A kernel takes the causal mask as lengths or segments; a prefix LM's mask is neither.
    lengths = (None if decoder_causal_attention is not None else
               (None, None) if decoder_segment_ids is None else
               Segments(decoder_segment_ids, decoder_segment_ids))
    x = self.decoder(self.token_embedder(decoder_input_tokens), positions, mask,
                     deterministic=not enable_dropout, decode=decode, self_lengths=lengths,
                     prefilled=prefill_lengths if decode else None)
    return self.logits(x)
