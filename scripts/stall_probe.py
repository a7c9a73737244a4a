"""What a run's checkpoint predicts, teacher-forced, with and without dropout (EXPERIMENTS.md §2:
the stalled Post-LN runs). For the held-out split (unpacked, as training evaluates it) and the
training split (unpacked, and packed and shuffled as training reads it) it prints the loss, the
token accuracy, the most frequent argmax tokens and the target tokens predicted right; the last
row applies the run's dropout, as a training step does.

  python scripts/stall_probe.py RUN_DIR [STEP] [BATCHES]
"""
import collections
import sys

import gin
import jax
import numpy as np

from t5x_variants.cli import common
from t5x_variants.data import pipeline
from t5x_variants.train import train_step
from t5x_variants.train.predictor import Predictor


def main(run: str, step: str = '600', num_batches: str = '4'):
  common.parse_recipe([f'{run}/config.gin'], [], (), True)
  common.use_run_vocabulary(run)
  config = common.build_config()
  predictor = Predictor(config)
  predictor.load(f'{run}/checkpoint_{step}')
  task, lengths, batch_size = (gin.query_parameter(f'%{m}') for m in
                               ('MIXTURE_OR_TASK_NAME', 'TASK_FEATURE_LENGTHS', 'BATCH_SIZE'))
  arch = config.architecture

  def logits(dropout):
    def fn(params, batch, rng):
      return predictor.model.apply({'params': params}, **train_step.model_inputs(config, batch),
                                   enable_dropout=dropout, rngs={'dropout': rng})
    return jax.jit(fn)

  rows = [('held-out, unpacked', pipeline.eval_batches(task, lengths, arch, batch_size), False),
          ('train, unpacked', pipeline.eval_batches(task, lengths, arch, batch_size, 'train'), False),
          ('train, packed', pipeline.batches(task, lengths, arch, batch_size), False),
          ('train, packed, dropout', pipeline.batches(task, lengths, arch, batch_size), True)]
  for label, batches, dropout in rows:
    fn, nll, right, total = logits(dropout), 0.0, 0, 0
    predicted, right_tokens = collections.Counter(), collections.Counter()
    for i, batch in zip(range(int(num_batches)), batches):
      out = np.asarray(fn(predictor.params, batch, jax.random.PRNGKey(i)), np.float32)
      target, weight = batch['decoder_target_tokens'], batch['decoder_loss_weights'] > 0
      log_p = np.asarray(jax.nn.log_softmax(out, -1))
      nll -= np.take_along_axis(log_p, target[..., None], -1)[..., 0][weight].sum()
      argmax = out.argmax(-1)
      hit = (argmax == target) & weight
      right, total = right + hit.sum(), total + weight.sum()
      predicted.update(argmax[weight].tolist())
      right_tokens.update(target[hit].tolist())
    print(f'{label}: loss {nll / total:.3f}, token accuracy {right / total:.4f} ({right}/{total}); '
          f'argmax {predicted.most_common(4)}; right {right_tokens.most_common(4)}')


if __name__ == '__main__':
  main(*sys.argv[1:])
