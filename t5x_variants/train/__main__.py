"""t5xv-train: pretrain or fine-tune a gin-configured model (T5X's train.py).

  t5xv-train --gin_file=gin/runs/pretrain.gin --gin_file=gin/models/t5_base.gin \\
    --gin_file=gin/variants/ffn/swiglu.gin --gin.MODEL_DIR="'/tmp/run'"
"""
import sys

import gin
import jax

from t5x_variants import cli


def vocabulary_files(name: str):
  """{'vocab.model': path} when the task's vocabulary is a local SentencePiece file."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from t5x_variants.data import tasks  # pylint: disable=g-import-not-at-top
  vocab = tasks.get_task_or_mixture(name).output_features['targets'].vocabulary
  path = getattr(vocab, 'sentencepiece_model_file', None)
  return {'vocab.model': path} if path and not path.startswith('gs://') and tf.io.gfile.exists(path) else {}


def main(argv=None):
  parser = cli.parser('t5xv-train', __doc__)
  with cli.clear_errors('t5xv-train'):
    _, config = cli.setup(parser, argv)
    from t5x_variants.data import pipeline  # pylint: disable=g-import-not-at-top
    from t5x_variants.train import trainer  # pylint: disable=g-import-not-at-top
    with gin.config_scope('train'):
      train_cfg = pipeline.DatasetConfig()
    with gin.config_scope('train_eval'):
      eval_cfg = pipeline.DatasetConfig()
    host = (jax.process_index(), jax.process_count())
    train_data = lambda: pipeline.config_batches(train_cfg, config.architecture, *host)
    eval_data = None
    if eval_cfg.mixture_or_task_name:
      eval_data = lambda: {eval_cfg.mixture_or_task_name: pipeline.config_batches(
          eval_cfg, config.architecture, *host)}
    result = trainer.train(config, train_data, eval_data=eval_data,
                           files=vocabulary_files(train_cfg.mixture_or_task_name))
  print(f'done: step {result["step"]}' + (f', loss {result["loss"]:.4f}' if 'loss' in result else ''))
  return 0


if __name__ == '__main__':
  sys.exit(main())
