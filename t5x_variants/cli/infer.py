"""t5xv-infer: decode a task split or a text file with a checkpoint, to JSONL (T5X's infer.py).

  t5xv-infer --gin_file=RUN/config.gin --gin_file=gin/runs/infer.gin \\
    --gin.CHECKPOINT_PATH="'RUN'" --gin.INFER_OUTPUT="'RUN/predictions.jsonl'"

Decodes MIXTURE_OR_TASK_NAME's split, or with ``--gin.INPUT_FILE="'texts.txt'"`` one text per
line. Decoding options: ``DecodeOptions.method = 'greedy' | 'sample' | 'beam'`` and friends.
Each output line: {"inputs", "prediction", "score", and for task examples "targets" and
"target_log_likelihood" (log p(targets | inputs), teacher-forced); with
``DecodeOptions.num_decodes`` > 1 "predictions", each decode's text and score, best first}; a
non-finite score is null. A decoder-only model on a
language-modelling task (targets only) continues the first ``--gin.PROMPT_LENGTH`` target tokens;
"inputs" is that prompt and "targets" the rest. The texts of an INPUT_FILE are prompts whole.
"""
import json
import sys
from typing import Mapping, Optional

import gin
import numpy as np

from t5x_variants.cli import common, ranges, recipe
from t5x_variants.train import multihost, storage
from t5x_variants.train.metrics import json_line
from t5x_variants.features import EOS_ID
from t5x_variants.train.predictor import (DecodeOptions, Predictor, continuation_length,
                                          continues_text, decode_examples, prompted, score_examples,
                                          until_eos)


def check_output(output_file: str):
  """Refuses an INFER_OUTPUT that is a directory, or an existing file other than an earlier
  t5xv-infer output (it would be replaced: a run's metrics.jsonl given by mistake)."""
  path = storage.path(output_file)
  if path.is_dir():
    raise ValueError(f'INFER_OUTPUT {output_file} is a directory: give a file path in it '
                     f'(e.g. {storage.join(output_file, "predictions.jsonl")})')
  above = storage.file_in_the_way(path.parent)  # found after decoding, before
  if above:
    raise ValueError(f'INFER_OUTPUT {output_file} cannot be written: {above} is a file; give a path '
                     'in a directory')
  if path.exists():
    try:
      with path.open() as f:
        first = json.loads(f.readline() or '{"prediction": null}')  # an empty file is ours
      ours = isinstance(first, dict) and 'prediction' in first
    except ValueError:  # not JSON, not text (UnicodeDecodeError is one)
      ours = False
    if not ours:
      raise ValueError(f'INFER_OUTPUT {output_file} exists and is not an earlier t5xv-infer output '
                       '(its first line has no "prediction"), which this would replace: give '
                       'another path, or remove that file')


@gin.configurable(denylist=['config'])
def infer(config, *, checkpoint_path: str = gin.REQUIRED, output_file: str = gin.REQUIRED,
          input_file: Optional[str] = None, mixture_or_task_name: Optional[str] = None,
          split: str = 'validation', task_feature_lengths: Mapping[str, int] = gin.REQUIRED,
          batch_size: int = 32, max_examples: Optional[int] = None,
          prompt_length: Optional[int] = None):
  """Writes one JSON line per example to ``output_file``; returns the number written."""
  from t5x_variants.data import tasks, vocab as vocab_lib  # pylint: disable=g-import-not-at-top
  predictor = Predictor(config, options=DecodeOptions())  # the decoding options checked first
  multihost.process0_does(f'checking {output_file}', lambda: check_output(output_file))

  def read_texts():  # INPUT_FILE's texts, before the checkpoint is looked for
    try:
      text = storage.path(input_file).read_text()
    except (OSError, UnicodeDecodeError) as e:  # missing, a directory, not text
      raise ValueError(f'INPUT_FILE {input_file} cannot be read as text ({type(e).__name__}: '
                       f'{e}): give a UTF-8 file of one input per line') from None
    texts = [line for line in text.splitlines() if line.strip()]
    if not texts:
      raise ValueError(f'INPUT_FILE {input_file} has no text to decode (one input per line)')
    return texts[:max_examples]
  texts = multihost.agree('reading INPUT_FILE', read_texts) if input_file else None
  recipe.use_run_vocabulary(checkpoint_path)

  def read():  # (vocabulary, examples, input length, target length)
    if input_file:
      vocab = vocab_lib.vocabulary()
      examples = [{'inputs_pretokenized': t, 'inputs': np.asarray(vocab.encode(t) + [EOS_ID])}
                  for t in texts]
      common.check_vocabulary_size(config, vocab, input_file)
    elif mixture_or_task_name:
      task = tasks.get_task_or_mixture(mixture_or_task_name)
      common.check_vocabulary_size(config, task, mixture_or_task_name)
      vocab = task.output_features['targets'].vocabulary
      examples = tasks.task_examples(task, split, task_feature_lengths, max_examples)
    else:
      raise ValueError('infer needs INPUT_FILE (a text per line) or MIXTURE_OR_TASK_NAME')
    input_length, target_length = task_feature_lengths.get('inputs'), task_feature_lengths['targets']
    if config.architecture == 'decoder_only' and 'inputs' not in task_feature_lengths:
      if input_file:  # each text whole is a prompt, continued for up to the targets length
        input_length = max(len(ex['inputs']) for ex in examples)
      else:
        examples = prompted(examples, prompt_length, mixture_or_task_name)
        input_length, target_length = prompt_length, continuation_length(target_length, prompt_length)
    return vocab, examples, input_length, target_length
  # Each process reads its own copy of the inputs and decodes them all: the same on every one.
  vocab, examples, input_length, target_length = multihost.same(
      'the examples to decode', read, key=lambda value: value[1:])
  eos = 0 if continues_text(config) else 1  # a language model's prompt is read without its EOS
  cut = sum(len(until_eos(ex['inputs'])) + eos > input_length for ex in examples) if (
      input_file and input_length) else 0
  if cut:
    print(f'{cut} of the {len(examples)} texts of {input_file} are longer than the inputs length, '
          f'{input_length} tokens{" with EOS" if eos else ""}: each is cut to it (to decode them '
          'whole, set --gin.TASK_FEATURE_LENGTHS with a longer \'inputs\')')
  if cut and eos:  # a cut input still ends in its EOS, as seqio's append_eos_after_trim cut them
    for ex in examples:
      ex['inputs'] = np.append(ex['inputs'][:-1][:input_length - 1], EOS_ID).astype(np.int32)
  predictor.load(checkpoint_path)
  decoded = decode_examples(predictor, vocab, examples, input_length, target_length, batch_size)
  if decoded and 'targets' in decoded[0]:
    decoded = score_examples(predictor, decoded, input_length, target_length, batch_size)

  def write():
    lines = []
    for ex in decoded:
      record = {'inputs': tasks.text(ex['inputs_pretokenized']) if 'inputs_pretokenized' in ex
                else vocab.decode([int(t) for t in ex['inputs']]),
                'prediction': ex['prediction'], 'score': ex['score']}
      if 'predictions' in ex:  # DecodeOptions.num_decodes > 1
        record['predictions'] = ex['predictions']
      if 'targets' in ex:
        record['targets'] = (tasks.text(ex['targets_pretokenized']) if 'targets_pretokenized' in ex
                             else vocab.decode(until_eos(ex['targets'])))
        record['target_log_likelihood'] = ex['log_likelihood']
      lines.append(json_line(record))
    storage.write_text(output_file, ''.join(lines))
  multihost.process0_does(f'writing {output_file}', write)
  return len(decoded)


def main(argv=None):
  with common.clear_errors('t5xv-infer'):
    _, config = recipe.setup(common.parser('t5xv-infer', __doc__), argv, {'infer': infer})
    ranges.check_ranges('infer', gin.get_bindings('infer'))  # before any work
    n = infer(config)
  print(f'wrote {n} predictions')
  return 0


if __name__ == '__main__':
  sys.exit(main())
