"""Encoder-decoder Transformer (T5, Raffel et al. 2020) with a shared token embedding; with
``shared_encoder_decoder`` the encoder runs on the decoder's stack (T5's Table 2 'shared' row)."""
import jax.numpy as jnp

from t5x_variants.layers.attention import causal_mask, pair_mask, segment_mask
from t5x_variants.layers.fused_attention import Segments, cross_segments
from t5x_variants.models.base import LanguageModel, default_positions, prefix_lengths, token_index
from t5x_variants.models.stack import Stack


class EncoderDecoder(LanguageModel):
  """Tokens are int arrays (batch, length); id 0 is padding in the encoder input."""

  def setup(self):
    super().setup()
    self.decoder = Stack(self.config, 'decoder', causal=True, cross_attention=True)
    if not self.config.shared_encoder_decoder:
      self.encoder = Stack(self.config, 'encoder')

  def encode(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None,
             enable_dropout: bool = False):
    valid = encoder_input_tokens > 0
    mask = pair_mask(valid, valid)
    if encoder_segment_ids is not None:
      mask = mask & segment_mask(encoder_segment_ids, encoder_segment_ids)
    n = prefix_lengths(valid, encoder_segment_ids)
    lengths = (n, n) if encoder_segment_ids is None else Segments(n, n)
    x = self.token_embedder(encoder_input_tokens)
    positions = default_positions(self.config, encoder_input_tokens, encoder_positions,
                                  encoder_segment_ids)
    if self.config.shared_encoder_decoder:
      return self.decoder(x, positions, mask, deterministic=not enable_dropout, self_lengths=lengths,
                          as_encoder=True)
    return self.encoder(x, positions, mask, deterministic=not enable_dropout, self_lengths=lengths)

  def decode(self, encoded, encoder_input_tokens, decoder_input_tokens, encoder_segment_ids=None,
             decoder_segment_ids=None, decoder_positions=None, enable_dropout: bool = False,
             decode: bool = False):
    """Logits (batch, target_length, vocab). With ``decode=True`` after cache init, one step.
    Packed rows give both sides' segment ids (one side's alone is a ValueError: the decoder would
    attend across the encoder's examples)."""
    if (encoder_segment_ids is None) != (decoder_segment_ids is None):
      given, missing = (('encoder', 'decoder') if decoder_segment_ids is None
                        else ('decoder', 'encoder'))
      raise ValueError(f'{given}_segment_ids without {missing}_segment_ids: packed rows give both '
                       '(a packed batch of the data pipeline has both), unpacked rows neither')
    positions = default_positions(self.config, decoder_input_tokens, decoder_positions,
                                  decoder_segment_ids)
    mask = causal_mask(token_index(decoder_input_tokens), token_index(decoder_input_tokens))
    cross = pair_mask(jnp.ones(decoder_input_tokens.shape, bool), encoder_input_tokens > 0)
    if decoder_segment_ids is not None:
      mask = mask & segment_mask(decoder_segment_ids, decoder_segment_ids)
      cross = cross & segment_mask(decoder_segment_ids, encoder_segment_ids)
    n = prefix_lengths(encoder_input_tokens > 0, encoder_segment_ids)
    if decoder_segment_ids is None:
      self_lengths, cross_lengths = (None, None), (None, n)
    else:
      self_lengths = Segments(decoder_segment_ids, decoder_segment_ids)
      cross_lengths = cross_segments(decoder_segment_ids, n)
    x = self.decoder(self.token_embedder(decoder_input_tokens), positions, mask, encoded, cross,
                     deterministic=not enable_dropout, decode=decode,
                     self_lengths=self_lengths, cross_lengths=cross_lengths)
    return self.logits(x)

  def __call__(self, encoder_input_tokens, decoder_input_tokens, encoder_segment_ids=None,
               decoder_segment_ids=None, encoder_positions=None, decoder_positions=None,
               enable_dropout: bool = False, decode: bool = False):
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids, encoder_positions, enable_dropout)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens, encoder_segment_ids,
                       decoder_segment_ids, decoder_positions, enable_dropout, decode)


def unshared_params(params):
  """A shared encoder-decoder's parameters (``shared_encoder_decoder``) as the plain model's that
  computes the same: an encoder holding copies of the decoder's self-attention, FFN, their norms,
  relative bias (or positions) and final norm, without its cross-attention."""
  own = lambda layer: {k: v for k, v in layer.items()
                       if 'cross_attention' not in k and k != 'encoder_decoder_attention'}
  encoder = {('encoder_norm' if k == 'decoder_norm' else k): own(v) if k.startswith('layers') else v
             for k, v in params['decoder'].items()}
  return {**params, 'encoder': encoder}
