"""The held-out cross-entropy of a unigram model of a task's targets: the loss a language model
reaches by learning the token frequencies alone (a floor that a plateau of the stability curves
can be compared with). Frequencies from one epoch of the train split (add-one smoothed), the loss
on the first BATCHES x BATCH_SIZE validation examples, in the order and padding the trainer's
evaluation uses.

  python scripts/unigram_baseline.py --task=embedded_lm --length=64 --batch_size=16 --batches=16
  python scripts/unigram_baseline.py --task=embedded_span_corruption --inputs_length=128 \
      --length=32 --batch_size=32 --batches=8     # an encoder-decoder task: its targets
"""
import argparse

import numpy as np

from t5x_variants.data import pipeline, tasks


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--task', default='embedded_lm')
  p.add_argument('--length', type=int, default=64, help='targets length')
  p.add_argument('--inputs_length', type=int, default=0,
                 help='inputs length of an encoder-decoder task (0: a decoder-only task)')
  p.add_argument('--batch_size', type=int, default=16)
  p.add_argument('--batches', type=int, default=16)
  args = p.parse_args()
  lengths = {'targets': args.length}
  architecture = 'decoder_only'
  if args.inputs_length:
    lengths['inputs'], architecture = args.inputs_length, 'encoder_decoder'
  vocab_size = tasks.get_task_or_mixture(args.task).output_features['targets'].vocabulary.vocab_size
  counts = np.ones(vocab_size)
  train = pipeline.get_dataset(args.task, lengths, architecture, 'train', shuffle=False,
                               num_epochs=1, pack=False)
  for ex in train.as_numpy_iterator():
    np.add.at(counts, ex['decoder_target_tokens'][ex['decoder_loss_weights'] > 0], 1)
  log_p = np.log(counts / counts.sum())
  loss = tokens = 0.0
  batches = pipeline.eval_batches(args.task, lengths, architecture, args.batch_size)
  for _, batch in zip(range(args.batches), batches):
    weights = batch['decoder_loss_weights'] > 0
    loss -= log_p[batch['decoder_target_tokens'][weights]].sum()
    tokens += weights.sum()
  print(f'{args.task}: unigram held-out cross-entropy {loss / tokens:.4f} nats over '
        f'{int(tokens)} tokens (train tokens counted: {int(counts.sum() - vocab_size)})')


if __name__ == '__main__':
  main()
