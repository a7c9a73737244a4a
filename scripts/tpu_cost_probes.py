"""Pieces of the T5-base train step compiled alone for one v5p chip, with what libtpu's cost model
says of each (FLOPs, bytes accessed, estimated seconds): compiler figures, not runs.

- attention: the encoder self-attention's forward and backward at one chip's share of batch 128
  on v5p-16 (16 x 512 x 12 heads x 64, bfloat16, T5's bias with its gradient), the XLA reference
  path against the project's row kernel (layers/row_attention.py: the bias read once per head,
  its gradient summed inside) and JAX's flash kernel (one bias per example, broadcast over the
  batch, its gradient summed after), each also without the bias (what the bias costs it). The
  cost model sees inside a Pallas kernel only the CostEstimate the kernel declares (the row
  kernel declares forward and backward; JAX's declares its forward, not its two backward
  kernels).
- loss: the output-logits matmul and the loss over the 32,128-token vocabulary, forward and
  backward, at 16 x 114 targets.
- adafactor: the optimizer update of T5-base's parameters (every chip updates all of them under
  data parallelism), against reading the gradient and the parameters and writing the parameters
  once.

    JAX_PLATFORMS=cpu python scripts/tpu_cost_probes.py     # needs libtpu (the 'tpu' extra)
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5x_variants.layers import attention, fused_attention, row_attention
from t5x_variants.models import TransformerConfig, build_model, init_inputs, losses
from t5x_variants.train import optimizer, targets

BF16 = jnp.bfloat16


def cost(fn, *args):
  ca = jax.jit(fn).lower(*args).compile().cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return ca['flops'], ca['bytes accessed'], ca['optimal_seconds']


def main():
  chip = targets.tpu_target('v5p:2x2x1').devices[:1]
  mesh = Mesh(np.array(chip), ('data',))
  one = NamedSharding(mesh, PartitionSpec())
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
  rows = []

  b, length, h, d = 16, 512, 12, 64
  qkv = spec((b, length, h, d), BF16)
  bias = spec((1, h, length, length), jnp.float32)

  def reference(q, k, v, ab):
    s = attention.add_shared_bias(jnp.einsum('bqhd,bkhd->bhqk', q, k).astype(jnp.float32), ab)
    return jnp.einsum('bhqk,bkhd->bqhd', attention.masked_softmax(s, None).astype(BF16), v)

  def pallas(q, k, v, ab):
    return fused_attention.attend(q, k, v, ab, implementation='pallas')

  def pallas_without_bias(q, k, v, ab):  # what T5's bias costs the kernel (ab unused: zero grad)
    return fused_attention.attend(q, k, v, None, implementation='pallas') + 0 * jnp.sum(ab)

  whole_rows = row_attention.MAX_ROW_ELEMENTS
  for name, f, row_budget in (
      ('attention, XLA path', reference, whole_rows),
      ('attention, row kernel (the TPU default)', pallas, whole_rows),
      ('attention, row kernel, no bias', pallas_without_bias, whole_rows),
      ("attention, JAX's flash kernel", pallas, 0),
      ("attention, JAX's flash kernel, no bias", pallas_without_bias, 0)):
    row_attention.MAX_ROW_ELEMENTS = row_budget  # 0: every row too long for the row kernel
    loss = lambda q, k, v, ab, f=f: jnp.sum(jnp.square(f(q, k, v, ab).astype(jnp.float32)))
    rows.append((name, cost(jax.grad(loss, argnums=(0, 1, 2, 3)), qkv, qkv, qkv, bias)))
  row_attention.MAX_ROW_ELEMENTS = whole_rows

  t, vocab, d_model = 114, 32128, 768
  def logits_loss(x, w, targets_, weights):
    def f(x, w):
      logits = jnp.einsum('btd,dv->btv', x, w.astype(BF16))
      return losses.loss_and_metrics(logits, targets_, weights, 0.0, 1e-4, 'none')['loss']
    return jax.value_and_grad(f, argnums=(0, 1))(x, w)
  rows.append(('logits matmul and loss', cost(
      logits_loss, spec((b, t, d_model), BF16), spec((d_model, vocab), jnp.float32),
      spec((b, t), jnp.int32), spec((b, t), jnp.float32))))

  config = TransformerConfig(scan_layers=False)  # T5-base's shape is the config's default
  model = build_model(config)
  params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.PRNGKey(0), *init_inputs(config))['params']))
  tx = optimizer.make_optimizer(params, 1e-2)
  state = jax.eval_shape(tx.init, params)
  on_chip = lambda tree: jax.tree_util.tree_map(lambda x: spec(x.shape, x.dtype), tree)
  def update(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  rows.append(('Adafactor update', cost(update, on_chip(params), on_chip(state), on_chip(params))))
  n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))

  print('| piece (one v5p chip) | FLOPs (cost model) | bytes accessed | estimated time |')
  print('|---|---|---|---|')
  for name, (flops, nbytes, seconds) in rows:
    print(f'| {name} | {flops / 1e9:.1f} G | {nbytes / 1e9:.2f} GB | {seconds * 1e3:.2f} ms |')
  print(f'\n{n:,} parameters: reading gradient and parameters and writing the parameters once '
        f'(float32) is {12 * n / 1e9:.2f} GB')


if __name__ == '__main__':
  main()
