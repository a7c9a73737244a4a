"""Precision as T5X: with ``dtype='bfloat16'`` every matrix multiply of the train step (forward
and backward: the output logits and their two gradients, the attention products, the
synthesizers, a classification head) takes bfloat16 operands; the output logits come out in
float32; the loss, softmax and norms stay in float32. Read from the lowered step (StableHLO), so it
holds on any backend."""
import functools
import re

import jax
import pytest

from conftest import tiny
from t5x_variants.models import build_model, init_inputs
from t5x_variants.train import optimizer, partitioning, train_step

DOT = re.compile(r'stablehlo\.dot_general.*?:\s*\((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)')


def lowered_dots(config):
  """[(lhs type, rhs type, result type)] of every dot_general in the lowered train step."""
  mesh_config = partitioning.MeshConfig()
  mesh = mesh_config.mesh()
  model = build_model(config)
  schedule = optimizer.learning_rate_schedule()
  layout = train_step.state_layout(
      model, functools.partial(optimizer.make_optimizer, learning_rate=schedule), mesh,
      mesh_config.rules(), jax.random.PRNGKey(0), init_inputs(config))
  step = train_step.make_train_step(layout.shardings, mesh, model=model, config=config,
                                    tx=layout.tx, schedule=schedule)
  batch = train_step.synthetic_batch(config, 2, {'inputs': 12, 'targets': 12})
  text = step.lower(layout.abstract, batch, jax.random.PRNGKey(0)).as_text()
  return [m.groups() for m in DOT.finditer(text)]


@pytest.mark.parametrize('overrides', [
    dict(architecture='encoder_decoder'),
    dict(architecture='encoder_decoder', tie_embeddings=True, ffn='swiglu'),
    dict(architecture='decoder_only', self_attention=('dense', 'random', 'factorized_dense',
                                                      'factorized_random', 'dot_product')),
    dict(architecture='encoder_only'),
    dict(architecture='encoder_only', head='classification'),
], ids=['t5', 'tied_swiglu', 'decoder_synthesizer_mixture', 'mlm', 'classification'])
def test_every_matmul_of_a_bfloat16_step_is_in_bfloat16(overrides):
  """Every operand in bfloat16; the output logits (or classifier scores) come out in float32, as
  T5X's float32 output layer, not rounded to bfloat16 before the softmax."""
  config = tiny(dtype='bfloat16', **overrides)
  dots = lowered_dots(config)
  assert len(dots) > 20
  assert [d for d in dots if 'f32' in d[0] or 'f32' in d[1]] == []
  width = config.num_labels if config.head == 'classification' else config.vocab_size
  output = [d for d in dots if d[1] == f'tensor<{config.d_model}x{width}xbf16>']
  assert output and all(d[2].endswith('xf32>') for d in output), output


def test_a_float32_step_stays_in_float32():
  assert all('bf16' not in ''.join(d) for d in lowered_dots(tiny()))


def test_tied_logits_are_scaled_without_a_bfloat16_bias():
  """d^-0.5 multiplies the decoder output in float32 before the bfloat16 matmul: rounded to
  bfloat16 itself (0.0361328 for 0.0360844 at d_model 768) it scaled every logit by 1.0013."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from conftest import init_params, tokens  # pylint: disable=g-import-not-at-top
  sizes = dict(d_model=768, num_heads=2, head_dim=8, d_ff=16, tie_embeddings=True, vocab_size=512)
  model, params = init_params(tiny(**sizes), tokens(1, 4), tokens(1, 4))
  x = jax.random.normal(jax.random.PRNGKey(1), (64, 768))
  logits = lambda m: np.asarray(m.apply({'params': params}, x, method=lambda module, y: module.logits(y)))
  exact, rounded = logits(model).ravel(), logits(build_model(tiny(**sizes, dtype='bfloat16'))).ravel()
  slope = np.dot(rounded, exact) / np.dot(exact, exact)
  assert abs(slope - 1) < 3e-4, slope


def test_a_float32_result_matmul_keeps_the_gradients_of_a_bfloat16_one():
  """``matmul_float32``: the logits unrounded (within float32 of the exact product of the bfloat16
  operands, where a bfloat16 result is off by its rounding), the gradients those of the bfloat16
  matmul, on bfloat16 operands."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from t5x_variants.layers.dense import matmul_float32  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(3, 5, 64) * 3, jnp.bfloat16)
  w = jnp.asarray(rng.randn(64, 40), jnp.bfloat16)
  g = jnp.asarray(rng.randn(3, 5, 40), jnp.float32)
  out, vjp = jax.vjp(matmul_float32, x, w)
  want, want_vjp = jax.vjp(lambda a, b: jnp.dot(a, b).astype(jnp.float32), x, w)
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert out.dtype == jnp.float32 and np.abs(out - exact).max() < 1e-4 < np.abs(want - exact).max()
  for got, ref in zip(vjp(g), want_vjp(g)):
    assert got.dtype == ref.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
