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

from t5x_variants.cli import recipe
from t5x_variants.data import pipeline
from t5x_variants.train import train_step
from t5x_variants.train.predictor import Predictor


def main(run: str, step: str = '600', num_batches: str = '4'):
  recipe.parse_recipe([f'{run}/config.gin'], [], (), True)
  recipe.use_run_vocabulary(run)
  config = recipe.build_config()
  predictor = Predictor(config)
  predictor.load(f'{run}/checkpoint_{step}')
  task, lengths, batch_size = (gin.query_parameter(f'%{m}') for m in
                               ('MIXTURE_OR_TASK_NAME', 'TASK_FEATURE_LENGTHS', 'BATCH_SIZE'))
  arch = config.data_architecture

  def argmax_and_sums(dropout):  # the training loss's sums (train_step.logits_loss)
    def fn(params, batch, rng):
      logits = predictor.model.apply({'params': params}, **train_step.model_inputs(config, batch),
                                     enable_dropout=dropout, rngs={'dropout': rng})
      return logits.argmax(-1), train_step.logits_loss(config, logits, batch)[1]
    return jax.jit(fn)

  rows = [('held-out, unpacked', pipeline.eval_batches(task, lengths, arch, batch_size), False),
          ('train, unpacked', pipeline.eval_batches(task, lengths, arch, batch_size, 'train'), False),
          ('train, packed', pipeline.batches(task, lengths, arch, batch_size), False),
          ('train, packed, dropout', pipeline.batches(task, lengths, arch, batch_size), True)]
  for label, batches, dropout in rows:
    fn, sums = argmax_and_sums(dropout), collections.Counter()
    predicted, right_tokens = collections.Counter(), collections.Counter()
    for i, batch in zip(range(int(num_batches)), batches):
      argmax, m = fn(predictor.params, batch, jax.random.PRNGKey(i))
      sums.update({k: float(m[k]) for k in ('loss', 'correct', 'num_tokens')})
      target, weight = batch['decoder_target_tokens'], batch['decoder_loss_weights'] > 0
      argmax = np.asarray(argmax)
      predicted.update(argmax[weight].tolist())
      right_tokens.update(target[(argmax == target) & weight].tolist())
    nll, right, total = sums['loss'], int(sums['correct']), int(sums['num_tokens'])
    print(f'{label}: loss {nll / total:.3f}, token accuracy {right / total:.4f} ({right}/{total}); '
          f'argmax {predicted.most_common(4)}; right {right_tokens.most_common(4)}')


if __name__ == '__main__':
  main(*sys.argv[1:])
