"""The model on the mesh (``ShardedModel``): its train state's layout, the state a run starts
from (a checkpoint to resume, a pretrained one to fine-tune, or fresh) and its jitted steps, as
``t5xv-train``, ``t5xv-bench`` and ``t5xv-compile`` build them."""
import dataclasses
import functools
import logging
from typing import Callable, Optional, Sequence

import flax.linen as nn
import jax

from t5x_variants import path_keys, path_within
from t5x_variants.models import build_model, fresh_head_params, init_inputs
from t5x_variants.models.config import TransformerConfig
from t5x_variants.train import (checkpoints, diagnostics, evaluation, optimizer, partitioning,
                                pretrained, train_step)
from t5x_variants.train.nonfinite import NonFiniteGuard

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ShardedModel:
  """The model on the mesh: its train state's layout (shapes, shardings, optimizer), the state it
  starts from and its jitted steps."""
  config: TransformerConfig
  mesh: jax.sharding.Mesh
  model: nn.Module
  layout: train_step.StateLayout
  schedule: Callable
  rng: jax.Array
  inputs: tuple

  @classmethod
  def build(cls, config: TransformerConfig, mesh_config: partitioning.MeshConfig, seed: int,
            devices=None):
    """``config``'s model on ``mesh_config``'s mesh (of ``devices``, default this host's), with
    the gin-bound ``learning_rate_schedule`` and ``make_optimizer``; ``seed``: the RNG of
    initialisation and dropout."""
    mesh = mesh_config.mesh(devices)
    model, rng, inputs = build_model(config), jax.random.PRNGKey(seed), init_inputs(config)
    schedule = optimizer.learning_rate_schedule()
    layout = train_step.state_layout(
        model, functools.partial(optimizer.make_optimizer, learning_rate=schedule), mesh,
        mesh_config.rules(), rng, inputs)
    return cls(config, mesh, model, layout, schedule, rng, inputs)

  def check_init_fresh(self, init_fresh: Sequence[str], init_checkpoint: Optional[str],
                       init_optimizer: bool):
    """ValueError (one line) if ``init_fresh`` is no list of paths, a path names none of this
    model's parameters, there is no ``init_checkpoint`` for the others to come from, or the
    optimizer state would come from it too (``init_optimizer``: statistics of other values)."""
    if isinstance(init_fresh, str):
      raise ValueError(f'train.init_fresh = {init_fresh!r}: expected a list of parameter paths, '
                       f'e.g. --gin.train.init_fresh="[{init_fresh!r}]"')
    names = [path_keys(p) for p, _ in jax.tree_util.tree_leaves_with_path(self.layout.abstract.params)]
    unmatched = [f for f in init_fresh if not any(path_within(keys, f) for keys in names)]
    if unmatched or (init_fresh and (not init_checkpoint or init_optimizer)):
      raise ValueError(f'train.init_fresh = {list(init_fresh)}: ' + (
          f'{unmatched[0]!r} is no path of this model\'s parameters (see t5xv-info)' if unmatched
          else 'it names parameters to start fresh when the others come from '
               'train.init_checkpoint, which is not set' if not init_checkpoint
          else 'their optimizer statistics would be the checkpoint\'s (train.init_optimizer = '
               'True): set --gin.train.init_optimizer=False'))

  def restore_or_init(self, ckpt: checkpoints.Checkpointer, data, model_dir: str,
                      init_checkpoint: Optional[str], init_optimizer: bool,
                      guard: Optional[NonFiniteGuard] = None, init_fresh: Sequence[str] = ()):
    """(state, step): the newest readable checkpoint's (and ``data``'s position, and what
    ``guard`` had counted), else step 0
    from ``init_checkpoint``: its parameters, and with ``init_optimizer`` its optimizer state
    where it has one (``pretrained.restore_state``), else a fresh optimizer state; else a fresh
    state. The parameters within an ``init_fresh`` path start from this model's init, whether
    ``init_checkpoint`` holds them or not (a fine-tuning head's, where it does not)."""
    restored = ckpt.restore_latest(self.layout.abstract, data, guard)
    if restored:
      log.info('resumed from step %d in %s', restored[1], model_dir)
      return restored
    if init_checkpoint and init_optimizer:  # (init_fresh refused with it: check_init_fresh)
      state = pretrained.restore_state(init_checkpoint, self.layout.abstract,
                                       fresh=fresh_head_params(self.config))
      if state is not None:
        return state, 0
      log.info('%s holds parameters only: the optimizer state starts fresh', init_checkpoint)
    params = (pretrained.restore_params(init_checkpoint, self.layout.abstract.params,
                                         fresh_head_params(self.config), init_fresh)
              if init_checkpoint else None)
    return train_step.create_state(self.layout, self.model, self.rng, self.inputs, params), 0

  def make_train_step(self, num_microbatches: int, **loss):
    """The jitted step on this mesh; ``loss``: label_smoothing, z_loss, loss_normalizing_factor."""
    return train_step.make_train_step(
        self.layout.shardings, self.mesh, model=self.model, config=self.config, tx=self.layout.tx,
        schedule=self.schedule, num_microbatches=num_microbatches,
        dropout=self.config.uses_dropout, **loss)

  def make_eval_step(self, z_loss: float):
    return evaluation.make_eval_step(self.model, self.config, self.layout.shardings.params,
                                     self.mesh, z_loss)

  def make_diagnostics(self, model_dir: str, **loss) -> diagnostics.Diagnostics:
    return diagnostics.Diagnostics(model_dir, self.model, self.config,
                                   self.layout.shardings.params, self.mesh, **loss)
