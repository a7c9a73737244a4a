"""t5xv-infer: decode a task split or a text file with a checkpoint, to JSONL (T5X's infer.py).

  t5xv-infer --gin_file=RUN/config.gin --gin_file=gin/runs/infer.gin \\
    --gin.CHECKPOINT_PATH="'RUN'" --gin.INFER_OUTPUT="'RUN/predictions.jsonl'"

Decodes MIXTURE_OR_TASK_NAME's split, or with ``--gin.INPUT_FILE="'texts.txt'"`` one text per
line. Decoding options: ``DecodeOptions.method = 'greedy' | 'sample' | 'beam'`` and friends.
Each output line: {"inputs", "prediction", "score", and "targets" for task examples}.
"""
import json
import os
import sys
from typing import Iterator, List, Mapping, Optional

import gin
import jax
import numpy as np

from t5x_variants import cli
from t5x_variants.data import tasks, vocab as vocab_lib
from t5x_variants.train import checkpoints
from t5x_variants.train.predictor import EOS_ID, DecodeOptions, Predictor, until_eos


def _text(x) -> str:
  return x.decode() if isinstance(x, bytes) else str(x)


def task_examples(task, split: str, lengths: Mapping[str, int],
                  max_examples: Optional[int] = None) -> List[dict]:
  """A seqio task's preprocessed examples in order (tokens trimmed to ``lengths``), as numpy."""
  with tasks.explain_missing_data(task):
    ds = task.get_dataset(lengths, split=split, shuffle=False, num_epochs=1)
    if max_examples:
      ds = ds.take(max_examples)
    return list(ds.as_numpy_iterator())


def batches(items: List, size: int) -> Iterator[List]:
  for i in range(0, len(items), size):
    yield items[i:i + size]


def pad_tokens(rows: List[np.ndarray], length: int, num_rows: int) -> np.ndarray:
  """(num_rows, length): each row cut or zero-padded to ``length``, zero rows after them (so every
  batch has one shape and decoding compiles once)."""
  out = np.zeros((num_rows, length), np.int32)
  for i, r in enumerate(rows):
    out[i, :min(len(r), length)] = r[:length]
  return out


def decode_examples(predictor, vocab, examples: List[dict], input_length: int,
                    max_decode_length: int, batch_size: int) -> List[dict]:
  """Adds 'prediction' (text), 'prediction_ids' and 'score' to each example (which has 'inputs'
  token ids; a decoder-only model continues them as a prompt, without their EOS)."""
  prompt = predictor.config.architecture == 'decoder_only'
  out = []
  for i, chunk in enumerate(batches(examples, batch_size)):
    rows = [np.asarray(ex['inputs'])[:-1] if prompt and ex['inputs'][-1] == EOS_ID
            else np.asarray(ex['inputs']) for ex in chunk]
    tokens, scores = predictor.predict(pad_tokens(rows, input_length, batch_size),
                                       max_decode_length, i)
    for ex, t, s in zip(chunk, tokens, scores):
      ids = until_eos(t)
      out.append(dict(ex, prediction=vocab.decode(ids), prediction_ids=ids, score=float(s)))
  return out


@gin.configurable(denylist=['config'])
def infer(config, *, checkpoint_path: str = gin.REQUIRED, output_file: str = gin.REQUIRED,
          input_file: Optional[str] = None, mixture_or_task_name: Optional[str] = None,
          split: str = 'validation', task_feature_lengths: Mapping[str, int] = gin.REQUIRED,
          batch_size: int = 32, max_examples: Optional[int] = None, mesh_shape=(-1, 1),
          fsdp: bool = False):
  """Writes one JSON line per example to ``output_file``; returns the number written."""
  cli.use_run_vocabulary(checkpoint_path)
  predictor = Predictor(config, mesh_shape, fsdp, DecodeOptions()).load(checkpoint_path)
  if input_file:
    vocab = vocab_lib.vocabulary()
    with open(input_file) as f:
      texts = [line.rstrip('\n') for line in f if line.strip()][:max_examples]
    examples = [{'inputs_pretokenized': t, 'inputs': np.asarray(vocab.encode(t) + [EOS_ID])}
                for t in texts]
  elif mixture_or_task_name:
    task = tasks.get_task_or_mixture(mixture_or_task_name)
    vocab = task.output_features['targets'].vocabulary
    examples = task_examples(task, split, task_feature_lengths, max_examples)
  else:
    raise ValueError('infer needs INPUT_FILE (a text per line) or MIXTURE_OR_TASK_NAME')
  decoded = decode_examples(predictor, vocab, examples, task_feature_lengths['inputs'],
                            task_feature_lengths['targets'], batch_size)
  if jax.process_index() == 0:
    os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
    with open(output_file, 'w') as f:
      for ex in decoded:
        record = {'inputs': _text(ex['inputs_pretokenized']) if 'inputs_pretokenized' in ex
                  else vocab.decode([int(t) for t in ex['inputs']]),
                  'prediction': ex['prediction'], 'score': ex['score']}
        if 'targets' in ex:
          record['targets'] = (_text(ex['targets_pretokenized']) if 'targets_pretokenized' in ex
                               else vocab.decode([int(t) for t in ex['targets']]))
        f.write(json.dumps(record) + '\n')
  return len(decoded)


def main(argv=None):
  with cli.clear_errors('t5xv-infer'):
    _, config = cli.setup(cli.parser('t5xv-infer', __doc__), argv,
                           {'infer': infer})
    n = infer(config)
  print(f'wrote {n} predictions')
  return 0


if __name__ == '__main__':
  sys.exit(main())
