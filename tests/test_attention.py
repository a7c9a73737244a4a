"""Relative position buckets, synthesizer formulas, mixtures and length errors."""
import os
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HOST_DEVICES, tiny, tokens
from t5x_variants.layers import synthesizer as synth
from t5x_variants.layers.attention import Attention, add_shared_bias, masked_softmax, resolve_components
from t5x_variants.layers.dense import Dense
from t5x_variants.layers.position import relative_position_bucket
from t5x_variants.models import build_model


@pytest.mark.parametrize('rel,bidirectional,bucket', [
    (0, True, 0), (-1, True, 1), (1, True, 17), (-7, True, 7), (-8, True, 8), (-16, True, 10),
    (-200, True, 15), (200, True, 31), (5, False, 0), (-5, False, 5), (-20, False, 17),
    (-1000, False, 31),
])
def test_t5_relative_position_buckets(rel, bidirectional, bucket):
  # key_pos - query_pos = rel; 32 buckets, max distance 128 (T5 defaults), values by hand.
  assert int(relative_position_bucket(jnp.asarray(rel), bidirectional, 32, 128)) == bucket


@pytest.mark.parametrize('rel,bidirectional,num_buckets,max_distance,bucket', [
    (-80, False, 128, 100, 96), (20, True, 8, 200, 7), (-20, True, 8, 200, 3)])
def test_relative_position_buckets_at_an_exact_log_boundary(rel, bidirectional, num_buckets,
                                                            max_distance, bucket):
  """log(n / max_exact) / log(max_distance / max_exact) exactly an integer / (num_buckets -
  max_exact) (80/64 = 1.25 = sqrt(100/64)): the bucket T5's and transformers' float32 division
  gives; XLA's multiplication by the reciprocal gave one less, under jit and eagerly."""
  fn = lambda r: relative_position_bucket(r, bidirectional, num_buckets, max_distance)
  assert int(fn(jnp.asarray(rel))) == int(jax.jit(fn)(jnp.asarray(rel))) == bucket


def test_relative_position_buckets_of_a_huge_max_distance_cost_nothing_more():
  """The bucket starts come from each bucket's real start, not a scan of every distance up to
  max_distance (10^9 would take GBs): bidirectional, 8 exact buckets, bucket 8 + k begins near
  8 (10^9 / 8)^(k / 8) (14: 9.4e6, 15: 9.7e7)."""
  rel = jnp.asarray([-7, -8, -10**7, -10**8, 10**9 - 1])
  assert np.asarray(relative_position_bucket(rel, True, 32, 10**9)).tolist() == [7, 8, 14, 15, 31]


def _x(b=2, l=6, d=32, seed=0):
  return jnp.asarray(np.random.RandomState(seed).randn(b, l, d), jnp.float32)


def _positions(l):
  return jnp.arange(l)[None]


def _h(b=2, l=6, heads=2, d_h=4, seed=1):
  return jnp.maximum(jnp.asarray(np.random.RandomState(seed).randn(b, l, heads, d_h), jnp.float32), 0)


@pytest.mark.parametrize('shared', [True, False])
def test_dense_synthesizer_formula(shared):
  """B = W_2 h + b_2 from hidden activations h, W_2 one (d_h, l) matrix for all heads (the
  authors' code) or one per head (the paper's count), sliced to the keys."""
  m = synth.DenseSynthesizer(max_length=10, use_bias=True, shared_projection=shared)
  h, pos = _h(), _positions(6)
  p = nn.unbox(m.init(jax.random.PRNGKey(0), h, pos)['params'])
  p = jax.tree_util.tree_map(lambda v: v + 0.1, p)  # nonzero biases
  w2, b2 = p['w2']['kernel'], p['w2']['bias']
  assert w2.shape == ((4, 10) if shared else (2, 4, 10))
  if shared:
    w2, b2 = np.broadcast_to(w2, (2, 4, 10)), np.broadcast_to(b2, (2, 10))
  want = (np.einsum('blhk,hkm->bhlm', h, w2) + b2[None, :, None, :])[..., :6]
  np.testing.assert_allclose(m.apply({'params': p}, h, pos), want, rtol=1e-5, atol=1e-5)


def test_factorized_dense_is_an_outer_product_over_a_times_b():
  m = synth.FactorizedDenseSynthesizer(max_length=12, factor=3)
  h, pos = _h(l=12), _positions(12)
  p = nn.unbox(m.init(jax.random.PRNGKey(0), h, pos)['params'])
  a = np.einsum('blhk,hkm->bhlm', h, p['w_a']['kernel'])  # (..., 3)
  b = np.einsum('blhk,hkm->bhlm', h, p['w_b']['kernel'])  # (..., 4)
  want = (b[..., :, None] * a[..., None, :]).reshape(a.shape[:-1] + (12,))  # j = a_idx + 3 * b_idx
  np.testing.assert_allclose(m.apply({'params': p}, h, pos), want, rtol=1e-5, atol=1e-6)


def test_factor_pair_takes_the_divisor_nearest_the_root_and_refuses_a_factor_of_1():
  """a x 1 would be a dense synthesizer's logits times one scale, nothing factorized: a prime
  length (the default divisor was 1), and a factor of 1 or l, are refused."""
  assert synth.factor_pair(512) == (16, 32) and synth.factor_pair(626) == (2, 313)
  assert synth.factor_pair(12, 3) == (3, 4)
  with pytest.raises(ValueError, match='length 127 has no divisor but 1 and itself'):
    synth.factor_pair(127)
  for a in (1, 12, 5, -2):
    with pytest.raises(ValueError, match=f'synthesizer_factor {a} does not divide the synthesizer '
                                         'length 12 into a x b with a, b > 1'):
      synth.factor_pair(12, a)


def _component_logits(att, params, x, pos, name):
  """The logits of one component of an Attention (batch, heads, q_len, k_len)."""
  _, state = att.apply({'params': params}, x, x, pos, pos, mutable=['intermediates'],
                       capture_intermediates=lambda m, method: m.name == name and method == '__call__')
  return state['intermediates'][name]['__call__'][0]


@pytest.mark.parametrize('hidden', ['query', 'w1'])
def test_dense_synthesizer_hidden_layer_is_the_scaled_query_or_a_separate_w1(hidden):
  """'query' (the authors' code): B = W_2 relu((x W_q + b_q) / sqrt(d_h)) + b_2 from the
  attention's own query; 'w1' (the paper): B = W_2 relu(x W_1 + b_1) + b_2, and no query."""
  att = Attention(num_heads=2, head_dim=4, components=('dense',), max_length=10, use_bias=True,
                  synthesizer_hidden=hidden)
  x, pos = _x(d=8), _positions(6)
  p = nn.unbox(att.init(jax.random.PRNGKey(0), x, x, pos, pos)['params'])
  p = jax.tree_util.tree_map(lambda v: v + 0.1, p)  # nonzero biases
  assert set(p) == {'query' if hidden == 'query' else 'dense_w1', 'value', 'out', 'dense'}
  w = p['query'] if hidden == 'query' else p['dense_w1']
  pre = np.einsum('bld,dhk->blhk', x, w['kernel']) + w['bias']
  h = np.maximum(pre / 2.0 if hidden == 'query' else pre, 0)  # sqrt(d_h) = 2
  want = (np.einsum('blhk,km->bhlm', h, p['dense']['w2']['kernel']) + p['dense']['w2']['bias'])[..., :6]
  np.testing.assert_allclose(_component_logits(att, p, x, pos, 'dense'), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('hidden', ['query', 'w1'])
def test_dense_plus_dot_product_shares_the_query(hidden):
  """D+V under 'query': one query q = x W_q / sqrt(d_h) gives both q k^T and W_2 relu(q), so the
  dense logits move with W_q; under 'w1' they do not (their W_1 is their own)."""
  att = Attention(num_heads=2, head_dim=4, components=('dense', 'dot_product'), max_length=6,
                  synthesizer_hidden=hidden)
  x, pos = _x(d=8), _positions(6)
  p = nn.unbox(att.init(jax.random.PRNGKey(0), x, x, pos, pos)['params'])
  assert ('dense_w1' in p) == (hidden == 'w1')
  p['mixture_weights'] = jnp.asarray([0.3, -0.5])
  if hidden == 'query':  # the whole layer by hand
    w = np.exp([0.3, -0.5]) / np.exp([0.3, -0.5]).sum()
    q = np.einsum('bld,dhk->blhk', x, p['query']['kernel']) / 2.0
    k = np.einsum('bld,dhk->blhk', x, p['key']['kernel'])
    v = np.einsum('bld,dhk->blhk', x, p['value']['kernel'])
    dense = np.einsum('blhk,km->bhlm', np.maximum(q, 0), p['dense']['w2']['kernel'])
    s = w[0] * dense + w[1] * np.einsum('bqhd,bkhd->bhqk', q, k)
    a = np.exp(s - s.max(-1, keepdims=True))
    y = np.einsum('bhqk,bkhd->bqhd', a / a.sum(-1, keepdims=True), v)
    want = np.einsum('bqhd,hdo->bqo', y, p['out']['kernel'])
    np.testing.assert_allclose(att.apply({'params': p}, x, x, pos, pos), want, rtol=1e-4, atol=1e-5)
  moved = {**p, 'query': {'kernel': p['query']['kernel'] * 1.5}}
  before, after = (_component_logits(att, params, x, pos, 'dense') for params in (p, moved))
  assert np.allclose(before, after) == (hidden == 'w1')


def test_random_synthesizers_index_r_by_position_and_fixed_gets_no_gradient():
  for fixed in (False, True):
    m = synth.RandomSynthesizer(num_heads=2, max_length=8, fixed=fixed)
    x, q, k = _x(l=3), jnp.asarray([[2, 3, 5]]), jnp.asarray([[0, 1, 4, 7]])
    p = nn.unbox(m.init(jax.random.PRNGKey(0), x, q, k)['params'])
    r = np.asarray(p['random_logits'])
    np.testing.assert_allclose(m.apply({'params': p}, x, q, k)[0], r[:, [2, 3, 5]][:, :, [0, 1, 4, 7]])
    g = jax.grad(lambda p: m.apply({'params': p}, x, q, k).sum())(p)
    assert (np.abs(np.asarray(g['random_logits'])).sum() == 0) == fixed
  m = synth.FactorizedRandomSynthesizer(num_heads=2, max_length=8, rank=3)
  p = nn.unbox(m.init(jax.random.PRNGKey(0), x, q, k)['params'])
  r1, r2 = np.asarray(p['random_factor_1']), np.asarray(p['random_factor_2'])
  want = np.einsum('hqr,hkr->hqk', r1[:, [2, 3, 5]], r2[:, [0, 1, 4, 7]])
  np.testing.assert_allclose(m.apply({'params': p}, x, q, k)[0], want, rtol=1e-5, atol=1e-6)


def test_mixture_is_softmax_weighted_sum_of_logits():
  """softmax(w_1 S_1 + w_2 S_2) V with w = softmax(mixture_weights) (Synthesizer R+V)."""
  att = Attention(num_heads=2, head_dim=4, components=('random', 'dot_product'), max_length=6)
  x, pos = _x(d=8), _positions(6)
  p = nn.unbox(att.init(jax.random.PRNGKey(0), x, x, pos, pos)['params'])
  p['mixture_weights'] = jnp.asarray([0.3, -0.5])
  w = np.exp([0.3, -0.5]) / np.exp([0.3, -0.5]).sum()
  q = np.einsum('bld,dhk->blhk', x, p['query']['kernel'])
  k = np.einsum('bld,dhk->blhk', x, p['key']['kernel'])
  v = np.einsum('bld,dhk->blhk', x, p['value']['kernel'])
  s = w[0] * np.asarray(p['random']['random_logits'])[None] + w[1] * np.einsum('bqhd,bkhd->bhqk', q, k) / 2.0
  a = np.exp(s - s.max(-1, keepdims=True))
  y = np.einsum('bhqk,bkhd->bqhd', a / a.sum(-1, keepdims=True), v)
  want = np.einsum('bqhd,hdo->bqo', y, p['out']['kernel'])
  np.testing.assert_allclose(att.apply({'params': p}, x, x, pos, pos), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('variant', synth.SYNTHESIZERS)
def test_sequence_longer_than_synthesizer_length_is_an_error(variant):
  c = tiny(architecture='encoder_only', self_attention=variant, encoder_max_length=6)
  with pytest.raises(ValueError, match='exceeds the synthesizer maximum length 6'):
    build_model(c).init(jax.random.PRNGKey(0), tokens(1, 7))


@pytest.mark.parametrize('variant', synth.SYNTHESIZERS)
def test_a_position_past_the_synthesizer_length_gives_nan_logits_in_every_kind(variant):
  """Positions of l or more (a caller's packed rows without positions) are NaN wherever they
  address the table, never R's last row silently (random kinds clamped, dense ones gave NaN)."""
  m = {'dense': lambda: synth.DenseSynthesizer(max_length=6),
       'factorized_dense': lambda: synth.FactorizedDenseSynthesizer(max_length=6),
       'random': lambda: synth.RandomSynthesizer(num_heads=2, max_length=6),
       'fixed_random': lambda: synth.RandomSynthesizer(num_heads=2, max_length=6, fixed=True),
       'factorized_random': lambda: synth.FactorizedRandomSynthesizer(num_heads=2, max_length=6)}[variant]()
  pos = jnp.asarray([[4, 5, 6, 7]])
  args = (_h(l=4), pos) if variant in synth.DENSE_SYNTHESIZERS else (_x(l=4), pos, pos)
  logits = np.asarray(m.apply(m.init(jax.random.PRNGKey(0), *args), *args))
  finite = np.isfinite(logits[0, 0])
  assert finite[:2, :2].all() and not finite[:, 2:].any(), finite


@pytest.mark.parametrize('architecture', ['encoder_decoder', 'decoder_only', 'encoder_only'])
def test_packed_rows_without_positions_are_refused_with_a_synthesizer(architecture):
  """Segment ids without positions: fine for dot-product attention with T5's relative bias
  (distances within a segment do not depend on where it starts), refused for a synthesizer
  (absolute columns) and for learned position embeddings."""
  ids = jnp.asarray([[1, 1, 2, 2]])
  for attention, position in (('dot_product', 'relative'), (('random', 'dot_product'), 'relative'),
                              ('dot_product', 'learned')):
    c = tiny(architecture=architecture, self_attention=attention, encoder_max_length=4,
             decoder_max_length=4, position_embedding=position)
    toks = tuple(tokens(1, 4) for _ in c.stacks)
    prefix = {'encoder_decoder': ('encoder', 'decoder'), 'decoder_only': ('decoder',),
              'encoder_only': ('encoder',)}[architecture]
    packed = {f'{p}_segment_ids': ids for p in prefix}
    model = build_model(c)
    params = model.init(jax.random.PRNGKey(0), *toks)
    if (attention, position) == ('dot_product', 'relative'):
      assert np.isfinite(np.asarray(model.apply(params, *toks, **packed))).all()
    else:
      what = 'a synthesizer' if position == 'relative' else 'learned position embeddings'
      with pytest.raises(ValueError, match=f'packed rows .* need their positions for {what}'):
        model.apply(params, *toks, **packed)


def test_invalid_attention_names():
  with pytest.raises(ValueError, match='dot_product, dense, random'):
    resolve_components('linformer')
  with pytest.raises(ValueError, match='distinct'):
    resolve_components(('dense', 'dense'))


def test_masked_softmax_gradient_equals_autodiff_of_the_unfused_form():
  rng = np.random.RandomState(0)
  s = jnp.asarray(rng.randn(3, 2, 5, 7), jnp.float32)
  mask = jnp.asarray(rng.rand(3, 1, 5, 7) > 0.3).at[0, 0, 1].set(False)  # one row fully masked
  g = jnp.asarray(rng.randn(3, 2, 5, 7), jnp.float32)
  for m in (mask, None):
    unfused = lambda x: jax.nn.softmax(x if m is None else jnp.where(m, x, -1e10), axis=-1)
    np.testing.assert_allclose(masked_softmax(s, m), unfused(s), rtol=1e-6, atol=1e-7)
    ours = jax.vjp(lambda x: masked_softmax(x, m), s)[1](g)[0]
    ref = jax.vjp(unfused, s)[1](g)[0]
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
  # Logits shared by the batch (a random synthesizer's, (1, h, q, k)) under a padding mask of the
  # whole batch: the gradient has the logits' shape, summed over the batch (a custom VJP that
  # returned the mask's batch failed here).
  shared = s[:1]
  unfused = lambda x: jax.nn.softmax(jnp.where(mask, x, -1e10), axis=-1)
  ours = jax.vjp(lambda x: masked_softmax(x, mask), shared)[1](g)[0]
  assert ours.shape == shared.shape
  np.testing.assert_allclose(ours, jax.vjp(unfused, shared)[1](g)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('batch', [1, 3, 8])
def test_shared_bias_gradient_is_the_sum_over_the_batch(batch):
  rng = np.random.RandomState(batch)
  s = jnp.asarray(rng.randn(batch, 2, 4, 4), jnp.float32)
  bias = jnp.asarray(rng.randn(1, 2, 4, 4), jnp.float32)
  g = jnp.asarray(rng.randn(batch, 2, 4, 4), jnp.float32)
  out, vjp = jax.vjp(add_shared_bias, s, bias)
  np.testing.assert_allclose(out, s + bias)
  ds, dbias = vjp(g)
  np.testing.assert_allclose(ds, g)
  np.testing.assert_allclose(dbias, g.sum(0, keepdims=True), rtol=1e-6, atol=1e-6)


def test_dense_contracts_and_produces_several_axes_like_einsum():
  x = jnp.asarray(np.random.RandomState(0).randn(2, 3, 4, 5), jnp.float32)
  m = Dense((6, 7), ('heads', 'kv'), ('embed', 'mlp'))
  p = nn.unbox(m.init(jax.random.PRNGKey(0), x)['params'])
  np.testing.assert_allclose(m.apply({'params': p}, x), jnp.einsum('bqhd,hdef->bqef', x, p['kernel']),
                             rtol=1e-5, atol=1e-6)


def test_dense_for_a_tpu_contracts_as_laid_out_with_the_same_values_and_gradients(monkeypatch):
  """On a TPU Dense is one dot_general over the axes as they are (layers/dense.py); elsewhere a
  2-D matmul between reshapes: the same function."""
  from t5x_variants.layers import fused_attention  # pylint: disable=g-import-not-at-top
  x = jnp.asarray(np.random.RandomState(0).randn(2, 3, 4, 5), jnp.float32)
  m = Dense((6, 7), ('heads', 'kv'), ('embed', 'mlp'), use_bias=True, init_scheme='xavier')
  p = nn.unbox(m.init(jax.random.PRNGKey(0), x)['params'])
  f = lambda p, x: jnp.sum(jnp.sin(m.apply({'params': p}, x)))
  monkeypatch.setattr(fused_attention, 'platform', lambda: 'cpu')
  two_d = jax.value_and_grad(f, argnums=(0, 1))(p, x)
  monkeypatch.setattr(fused_attention, 'platform', lambda: 'tpu')
  laid_out = jax.value_and_grad(f, argnums=(0, 1))(p, x)
  for a, b in zip(jax.tree_util.tree_leaves(two_d), jax.tree_util.tree_leaves(laid_out)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
  # T5XV_DENSE_CONTRACTION forces either form on any platform (to measure one against the other).
  ranks = lambda: {e.invars[0].aval.ndim for e in jax.make_jaxpr(lambda *a: f(*a))(p, x).jaxpr.eqns
                   if e.primitive.name == 'dot_general'}  # a new function each time: traced again
  assert ranks() == {4}  # the TPU's form
  monkeypatch.setenv('T5XV_DENSE_CONTRACTION', 'matmul')
  assert ranks() == {2}
  monkeypatch.setattr(fused_attention, 'platform', lambda: 'cpu')
  monkeypatch.setenv('T5XV_DENSE_CONTRACTION', 'dot_general')
  assert ranks() == {4}
  monkeypatch.setenv('T5XV_DENSE_CONTRACTION', '2d')
  with pytest.raises(ValueError, match="T5XV_DENSE_CONTRACTION='2d': 'dot_general', 'matmul' or unset"):
    ranks()


def test_shared_bias_must_have_batch_one():
  with pytest.raises(ValueError, match='batch 1'):
    add_shared_bias(jnp.zeros((2, 1, 3, 3)), jnp.zeros((2, 1, 3, 3)))


def test_the_shared_bias_gradient_stays_on_each_device_of_a_split_batch():
  """The relative-bias gradient sums the logits' gradient over the batch: with the batch split
  over 8 devices (4 rows each), the rows are summed on their device first; only the one row per
  device left then moves (collective-permutes of (1, heads, q, k) blocks), never a block of the
  split batch itself (pairing the batch's halves moved (16, ...) and (8, ...) blocks)."""
  import subprocess, sys, textwrap  # pylint: disable=g-import-not-at-top
  script = textwrap.dedent(r'''
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from t5x_variants.layers.attention import add_shared_bias
    mesh = Mesh(np.array(jax.devices()), ('data',))
    s = jax.ShapeDtypeStruct((32, 4, 64, 64), jnp.float32, sharding=NamedSharding(mesh, P('data')))
    b = jax.ShapeDtypeStruct((1, 4, 64, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
    grad = jax.jit(jax.grad(lambda s, b: jnp.sum(jnp.sin(add_shared_bias(s, b))), argnums=1))
    text = grad.lower(s, b).compile().as_text()
    x = np.random.RandomState(0).randn(32, 4, 64, 64).astype(np.float32)
    got = grad(jax.device_put(x, s.sharding), jnp.zeros((1, 4, 64, 64)))
    import re
    moved = sorted({int(np.prod([int(d) for d in m.split(',')])) // (4 * 64 * 64)
                    for m in re.findall(r'= f32\[([\d,]+)\]\S* collective-permute', text)})
    print(moved or [0], float(np.abs(got - np.cos(x).sum(0, keepdims=True)).max()))
  ''')
  out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                       env={**os.environ, **HOST_DEVICES})
  assert out.returncode == 0, out.stderr[-2000:]
  moved, error = out.stdout.rsplit(' ', 1)
  assert moved == '[1]' and float(error) < 1e-4, out.stdout


def test_random_tables_start_as_their_own_draw_per_layer_and_head_at_std_one_over_root_l():
  """A fixed random synthesizer's starting table is all it ever has: std l^-1/2 (variance
  scaling over the keys), a draw of its own for each layer and head; a mixture's weights start
  equal (zeros: softmax 1/n each); the factorized random factors at std k^-1/2."""
  from conftest import init_params  # pylint: disable=g-import-not-at-top
  l = 64
  c = tiny(architecture='encoder_only', self_attention='fixed_random', encoder_max_length=l, num_heads=2)
  _, p = init_params(c, tokens(1, l))
  r = np.asarray(p['encoder']['layers']['self_attention']['fixed_random']['random_logits'])
  assert r.shape == (c.num_encoder_layers, 2, l, l) and c.num_encoder_layers >= 2
  assert abs(r.std() - l ** -0.5) < 0.05 * l ** -0.5 and abs(r.mean()) < 0.05 * l ** -0.5
  assert not np.allclose(r[0], r[1]) and not np.allclose(r[0, 0], r[0, 1])
  c = tiny(architecture='encoder_only', self_attention=('random', 'factorized_random'), encoder_max_length=l)
  _, p = init_params(c, tokens(1, l))
  attention = p['encoder']['layers']['self_attention']
  np.testing.assert_array_equal(attention['mixture_weights'], 0.0)
  factor = np.asarray(attention['factorized_random']['random_factor_1'])
  assert abs(factor.std() - c.synthesizer_rank ** -0.5) < 0.05 * c.synthesizer_rank ** -0.5
