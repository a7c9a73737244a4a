"""t5xv-data: print decoded examples of a seqio task or mixture and their statistics.

  t5xv-data --task=embedded_span_corruption [--split=validation] [--n=5] [--inputs_length=512]
            [--targets_length=114] [--gin_file=...]

Its gin files and bindings set the data layer (``vocabulary``, ``local_corpus_files``,
``span_corruption``); a run's
task and lengths are its flags. A run or experiment file, or a run's config.gin, also binds the
trainer's settings, which it refuses.
"""
import sys

import numpy as np

from t5x_variants.cli import common, ranges, recipe
from t5x_variants.features import EOS_ID, PAD_ID


def _decode(vocabulary, ids) -> str:
  """Text of the ids up to padding; sentinels, which come in order, read <extra_id_i>, EOS reads
  </s> (an id is the next sentinel or a piece: ByT5's sentinels are bytes of text too)."""
  from t5x_variants.data import vocab  # pylint: disable=g-import-not-at-top  (the data layer)
  ids = [int(i) for i in ids if i != PAD_ID]
  pieces, run, shown = [], [], 0
  for i in ids + [None]:
    sentinel = shown < vocab.sentinels(vocabulary) and i == vocabulary.vocab_size - 1 - shown
    if i is None or i == EOS_ID or sentinel:
      if run:
        pieces.append(vocabulary.decode(run))
        run = []
      if i == EOS_ID:
        pieces.append('</s>')
      elif sentinel:
        pieces.append(f'<extra_id_{shown}>')
        shown += 1
    else:
      run.append(i)
  return ' '.join(pieces)


def default_lengths(name: str, inputs_length: int):
  """Span corruption's targets follow from its inputs and its gin-bound noise (T5: 512 -> 114),
  the prefix LM objective's are one shorter (512 -> 511); else equal lengths."""
  from t5x_variants.data import span_corruption  # pylint: disable=g-import-not-at-top
  if name.endswith('span_corruption'):
    return {'inputs': inputs_length,
            'targets': span_corruption.bound_targets_length(inputs_length)}
  if name.endswith('prefix_lm'):
    return {'inputs': inputs_length, 'targets': inputs_length - 1}
  return {'inputs': inputs_length, 'targets': inputs_length}


def inspect_task(name, split='validation', n=5, lengths=None, out=None):
  """Prints n examples and statistics (to stdout by default); returns the statistics dict."""
  from t5x_variants.data import span_corruption, tasks  # pylint: disable=g-import-not-at-top
  out = out or sys.stdout
  task = tasks.get_task_or_mixture(name)
  common.vocabulary_size(task)  # its vocabulary readable, before the pipeline uses it
  lengths = lengths or default_lengths(name, 512)
  with tasks.explain_missing_data(task), tasks.without_autograph():
    ds = task.get_dataset(lengths, split=split, shuffle=False, seed=0)
  examples = [{k: np.asarray(v) for k, v in ex.items()} for ex in ds.take(n).as_numpy_iterator()]
  if not examples:
    raise ValueError(f'{name} {split} produced no examples with lengths {lengths}')
  vocabulary = tasks.output_vocabulary(task)
  for i, ex in enumerate(examples):
    print(f'--- example {i}', file=out)
    for key in ('inputs', 'targets'):
      if key in ex:
        print(f'{key} ({int((ex[key] != PAD_ID).sum())} tokens): {_decode(vocabulary, ex[key])}', file=out)
    if 'targets' not in ex and 'label' in ex:  # a classification task (glue_<t>_cls)
      print(f'label: {ex["label"]}', file=out)
  stats = {'examples': len(examples)}
  for key in ('inputs', 'targets'):
    if key in examples[0]:
      stats[f'mean_{key}_length'] = float(np.mean([(ex[key] != PAD_ID).sum() for ex in examples]))
  if name.endswith('span_corruption'):
    stats.update(span_corruption.noise_statistics([ex['inputs'] for ex in examples],
                                                  [ex['targets'] for ex in examples],
                                                  vocabulary.vocab_size))
  print('--- statistics', file=out)
  for key, value in stats.items():
    print(f'{key}: {value:.4g}' if isinstance(value, float) else f'{key}: {value}', file=out)
  return stats


def main(argv=None):
  parser = common.parser('t5xv-data', __doc__, processes=False)
  parser.add_argument('--task', required=True, help='task or mixture name')
  parser.add_argument('--split', default='validation')
  parser.add_argument('--n', type=int, default=5, help='examples to print and sample')
  parser.add_argument('--inputs_length', type=int, default=None)
  parser.add_argument('--targets_length', type=int, default=None)
  with common.clear_errors('t5xv-data'):
    args = common.parse_args(parser, argv)
    ranges.check_flags(args, {'n': 1, 'inputs_length': 1, 'targets_length': 1})
    common.import_data_layer()
    from t5x_variants.data import corpus, span_corruption, vocab  # pylint: disable=g-import-not-at-top
    try:
      recipe.parse_gin(args.gin_file, args.gin_bindings, args.gin_search_paths.split(','),
                       configurables={'vocabulary': vocab.vocabulary,
                                      'local_corpus_files': corpus.local_corpus_files,
                                      'span_corruption': span_corruption.span_corruption})
    except recipe.GinConfigError as e:
      if 'No configurable matching' not in str(e):
        raise
      raise recipe.GinConfigError(
          f'{e}. t5xv-data takes the data layer\'s gin files and bindings (vocabulary, '
          'local_corpus_files, span_corruption), not a run or experiment file or a run\'s config.gin: give its task '
          'and lengths as --task, --inputs_length and --targets_length', detail=e.detail) from None
    lengths = default_lengths(args.task, args.inputs_length or 512)
    if args.targets_length:
      lengths['targets'] = args.targets_length
    inspect_task(args.task, args.split, args.n, lengths)
  return 0


if __name__ == '__main__':
  sys.exit(main())
