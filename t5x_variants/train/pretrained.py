"""Reading a checkpoint into another run or tool (T5X's restore from INITIAL_CHECKPOINT_PATH):
its arrays on this host (export, tests), its parameters laid out for a model (evaluation,
inference, fine-tuning), or its parameters and optimizer state (fine-tuning that goes on with the
pretrained run's Adafactor statistics). A run's own checkpoints are ``checkpoints.py``'s.
"""
import logging
from typing import Optional, Sequence

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

from t5x_variants import path_keys, path_within
from t5x_variants.train.checkpoint_reads import (array_shapes, error_reason, intact, outside_cause,
                                                 read_with, saved_tree)
from t5x_variants.train.checkpoints import CheckpointError, abstract_arrays, checkpoint_path
from t5x_variants.train.optimizer import optimizer_hint

log = logging.getLogger(__name__)


def _read(path, target):
  """``target``'s arrays (ShapeDtypeStructs with their shardings, named as saved) from checkpoint
  ``path``; saved arrays it does not name are not read. One holding a NaN or an infinity, or
  whose fingerprint differs from the one saved, is a damaged checkpoint (a ReadError)."""
  restore_args = jax.tree_util.tree_map(
      lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype),
      target)
  args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
  return intact(read_with(ocp.PyTreeCheckpointHandler(), 'state',
                          lambda handler: handler.restore(path / 'state', args=args)), path)


def _read_error(path, what: str, e: Exception) -> CheckpointError:
  why = ('fix that cause (memory, the network, the bucket or its permissions) and rerun'
         if outside_cause(e) else 'is it damaged? Another checkpoint of the run may read')
  return CheckpointError(f'cannot read {what} of {path} ({error_reason(e)}): {why}')


def _new_params(path, saved, wanted, fresh: Sequence[str] = ()):
  """The names of ``wanted``'s parameters ({name: shape}) that ``saved`` lacks or holds with
  another shape; a CheckpointError if one is not within a ``fresh`` path (``path_within``), or if
  ``saved`` has a stack ``wanted`` lacks."""
  new = sorted(k for k in wanted if saved.get(k) != wanted[k])
  scanned = lambda names: any('layers' in k.split('/') for k in names)  # one stacked 'layers'
  if saved and scanned(saved) != scanned(wanted):
    raise CheckpointError(f'{path} was saved with TransformerConfig.scan_layers={scanned(saved)}; '
                          f'this model has scan_layers={scanned(wanted)}, which stores its layers '
                          'otherwise: set scan_layers as the checkpoint was saved')
  stack_of = lambda k: k.split('/')[0]
  extra = sorted(k for k in saved.keys() - wanted.keys() if stack_of(k) in ('encoder', 'decoder'))
  stacks = sorted({stack_of(k) for k in extra} - {stack_of(k) for k in wanted})
  if stacks:  # e.g. a trained encoder that a shared encoder-decoder would silently drop
    raise CheckpointError(f'{path} holds {" and ".join(stacks)} parameters this model has none of '
                          '(a model whose encoder runs on the decoder\'s parameters, '
                          'shared_encoder_decoder, reading a separate encoder\'s?). Is it a '
                          'checkpoint of the same model configuration?')
  refused = [k for k in new if not any(path_within(k.split('/'), f) for f in fresh)] + extra
  if refused:  # (extra: more layers, say)
    k = refused[0]
    hint = (' (to start a variant from it, name the parameters it lacks or holds otherwise in '
            '--gin.train.init_fresh)' if k in wanted else '')
    raise CheckpointError(f'{path} holds another model ({k}: saved {saved.get(k)}, this model '
                          f'{wanted.get(k, "nothing")}; {len(refused)} parameter(s) differ). Is it '
                          f'a checkpoint of the same model configuration?{hint}')
  return new


def _subtree(tree, keep):
  """``tree`` (nested dicts) with only the leaves whose 'a/b/c' name is in ``keep``."""
  out = {}
  for p, x in jax.tree_util.tree_leaves_with_path(tree):
    keys = path_keys(p)
    if '/'.join(keys) in keep:
      node = out
      for k in keys[:-1]:
        node = node.setdefault(k, {})
      node[keys[-1]] = x
  return out


def read_on_host(path: str, part: Optional[str] = 'params'):
  """A checkpoint's ``part`` of its saved state (None: all of it) as numpy arrays on this host,
  whatever mesh wrote it (the shapes from its metadata; read onto one local device, so no mesh is
  needed)."""
  path = checkpoint_path(path)
  one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  try:
    saved = saved_tree(path)
    saved = {part: saved[part]} if part else saved
  except Exception as e:
    raise _read_error(path, part or 'the state', e) from e
  try:
    restored = _read(path, jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), saved))
  except Exception as e:  # orbax raises many types for a damaged directory
    raise _read_error(path, part or 'the state', e) from e
  restored = jax.tree_util.tree_map(np.asarray, restored)
  return restored[part] if part else restored


def restore_params(path: str, abstract_params, fresh: Sequence[str] = (),
                   init_fresh: Sequence[str] = ()):
  """Only the parameters of a checkpoint (evaluation; fine-tuning with a fresh optimizer state),
  laid out as ``abstract_params`` says.

  ``fresh``: parameter paths (a fine-tuning head, e.g. 'pooler', 'classifier') whose parameters
  the checkpoint may lack or hold with other shapes; those are left out of the result, for the
  caller to initialise. ``init_fresh``: paths (a variant's own parameters, e.g. Sub-LN's
  'inner_layer_norm') left out whether the checkpoint holds them or not. Any other parameter the
  checkpoint lacks, or holds with another shape, is a CheckpointError naming it (another model
  configuration). Saved parameters the model does not have (an MLM head when fine-tuning a
  classifier) are not read. What was initialised fresh and what was dropped is logged."""
  path = checkpoint_path(path)
  try:
    saved = array_shapes(saved_tree(path)['params'])
  except Exception as e:
    raise _read_error(path, 'the parameters', e) from e
  wanted = array_shapes(abstract_params)
  within = lambda k: any(path_within(k.split('/'), f) for f in init_fresh)
  new = sorted(set(_new_params(path, saved, wanted, tuple(fresh) + tuple(init_fresh)))
               | {k for k in wanted if within(k)})
  dropped = sorted(saved.keys() - wanted.keys())
  if new or dropped:
    log.info('restored %d of %d parameters from %s; initialised fresh: %s; not used (dropped): %s',
             len(wanted) - len(new), len(wanted), path, ', '.join(new) or 'none',
             ', '.join(dropped) or 'none')
  try:
    kept = _subtree(abstract_params, wanted.keys() - set(new))
    restored = _read(path, {'params': abstract_arrays(kept)})
  except Exception as e:
    raise _read_error(path, 'the parameters', e) from e
  return restored['params']


def restore_state(path: str, abstract_state, fresh: Sequence[str] = ()):
  """A checkpoint's parameters and optimizer state, laid out as ``abstract_state`` says (fine-
  tuning as T5 and T5X start it: Adafactor's statistics and their step count go on from the
  pretrained run); None if the checkpoint holds parameters only (t5xv-import's). Every statistic
  this run's optimizer keeps must be saved with its shape (a path this run freezes keeps none, so a
  checkpoint with more reads); else a CheckpointError names the first one missing. The state's
  step and the learning-rate schedules' counts are set to 0: the schedule counts the fine-tuning
  steps, as ``TRAIN_STEPS`` does. A parameter within a ``fresh`` path that the checkpoint lacks is
  a CheckpointError: it would need an optimizer state the checkpoint cannot give."""
  path = checkpoint_path(path)
  try:
    tree = saved_tree(path)
  except Exception as e:
    raise _read_error(path, 'the state', e) from e
  if 'opt_state' not in tree:
    return None
  new = _new_params(path, array_shapes(tree['params']), array_shapes(abstract_state.params), fresh)
  if new:
    raise CheckpointError(
        f'{path} has no optimizer state for this model\'s new parameters ({", ".join(new)}), '
        'which --gin.train.init_optimizer=True would restore: start from its parameters alone, '
        'with a fresh optimizer state, by --gin.train.init_optimizer=False (as '
        'gin/runs/finetune_classification.gin does)')
  saved = array_shapes(tree)
  target = ocp.tree.serialize_tree(abstract_state, keep_empty_nodes=True)
  wanted = array_shapes(abstract_state)
  for name, shape in wanted.items():
    if saved.get(name) != shape:
      raise CheckpointError(
          f'{path} holds no {name} of shape {shape} (saved: {saved.get(name, "nothing")}): its '
          'run trained with other optimizer settings (another optimizer, or paths frozen there '
          f'that this run trains){optimizer_hint(name, name in saved)}. Start from its '
          'parameters alone with --gin.train.init_optimizer=False')
  try:
    restored = _read(path, target)
  except Exception as e:
    raise _read_error(path, 'the state', e) from e
  unread = sorted(saved.keys() - wanted.keys())
  log.info('%s: parameters and optimizer state restored (the optimizer\'s counts go on; the '
           'schedule counts from 0); saved but not used: %s', path, ', '.join(unread) or 'none')
  state = ocp.tree.deserialize_tree(restored, abstract_state, keep_empty_nodes=True)
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
  return state.replace(step=state.step * 0, opt_state=jax.tree_util.tree_map(
      lambda s: s._replace(count=s.count * 0) if is_schedule(s) else s,
      state.opt_state, is_leaf=is_schedule))
