"""A run's data as gin binds it; no TensorFlow, so a host without the data layer still reads it
(``t5xv-train --batches_dir``, ``train/prebuilt.py``)."""
import dataclasses
from typing import Mapping, Optional

import gin


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DatasetConfig:
  """A run's data, bound in gin under a scope: ``train/DatasetConfig`` (what the model trains on)
  and ``train_eval/DatasetConfig`` (teacher-forced eval during training), as in T5X."""
  mixture_or_task_name: Optional[str] = None
  task_feature_lengths: Optional[Mapping[str, int]] = None
  batch_size: int = 128
  split: str = 'train'
  shuffle: bool = True
  seed: int = 0
  pack: bool = True
  num_epochs: Optional[int] = None  # None: repeat forever
  # A prefix LM's loss on its targets only (T5X's and seqio's default); False: on the inputs too,
  # i.e. on the whole row, as the T5 paper's code trains its decoder-only models on every
  # objective (Mesh TF's Unitransformer.loss_on_targets_only=False). Each scope its own: a train/
  # binding leaves the held-out loss (train_eval/) on the targets.
  loss_on_targets_only: bool = True


def check_loss_on_targets_only(loss_on_targets_only: bool, architecture: str,
                               name: str = 'loss_on_targets_only'):
  """``loss_on_targets_only=False`` means something only for a prefix LM's rows; ``name``: the
  binding as the error calls it."""
  if not loss_on_targets_only and architecture != 'prefix_lm':
    raise ValueError(f"{name}=False puts a prefix LM's loss on its inputs too, but "
                     f'only a prefix LM holds inputs and targets in one row (this model: '
                     f'{architecture}); leave it True (the default)')
