"""Position information and the token embedding: sinusoidal / learned / none beside T5's relative
bias, the relative bias added after mixing synthesizer logits, and the sqrt(d_model) scale."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import count, init_params, jit_apply, tiny, tokens
from t5x_variants.layers.position import sinusoidal
from test_models import assert_cached_decoding_equals_full_forward

L = 8


def test_sinusoids_are_vaswanis_formula():
  """PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(p / 10000^(2i/d))."""
  d, positions = 6, np.array([[0, 1, 5, 40]])
  want = np.zeros((1, 4, d))
  for j, p in enumerate(positions[0]):
    for i in range(d // 2):
      want[0, j, 2 * i] = math.sin(p / 10000 ** (2 * i / d))
      want[0, j, 2 * i + 1] = math.cos(p / 10000 ** (2 * i / d))
  np.testing.assert_allclose(sinusoidal(jnp.asarray(positions), d), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('kind', ['sinusoidal', 'learned', 'none'])
def test_absolute_positions_replace_the_relative_bias(kind):
  """No relative-bias table; a learned (max_length, d_model) table per stack when 'learned'."""
  c = tiny(position_embedding=kind)
  _, params = init_params(c, tokens(1, 4), tokens(1, 4))
  for stack in ('encoder', 'decoder'):
    assert 'relpos_bias' not in params[stack]
    assert ('position_embedding' in params[stack]) == (kind == 'learned')
  base = count(init_params(tiny(), tokens(1, 4), tokens(1, 4))[1])
  relpos = 2 * c.num_heads * c.relative_attention_num_buckets
  learned = c.d_model * (c.encoder_max_length + c.decoder_max_length)
  assert count(params) == base - relpos + (learned if kind == 'learned' else 0)


@pytest.mark.parametrize('kind', ['sinusoidal', 'learned', 'none', 'relative'])
def test_only_no_positions_leaves_the_encoder_permutation_equivariant(kind):
  """Without positions a bidirectional encoder maps a permuted input to the permuted output;
  any position information breaks that."""
  c = tiny(architecture='encoder_only', position_embedding=kind)
  x = tokens(1, L)
  perm = np.array([3, 0, 7, 1, 6, 2, 5, 4])
  model, params = init_params(c, x)
  if kind == 'learned':  # its table starts small (N(0, 0.02^2)): make it matter
    params['encoder']['position_embedding']['pos_embedding'] *= 50
  apply = jit_apply(model)
  a, b = apply({'params': params}, x), apply({'params': params}, x[:, perm])
  assert np.allclose(a[:, perm], b, rtol=1e-4, atol=1e-4) == (kind == 'none')


@pytest.mark.parametrize('kind', ['sinusoidal', 'learned'])
@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_decoder'])
def test_cached_decoding_with_absolute_positions_equals_full_forward(arch, kind):
  assert_cached_decoding_equals_full_forward(
      tiny(architecture=arch, position_embedding=kind, decoder_max_length=L))


@pytest.mark.parametrize('kind', ['sinusoidal', 'learned'])
def test_packed_rows_restart_absolute_positions(kind):
  c = tiny(architecture='decoder_only', position_embedding=kind, decoder_max_length=L)
  a, b = tokens(1, 5, seed=1), tokens(1, 3, seed=2)
  model, params = init_params(c, a)
  apply = jit_apply(model)
  packed = apply({'params': params}, jnp.concatenate([a, b], 1), jnp.asarray([[1] * 5 + [2] * 3]),
                 jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2]]))
  np.testing.assert_allclose(packed[:, 5:], apply({'params': params}, b), rtol=1e-5, atol=1e-5)


def test_learned_positions_refuse_a_longer_sequence():
  c = tiny(architecture='decoder_only', position_embedding='learned', decoder_max_length=4)
  with pytest.raises(ValueError, match='sequence length 6 exceeds the 4 learned positions'):
    init_params(c, tokens(1, 6))


def test_relative_bias_is_added_after_mixing():
  """A dot-product + random mixture (with its relative bias bound on) whose weight puts ~all mass
  on the random synthesizer: the relative bias still shifts the logits in full (it is added to the mixed logits, not to the
  dot-product component before weighting)."""
  c = tiny(architecture='decoder_only', self_attention=('dot_product', 'random'), synthesizer_relative_bias=True,
           decoder_max_length=L, num_decoder_layers=1, scan_layers=False)
  x = tokens(1, L)
  model, params = init_params(c, x)
  attention = params['decoder']['layers_0']['self_attention']
  attention['mixture_weights'] = jnp.array([-40.0, 40.0])  # softmax: (~1e-35, 1)
  apply = jit_apply(model)
  outputs = []
  for scale in (0.0, 5.0):
    p = jax.tree_util.tree_map(lambda v: v, params)  # a new tree of the same arrays
    p['decoder']['relpos_bias']['rel_embedding'] = scale * jnp.ones_like(
        p['decoder']['relpos_bias']['rel_embedding']).at[:, 1:].set(-scale)
    outputs.append(np.asarray(apply({'params': p}, x)))
  assert not np.allclose(outputs[0], outputs[1], atol=1e-3)


def test_embedding_scale_and_init_std():
  """Lookup returns sqrt(d_model) * E[id] with ``scale_embeddings``; E ~ N(0, std^2)."""
  d = 256
  c = tiny(architecture='encoder_only', d_model=d, num_heads=4, head_dim=64, vocab_size=512,
           embedding_init_std=d**-0.5, scale_embeddings=True)
  model, params = init_params(c, tokens(1, 4))
  table = params['token_embedder']['embedding']
  assert float(np.std(table)) == pytest.approx(d**-0.5, rel=0.03)
  ids = tokens(1, 4)
  looked_up = model.apply({'params': params}, ids, method=lambda m, i: m.token_embedder(i))
  np.testing.assert_allclose(looked_up, math.sqrt(d) * np.asarray(table)[np.asarray(ids)], rtol=1e-6)
