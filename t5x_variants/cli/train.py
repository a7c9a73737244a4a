"""t5xv-train: pretrain or fine-tune a gin-configured model (T5X's train.py).

Also ``python -m t5x_variants.cli.train``. This module wires the data layer (TensorFlow) to the
TensorFlow-free ``t5x_variants.train`` library.

  t5xv-train --gin_file=gin/runs/pretrain.gin --gin_file=gin/models/t5_base.gin \\
    --gin_file=gin/variants/ffn/swiglu.gin --gin.MODEL_DIR="'/tmp/run'"
"""
import sys

import gin
import jax

from t5x_variants.cli import common


def vocabulary_files(name: str):
  """{'vocab.model': path} when the task's vocabulary is a SentencePiece file (local or gs://)."""
  from t5x_variants.data import tasks  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import storage  # pylint: disable=g-import-not-at-top
  features = tasks.get_task_or_mixture(name).output_features
  vocab = features['targets' if 'targets' in features else 'inputs'].vocabulary  # classification: inputs only
  path = getattr(vocab, 'sentencepiece_model_file', None)
  return {'vocab.model': path} if path and storage.path(path).exists() else {}


def _init_checkpoint():
  """The gin-bound ``train.init_checkpoint`` (macros resolved), or None."""
  try:
    value = gin.query_parameter('train.init_checkpoint')
  except ValueError:
    return None
  return value.scoped_configurable_fn() if isinstance(value, gin.config.ConfigurableReference) else value


def main(argv=None):
  with common.clear_errors('t5xv-train'):
    _, config = common.setup(common.parser('t5xv-train', __doc__), argv)
    from t5x_variants.data import classification, pipeline, tasks  # pylint: disable=g-import-not-at-top
    from t5x_variants.train import trainer  # pylint: disable=g-import-not-at-top
    if _init_checkpoint():  # fine-tuning tokenizes as the pretrained run did
      common.use_run_vocabulary(_init_checkpoint())
    with gin.config_scope('train'):
      train_cfg = pipeline.DatasetConfig()
    with gin.config_scope('train_eval'):
      eval_cfg = pipeline.DatasetConfig()
    if train_cfg.mixture_or_task_name:  # a model that does not fit the data: one clear error
      classification.check_model(train_cfg.mixture_or_task_name, config)
      common.check_vocabulary_size(config, tasks.get_task_or_mixture(train_cfg.mixture_or_task_name),
                                   train_cfg.mixture_or_task_name)
    host = (jax.process_index(), jax.process_count())
    train_data = lambda: pipeline.config_batches(train_cfg, config.architecture, *host)
    eval_data = eval_metric_fns = None
    if eval_cfg.mixture_or_task_name:
      subtasks = getattr(tasks.get_task_or_mixture(eval_cfg.mixture_or_task_name), 'tasks', None)
      names = [t.name for t in subtasks] if subtasks else [eval_cfg.mixture_or_task_name]
      if classification.check_model(eval_cfg.mixture_or_task_name, config):  # GLUE metrics at eval
        eval_metric_fns = classification.metric_fns(names)
      eval_data = lambda: {n: pipeline.eval_batches(n, eval_cfg.task_feature_lengths,
                                                    config.architecture, eval_cfg.batch_size,
                                                    eval_cfg.split) for n in names}
    result = trainer.train(config, train_data, eval_data=eval_data, eval_metric_fns=eval_metric_fns,
                           files=vocabulary_files(train_cfg.mixture_or_task_name))
  print(f'done: step {result["step"]}' + (f', loss {result["loss"]:.4f}' if 'loss' in result else ''))
  return 0


if __name__ == '__main__':
  sys.exit(main())
