"""Training FLOPs of one step, counted matrix multiply by matrix multiply (2 m n k each).

Counted, per token of every stack: the attention projections (query, key, value, out; the
Synthesizers' W_1 where they have one, ``synthesizer_hidden``, and W_2 or factor projections), the
attention products (Q K^T, or the factorized random R_1 R_2^T once per layer, as it depends on
no input: the code computes it per row of a packed batch, work not counted; and probabilities
times values),
over the full length with no discount for causal masking, the FFN matrices (two or three), the
logits layer (and the encoder-only MLM transform; a classification head: its pooler and
classifier on the first token). A training step is 3x the forward pass (the backward pass is
twice the forward; PaLM Appendix B, MaxText). Not counted: embedding lookups, norms, softmax,
activations, the relative position bias, random-synthesizer table lookups, the optimizer, and
recomputation under remat (so utilisation is model FLOPs utilisation, MFU).
"""
from typing import Dict, Sequence

from t5x_variants.layers.synthesizer import DENSE_SYNTHESIZERS, factor_pair
from t5x_variants.models.config import TransformerConfig


def attention_flops(config: TransformerConfig, tokens_q: int, q_len: int, kv_len: int,
                    components: Sequence[str], synth_length: int) -> int:
  """One attention layer over ``tokens_q`` = batch x q_len queries and batch x kv_len keys."""
  batch = tokens_q // q_len
  hd = config.num_heads * config.head_dim
  tokens_kv = batch * kv_len
  scores = 2 * batch * config.num_heads * q_len * kv_len * config.head_dim  # Q K^T or P V
  flops = 2 * tokens_kv * config.d_model * hd + 2 * tokens_q * hd * config.d_model + scores
  # Projections of the queries: the dot product's query and the dense synthesizers' hidden layer,
  # one shared query under synthesizer_hidden 'query', a W_1 for each dense synthesizer under 'w1'.
  dense = [c for c in components if c in DENSE_SYNTHESIZERS]
  if config.synthesizer_hidden == 'query':
    queries = int('dot_product' in components or bool(dense))
  else:
    queries = int('dot_product' in components) + len(dense)
  flops += queries * 2 * tokens_q * config.d_model * hd
  for c in components:
    if c == 'dot_product':
      flops += 2 * tokens_kv * config.d_model * hd + scores
    elif c in dense:
      width = synth_length if c == 'dense' else sum(factor_pair(synth_length, config.synthesizer_factor))
      flops += 2 * tokens_q * hd * width
    elif c == 'factorized_random':  # R_1 R_2^T depends on no input: once per layer
      flops += 2 * config.num_heads * q_len * kv_len * config.synthesizer_rank
  return flops


def ffn_flops(config: TransformerConfig, tokens: int) -> int:
  return 2 * tokens * config.d_model * config.ffn_hidden_dim * (len(config.activations) + 1)


def forward_flops(config: TransformerConfig, batch: int, lengths: Dict[str, int]) -> Dict[str, int]:
  """{'attention', 'ffn', 'logits', 'total'} of one forward pass. ``lengths``: 'inputs' and
  'targets' (encoder-decoder), 'targets' (decoder-only; a prefix LM's rows are both) or 'inputs'
  (encoder-only)."""
  attention = ffn = 0
  self_components = config.attention_components
  if config.architecture != 'decoder_only':
    n = lengths['inputs']
    layers = config.num_layers('encoder')
    attention += layers * attention_flops(config, batch * n, n, n, self_components,
                                          config.max_length('encoder'))
    ffn += layers * ffn_flops(config, batch * n)
  if config.architecture != 'encoder_only':
    n = config.stack_length('decoder', lengths)
    layers = config.num_layers('decoder')
    attention += layers * attention_flops(config, batch * n, n, n, self_components,
                                          config.max_length('decoder'))
    if config.architecture == 'encoder_decoder':
      attention += layers * attention_flops(config, batch * n, n, lengths['inputs'],
                                            ('dot_product',), 0)
    ffn += layers * ffn_flops(config, batch * n)
  out_tokens = batch * config.stack_length(config.stacks[-1], lengths)
  logits = 2 * out_tokens * config.d_model * config.vocab_size
  if config.architecture == 'encoder_only':
    logits += 2 * out_tokens * config.d_model * config.d_model  # the MLM transform
  if config.head == 'classification':  # pooler and classifier on one token per example
    logits = 2 * batch * config.d_model * (config.d_model + config.num_labels)
  return {'attention': attention, 'ffn': ffn, 'logits': logits, 'total': attention + ffn + logits}


def train_flops(config: TransformerConfig, batch: int, lengths: Dict[str, int]) -> int:
  return 3 * forward_flops(config, batch, lengths)['total']
