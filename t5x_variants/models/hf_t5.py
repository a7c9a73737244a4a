"""Hugging Face ``transformers`` T5 and this codebase's encoder-decoder: configuration and weights.

HF's ``T5ForConditionalGeneration`` (T5 v1.0, v1.1, Flan-T5) is our encoder-decoder with Pre-LN
RMSNorm, T5's relative position bias (one table per stack, HF keeps it in block 0), dot-product
attention and an FFN of the GLU paper (``feed_forward_proj``). Two conventions differ:

- The attention scale. Ours is softmax(Q K^T / sqrt(d_h)) (Vaswani et al. 2017, Eq. 1); T5 folds
  1 / sqrt(d_h) into the initialisation of W_q and computes softmax(Q K^T). So
  W_q(ours) = sqrt(d_h) W_q(T5), and back: exactly where sqrt(d_h) is a power of 2 (d_h 16, 64,
  256), else to float32 rounding (d_h 32 or 128: about 15% of W_q's weights move by one ulp).
- Layouts. A torch ``Linear`` weight is (out, in); ours are (in, heads, d_h), (heads, d_h, out)
  and (in, out). The relative-bias table is (buckets, heads) in HF, (heads, buckets) here.

Tied embeddings (T5 v1.0) multiply the decoder output by d_model^-0.5 before the shared embedding
in both. transformers (5.x) keeps that scale apart from the tying (``scale_decoder_outputs``): a
checkpoint whose output layer is scaled but not the embedding imports as an untied ``logits_dense``
with the scale folded in. Parameters here are numpy trees with unrolled layers (``layers_<i>``); ``stack_layers`` /
``unstack_layers`` convert to and from the scanned form (one ``layers`` subtree, layer axis 0).
"""
from typing import Dict, Mapping, Optional

import jax
import numpy as np

from t5x_variants.models.config import TransformerConfig

# Our FFN activations (layers/ffn.py) -> transformers' ACT2FN names. HF's 'gated-gelu' means the
# tanh GELU (gelu_new), as ours; its 'gelu' is the exact one.
_HF_ACT = {'relu': 'relu', 'gelu': 'gelu_new', 'gelu_exact': 'gelu', 'swish': 'silu',
           'sigmoid': 'sigmoid', 'tanh': 'tanh', 'linear': 'linear'}
_FROM_HF_ACT = {**{v: k for k, v in _HF_ACT.items()}, 'swish': 'swish', 'gelu_pytorch_tanh': 'gelu'}
_GATED = 'gated-'
_HF_ATTENTION = {'self_attention': 'SelfAttention', 'encoder_decoder_attention': 'EncDecAttention'}


def feed_forward_proj(activations) -> Optional[str]:
  """transformers' ``feed_forward_proj`` of an FFN activation tuple, or None if it has none."""
  if len(activations) == 1 and activations[0] in _HF_ACT:
    return _HF_ACT[activations[0]]
  if len(activations) == 2 and activations[1] == 'linear' and activations[0] in _HF_ACT:
    act = activations[0]
    return 'gated-gelu' if act == 'gelu' else None if act == 'gelu_exact' else _GATED + _HF_ACT[act]
  return None


def activations_of(proj: str) -> tuple:
  """The FFN activation tuple of a ``feed_forward_proj``."""
  gated = proj.startswith(_GATED)
  act = proj[len(_GATED):] if gated else proj
  act = 'gelu_new' if gated and act == 'gelu' else act  # transformers' legacy meaning
  if act not in _FROM_HF_ACT:
    raise ValueError(f'feed_forward_proj {proj!r}: the activation {act!r} has no counterpart here '
                     f'(supported: {", ".join(sorted(_FROM_HF_ACT))}, each optionally gated-)')
  return (_FROM_HF_ACT[act], 'linear') if gated else (_FROM_HF_ACT[act],)


def inexpressible(config: TransformerConfig) -> Optional[str]:
  """Why HF's T5 cannot hold ``config`` (the first variant axis it lacks), or None."""
  checks = [
      (config.architecture == 'encoder_decoder', f'architecture {config.architecture!r}: '
       'transformers T5 is encoder-decoder'),
      (config.head == 'lm', f'head {config.head!r}: T5ForConditionalGeneration has a language-model head'),
      (config.placement == 'pre', f'norm placement {config.placement!r}: transformers T5 is Pre-LN'),
      (config.norm == 'rmsnorm', f'norm {config.norm!r}: transformers T5 uses RMSNorm'),
      (config.attention_components == ('dot_product',),
       f'self-attention {config.self_attention!r}: transformers T5 has dot-product attention only'),
      (feed_forward_proj(config.activations) is not None,
       f'ffn {config.ffn!r}: no transformers feed_forward_proj computes it'),
      (config.position_embedding == 'relative',
       f'position embedding {config.position_embedding!r}: transformers T5 has relative position bias'),
      (not config.bidirectional_buckets(causal=True), 'relative_attention_bidirectional=True: '
       "transformers T5's decoder buckets are causal"),
      (not config.use_bias, 'use_bias: transformers T5 has no biases'),
      (not config.scale_embeddings, 'scale_embeddings: transformers T5 does not scale its embeddings'),
      (not config.tie_embeddings or config.scale_tied_logits, 'tie_embeddings without '
       'scale_tied_logits: transformers T5 scales a tied output layer by d_model^-0.5'),
  ]
  return next((why for ok, why in checks if not ok), None)


def hf_config(config: TransformerConfig) -> dict:
  """``config.json`` of ``T5ForConditionalGeneration`` for ``config`` (check ``inexpressible``)."""
  return {
      'architectures': ['T5ForConditionalGeneration'], 'model_type': 't5',
      'vocab_size': config.vocab_size, 'd_model': config.d_model, 'd_kv': config.head_dim,
      'd_ff': config.ffn_hidden_dim, 'num_layers': config.num_encoder_layers,
      'num_decoder_layers': config.num_decoder_layers, 'num_heads': config.num_heads,
      'relative_attention_num_buckets': config.relative_attention_num_buckets,
      'relative_attention_max_distance': config.relative_attention_max_distance,
      'dropout_rate': config.dropout_rate, 'layer_norm_epsilon': config.norm_epsilon,
      'feed_forward_proj': feed_forward_proj(config.activations),
      'tie_word_embeddings': config.tie_embeddings, 'is_encoder_decoder': True,
      'pad_token_id': 0, 'eos_token_id': 1, 'decoder_start_token_id': 0, 'initializer_factor': 1.0,
      'use_cache': True}


def scales_decoder_outputs(hf: Mapping) -> bool:
  """Whether an HF T5 ``config.json`` multiplies the decoder output by d_model^-0.5 (T5 v1.0).
  mT5 never does in transformers 5 (its released checkpoints are untied, which transformers 4
  took for unscaled too), whatever its config says of tying."""
  if hf.get('model_type') == 'mt5':
    return False
  return hf.get('scale_decoder_outputs', hf.get('tie_word_embeddings', True) is not False)


def _tied(hf: Mapping, weights: Mapping[str, np.ndarray]) -> bool:
  """Our ``tie_embeddings``: a scaled output layer that is the embedding itself (``shared``, or
  the encoder's copy of it where a file has no ``shared.weight``)."""
  head, shared = weights.get('lm_head.weight'), weights.get(_embedding_name(weights))
  return scales_decoder_outputs(hf) and (head is None or shared is None or np.array_equal(head, shared))


def _embedding_name(weights: Mapping[str, np.ndarray]) -> str:
  """Where a file holds the shared embedding: ``shared.weight``, else the encoder's copy."""
  return next((n for n in ('shared.weight', 'encoder.embed_tokens.weight') if n in weights), 'shared.weight')


def config_bindings(hf: Mapping, weights: Mapping[str, np.ndarray]) -> Dict[str, object]:
  """TransformerConfig fields of an HF T5 ``config.json`` and its weights (missing keys:
  transformers' defaults)."""
  activations = activations_of(hf.get('feed_forward_proj', 'relu'))
  d_ff = hf.get('d_ff', 2048)
  bindings = {
      'architecture': 'encoder_decoder', 'vocab_size': hf.get('vocab_size', 32128),
      'd_model': hf.get('d_model', 512), 'num_heads': hf.get('num_heads', 8),
      'head_dim': hf.get('d_kv', 64), 'd_ff': d_ff,
      'num_encoder_layers': hf.get('num_layers', 6),
      'num_decoder_layers': hf.get('num_decoder_layers') or hf.get('num_layers', 6),
      'ffn': activations, 'self_attention': 'dot_product', 'norm': 'rmsnorm', 'placement': 'pre',
      'norm_epsilon': hf.get('layer_norm_epsilon', 1e-6), 'use_bias': False,
      'tie_embeddings': _tied(hf, weights), 'position_embedding': 'relative',
      'relative_attention_num_buckets': hf.get('relative_attention_num_buckets', 32),
      'relative_attention_max_distance': hf.get('relative_attention_max_distance', 128),
      'dropout_rate': hf.get('dropout_rate', 0.1), 'scale_embeddings': False}
  if len(activations) == 2:
    bindings['d_ff_glu'] = d_ff  # HF's d_ff is the gated FFN's hidden width itself
  return bindings


def _blocks(stack: str, n: int):
  """(our layer name, HF block prefix, {our sublayer: HF layer index}) of each layer of a stack."""
  sub = ({'self_attention': 0, 'mlp': 1} if stack == 'encoder' else
         {'self_attention': 0, 'encoder_decoder_attention': 1, 'mlp': 2})
  return [(f'layers_{i}', f'{stack}.block.{i}.layer', sub) for i in range(n)]


_NORM_OF = {'self_attention': 'pre_attention_layer_norm',
            'encoder_decoder_attention': 'pre_cross_attention_layer_norm', 'mlp': 'pre_mlp_layer_norm'}


# Weights a transformers T5 file may hold beside those read: the stacks' copies of the shared
# embedding, and a relative-bias table of the first cross-attention that T5 never used.
_COPIES = ('encoder.embed_tokens.weight', 'decoder.embed_tokens.weight',
           'decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight')


def params_from_hf(weights: Mapping[str, np.ndarray], config: TransformerConfig,
                   scale_decoder_outputs: bool) -> dict:
  """Our unrolled parameter tree from an HF T5 state dict (numpy, float32); the config from
  ``config_bindings`` of the same checkpoint."""
  w = {k: np.asarray(v, np.float32) for k, v in weights.items()}
  used = set(_COPIES)

  def get(name, shape=None):  # ``shape``: what the config makes of it, checked before a reshape
    if name not in w:
      raise ValueError(f'the checkpoint has no {name}: is it a transformers T5 of this configuration?')
    if shape and w[name].shape != shape:
      raise ValueError(f'its weights and its config.json disagree: {name} is {w[name].shape} in the '
                       f'weights, {shape} by the config (d_model, num_heads, d_kv)')
    used.add(name)
    return w[name]
  heads, d_h, d = config.num_heads, config.head_dim, config.d_model
  embedding = get(_embedding_name(w))
  params = {'token_embedder': {'embedding': embedding}}
  if config.tie_embeddings:
    used.add('lm_head.weight')  # the embedding itself (config_bindings' judgement)
  else:
    head = get('lm_head.weight') if 'lm_head.weight' in w else embedding
    params['logits_dense'] = {'kernel': head.T * np.float32(
        config.d_model**-0.5 if scale_decoder_outputs else 1.0)}
  for stack, n in (('encoder', config.num_encoder_layers), ('decoder', config.num_decoder_layers)):
    tree = {f'{stack}_norm': {'scale': get(f'{stack}.final_layer_norm.weight')},
            'relpos_bias': {'rel_embedding': get(
                f'{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight').T}}
    for ours, prefix, sub in _blocks(stack, n):
      layer = {}
      for part, index in sub.items():
        hf = f'{prefix}.{index}'
        layer[_NORM_OF[part]] = {'scale': get(f'{hf}.layer_norm.weight')}
        if part == 'mlp':
          names = ['wi'] if len(config.activations) == 1 else ['wi_0', 'wi_1']
          layer['mlp'] = {**{m: {'kernel': get(f'{hf}.DenseReluDense.{m}.weight').T} for m in names},
                          'wo': {'kernel': get(f'{hf}.DenseReluDense.wo.weight').T}}
        else:
          a = f'{hf}.{_HF_ATTENTION[part]}'
          split = lambda m: get(f'{a}.{m}.weight', (heads * d_h, d)).T.reshape(d, heads, d_h)
          layer[part] = {'query': {'kernel': split('q') * np.float32(np.sqrt(d_h))}, 'key': {'kernel': split('k')},
                         'value': {'kernel': split('v')},
                         'out': {'kernel': get(f'{a}.o.weight', (d, heads * d_h)).T.reshape(heads, d_h, d)}}
      tree[ours] = layer
    params[stack] = tree
  unused = sorted(w.keys() - used)
  if unused:
    raise ValueError(f'the checkpoint holds {len(unused)} weights this configuration does not use '
                     f'(e.g. {unused[0]}): does its config.json describe all its layers, and is it a '
                     'T5ForConditionalGeneration?')
  return params


def params_to_hf(params: Mapping, config: TransformerConfig) -> Dict[str, np.ndarray]:
  """An HF T5 state dict (numpy float32, contiguous) from our unrolled parameter tree."""
  heads, d_h, d = config.num_heads, config.head_dim, config.d_model
  f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  out = {'shared.weight': f32(params['token_embedder']['embedding'])}  # tied to embed_tokens
  if not config.tie_embeddings:
    out['lm_head.weight'] = f32(np.asarray(params['logits_dense']['kernel']).T)
  for stack, n in (('encoder', config.num_encoder_layers), ('decoder', config.num_decoder_layers)):
    tree = params[stack]
    out[f'{stack}.final_layer_norm.weight'] = f32(tree[f'{stack}_norm']['scale'])
    out[f'{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight'] = f32(
        np.asarray(tree['relpos_bias']['rel_embedding']).T)
    for ours, prefix, sub in _blocks(stack, n):
      layer = tree[ours]
      for part, index in sub.items():
        hf = f'{prefix}.{index}'
        out[f'{hf}.layer_norm.weight'] = f32(layer[_NORM_OF[part]]['scale'])
        if part == 'mlp':
          for name, kernel in layer['mlp'].items():
            out[f'{hf}.DenseReluDense.{name}.weight'] = f32(np.asarray(kernel['kernel']).T)
        else:
          a = f'{hf}.{_HF_ATTENTION[part]}'
          merge = lambda m, scale=1.0: f32((np.asarray(layer[part][m]['kernel']) / scale).reshape(d, heads * d_h).T)
          out[f'{a}.q.weight'] = merge('query', np.float32(np.sqrt(d_h)))
          out[f'{a}.k.weight'], out[f'{a}.v.weight'] = merge('key'), merge('value')
          out[f'{a}.o.weight'] = f32(np.asarray(layer[part]['out']['kernel']).reshape(heads * d_h, d).T)
  return out


def unstack_layers(params: Mapping) -> dict:
  """Scanned -> unrolled: each stack's ``layers`` subtree (layer axis 0) as ``layers_<i>``."""
  out = {}
  for key, value in params.items():
    if isinstance(value, Mapping) and 'layers' in value:
      rest = {k: v for k, v in value.items() if k != 'layers'}
      n = len(jax.tree_util.tree_leaves(value['layers'])[0])
      out[key] = {**rest, **{f'layers_{i}': jax.tree_util.tree_map(lambda a, i=i: np.asarray(a)[i],
                                                                   value['layers'])
                             for i in range(n)}}
    else:
      out[key] = value
  return out


def stack_layers(params: Mapping) -> dict:
  """Unrolled -> scanned: each stack's ``layers_<i>`` stacked along a new axis 0 as ``layers``."""
  out = {}
  for key, value in params.items():
    layers = sorted((k for k in value if k.startswith('layers_')), key=lambda k: int(k[7:])) \
        if isinstance(value, Mapping) else []
    if layers:
      rest = {k: v for k, v in value.items() if not k.startswith('layers_')}
      out[key] = {**rest, 'layers': jax.tree_util.tree_map(lambda *a: np.stack(a), *[value[k] for k in layers])}
    else:
      out[key] = value
  return out


