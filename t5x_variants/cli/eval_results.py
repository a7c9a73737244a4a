"""eval_results.json, what t5xv-eval writes in a run directory: {split: {step: {task: metrics}}},
and under each split the settings each task's results were made with (``check_settings``), each
metric's best value over the checkpoints (``best_over_checkpoints``) and the GLUE and SuperGLUE
averages as T5 scores them (``benchmark_averages``)."""
import json
import math

from etils import epath

from t5x_variants.train import multihost

RESULTS = 'eval_results.json'
BEST = 'best'  # eval_results.json's key for the best value of each metric over checkpoints
SETTINGS = 'settings'  # its key for how each task's results were made
AVERAGE = 'average'  # its key for the benchmarks' averages (benchmark_averages)
BENCHMARKS = {'super_glue_': 'SuperGLUE', 'glue_': 'GLUE'}  # task name prefix: benchmark
# The tasks whose mean is a benchmark's score (T5's eval_utils; GLUE's without WNLI).
BENCHMARK_TASKS = {'GLUE': ('cola', 'sst2', 'mrpc', 'stsb', 'qqp', 'mnli', 'qnli', 'rte'),
                   'SuperGLUE': ('boolq', 'cb', 'copa', 'multirc', 'record', 'rte', 'wic', 'wsc')}
# Figures every task gets (teacher-forced) and a continuation's: not a task's own metrics.
NOT_TASK_METRICS = ('loss', 'z_loss', 'log_perplexity', 'token_accuracy', 'num_tokens',
                  'continuation_exact_match', 'continuation_log_perplexity')
LOWER_IS_BETTER = ('loss', 'z_loss', 'log_perplexity', 'continuation_log_perplexity')
DEFAULT_SPLIT = 'validation'


def best_over_checkpoints(results) -> dict:
  """{task: {metric: {'value', 'step'}}}: each metric's best value over the evaluated checkpoints
  (lowest loss and log-perplexity, highest score), as the GLU-variants paper reports fine-tuning:
  the best checkpoint per task."""
  best = {}
  for step, by_task in results.items():
    if not step.isdigit():
      continue
    for task, metrics in by_task.items():
      for name, value in metrics.items():
        if name == 'num_tokens' or value is None or not math.isfinite(value):
          continue  # an undefined score (a constant prediction's correlation) is no best
        current = best.setdefault(task, {}).get(name)
        lower = name in LOWER_IS_BETTER
        if current is None or (value < current['value'] if lower else value > current['value']):
          best[task][name] = {'value': value, 'step': int(step)}
  return best


def check_settings(results: dict, path, split: str, task_names, settings: dict):
  """Records ``settings`` for each of ``task_names`` in a split's results; ValueError if one of
  those tasks' results there were made with others (skipping the checkpoints they hold would mix
  two ways of evaluating). Other tasks' results may have their own settings."""
  recorded, now = results.setdefault(SETTINGS, {}), json.loads(json.dumps(settings))  # as read back
  for task in task_names:
    before = recorded.setdefault(task, now)
    differ = [f'{k}: {before.get(k)!r} there, {now[k]!r} now' for k in now if before.get(k) != now[k]]
    if differ:
      raise ValueError(f'{path} holds {split} results of {task} made with other settings '
                       f'({"; ".join(differ)}); evaluate it with those settings, or move that file '
                       'aside to start its results afresh')


def benchmark_averages(results) -> dict:
  """{'GLUE': {'value', 'step', 'tasks': {task: {'value', 'step'}}}, 'SuperGLUE': ...} of one
  split's results, as T5's evaluation scores a benchmark (its eval_utils: compute_avg_glue,
  metric_group_max): a task's score at a step is the mean of its metrics (MRPC's F1 and accuracy,
  STS-B's two correlations, MNLI's matched and mismatched accuracies, ...), the benchmark's the
  mean over its tasks at a step where every task evaluated has a score; reported are the best
  step's benchmark score and each task's best step's score, and under 'missing' the benchmark's
  tasks not evaluated (T5 gives no score then: the mean is of fewer tasks). WNLI is left out, as
  T5; a metric that is undefined (NaN) leaves its task without a score at that step."""
  raw = {}  # benchmark -> step -> task -> its metrics' values
  benchmark_of = lambda task: next((n for p, n in BENCHMARKS.items() if task.startswith(p)), None)
  # glue_mnli_local: mnli; a classification task (data/classification.SUFFIX): glue_rte_cls: rte
  short = lambda task: task.split('glue_', 1)[1].removesuffix('_local').removesuffix('_cls')
  for step, by_task in results.items():
    if not step.isdigit():
      continue
    for task, metrics in by_task.items():
      values = [v for k, v in metrics.items() if k not in NOT_TASK_METRICS and v is not None]
      benchmark = benchmark_of(task)
      if benchmark and not task.startswith('glue_wnli') and values:
        raw.setdefault(benchmark, {}).setdefault(int(step), {})[task] = values
  out = {}
  first_best = lambda pair: (pair[0], -pair[1])  # the earliest step of a tie, as T5's idxmax
  for benchmark, by_step in raw.items():
    groups = {}  # a task of the average -> the evaluated tasks it is the mean of (MNLI: m and mm)
    for task in set().union(*by_step.values()):
      groups.setdefault(task.replace('_mismatched', ''), []).append(task)
    scores = {}  # step -> task -> score, where every one of its tasks has finite values
    for step, tasks in by_step.items():
      for group, members in groups.items():
        values = [v for t in members for v in tasks.get(t, [math.nan])]
        if all(map(math.isfinite, values)):
          scores.setdefault(step, {})[group] = sum(values) / len(values)
    best = {g: max(((s[g], step) for step, s in scores.items() if g in s), key=first_best)
            for g in groups if any(g in s for s in scores.values())}
    full = {step: sum(s.values()) / len(s) for step, s in scores.items() if len(s) == len(groups)}
    if full:
      step = max(full, key=lambda k: first_best((full[k], k)))
      out[benchmark] = {'value': full[step], 'step': step,
                        'tasks': {t: {'value': v, 'step': k} for t, (v, k) in sorted(best.items())},
                        'missing': sorted(set(BENCHMARK_TASKS[benchmark]) - set(map(short, groups)))}
  return out


def _read(path: epath.Path) -> dict:
  """The file's object of objects ({} where there is none); ValueError, one line, for anything
  else (cut short, edited, another file of its name)."""
  if not path.exists():
    return {}
  try:
    results = json.loads(path.read_text())
    why = '' if isinstance(results, dict) and all(isinstance(v, dict) for v in results.values()) \
        else f'a {type(results).__name__}, not results by split'
  except ValueError as e:  # not JSON, or not text (UnicodeDecodeError)
    why = f'{type(e).__name__}: {e}'
  if why:
    raise ValueError(f'{path} cannot be read as t5xv-eval results ({why}): move it aside to start '
                     'its results afresh')
  return results


def read_results(path: epath.Path) -> dict:
  """eval_results.json as {split: {step: {task: metrics}, 'best': ...}}, as process 0 reads it, on
  every process. A file written before results were keyed by split ({step: ...} at the top) is
  read as the default split's."""
  results = multihost.process0_json(  # the file process 0 writes, as it reads it
      f'reading {path}', lambda: _read(path))
  if any(key.isdigit() or key == BEST for key in results):
    return {DEFAULT_SPLIT: results}
  return results
