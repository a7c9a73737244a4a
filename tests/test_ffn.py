"""Each FFN variant computes its formula from "GLU Variants Improve Transformer"."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_variants.layers.ffn import FFN_VARIANTS, MlpBlock, resolve_activations

sigmoid = lambda z: 1 / (1 + np.exp(-z))
gelu_tanh = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
FORMULAS = {  # x, W (first), V (second), W2 -> FFN(x)
    'relu': lambda x, w, v, w2: np.maximum(x @ w, 0) @ w2,
    'gelu': lambda x, w, v, w2: gelu_tanh(x @ w) @ w2,
    'swish': lambda x, w, v, w2: ((x @ w) * sigmoid(x @ w)) @ w2,
    'glu': lambda x, w, v, w2: (sigmoid(x @ w) * (x @ v)) @ w2,
    'bilinear': lambda x, w, v, w2: ((x @ w) * (x @ v)) @ w2,
    'reglu': lambda x, w, v, w2: (np.maximum(x @ w, 0) * (x @ v)) @ w2,
    'geglu': lambda x, w, v, w2: (gelu_tanh(x @ w) * (x @ v)) @ w2,
    'swiglu': lambda x, w, v, w2: ((x @ w) * sigmoid(x @ w) * (x @ v)) @ w2,
}


@pytest.mark.parametrize('variant', sorted(FFN_VARIANTS))
def test_ffn_variant_formula(variant):
  acts = resolve_activations(variant)
  block = MlpBlock(acts, d_ff=24)
  x = jnp.asarray(np.random.RandomState(0).randn(2, 3, 16), jnp.float32)
  p = nn.unbox(block.init(jax.random.PRNGKey(0), x)['params'])
  k = lambda name: np.asarray(p[name]['kernel'], np.float64)
  gated = len(acts) == 2
  assert sorted(p) == (['wi_0', 'wi_1', 'wo'] if gated else ['wi', 'wo'])
  w, v = (k('wi_0'), k('wi_1')) if gated else (k('wi'), None)
  want = FORMULAS[variant](np.asarray(x, np.float64), w, v, k('wo'))
  np.testing.assert_allclose(np.asarray(block.apply({'params': p}, x)), want, rtol=1e-4, atol=1e-5)


def test_unknown_variant_names_the_choices():
  with pytest.raises(ValueError, match='swiglu'):
    resolve_activations('swigloo')
  with pytest.raises(ValueError, match='unknown activation'):
    resolve_activations(('relu', 'mish'))
