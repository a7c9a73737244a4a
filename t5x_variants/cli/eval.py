"""t5xv-eval: evaluate a run's checkpoints (T5X's eval.py).

  t5xv-eval --gin_file=RUN/config.gin --gin_file=gin/runs/eval.gin --gin.CHECKPOINT_PATH="'RUN'"

CHECKPOINT_PATH is a run directory (its newest checkpoint, or all with ``--gin.EVAL_ALL=True``)
or one ``checkpoint_<step>`` directory. For every task of MIXTURE_OR_TASK_NAME it computes the
teacher-forced loss, log-perplexity and token accuracy, and, for tasks with metrics (GLUE,
SuperGLUE), decodes greedily and applies the task's postprocessor and metrics; a task's metrics
of scores (rank classification) get each example's log-likelihood of its targets. A decoder-only
model on a language-modelling task, with ``--gin.PROMPT_LENGTH=N``, is prompted with each
example's first N target tokens: ``continuation_exact_match`` (percent of greedy continuations
equal to the reference) and ``continuation_log_perplexity`` (of the reference continuation given
the prompt, per token with EOS). A classification
head (encoder-only, ``glue_<t>_cls`` tasks) gets the same metrics of its predicted labels, in the
same pass as its loss. ``token_accuracy`` is the teacher-forced fraction of target tokens
predicted right; ``accuracy`` (percent) is a task metric of the decoded text or labels. Results go
to RUN/metrics.jsonl (kind 'eval', with the split), TensorBoard and RUN/eval_results.json
({split: {step: {task: metrics}}}, and under each split's 'best' each task's best value of every
metric over the evaluated checkpoints with its step, under 'average' the GLUE and SuperGLUE
averages as T5 scores them (``benchmark_averages``), both also printed), each example's
prediction or score to RUN/inference_eval/ (``eval_passes.predictions_file``); checkpoints already there for
the same split and tasks are skipped. Each task's results record the settings they were made
with (``settings``: feature lengths, batch and example limits, inference, z-loss, decoding
options); evaluating a task again with other settings is one error, not a mix of the two.
"""
import dataclasses
import functools
import json
import sys
import time
from typing import Mapping, Optional

import gin
from etils import epath

from t5x_variants.cli import common, ranges, recipe
from t5x_variants.cli.eval_passes import check_labelled, inference_passes, pass_metrics, unscored
from t5x_variants.cli.eval_results import (AVERAGE, BEST, DEFAULT_SPLIT, RESULTS,
                                          benchmark_averages, best_over_checkpoints,
                                          check_settings, read_results)
from t5x_variants.train import checkpoints, evaluation, multihost, storage
from t5x_variants.train.metrics import MetricsLogger
from t5x_variants.train.predictor import DecodeOptions, Predictor

VANISH_WAIT_SECS = 5.0  # how long a checkpoint that failed to load is watched for its deletion
# The data layer (TensorFlow) is imported inside the functions, after recipe.setup has loaded it
# quietly (common.import_data_layer).


def teacher_forced(predictor, task_name: str, split: str, lengths, batch_size: int,
                   max_batches: Optional[int], metric_fns=()):
  """Loss, log-perplexity, token accuracy over the split (every example once); with a classification
  head also ``metric_fns`` of its predictions (the task's GLUE metrics)."""
  from t5x_variants.data import pipeline  # pylint: disable=g-import-not-at-top
  batches = pipeline.eval_batches(task_name, lengths, predictor.config.data_architecture, batch_size,
                                  split)
  return evaluation.evaluate(predictor.eval_step, predictor.params, batches, predictor.mesh,
                             max_batches, metric_fns, name=f'the {split} data of {task_name}')


def uncomputed_metrics(task) -> Optional[str]:
  """The task's metrics that t5xv-eval does not compute, named, or None: it computes seqio's
  ``predict_metric_fns`` and ``score_metric_fns``, not ``predict_with_aux_metric_fns`` nor metric
  objects given as such (seqio's ``metric_objs``, beyond those it makes of metric functions)."""
  aux = [getattr(f, '__name__', repr(f)) for f in task.predict_with_aux_metric_fns]
  fns = len(task.predict_metric_fns) + len(task.score_metric_fns) + len(aux)
  objects = len(task.metric_objs) - fns
  named = ([f'predict_with_aux_metric_fns {", ".join(aux)}'] if aux else []) + (
      [f'{objects} metric object(s) (metric_objs)'] if objects > 0 else [])
  return '; '.join(named) or None


def examples_read(passes, batch_size: int, max_batches: Optional[int],
                  max_examples: Optional[int]) -> Optional[int]:
  """How many of a split's first examples an evaluation with ``passes`` reads (None: all): the
  teacher-forced pass ``max_batches`` batches, the others ``max_examples`` (scores one more, to see
  whether the last question is whole)."""
  if max_batches is None or (passes and max_examples is None):
    return None
  teacher_forced = max_batches * batch_size
  return max(teacher_forced, max_examples + 1) if passes else teacher_forced


def _check_fits(config, task: str, split: str, lengths: Mapping[str, int]):
  """ValueError if the rows of ``task``'s whole examples are longer than a model whose parameters
  are sized by its stacks' lengths (learned positions, a synthesizer) can read."""
  found = config.overlong_stack(lengths)
  if found:
    stack, n = found
    most = config.max_length(stack)
    raise ValueError(f'the longest {split} example of {task} makes {stack} rows of {n} tokens, '
                     f'more than this model reads ({stack}_max_length {most}: '
                     'its learned positions or synthesizer are sized by it); evaluate it at '
                     'lengths that fit (--gin.EVAL_FEATURE_LENGTHS, e.g. the run\'s '
                     'TASK_FEATURE_LENGTHS)')


def _load(predictor, path: epath.Path) -> bool:
  """Loads checkpoint ``path``; False if it was removed after it was listed (a training run beside
  this evaluation deletes its old checkpoints as it keeps the newest N), also while it was being
  read (a deletion in progress is waited for up to ``VANISH_WAIT_SECS``). A checkpoint that still
  exists but cannot be read raises as before. Process 0 decides which, for every process."""
  try:
    predictor.load(str(path))
  except Exception:  # pylint: disable=broad-except  (on every process: the reads are agreed)
    deadline = time.time() + VANISH_WAIT_SECS
    while path.exists() and time.time() <= deadline:
      time.sleep(0.2)
    if multihost.process0_says(f'looking for {path}', path.exists):
      raise
    return False
  return True


@gin.configurable(denylist=['config'])
def evaluate_checkpoints(config, *, checkpoint_path: str = gin.REQUIRED, all_checkpoints: bool = False,
                         mixture_or_task_name: str = gin.REQUIRED,
                         task_feature_lengths: Optional[Mapping[str, int]] = gin.REQUIRED,
                         split: str = DEFAULT_SPLIT, batch_size: int = 32,
                         max_batches: Optional[int] = None, max_examples: Optional[int] = None,
                         inference: bool = True, z_loss: float = 0.0,
                         prompt_length: Optional[int] = None):
  """{step: {task: metrics}} of the checkpoints evaluated on ``split`` by this call.
  ``task_feature_lengths`` None evaluates every example whole (T5X's eval.gin), each task at the
  lengths of its longest example in ``split`` of those read (tasks.whole_lengths, examples_read)."""
  from t5x_variants.data import classification, tasks  # pylint: disable=g-import-not-at-top
  recipe.use_run_vocabulary(checkpoint_path)
  paths = [checkpoints.checkpoint_path(checkpoint_path)]
  run_dir = paths[0].parent
  if all_checkpoints and run_dir == storage.path(checkpoint_path):
    paths = checkpoints.list_checkpoints(run_dir)

  def find_task():  # (the task or mixture, whether the model classifies it, its tasks' names)
    mixture = tasks.get_task_or_mixture(mixture_or_task_name)
    common.check_vocabulary_size(config, mixture, mixture_or_task_name)
    names = sorted(t.name for t in getattr(mixture, 'tasks', [mixture]))
    return mixture, classification.check_model(mixture, config) is not None, names
  mixture, classify, names = multihost.same(f'the tasks of {mixture_or_task_name}', find_task,
                                            key=lambda found: found[1:])
  subtasks = getattr(mixture, 'tasks', [mixture])
  for task in subtasks:
    if task.score_metric_fns and inference and unscored(task, config):
      left_out = ', '.join(getattr(f, '__name__', repr(f)) for f in task.score_metric_fns)
      print(f'{task.name}: its metrics of scores ({left_out}) are not computed: '
            f'{unscored(task, config)}')
    uncomputed = inference and uncomputed_metrics(task)
    if uncomputed:
      print(f'{task.name}: its {uncomputed} are not computed: t5xv-eval computes '
            "seqio's predict_metric_fns and score_metric_fns")
  results_file = run_dir / RESULTS
  all_results = read_results(results_file)
  results = all_results.setdefault(split, {})
  options = DecodeOptions()
  whole = task_feature_lengths is None
  passes = {task.name: inference_passes(task, config, inference, prompt_length) for task in subtasks}
  read = {name: examples_read(p, batch_size, max_batches, max_examples) for name, p in passes.items()}
  lengths = {task.name: dict(task_feature_lengths) if not whole else
             multihost.same(f'the longest {split} examples of {task.name}',
                            functools.partial(tasks.whole_lengths, task, split, read[task.name]))
             for task in subtasks}
  for task in subtasks:
    multihost.same(f'the {split} labels of {task.name}',
                   functools.partial(check_labelled, task, split, lengths[task.name]), key=None)
  if whole:
    for name, longest in sorted(lengths.items()):
      of = f' of its first {read[name]}' if read[name] else ''
      print(f'{name} ({split}): whole examples, the longest{of} ' +
            ', '.join(f'{k} {n} tokens' for k, n in longest.items()))
      _check_fits(config, name, split, longest)
  settings = {'task_feature_lengths': None if whole else dict(task_feature_lengths),
              'max_batches': max_batches,
              'max_examples': max_examples, 'inference': inference, 'z_loss': z_loss,
              'prompt_length': prompt_length, 'decoding': {  # num_decodes only where set: the
                  k: v for k, v in dataclasses.asdict(options).items()  # results of before match
                  if k != 'num_decodes' or v != 1}}
  if max_batches is not None:  # then the batch size sets how many examples are evaluated
    settings['batch_size'] = batch_size
  predictor = Predictor(config, options=options, z_loss=z_loss)  # the options checked first
  predictor.check_run(run_dir)  # also before any checkpoint is skipped as evaluated
  check_settings(results, results_file, split, names, settings)
  logger = None  # opened at the first record: a call that evaluates nothing writes no events file
  new = {}
  try:
    for path in paths:
      step = path.name.split('_')[-1]
      if all(n in results.get(step, {}) for n in names):
        print(f'checkpoint {step}: already evaluated on {split}, skipped')
        continue
      if not (_load(predictor, path) if all_checkpoints else predictor.load(str(path))):
        print(f'checkpoint {step}: {path.name} was removed before it could be read (e.g. by the '
              'training run\'s keep-N cleanup), skipped')
        continue
      for task in sorted(subtasks, key=lambda t: t.name):
        metrics = teacher_forced(predictor, task.name, split, lengths[task.name], batch_size,
                                 max_batches, task.predict_metric_fns if classify else ())
        metrics.update(pass_metrics(predictor, task, passes[task.name], split, lengths[task.name],
                                    batch_size, max_examples, prompt_length,
                                    run_dir / 'inference_eval', int(step)))
        logger = logger or MetricsLogger(str(run_dir), console=True)
        logger.eval(int(step), task.name, metrics, split=split)
        results.setdefault(step, {})[task.name] = metrics
        new.setdefault(int(step), {})[task.name] = metrics
      results[BEST] = best_over_checkpoints(results)
      results[AVERAGE] = benchmark_averages(results)
      if logger:  # its records first: on a store they wait for a period, lost if an error follows
        logger.flush()  # while the results file would list them (a rerun skips what it lists)
      multihost.process0_does(f'writing {results_file}', lambda: storage.write_text(
          results_file, json.dumps(all_results, indent=1, sort_keys=True)))
  except BaseException:  # its files closed here (an event file's writer would outlive it)
    try:
      if logger:
        logger.close(agreed=False)
    except Exception as e:  # pylint: disable=broad-except
      print(f't5xv-eval: warning: closing {run_dir}/metrics.jsonl after the error: {e}',
            file=sys.stderr)  # (the error raised is the first one)
    raise
  if logger:
    logger.close()
  evaluated = sum(step.isdigit() for step in results)
  for task, metrics in sorted(results.get(BEST, {}).items()):
    print(f'best of {evaluated} checkpoint(s), {task} ({split}): ' + ', '.join(
        f'{name} {m["value"]:.4g} (step {m["step"]})' for name, m in sorted(metrics.items())))
  for name, average in sorted(benchmark_averages(results).items()):  # (a file's may be older)
    missing = average['missing']
    of = (f'{len(average["tasks"])} of its tasks, not its score: {", ".join(missing)} not '
          'evaluated' if missing else f'its {len(average["tasks"])} tasks')
    print(f'{name} average ({split}, as T5 scores it: each task its metrics\' mean, the mean over '
          f'{of}): {average["value"]:.2f} at its best step {average["step"]}; '
          + ', '.join(f'{t} {v["value"]:.2f} (step {v["step"]})' for t, v in average['tasks'].items()))
  return new


def main(argv=None):
  with common.clear_errors('t5xv-eval'):
    _, config = recipe.setup(common.parser('t5xv-eval', __doc__), argv,
                             {'evaluate_checkpoints': evaluate_checkpoints})
    ranges.check_ranges('evaluate_checkpoints', gin.get_bindings('evaluate_checkpoints'))
    results = evaluate_checkpoints(config)
  print(f'evaluated {len(results)} checkpoint(s)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
