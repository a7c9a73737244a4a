"""Norm placement: the papers' constants, the init gains they imply, and each block's equation."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import init_params, tiny
from t5x_variants.layers.placement import residual_constants
from t5x_variants.models.block import TransformerLayer


# (architecture, N, M) -> {stack: (alpha, gain)}, numbers evaluated by hand from the formulas in
# DeepNet's table (alpha, beta) and Magneto Sec. 2 (gamma), not by the code under test.
DEEPNORM = {
    ('encoder_only', 6, 0): {'encoder': (1.8612097, 0.3799178)},
    ('encoder_only', 100, 0): {'encoder': (3.7606031, 0.1880302)},
    ('decoder_only', 0, 12): {'decoder': (2.2133638, 0.3194716)},
    ('decoder_only', 0, 1000): {'decoder': (6.6874030, 0.1057371)},
    ('encoder_decoder', 6, 6): {'encoder': (1.4179381, 0.4969892), 'decoder': (2.0597671, 0.3432945)},
    ('encoder_decoder', 100, 100): {'encoder': (3.4157417, 0.2063095), 'decoder': (4.1617915, 0.1699044)},
}
SUBLN = {
    ('encoder_only', 6, 0): {'encoder': 1.5763587},
    ('decoder_only', 0, 24): {'decoder': 1.9675368},
    ('encoder_decoder', 12, 12): {'encoder': 1.9483853, 'decoder': 1.8930185},
}


@pytest.mark.parametrize('key', list(DEEPNORM))
def test_deepnorm_alpha_beta(key):
  got = residual_constants('deepnorm', *key)
  assert got.keys() == DEEPNORM[key].keys()
  for stack, want in DEEPNORM[key].items():
    np.testing.assert_allclose(got[stack], want, rtol=1e-5)


@pytest.mark.parametrize('key', list(SUBLN))
def test_subln_gamma(key):
  got = residual_constants('subln', *key)
  for stack, gamma in SUBLN[key].items():
    np.testing.assert_allclose(got[stack], (1.0, gamma), rtol=1e-5)


def test_pre_and_post_have_unit_constants_and_gin_overrides_apply():
  assert residual_constants('pre', 'encoder_decoder', 12, 12) == {'encoder': (1.0, 1.0), 'decoder': (1.0, 1.0)}
  c = tiny(placement='deepnorm', encoder_alpha=2.5, decoder_gain=0.125)
  consts = c.residual_constants()
  assert consts['encoder'][0] == 2.5 and consts['decoder'][1] == 0.125
  assert consts['encoder'][1] == pytest.approx(0.87 * (2**4 * 2)**(-1 / 16))


def test_an_override_the_model_would_ignore_is_refused():
  """alpha outside DeepNorm (the residual has none) and a stack the architecture lacks: refused
  (before, accepted, dropped, and model-info.txt showed the unused alpha)."""
  with pytest.raises(ValueError, match="encoder_alpha scales the residual only under DeepNorm.*'post'"):
    tiny(placement='post', encoder_alpha=3.0)
  with pytest.raises(ValueError, match='encoder_gain is set but a decoder_only model has no encoder: '
                                       'set decoder_gain'):
    tiny(architecture='decoder_only', placement='subln', encoder_gain=0.5)
  assert tiny(placement='subln', encoder_gain=0.5).residual_constants()['encoder'] == (1.0, 0.5)


@pytest.mark.parametrize('placement,subln_cross', [('deepnorm', False), ('subln', False), ('subln', True)])
def test_xavier_init_std_matches_the_gains(placement, subln_cross):
  """xavier-normal std = gain * sqrt(2 / (fan_in + fan_out)): gain beta (DeepNorm) or gamma
  (Sub-LN) on FFN, value and output projections, gain 1 on query and key. Cross-attention gets
  the decoder's beta under DeepNorm (DeepNet's code) but gain 1 and no inner LN under Sub-LN
  (Magneto's code) unless ``subln_cross_attention``."""
  c = tiny(d_model=256, num_heads=4, head_dim=64, d_ff=1024, vocab_size=16, num_encoder_layers=6,
           num_decoder_layers=6, placement=placement, init_scheme='xavier',
           subln_cross_attention=subln_cross)
  model, params = init_params(c, jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32))
  consts = c.residual_constants()
  assert consts == residual_constants(placement, 'encoder_decoder', 6, 6)
  cross_gain = consts['decoder'][1] if placement == 'deepnorm' or subln_cross else 1.0
  cross = params['decoder']['layers']['encoder_decoder_attention']
  assert ('inner_layer_norm' in cross) == subln_cross
  assert ('inner_layer_norm' in params['decoder']['layers']['self_attention']) == (placement == 'subln')
  xavier = lambda fi, fo: math.sqrt(2 / (fi + fo))
  checks = [
      ('encoder', ('self_attention', 'query'), 1.0, xavier(256, 256)),
      ('encoder', ('self_attention', 'key'), 1.0, xavier(256, 256)),
      ('encoder', ('self_attention', 'value'), consts['encoder'][1], xavier(256, 256)),
      ('encoder', ('self_attention', 'out'), consts['encoder'][1], xavier(256, 256)),
      ('encoder', ('mlp', 'wi'), consts['encoder'][1], xavier(256, 1024)),
      ('encoder', ('mlp', 'wo'), consts['encoder'][1], xavier(1024, 256)),
      ('decoder', ('self_attention', 'value'), consts['decoder'][1], xavier(256, 256)),
      ('decoder', ('encoder_decoder_attention', 'query'), 1.0, xavier(256, 256)),
      ('decoder', ('encoder_decoder_attention', 'value'), cross_gain, xavier(256, 256)),
      ('decoder', ('encoder_decoder_attention', 'out'), cross_gain, xavier(256, 256)),
      ('decoder', ('mlp', 'wo'), consts['decoder'][1], xavier(1024, 256)),
  ]
  for stack, path, gain, std in checks:
    w = params[stack]['layers'][path[0]][path[1]]['kernel']
    assert float(np.std(w)) == pytest.approx(gain * std, rel=0.03), (stack, path)


@pytest.mark.parametrize('placement', ['pre', 'deepnorm', 'subln'])
def test_torchscale_init_is_pytorch_linear_times_the_code_gains(placement):
  """The released code's init: W, b ~ U(+-1/sqrt(fan_in)) (std 1/sqrt(3 fan_in)), times the gain on
  value / out / FFN weights and biases; DeepNorm's encoder beta in an encoder-decoder is the
  code's 1.15 (N^4 M)^(-1/16) (the paper: 0.87); untied logits N(0, 1/d); relative bias N(0, 1)."""
  c = tiny(d_model=256, num_heads=4, head_dim=64, d_ff=1024, vocab_size=512, num_encoder_layers=6,
           num_decoder_layers=6, placement=placement, init_scheme='torchscale', use_bias=True)
  _, params = init_params(c, jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32))
  consts = c.residual_constants()
  if placement == 'deepnorm':
    assert consts['encoder'][1] == pytest.approx(1.15 * (6**5)**(-1 / 16))
    assert consts['decoder'][1] == pytest.approx((12 * 6)**-0.25)
  cross_gain = consts['decoder'][1] if placement == 'deepnorm' else 1.0
  checks = [('encoder', 'self_attention', 'query', 1.0, 256), ('encoder', 'self_attention', 'key', 1.0, 256),
            ('encoder', 'self_attention', 'value', consts['encoder'][1], 256),
            ('encoder', 'self_attention', 'out', consts['encoder'][1], 256),
            ('encoder', 'mlp', 'wi', consts['encoder'][1], 256), ('encoder', 'mlp', 'wo', consts['encoder'][1], 1024),
            ('decoder', 'encoder_decoder_attention', 'value', cross_gain, 256),
            ('decoder', 'encoder_decoder_attention', 'out', cross_gain, 256),
            ('decoder', 'mlp', 'wo', consts['decoder'][1], 1024)]
  for stack, block, name, gain, fan_in in checks:
    for leaf in ('kernel', 'bias'):
      w = np.asarray(params[stack]['layers'][block][name][leaf])
      bound = gain / math.sqrt(fan_in)
      assert np.abs(w).max() <= bound * (1 + 1e-6) and np.abs(w).max() > 0.95 * bound, (stack, name, leaf)
      if leaf == 'kernel':
        assert float(np.std(w)) == pytest.approx(bound / math.sqrt(3), rel=0.03), (stack, name)
  assert float(np.std(params['logits_dense']['kernel'])) == pytest.approx(256**-0.5, rel=0.03)
  assert float(np.std(params['encoder']['relpos_bias']['rel_embedding'])) == pytest.approx(1.0, rel=0.3)


def test_placement_files_leave_the_init_scheme_alone():
  """Init is its own gin choice (gin/variants/init/): no placement or norm file sets it, so a
  placement comparison never changes the init with it."""
  import glob
  for path in glob.glob('gin/variants/norm/*.gin'):
    assert 'init_scheme' not in open(path).read(), path
  for scheme in ('t5', 'xavier', 'torchscale'):
    assert f"init_scheme = '{scheme}'" in open(f'gin/variants/init/{scheme}.gin').read()


def test_t5_init_std_is_fan_in():
  c = tiny(d_model=256, num_heads=4, head_dim=64, d_ff=1024, vocab_size=16, architecture='encoder_only')
  _, params = init_params(c, jnp.ones((1, 4), jnp.int32))
  layers = params['encoder']['layers']
  assert float(np.std(layers['mlp']['wi']['kernel'])) == pytest.approx(256**-0.5, rel=0.03)
  assert float(np.std(layers['mlp']['wo']['kernel'])) == pytest.approx(1024**-0.5, rel=0.03)
  assert float(np.std(layers['self_attention']['query']['kernel'])) == pytest.approx(256**-0.5, rel=0.03)


def _norm(x, p, axes, kind):
  x = np.asarray(x, np.float64)
  if kind == 'layernorm':
    x = x - x.mean(axes, keepdims=True)
  y = x / np.sqrt((x * x).mean(axes, keepdims=True) + 1e-6) * p['scale']
  return y + p['bias'] if kind == 'layernorm' else y


def _reference_layer(p, x, bias, placement, alpha, kind):
  """One encoder layer written out in numpy from the papers' equations."""
  norm = lambda name, h: _norm(h, p[name], (-1,), kind)
  subln = placement == 'subln'

  def attention(h):
    a = p['self_attention']
    q, k, v = (np.einsum('bld,dhk->blhk', h, a[n]['kernel']) for n in ('query', 'key', 'value'))
    s = np.einsum('bqhd,bkhd->bhqk', q, k) / math.sqrt(q.shape[-1]) + bias
    w = np.exp(s - s.max(-1, keepdims=True))
    y = np.einsum('bhqk,bkhd->bqhd', w / w.sum(-1, keepdims=True), v)
    if subln:
      y = _norm(y, a['inner_layer_norm'], (-2, -1), kind)
    return np.einsum('bqhd,hdo->bqo', y, a['out']['kernel'])

  def mlp(h):
    m = p['mlp']
    y = np.maximum(h @ m['wi']['kernel'], 0)
    if subln:
      y = _norm(y, m['inner_layer_norm'], (-1,), kind)
    return y @ m['wo']['kernel']

  for name, f in (('attention', attention), ('mlp', mlp)):
    if placement in ('pre', 'subln'):
      x = x + f(norm(f'pre_{name}_layer_norm', x))
    elif placement == 'post':
      x = norm(f'post_{name}_layer_norm', x + f(x))
    else:
      x = norm(f'post_{name}_layer_norm', alpha * x + f(x))
  return x


@pytest.mark.parametrize('alpha', [24**0.25, 0.81 * (12**5)**(1 / 16), 36**0.25])
def test_deepnorm_scales_a_bfloat16_stream_by_alpha_itself(alpha):
  """In bfloat16 the residual is alpha x rounded, not x times alpha rounded to bfloat16 (2.2134 is
  2.21875 there: every DeepNorm layer of a 12-layer decoder-only model scaled 0.24% too far)."""
  from t5x_variants.layers.placement import residual  # pylint: disable=g-import-not-at-top
  x = jnp.asarray(np.random.RandomState(0).randn(100_000), jnp.bfloat16)
  out = residual(x, jnp.zeros_like, lambda v: v, 'deepnorm', alpha)
  x32, out32 = np.asarray(x, np.float32), np.asarray(out, np.float32)
  assert abs(float((out32 * x32).sum() / (x32 * x32).sum()) / alpha - 1) < 3e-4


@pytest.mark.parametrize('placement', ['post', 'pre', 'deepnorm', 'subln'])
@pytest.mark.parametrize('kind', ['rmsnorm', 'layernorm'])
def test_each_placement_computes_its_equation(placement, kind):
  c = tiny(architecture='encoder_only', placement=placement, norm=kind, num_encoder_layers=4)
  layer = TransformerLayer(c, 'encoder')
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(2, 5, c.d_model), jnp.float32)
  bias = jnp.asarray(rng.randn(1, c.num_heads, 5, 5), jnp.float32)
  pos = jnp.arange(5)[None]
  args = (x, pos, pos, None, bias, None, None, None)
  params = nn.unbox(layer.init(jax.random.PRNGKey(1), *args)['params'])
  # Perturb norm scales/biases so a misplaced norm cannot hide behind ones and zeros.
  params = jax.tree_util.tree_map_with_path(
      lambda path, v: v + 0.3 * jax.random.normal(jax.random.PRNGKey(len(str(path))), v.shape)
      if 'layer_norm' in str(path) else v, params)
  got, _ = layer.apply({'params': params}, *args)
  alpha = c.residual_constants()['encoder'][0]
  want = _reference_layer(jax.tree_util.tree_map(np.asarray, params), np.asarray(x), np.asarray(bias),
                          placement, alpha, kind)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)
