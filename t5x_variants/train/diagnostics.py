"""Per-layer diagnostics on a fixed batch (``train.diagnostics_period``; off by default).

The fixed batch x is the run's first training batch. When diagnostics start (step 0 of a run) and
every ``diagnostics_period`` steps after, one jitted forward and backward pass on x, without
dropout and outside the training state and RNG, gives the flat keys of the ``kind:
"diagnostics"`` records of ``metrics.jsonl`` (TensorBoard: ``diagnostics/<key>``):

- ``update_norm``: ||F(x; theta_t) - F(x; theta_0)||, the model update of DeepNet (Wang et al.
  2022, Sec. 3 and Fig. 4(a)). F: the final hidden states that the output layer (or head) takes,
  i.e. the last stack's output after its final norm if it has one (the decoder's; the encoder's for
  encoder-only), in float32. The plain L2 norm over every non-padding position of x and every
  d_model feature. theta_0: the parameters when diagnostics started (step 0).
- ``update_norm_per_token``: ``update_norm / sqrt(number of those positions)``, the root mean
  square over positions of each position's L2 distance.
- ``grad_norm/<stack>/<i>``: the L2 norm of the gradient of the training loss on x (the run's
  label smoothing, z-loss and loss normalisation: the gradient a train step on x would take,
  without dropout) with respect to layer i's parameters of ``encoder`` or ``decoder`` (i = 0 next
  to the embedding), for scanned and unrolled stacks alike.
- ``activation_norm/<stack>/<i>``: the RMS of the residual stream of layer i: sqrt of the mean of
  x^2 over the stack's non-padding positions and the d_model features, x the layer's output
  (before the stack's final norm) for Pre-LN and Sub-LN, and for Post-LN and DeepNorm, whose
  layers end with a norm, what enters that norm, x + f(x) or alpha x + f(x) (DeepNet's Fig. 3;
  the norm's output has an RMS of about its gain whatever the weights do).

Non-padding positions: encoder input tokens != 0, decoder target tokens != 0. x is processed
whole (no microbatches). Process 0 saves x and F(x; theta_0) (global arrays) in
``MODEL_DIR/diagnostics.npz`` when diagnostics start; a resumed run reloads them, so its values
continue the run's. A run resumed without that file starts its diagnostics at its first step
(theta_0: the parameters there, x: its first batch).
"""
import functools
import io
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from t5x_variants.models import losses
from t5x_variants.train import multihost, partitioning, storage, train_step

FILE = 'diagnostics.npz'
REFERENCE = 'diagnostics_reference'  # F(x; theta_0), carried in the batch as one more feature
TOKENS = {'encoder': 'encoder_input_tokens', 'decoder': 'decoder_target_tokens'}  # 0: padding


def _per_layer(tree, config, stack, fn):
  """``fn`` (of a subtree whose leaves have a leading layer axis) applied to a stack's layers."""
  if config.scan_layers:
    return fn(tree[stack]['layers'])
  layers = [jax.tree_util.tree_map(lambda a: a[None], tree[stack][f'layers_{i}'])
            for i in range(config.num_layers(stack))]
  return jnp.concatenate([fn(layer) for layer in layers])


def compute(model, config, params, batch, label_smoothing=0.0, z_loss=0.0,
            loss_normalizing_factor='num_tokens'):
  """({key: value} of ``params`` on ``batch``, F(x; params)); ``batch[REFERENCE]`` holds
  F(x; theta_0)."""
  def loss(p):
    logits, state = model.apply({'params': p}, **train_step.model_inputs(config, batch),
                                mutable='intermediates')
    total, sums = train_step.logits_loss(config, logits, batch, label_smoothing, z_loss,
                                         loss_normalizing_factor=loss_normalizing_factor)
    factor = losses.normalizing_factor(loss_normalizing_factor, sums['num_tokens'])
    return total / factor, state['intermediates']

  grads, inter = jax.grad(loss, has_aux=True)(params)
  squares = lambda t: sum(jnp.sum(jnp.square(g.astype(jnp.float32)).reshape(len(g), -1), 1)
                          for g in jax.tree_util.tree_leaves(t))
  out, mask = {}, {s: batch[TOKENS[s]] != 0 for s in config.stacks}
  count = lambda s: jnp.maximum(jnp.sum(mask[s]), 1).astype(jnp.float32)
  for s in config.stacks:
    grad_norms = jnp.sqrt(_per_layer(grads, config, s, squares))
    sums = _per_layer(inter, config, s, lambda t: jnp.sum(
        jnp.where(mask[s], t['residual_mean_square'][0], 0.0), (1, 2)))
    activation_norms = jnp.sqrt(sums / count(s))
    for i in range(config.num_layers(s)):
      out[f'grad_norm/{s}/{i}'] = grad_norms[i]
      out[f'activation_norm/{s}/{i}'] = activation_norms[i]
  last = config.stacks[-1]
  f = inter[last]['output'][0].astype(jnp.float32)
  update = jnp.sum(jnp.where(mask[last][..., None], jnp.square(f - batch[REFERENCE]), 0.0))
  out['update_norm'] = jnp.sqrt(update)
  out['update_norm_per_token'] = jnp.sqrt(update / count(last))
  return out, f


class Diagnostics:
  """A run's fixed batch, F(x; theta_0) and their jitted ``compute``; parameters sharded as
  ``param_shardings`` say, the batch over the batch axes as training batches."""

  def __init__(self, model_dir: str, model, config, param_shardings, mesh, **loss_kwargs):
    self.path = storage.path(model_dir) / FILE
    self.config, self.mesh, self.batch = config, mesh, None
    data = partitioning.batch_sharding(mesh)
    self._compute = partitioning.jit(functools.partial(compute, model, config, **loss_kwargs), mesh,
                                     in_shardings=(param_shardings, data),
                                     out_shardings=(NamedSharding(mesh, PartitionSpec()), data))

  def begin(self, params, host_batch, fresh: bool) -> bool:
    """Reloads x and F(x; theta_0) from ``diagnostics.npz``, unless ``fresh`` (step 0) or there is
    none: then x is ``host_batch`` (this process's rows), theta_0 ``params``, and process 0 saves
    them. True if they were made now (every process calls this at the same step)."""
    # Process 0's answer: the others may see a file it writes now.
    if multihost.process0_says(f'looking for {self.path}',
                               lambda: not fresh and self.path.exists()):
      def read():
        with self.path.open('rb') as f, np.load(f) as saved:
          return dict(saved)
      saved = multihost.agree(f'reading {self.path}', read)
      self.batch = partitioning.global_batch(partitioning.host_rows(saved, self.mesh), self.mesh)
      return False
    rows, length = host_batch[TOKENS[self.config.stacks[-1]]].shape
    zeros = np.zeros((rows, length, self.config.d_model), np.float32)
    batch = partitioning.global_batch({**host_batch, REFERENCE: zeros}, self.mesh)
    self.batch = {**batch, REFERENCE: self._compute(params, batch)[1]}
    saved = multihost_utils.process_allgather(self.batch, tiled=True)

    def write():
      buffer = io.BytesIO()
      np.savez(buffer, **saved)
      storage.write_bytes(self.path, buffer.getvalue())  # never a half-written file
    multihost.process0_does(f'writing {self.path}', write)
    return True

  def __call__(self, params) -> Dict[str, float]:
    """The diagnostics of ``params`` (after ``begin``), on the host."""
    values = partitioning.to_host(self._compute(params, self.batch)[0])
    return {k: float(v) for k, v in values.items()}
