"""One training step, from a batch of model features to updated parameters.

loss -> gradients (summed over microbatches, then normalised once, so accumulation equals the
full batch) -> optional skip of a non-finite step -> Adafactor update. ``make_train_step`` jits
it with parameters sharded by their logical axes and the batch split over the mesh's batch axes.
"""
import functools
from typing import Any, Callable, Dict, NamedTuple, Union

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from t5x_variants.models import losses
from t5x_variants.models.config import TransformerConfig
from t5x_variants.train import optimizer, partitioning

# Model inputs per architecture: the feature converters' names, which the models' arguments share.
MODEL_INPUTS = {
    'encoder_decoder': ('encoder_input_tokens', 'decoder_input_tokens', 'encoder_segment_ids',
                        'decoder_segment_ids', 'encoder_positions', 'decoder_positions'),
    'decoder_only': ('decoder_input_tokens', 'decoder_segment_ids', 'decoder_positions',
                     'decoder_causal_attention'),
    'encoder_only': ('encoder_input_tokens', 'encoder_segment_ids', 'encoder_positions'),
}
TARGETS = {'encoder_decoder': 'decoder', 'decoder_only': 'decoder', 'encoder_only': 'encoder'}


def synthetic_batch(config: TransformerConfig, batch: int, lengths, seed: int = 0,
                    packed: bool = False):
  """Random tokens (no padding, ids >= 2) with every target position weighted, for the
  architecture's features (``lengths``: 'inputs' / 'targets'), or a classification head's
  (random labels, every example weighted); for benchmarks and tests. ``packed``: two examples
  per row as packing lays them out (segment ids 1 then 2, positions restarting), the mask a
  packed pretraining step computes with. A prefix LM's row (each packed example's) is the inputs
  then the targets, the loss on the targets."""
  rng = np.random.RandomState(seed)
  ids = lambda n: rng.randint(2, config.vocab_size, (batch, n)).astype(np.int32)
  if config.head == 'classification':
    labels = (rng.rand(batch).astype(np.float32) if config.num_labels == 1
              else rng.randint(0, config.num_labels, batch).astype(np.int32))
    return {'encoder_input_tokens': ids(lengths['inputs']), 'classification_labels': labels,
            'classification_weights': np.ones(batch, np.int32)}
  if config.architecture == 'encoder_only':
    tokens = ids(lengths['inputs'])
    out = {'encoder_input_tokens': tokens, 'encoder_target_tokens': tokens,
           'encoder_loss_weights': np.ones_like(tokens)}
  else:
    targets = ids(config.stack_length('decoder', lengths))
    out = {'decoder_input_tokens': np.concatenate([np.zeros((batch, 1), np.int32), targets[:, :-1]], 1),
           'decoder_target_tokens': targets, 'decoder_loss_weights': np.ones_like(targets)}
  if config.architecture == 'encoder_decoder':
    out['encoder_input_tokens'] = ids(lengths['inputs'])
  if packed:
    for stack in ('encoder', 'decoder'):
      if f'{stack}_input_tokens' in out:
        n = out[f'{stack}_input_tokens'].shape[1]
        halves = (n // 2, n - n // 2)
        out[f'{stack}_segment_ids'] = np.tile(np.repeat([1, 2], halves).astype(np.int32), (batch, 1))
        out[f'{stack}_positions'] = np.tile(np.concatenate([np.arange(h) for h in halves]).astype(np.int32),
                                            (batch, 1))
    if 'decoder_positions' in out:  # each packed example's shifted targets begin at 0, as seqio's
      out['decoder_input_tokens'] = np.where(out['decoder_positions'] == 0, 0,
                                             out['decoder_input_tokens'])
  if config.prefix_lm:  # seqio's layout: the inputs, and the position that reads their last token
    index = out.get('decoder_positions', np.arange(targets.shape[1]))
    inputs = lengths['inputs'] // 2 if packed else lengths['inputs']
    out['decoder_loss_weights'] = np.broadcast_to(index >= inputs, targets.shape).astype(np.int32)
    out['decoder_causal_attention'] = np.broadcast_to(index <= inputs, targets.shape).astype(np.int32)
  return out


class TrainState(flax.struct.PyTreeNode):
  step: jnp.ndarray
  params: Any
  opt_state: Any


def summed_loss(model, config: TransformerConfig, params, batch, dropout_rng, label_smoothing=0.0,
                z_loss=0.0, rows: bool = False, loss_normalizing_factor='num_tokens'):
  """(summed loss, metrics sums) of one (micro)batch; dropout on when ``dropout_rng`` is given;
  ``loss_normalizing_factor`` 'average_per_sequence' weights each sequence's tokens to sum to 1.
  A classification head's batch has ``classification_labels`` / ``classification_weights`` (one
  per example, counted as its 'num_tokens'); with ``rows`` its metrics also hold 'rows': each
  example's prediction (argmax, or the regression output), label and weight (for evaluation)."""
  rngs = {'dropout': dropout_rng} if dropout_rng is not None else {}
  logits = model.apply({'params': params}, **model_inputs(config, batch),
                       enable_dropout=dropout_rng is not None, rngs=rngs)
  return logits_loss(config, logits, batch, label_smoothing, z_loss, rows, loss_normalizing_factor)


def model_inputs(config: TransformerConfig, batch):
  """The batch's features that are arguments of the architecture's model."""
  return {k: batch[k] for k in MODEL_INPUTS[config.architecture] if k in batch}


def logits_loss(config: TransformerConfig, logits, batch, label_smoothing=0.0, z_loss=0.0,
                rows: bool = False, loss_normalizing_factor='num_tokens'):
  """``summed_loss`` of the model's ``logits`` on ``batch``."""
  if config.head == 'classification':
    return _classification_sums(config, logits[:, 0], batch, label_smoothing, z_loss, rows)
  prefix = TARGETS[config.architecture]
  if f'{prefix}_target_tokens' not in batch:
    raise ValueError(f'the batch has no {prefix}_target_tokens (features: {", ".join(sorted(batch))});'
                     ' a classification task needs TransformerConfig.head = "classification"')
  summed = 'average_per_sequence' if loss_normalizing_factor == 'average_per_sequence' else 'none'
  m = losses.loss_and_metrics(logits, batch[f'{prefix}_target_tokens'], batch[f'{prefix}_loss_weights'],
                              label_smoothing, z_loss, summed, batch.get(f'{prefix}_segment_ids'))
  del m['token_accuracy']  # a ratio; the step sums 'correct' over microbatches instead
  return m['loss'], m


def _classification_sums(config: TransformerConfig, logits, batch, label_smoothing, z_loss, rows):
  if 'classification_labels' not in batch:
    raise ValueError('a classification head needs classification_labels and classification_weights '
                     f'(a classification task such as glue_rte_cls); the batch has {", ".join(sorted(batch))}')
  labels = batch['classification_labels']
  weights = batch['classification_weights'].astype(jnp.float32)
  per_example, z = losses.classification_loss(logits, labels, weights, label_smoothing, z_loss)
  if config.num_labels == 1:  # regression: no accuracy
    predictions, correct = logits[:, 0], jnp.zeros((), jnp.float32)
  else:
    predictions = jnp.argmax(logits, -1).astype(jnp.int32)
    correct = jnp.sum((predictions == labels) * weights)
  m = {'loss': jnp.sum(per_example), 'z_loss': jnp.sum(z), 'correct': correct,
       'num_tokens': jnp.sum(weights)}
  if rows:
    m['rows'] = {'predictions': predictions, 'labels': labels, 'weights': weights}
  return m['loss'], m


# Optimizer states whose count bias-corrects their moments: kept on a skipped step with them
# (optax's own skip keeps them too). Every other count advances (a schedule's, Adafactor's decay
# rate's, as T5X's skipped update does).
MOMENT_COUNTED = (optax.ScaleByAdamState, optax.ScaleByAmsgradState, optax.ScaleByBeliefState)


def train_step(state: TrainState, batch: Dict[str, jnp.ndarray], rng, *, model, config,
               tx: optimizer.Optimizer, schedule: Callable, num_microbatches: int = 1,
               label_smoothing: float = 0.0, z_loss: float = 0.0,
               loss_normalizing_factor: Union[str, float] = 'num_tokens', dropout: bool = False):
  """Returns (new state, metrics). A step whose loss or gradients are not finite leaves the
  parameters and optimizer statistics unchanged (metrics['skipped'] = 1); the step counts still
  advance with the state's, so the learning rate logged is the one applied, except Adam's, which
  stays with the moments it bias-corrects (``MOMENT_COUNTED``).
  ``grad_norm`` is over the trained parameters (a frozen path's gradient updates nothing)."""
  grad_fn = jax.grad(functools.partial(summed_loss, model, config, label_smoothing=label_smoothing,
                                       z_loss=z_loss, loss_normalizing_factor=loss_normalizing_factor),
                     argnums=0, has_aux=True)
  # Microbatch i holds rows i, i + n, i + 2n, ...: each device's contiguous share of the batch
  # (its `data` shard) holds its rows of every microbatch, so no row moves between devices
  # (contiguous microbatches would each sit on 1/n of the devices and be gathered to all).
  micro = jax.tree_util.tree_map(
      lambda x: x.reshape((-1, num_microbatches) + x.shape[1:]).swapaxes(0, 1), batch)
  rngs = jax.random.split(jax.random.fold_in(rng, state.step), num_microbatches)

  def accumulate(carry, xs):
    mb, r = xs
    g, m = grad_fn(state.params, mb, r if dropout else None)
    return jax.tree_util.tree_map(jnp.add, carry, (g, m)), None

  zeros = jax.eval_shape(grad_fn, state.params, jax.tree_util.tree_map(lambda x: x[0], micro), None)
  zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
  (grads, sums), _ = jax.lax.scan(accumulate, zeros, (micro, rngs))
  factor = losses.normalizing_factor(loss_normalizing_factor, sums['num_tokens'])
  grads = jax.tree_util.tree_map(lambda g: g / factor, grads)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  new = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)
  metrics = {'loss': sums['loss'] / factor, 'z_loss': sums['z_loss'] / factor,
             'token_accuracy': sums['correct'] / jnp.maximum(sums['num_tokens'], 1.0),
             'num_tokens': sums['num_tokens'], 'learning_rate': schedule(state.step),
             'grad_norm': tx.trained_norm(grads)}
  finite = jnp.isfinite(metrics['loss']) & jnp.isfinite(metrics['grad_norm'])
  keep = lambda a, b: jax.tree_util.tree_map(lambda x, y: jnp.where(finite, x, y), a, b)

  def kept(a, b):  # the step still counts (it consumed a batch): so do the optimizer's counts,
    # except one that bias-corrects moments (it stays with them); any other array is kept
    if isinstance(a, MOMENT_COUNTED) or not hasattr(a, '_fields'):
      return keep(a, b)
    return a._replace(**{f: keep(getattr(a, f), getattr(b, f)) for f in a._fields if f != 'count'})
  opt_state = jax.tree_util.tree_map(kept, new.opt_state, state.opt_state,
                                     is_leaf=lambda x: hasattr(x, '_fields') and 'count' in x._fields)
  new = TrainState(new.step, keep(new.params, state.params), opt_state)
  metrics['param_norm'] = optax.tree_utils.tree_norm(new.params)  # of the parameters kept
  metrics['skipped'] = (~finite).astype(jnp.int32)
  return new, metrics


class StateLayout(NamedTuple):
  """Where a TrainState lives: its abstract form (with shardings), the shardings, the optimizer."""
  abstract: TrainState
  shardings: TrainState
  tx: optimizer.Optimizer


def state_layout(model, tx_fn: Callable, mesh, rules, rng, init_inputs) -> StateLayout:
  """Parameters are sharded by their logical axes, the optimizer statistics like their
  parameters (see ``partitioning.follow_param_shardings``)."""
  _, params = partitioning.sharded_abstract_params(model, init_inputs, mesh, rules, rng)
  tx = tx_fn(params)
  replicated = NamedSharding(mesh, PartitionSpec())
  abstract = jax.eval_shape(lambda p: _fresh(p, tx), params)
  shardings = TrainState(replicated, jax.tree_util.tree_map(lambda p: p.sharding, params),
                         partitioning.follow_param_shardings(abstract.opt_state, params, mesh))
  with_sharding = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
  return StateLayout(jax.tree_util.tree_map(with_sharding, abstract, shardings), shardings, tx)


def _fresh(params, tx) -> TrainState:
  return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))


def create_state(layout: StateLayout, model, rng, init_inputs, params=None) -> TrainState:
  """A step-0 state built directly in its shards: freshly initialised parameters, or ``params``
  (e.g. a pretrained checkpoint's) with a fresh optimizer state. ``params`` may hold only some of
  the model's parameters (a pretrained encoder without the fine-tuning head): the others are
  initialised fresh, as ``rng`` would initialise them."""
  init = lambda: nn.unbox(model.init(rng, *init_inputs)['params'])
  if params is None:
    return jax.jit(lambda: _fresh(init(), layout.tx), out_shardings=layout.shardings)()
  given = flax.traverse_util.flatten_dict(params)
  if given.keys() == flax.traverse_util.flatten_dict(layout.abstract.params).keys():
    return jax.jit(lambda p: _fresh(p, layout.tx), out_shardings=layout.shardings)(params)

  def merged(p):  # the replaced parts of the fresh initialisation are never computed (XLA DCE)
    full = flax.traverse_util.flatten_dict(init())
    unknown = p.keys() - full.keys()
    if unknown:
      raise ValueError(f'parameters the model does not have: {sorted("/".join(k) for k in unknown)}')
    return _fresh(flax.traverse_util.unflatten_dict({**full, **p}), layout.tx)
  return jax.jit(merged, out_shardings=layout.shardings)(given)


def make_train_step(shardings: TrainState, mesh, **kwargs):
  """The jitted step: state in place (donated), batch split over the batch axes."""
  step = functools.partial(train_step, **kwargs)
  return partitioning.jit(step, mesh, in_shardings=(shardings, partitioning.batch_sharding(mesh), None),
                          out_shardings=(shardings, None), donate_argnums=(0,))
