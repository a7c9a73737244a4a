"""Architectures: encoder-decoder (T5), decoder-only LM, encoder-only MLM.

Imports only jax, flax, numpy and gin.
"""
import jax.numpy as jnp

from t5x_variants.models.config import TransformerConfig
from t5x_variants.models.decoder_only import DecoderOnly
from t5x_variants.models.encoder_decoder import EncoderDecoder
from t5x_variants.models.encoder_only import CLASSIFICATION_PARAMS, EncoderOnly

ARCHITECTURE_CLASSES = {
    'encoder_decoder': EncoderDecoder,
    'decoder_only': DecoderOnly,
    'encoder_only': EncoderOnly,
}


def build_model(config: TransformerConfig):
  """The Flax module of ``config.architecture``."""
  return ARCHITECTURE_CLASSES[config.architecture](config)


def init_inputs(config: TransformerConfig, batch: int = 1):
  """Positional token inputs of the architecture's ``__call__``, for ``init`` / ``eval_shape``."""
  tokens = lambda stack: jnp.ones((batch, min(8, config.max_length(stack))), jnp.int32)
  return tuple(tokens(s) for s in config.stacks)


def fresh_head_params(config: TransformerConfig):
  """Top-level parameter names of a fine-tuning head that a pretrained checkpoint does not hold
  (or holds with other shapes): initialised fresh when fine-tuning from one."""
  return CLASSIFICATION_PARAMS if config.head == 'classification' else ()
