"""Oracle: Microsoft's torchscale 0.3.0 (the DeepNet / Magneto papers' released code) against ours.

For each architecture x placement (post, pre, deepnorm, subln) a small random torchscale model
(LayerNorm eps 1e-5, biases, exact GELU, T5 relative position bias, dropout 0, eval mode) is
copied into our parameter tree, and both must give the same float32 outputs on the same tokens
(padding in the encoder input). The same test checks that our residual scale alpha is each
torchscale layer's and that our init gain (under ``init_scheme='torchscale'``) is the factor
torchscale multiplies each projection by.

The mapping (torch ``Linear`` weights are (out, in); ours (in, out), split per head):
  q/k/v_proj -> query/key/value (d, heads, d_h); out_proj -> out (heads, d_h, d); both scale the
    query by d_h^-0.5 after its bias; inner_attn_ln (Sub-LN, over heads x d_h) -> inner_layer_norm
  ffn.fc1 / fc2 / ffn_layernorm -> mlp.wi / wo / inner_layer_norm
  self_attn_layer_norm / encoder_attn_layer_norm / final_layer_norm -> {pre|post}_attention /
    cross_attention / mlp_layer_norm; Encoder/Decoder.layer_norm (pre, subln) -> {stack}_norm
  relative_position (one per stack, shared by its layers as ours) -> relpos_bias (transposed)
  embed_tokens -> token_embedder (one table for both stacks); output_projection (no bias) ->
    logits_dense, or the shared embedding (share_all_embeddings) -> tie_embeddings with
    scale_tied_logits=False (x E^T, no 1/sqrt(d) on the output); no_scale_embedding=False ->
    scale_embeddings (sqrt(d) on the input; encoder-decoder here, as fairseq translation)

Differences between the two codebases, explicit here rather than hidden:
  1. torchscale's Decoder builds its self-attention RelativePositionBias with the default
     ``bidirectional=True``: a causal decoder's past distances n fall in T5's two-sided buckets
     (exact below 8, log-spaced to 128 in 8 buckets), ours in T5's one-sided ones (exact below
     16, 16 log buckets). Their table is copied through the bucket maps (``causal_table``), which
     is exact for the distances used here (decoder length 16; it is for any length up to 23) and
     raises, saying so, where one of our buckets covers two of theirs.
  2. torchscale's encoder-decoder Decoder adds a second relative position bias to the
     cross-attention logits (bidirectional buckets of encoder index - decoder index); ours has
     no position bias in cross-attention (T5). Its table is zeroed in the torchscale model.
  3. torchscale's Encoder projects its final hidden state straight to the vocabulary; our
     encoder-only LM head has BERT's transform first (W_out LN(gelu(W_t h))). Encoder-only
     compares the encoder's output and ``logits`` applied to it, not the head.
"""
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# torchscale imports timm (DropPath), which imports torchvision: torchvision warns when its
# optional image.so cannot load, timm's jit-scripted activations warn on this torch. Neither
# matters here; neither may become an error under the suite's filterwarnings.
_IMPORT_WARNINGS = [('ignore', 'Failed to load image Python extension', UserWarning),
                    ('ignore', r'`torch\.jit\.script` is deprecated', DeprecationWarning)]
pytestmark = [pytest.mark.filterwarnings(f'{a}:{m}:{c.__name__}') for a, m, c in _IMPORT_WARNINGS]
_SKIP = ('torchscale 0.3.0 (the DeepNet / Magneto oracle) is not installed: '
         'pip install --no-deps torchscale==0.3.0 fairscale==0.4.0 timm==0.6.13 torchvision==0.16.2')
with warnings.catch_warnings():
  for action, message, category in _IMPORT_WARNINGS:
    warnings.filterwarnings(action, message, category)
  torch = pytest.importorskip('torch', reason=_SKIP)
  pytest.importorskip('torchscale', reason=_SKIP)
  ts_config = pytest.importorskip('torchscale.architecture.config', reason=_SKIP)
  ts_encoder = pytest.importorskip('torchscale.architecture.encoder', reason=_SKIP)
  ts_decoder = pytest.importorskip('torchscale.architecture.decoder', reason=_SKIP)
  ts_encdec = pytest.importorskip('torchscale.architecture.encoder_decoder', reason=_SKIP)
  ts_relpos = pytest.importorskip('torchscale.component.relative_position_bias', reason=_SKIP)

from t5x_variants.layers.position import relative_position_bucket  # pylint: disable=g-import-not-at-top
from t5x_variants.models import TransformerConfig, build_model  # pylint: disable=g-import-not-at-top

VOCAB, D, HEADS, FFN, N_ENC, N_DEC = 97, 32, 4, 64, 3, 2  # N != M: alpha/beta formulas differ
BUCKETS, MAX_DISTANCE = 32, 128
# Encoder distances up to 19 and decoder ones up to 15 reach torchscale's log-spaced buckets (8+).
ENC_LEN, DEC_LEN, ENC_PAD = 20, 16, 5
ARCHITECTURES = ('encoder_only', 'decoder_only', 'encoder_decoder')
PLACEMENTS = ('post', 'pre', 'deepnorm', 'subln')
# torchscale's flags per placement (its config forces normalize_before off under deepnorm, on
# under subln; subln defaults to True, so post and pre must turn it off).
TS_PLACEMENT = {'post': dict(subln=False, deepnorm=False, normalize_before=False),
                'pre': dict(subln=False, deepnorm=False, normalize_before=True),
                'deepnorm': dict(subln=False, deepnorm=True, normalize_before=False),
                'subln': dict(subln=True, deepnorm=False, normalize_before=True)}


def torchscale_model(architecture, placement, seed=0, d=D, ffn=FFN, randomise_norms=True):
  """A random torchscale model in eval mode (its Linear defaults, then DeepNorm's / Sub-LN's own
  rescaling), LayerNorms randomised (unless told not to) so that every weight is tested."""
  flags = dict(TS_PLACEMENT[placement])
  before = flags.pop('normalize_before')
  tied = architecture == 'encoder_decoder'  # fairseq translation: shared, scaled embeddings
  kw = dict(vocab_size=VOCAB, activation_fn='gelu', dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, rel_pos_buckets=BUCKETS, max_rel_pos=MAX_DISTANCE,
            layernorm_eps=1e-5, no_scale_embedding=not tied, **flags)
  enc = dict(encoder_embed_dim=d, encoder_attention_heads=HEADS, encoder_ffn_embed_dim=ffn,
             encoder_layers=N_ENC, encoder_normalize_before=before)
  dec = dict(decoder_embed_dim=d, decoder_attention_heads=HEADS, decoder_ffn_embed_dim=ffn,
             decoder_layers=N_DEC, decoder_normalize_before=before)
  torch.manual_seed(seed)
  embed = torch.nn.Embedding(VOCAB, d)
  torch.nn.init.normal_(embed.weight, std=d**-0.5)
  if architecture == 'encoder_only':
    model = ts_encoder.Encoder(ts_config.EncoderConfig(**kw, **enc), embed_tokens=embed)
  elif architecture == 'decoder_only':
    model = ts_decoder.Decoder(ts_config.DecoderConfig(**kw, **dec), embed_tokens=embed)
  else:
    args = ts_config.EncoderDecoderConfig(**kw, **enc, **dec, share_all_embeddings=True)
    model = ts_encdec.EncoderDecoder(args, encoder_embed_tokens=embed, decoder_embed_tokens=embed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if randomise_norms and ('norm' in name or '_ln' in name):
        p.copy_(torch.rand_like(p) + 0.5 if name.endswith('weight') else torch.randn_like(p) * 0.1)
    if architecture == 'encoder_decoder':  # difference 2: no counterpart here
      model.decoder.cross_attn_relative_position.relative_attention_bias.weight.zero_()
  return model.eval()


def our_config(architecture, placement, d=D, ffn=FFN):
  tied = architecture == 'encoder_decoder'
  return TransformerConfig(
      architecture=architecture, vocab_size=VOCAB, d_model=d, num_heads=HEADS, head_dim=d // HEADS,
      d_ff=ffn, embedding_init_std=d**-0.5, num_encoder_layers=N_ENC, num_decoder_layers=N_DEC, ffn=('gelu_exact',),
      norm='layernorm', norm_epsilon=1e-5, placement=placement, init_scheme='torchscale',
      use_bias=True, tie_embeddings=tied, scale_tied_logits=False, scale_embeddings=tied,
      position_embedding='relative', relative_attention_num_buckets=BUCKETS, relative_attention_max_distance=MAX_DISTANCE,
      encoder_max_length=ENC_LEN, decoder_max_length=DEC_LEN, scan_layers=False)


def _np(t):
  return t.detach().numpy().astype(np.float32)


def _layer_norm(ln, shape=None):
  return {'scale': _np(ln.weight).reshape(shape or -1), 'bias': _np(ln.bias).reshape(shape or -1)}


def _attention(m):
  d = m.embed_dim
  d_h = d // HEADS
  split = lambda lin: {'kernel': _np(lin.weight).T.reshape(d, HEADS, d_h),
                       'bias': _np(lin.bias).reshape(HEADS, d_h)}
  out = {'query': split(m.q_proj), 'key': split(m.k_proj), 'value': split(m.v_proj),
         'out': {'kernel': _np(m.out_proj.weight).T.reshape(HEADS, d_h, d), 'bias': _np(m.out_proj.bias)}}
  if m.inner_attn_ln is not None:
    out['inner_layer_norm'] = _layer_norm(m.inner_attn_ln, (HEADS, d_h))
  return out


def _mlp(f):
  out = {'wi': {'kernel': _np(f.fc1.weight).T, 'bias': _np(f.fc1.bias)},
         'wo': {'kernel': _np(f.fc2.weight).T, 'bias': _np(f.fc2.bias)}}
  if f.ffn_layernorm is not None:
    out['inner_layer_norm'] = _layer_norm(f.ffn_layernorm)
  return out


def causal_table(table, length):
  """Our causal (heads, buckets) table from torchscale's decoder (buckets, heads) table, whose
  buckets are two-sided (difference 1): our bucket b gets their bucket of the distances n < length
  in b. Exact iff no bucket of ours holds distances of two of theirs."""
  n = np.arange(length)
  theirs = ts_relpos.RelativePositionBias._relative_position_bucket(  # pylint: disable=protected-access
      torch.as_tensor(-n), bidirectional=True, num_buckets=BUCKETS, max_distance=MAX_DISTANCE).numpy()
  ours = np.asarray(relative_position_bucket(jnp.asarray(-n), False, BUCKETS, MAX_DISTANCE))
  out = np.zeros((HEADS, BUCKETS), np.float32)  # buckets of distances >= length: unused
  for b in np.unique(ours):
    sources = np.unique(theirs[ours == b])
    if len(sources) != 1:
      raise AssertionError(f'distances {n[ours == b].tolist()} share our causal bucket {b} but fall in '
                           f'torchscale buckets {sources.tolist()} (its decoder bias is bidirectional): '
                           f'no exact mapping for decoder length {length}')
    out[:, b] = table[sources[0]]
  return out


def _stack(module, stack, placement, cross=False):
  prefix = 'pre' if placement in ('pre', 'subln') else 'post'
  tree = {}
  for i, l in enumerate(module.layers):
    layer = {f'{prefix}_attention_layer_norm': _layer_norm(l.self_attn_layer_norm),
             'self_attention': _attention(l.self_attn),
             f'{prefix}_mlp_layer_norm': _layer_norm(l.final_layer_norm), 'mlp': _mlp(l.ffn)}
    if cross:
      layer[f'{prefix}_cross_attention_layer_norm'] = _layer_norm(l.encoder_attn_layer_norm)
      layer['encoder_decoder_attention'] = _attention(l.encoder_attn)
    tree[f'layers_{i}'] = layer
  relpos = module.relative_position if stack == 'encoder' else module.self_attn_relative_position
  table = _np(relpos.relative_attention_bias.weight)
  tree['relpos_bias'] = {'rel_embedding': table.T if stack == 'encoder' else causal_table(table, DEC_LEN)}
  if module.layer_norm is not None:
    tree[f'{stack}_norm'] = _layer_norm(module.layer_norm)
  return tree


def _stacks(model, architecture):
  """{our stack name: torchscale Encoder / Decoder}."""
  if architecture == 'encoder_decoder':
    return {'encoder': model.encoder, 'decoder': model.decoder}
  return {'encoder' if architecture == 'encoder_only' else 'decoder': model}


def params_from_torchscale(model, config):
  """Our unrolled parameter tree (numpy float32) of a torchscale model."""
  arch, placement = config.architecture, config.placement
  stacks = _stacks(model, arch)
  first = next(iter(stacks.values()))
  params = {'token_embedder': {'embedding': _np(first.embed_tokens.weight)}}
  for stack, module in stacks.items():
    params[stack] = _stack(module, stack, placement, cross=arch == 'encoder_decoder' and stack == 'decoder')
  last = stacks['decoder' if 'decoder' in stacks else 'encoder']
  if config.tie_embeddings:
    assert last.output_projection.weight is first.embed_tokens.weight
  else:
    params['logits_dense'] = {'kernel': _np(last.output_projection.weight).T}
  return params


def complete(params, reference):
  """``params`` with our encoder-only MLM head (difference 3: no torchscale counterpart) filled
  with zeros; every other leaf must be there with our shape, and nothing more."""
  params = dict(params)
  for name in set(reference) - set(params):
    assert name in ('mlm_transform', 'mlm_norm'), f'torchscale has no counterpart of {name}'
    params[name] = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), reference[name])
  shapes = lambda t: jax.tree_util.tree_map(lambda a: tuple(a.shape), t)
  assert shapes(params) == shapes(reference)
  return params


def inputs():
  """Encoder and decoder tokens (numpy), the encoder's second row ending in padding."""
  rng = np.random.RandomState(1)
  enc = rng.randint(1, VOCAB, (2, ENC_LEN))
  enc[1, ENC_LEN - ENC_PAD:] = 0  # our pad id; torchscale gets encoder_padding_mask
  return enc, rng.randint(1, VOCAB, (2, DEC_LEN))


def model_inputs(architecture, enc, dec):
  """Our model's positional token arguments."""
  tokens = {'encoder_only': (enc,), 'decoder_only': (dec,), 'encoder_decoder': (enc, dec)}[architecture]
  return tuple(jnp.asarray(t, jnp.int32) for t in tokens)


def measured_gain(model, reference, name):
  """The factor torchscale's init put on parameter ``name`` (same seed, no DeepNorm / Sub-LN)."""
  ratio = _np(dict(model.named_parameters())[name]) / _np(dict(reference.named_parameters())[name])
  np.testing.assert_allclose(ratio, ratio.flat[0], rtol=1e-5)
  return float(ratio.flat[0])


def check_residual_constants(model, reference, config):
  """alpha of every torchscale layer, and its init gain on each projection, are ours."""
  arch, placement = config.architecture, config.placement
  consts = config.residual_constants()
  for stack, module in _stacks(model, arch).items():
    alpha, gain = consts[stack]
    for layer in module.layers:
      assert layer.alpha == pytest.approx(alpha, rel=1e-12), (stack, layer.alpha, alpha)
    p = f'{stack}.' if arch == 'encoder_decoder' else ''
    expected = {'self_attn.q_proj': 1.0, 'self_attn.k_proj': 1.0, 'self_attn.v_proj': gain,
                'self_attn.out_proj': gain, 'ffn.fc1': gain, 'ffn.fc2': gain}
    if stack == 'decoder' and arch == 'encoder_decoder':  # block.py: plain under Sub-LN
      cross = 1.0 if placement == 'subln' and not config.subln_cross_attention else gain
      expected.update({'encoder_attn.q_proj': 1.0, 'encoder_attn.v_proj': cross, 'encoder_attn.out_proj': cross})
    for sub, want in expected.items():
      for kind in ('weight', 'bias'):
        got = measured_gain(model, reference, f'{p}layers.0.{sub}.{kind}')
        assert got == pytest.approx(want, rel=1e-5), (stack, sub, kind, got, want)


def torchscale_outputs(model, architecture, enc, dec):
  """(hidden states or None, logits) of the torchscale model."""
  with torch.no_grad():
    src, tgt = torch.as_tensor(enc), torch.as_tensor(dec)
    if architecture == 'encoder_only':
      hidden = model(src, encoder_padding_mask=src == 0, features_only=True)['encoder_out']
      return _np(hidden), _np(model.output_projection(hidden))
    if architecture == 'decoder_only':
      return None, _np(model(tgt)[0])
    encoded = model.encoder(src, encoder_padding_mask=src == 0)
    return None, _np(model.decoder(tgt, encoder_out=encoded)[0])


def our_outputs(config, params, enc, dec):
  model = build_model(config)
  variables = {'params': params}
  if config.architecture == 'encoder_only':
    @jax.jit
    def run(variables, tokens):
      _, state = model.apply(variables, tokens, mutable=['intermediates'])
      hidden = state['intermediates']['encoder']['output'][0]
      return hidden, model.apply(variables, hidden, method=lambda m, x: m.logits(x))
    return tuple(np.asarray(a) for a in run(variables, *model_inputs('encoder_only', enc, dec)))
  return None, np.asarray(jax.jit(model.apply)(variables, *model_inputs(config.architecture, enc, dec)))


@pytest.mark.parametrize('placement', PLACEMENTS)
@pytest.mark.parametrize('architecture', ARCHITECTURES)
def test_matches_torchscale(architecture, placement):
  config = our_config(architecture, placement)
  model = torchscale_model(architecture, placement)
  plain = torchscale_model(architecture, 'post')  # the same seed without DeepNorm / Sub-LN
  check_residual_constants(model, plain, config)

  enc, dec = inputs()
  shapes = jax.eval_shape(build_model(config).init, jax.random.PRNGKey(0),
                          *model_inputs(architecture, enc, dec))
  params = complete(params_from_torchscale(model, config), nn.unbox(shapes['params']))
  ours_hidden, ours = our_outputs(config, params, enc, dec)
  theirs_hidden, theirs = torchscale_outputs(model, architecture, enc, dec)
  if architecture == 'encoder_only':  # padded positions (queries) differ by convention: not compared
    keep = enc != 0
    np.testing.assert_allclose(ours_hidden[keep], theirs_hidden[keep], rtol=1e-5, atol=1e-5)
    ours, theirs = ours[keep], theirs[keep]
  assert np.abs(theirs).max() > 0.1  # not a degenerate comparison
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('placement', PLACEMENTS)
@pytest.mark.parametrize('architecture', ARCHITECTURES)
def test_code_init_matches_a_fresh_torchscale_model(architecture, placement):
  """Under init_scheme='torchscale' every initial matrix and bias has the spread of the one a
  freshly built torchscale model has (std within sampling error; both means ~0), and every
  LayerNorm starts at (1, 0) as there."""
  config = our_config(architecture, placement, d=128, ffn=512)
  theirs = params_from_torchscale(torchscale_model(architecture, placement, d=128, ffn=512,
                                                   randomise_norms=False), config)
  enc, dec = inputs()
  ours = nn.unbox(build_model(config).init(jax.random.PRNGKey(0), *model_inputs(architecture, enc, dec))['params'])
  ours = {name: tree for name, tree in ours.items() if name in theirs}  # not the MLM head (difference 3)
  flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}
  ours, theirs = flat(ours), flat(theirs)
  assert ours.keys() == theirs.keys()
  compared = 0
  for where in (k for k in ours if 'token_embedder' not in k):
    a, b = ours[where], theirs[where]
    if 'norm' in where:
      np.testing.assert_array_equal(a, b, err_msg=where)
      continue
    sampling = 5 / np.sqrt(a.size)  # ~5 standard errors of a sample std
    assert np.std(a) == pytest.approx(np.std(b), rel=sampling), where
    assert abs(np.mean(a)) < 5 * np.std(b) / np.sqrt(a.size) + 1e-6, where
    compared += 1
  assert compared >= 12
