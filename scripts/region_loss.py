"""A decoder-only run's held-out loss by region of the row (EXPERIMENTS.md §6, the whole-row
loss): on the targets, and on the inputs, which a whole-row run also scores. A prefix LM sees its
inputs whole, so a position in them can read the token it predicts; a language model cannot. The
held-out rows are those of the run's own held-out loss (``train_eval/DatasetConfig``, at most
``train.eval_batches`` batches, or BATCHES); each batch is built twice (loss on the targets only, and on the whole row: the same tokens,
checked), the model run once; an input position is one the whole row weights and the targets do
not. Prints JSON: per region the cross-entropy per token and the token accuracy, and how far the
logits at input positions 4 and 39 move when the token each predicts (the input at the next
position) is replaced in the first batch ('next_token_logit_change', the largest absolute change:
0 where the model cannot see that token).

  python scripts/region_loss.py RUN_DIR [STEP] [BATCHES]
"""
import json
import sys

import gin
import jax
import numpy as np

from t5x_variants.cli import recipe
from t5x_variants.data import pipeline
from t5x_variants.data.config import DatasetConfig
from t5x_variants.models import losses
from t5x_variants.train import train_step
from t5x_variants.train.predictor import Predictor


def main(run: str, step: str = '600', num_batches: str = None):
  recipe.parse_recipe([f'{run}/config.gin'], [], (), True)
  recipe.use_run_vocabulary(run)
  config = recipe.build_config()
  if config.architecture != 'decoder_only':
    raise SystemExit(f'{run} is not a decoder-only run')
  predictor = Predictor(config)
  predictor.load(f'{run}/checkpoint_{step}')
  with gin.config_scope('train_eval'):
    held_out = DatasetConfig()
  num_batches = int(num_batches or gin.query_parameter('train.eval_batches'))

  logits_of = jax.jit(lambda params, batch: predictor.model.apply(
      {'params': params}, **train_step.model_inputs(config, batch)))

  def per_position(batch):  # (nll, correct, logits) at every position, unweighted
    logits = logits_of(predictor.params, batch)
    targets = batch['decoder_target_tokens']
    nll, _ = losses.cross_entropy(logits, targets, np.ones(targets.shape, np.float32))
    return np.asarray(nll), np.asarray(logits.argmax(-1) == targets), np.asarray(logits)

  batches = [pipeline.eval_batches(held_out.mixture_or_task_name, held_out.task_feature_lengths,
                                   config.data_architecture, held_out.batch_size, held_out.split,
                                   loss_on_targets_only=only) for only in (True, False)]
  sums = {region: np.zeros(3) for region in ('targets', 'inputs')}  # nll, correct, tokens
  change = 0.0
  for i, targets_only, whole in zip(range(num_batches), *batches):
    for key in set(targets_only) - {'decoder_loss_weights'}:
      np.testing.assert_array_equal(targets_only[key], whole[key], err_msg=key)
    nll, correct, logits = per_position(whole)
    if i == 0:
      for position in (5, 40):  # in the inputs
        other = {k: v.copy() for k, v in whole.items()}
        other['decoder_input_tokens'][:, position] = (other['decoder_input_tokens'][:, position]
                                                      + 1) % config.vocab_size
        moved = np.abs(per_position(other)[2][:, position - 1] - logits[:, position - 1]).max()
        change = max(change, float(moved))
    on_targets = targets_only['decoder_loss_weights'] > 0
    on_inputs = (whole['decoder_loss_weights'] > 0) & ~on_targets
    for region, mask in (('targets', on_targets), ('inputs', on_inputs)):
      sums[region] += [nll[mask].sum(), correct[mask].sum(), mask.sum()]
  print(json.dumps({**{region: {'loss': s[0] / s[2], 'token_accuracy': s[1] / s[2],
                                'num_tokens': int(s[2])} for region, s in sums.items()},
                    'next_token_logit_change': change}))


if __name__ == '__main__':
  main(*sys.argv[1:])
