"""The whole-row Pallas TPU kernel (layers/row_attention.py) against softmax(s Q K^T + B) V
written out in jnp: outputs and the gradients of Q, K, V and the shared bias, run on the CPU in
Pallas' TPU interpret mode; compiled for a v5p chip through libtpu, the compiler's cost model
counts the FLOPs the kernels declare, backward included."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from conftest import tpu_interpreter
from t5x_variants.layers import row_attention

SCALE = 0.125


def reference(q, k, v, bias, q_lens, k_lens, causal):
  s = jnp.einsum('bhqd,bhkd->bhqk', q, k) * SCALE
  if bias is not None:
    s = s + bias[None]
  nq, nk = s.shape[2:]
  keep = jnp.arange(nk)[None, None, None, :] < k_lens[:, None, None, None]
  if causal:
    keep = keep & (jnp.arange(nk)[None, :] <= jnp.arange(nq)[:, None])
  p = jax.nn.softmax(jnp.where(keep, s, -1e30), axis=-1)
  o = jnp.einsum('bhqk,bhkd->bhqd', p, v)
  return jnp.where((jnp.arange(nq)[None, :] < q_lens[:, None])[:, None, :, None], o, 0)


@tpu_interpreter
@pytest.mark.parametrize('causal,keys,with_bias', [(False, 256, True), (True, 128, True),
                                                   (False, 256, False)])
def test_kernel_equals_the_formula_with_its_gradients(causal, keys, with_bias):
  """Encoder-like (keys past each row's length masked, queries past it zero), causal, and
  cross-attention-like without a bias; three rows of lengths full, partial and short."""
  rng = np.random.default_rng(0)
  b, h, nq, d = 3, 2, 128, 64
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, k, v, w = normal(b, h, nq, d), normal(b, h, keys, d), normal(b, h, keys, d), normal(b, h, nq, d)
  bias = normal(h, nq, keys) if with_bias else None
  q_lens = jnp.array([nq, 100, 7], jnp.int32)
  k_lens = q_lens if causal else jnp.array([keys, 90, 5], jnp.int32)
  argnums = (0, 1, 2, 3) if with_bias else (0, 1, 2)

  def value_and_grads(f):
    loss = lambda *x: jnp.sum(f(*x, q_lens, k_lens) * w)
    return f(q, k, v, bias, q_lens, k_lens), jax.grad(loss, argnums)(q, k, v, bias)

  with pltpu.force_tpu_interpret_mode():
    got = value_and_grads(
        lambda q, k, v, ab, ql, kl: row_attention.attention(q, k, v, ab, None, ql, kl, SCALE, causal))
  want = value_and_grads(lambda *x: reference(*x, causal))
  for name, a, b_ in zip(('out', 'dq', 'dk', 'dv', 'dbias'), jax.tree_util.tree_leaves(got),
                         jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5, err_msg=name)


def test_fits_holds_t5_rows_and_not_longer_ones():
  assert row_attention.fits(512, 512) and row_attention.fits(128, 512)
  assert not row_attention.fits(1024, 512)


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason="libtpu is not installed (pip install -e '.[tpu]')")
# the persistent cache stores executables for compile-only TPU devices but cannot load them back
@pytest.mark.filterwarnings('ignore:Error reading persistent compilation cache')
def test_the_cost_model_counts_forward_and_backward_on_a_v5p_chip():
  """Forward (2 matmuls) and backward (6) at the encoder self-attention's shape on one chip:
  16 b h q k d FLOPs in all; no (batch, heads, q, k) array anywhere (the bias is read per
  head, its gradient summed inside the kernel)."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import targets  # pylint: disable=g-import-not-at-top
  targets.deviceless_environment()
  chip = Mesh(np.array(targets.tpu_target('v5p:2x2x1').devices[:1]), ('data',))
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(chip, PartitionSpec()))
  b, h, n, d = 16, 12, 512, 64
  qkv, bias, lens = spec((b, h, n, d), jnp.bfloat16), spec((h, n, n), jnp.bfloat16), spec((b,), jnp.int32)

  def loss(q, k, v, ab, q_lens, k_lens):
    out = row_attention.attention(q, k, v, ab, None, q_lens, k_lens, SCALE, False)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  compiled = jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(qkv, qkv, qkv, bias, lens, lens).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  kernel_flops = 16 * b * h * n * n * d
  assert kernel_flops <= cost['flops'] < 1.05 * kernel_flops
  assert f'[{b},{h},{n},{n}]' not in compiled.as_text()  # no bias or dB per example
