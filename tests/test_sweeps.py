"""t5xv-sweep and t5xv-report: the grid (gin-file and --grid binding axes) and its commands,
resuming and recording failures (with a stand-in trainer), reading run directories (divergence,
resumed steps), Spearman's rho, its bootstrap interval and the flipped pairs, t intervals over
seeds and paired differences against a baseline, the report's tables and plots; a sweep that
writes its batches once and trains 4 runs from them through the real trainer. (The suite's sweep
and report end to end through the real trainer, on a bucket: tests/test_gcs.py.)"""
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from scipy import stats

from conftest import needs_data_layer
from t5x_variants.sweeps import grid, papers, plots, report, runner, runs, statistics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'

# A stand-in for t5xv-train: a run whose variant file is named bad.gin diverges at step 7, crash.gin
# fails, any other writes a finished run (train and eval records ending at step 4).
FAKE_TRAINER = '''
import json, os, sys
args = sys.argv[1:]
model_dir = next(a for a in args if a.startswith('--gin.MODEL_DIR=')).split('=', 1)[1].strip("'")
with open(os.path.join(os.path.dirname(model_dir), 'calls.txt'), 'a') as f:
  f.write(os.path.basename(model_dir) + '\\n')
if any(a.endswith('bad.gin') for a in args):
  print('t5xv-train: error: non-finite from step 7: the loss or gradients are not finite (loss nan); ...')
  sys.exit(2)
if any(a.endswith('stopped.gin') for a in args):  # a signal: checkpoint saved, exit 0, not finished
  with open(os.path.join(model_dir, 'metrics.jsonl'), 'w') as f:
    f.write(json.dumps({'step': 2, 'kind': 'train', 'loss': 5.0}) + '\\n')
  with open(os.path.join(model_dir, 'config.gin'), 'w') as f:
    f.write('train.total_steps = 4\\n')
  sys.exit(0)
if any(a.endswith('crash.gin') for a in args):
  print('t5xv-train: error: cannot read gin file: no such file')
  sys.exit(2)
seed = int(next(a for a in args if a.startswith('--gin.train.seed=')).split('=')[1])
with open(os.path.join(model_dir, 'metrics.jsonl'), 'w') as f:
  for step in (2, 4):
    f.write(json.dumps({'step': step, 'kind': 'train', 'loss': 5.0 - step / 4,
                        'tokens_per_second': 100.0, 'skipped': 0.0}) + '\\n')
    f.write(json.dumps({'step': step, 'kind': 'eval', 'task': 't',
                        'log_perplexity': 4.0 - step / 4 + seed / 10}) + '\\n')
with open(os.path.join(model_dir, 'config.gin'), 'w') as f:
  f.write('TRAIN_STEPS = 4\\ntrain.total_steps = %TRAIN_STEPS\\n')
'''


def gin_files(tmp_path, *names):
  for name in names:
    (tmp_path / name).write_text('# variant\n')
  return [str(tmp_path / n) for n in names]


def test_grid_is_seed_major_and_names_runs_by_variant_and_seed(tmp_path):
  base, a, b, d6, d12 = gin_files(tmp_path, 'base.gin', 'post_ln.gin', 'deepnorm.gin',
                                  'depth_6.gin', 'depth_12.gin')
  sweep = grid.Sweep.build(str(tmp_path / 's'), [base], [f'{a},{b}', str(tmp_path / 'depth_*.gin')],
                           seeds=2, bindings=['train.log_period = 5'])
  assert [r.name for r in sweep.runs] == [
      'post_ln+depth_12-seed0', 'post_ln+depth_6-seed0', 'deepnorm+depth_12-seed0',
      'deepnorm+depth_6-seed0', 'post_ln+depth_12-seed1', 'post_ln+depth_6-seed1',
      'deepnorm+depth_12-seed1', 'deepnorm+depth_6-seed1']
  command = sweep.command(sweep.runs[-1])
  assert command[:4] == ['t5xv-train', f'--gin_file={base}', f'--gin_file={b}', f'--gin_file={d6}']
  assert command[4:] == ["--gin.train.on_nonfinite='stop'",
                         f"--gin.MODEL_DIR='{tmp_path}/s/deepnorm+depth_6-seed1'",
                         '--gin.train.seed=1', '--gin.train/DatasetConfig.seed=1',
                         '--gin.train.log_period=5']  # the sweep's own bindings come last
  assert grid.shell_line(command[4:6]) == (
      f"--gin.train.on_nonfinite=\"'stop'\" --gin.MODEL_DIR=\"'{tmp_path}/s/deepnorm+depth_6-seed1'\"")


def test_gin_files_are_found_from_any_directory_as_training_finds_them(tmp_path, monkeypatch):
  """Outside a checkout the base file comes from the installed package's gin/ and a variant from
  --gin_search_paths, which every run's command then carries."""
  (tmp_path / 'mine' / 'norm').mkdir(parents=True)
  gin_files(tmp_path / 'mine' / 'norm', 'deepnorm.gin')
  monkeypatch.chdir(tmp_path)
  sweep = grid.Sweep.build('s', ['gin/runs/pretrain.gin'], ['norm/deep*.gin', 'gin/variants/ffn/swiglu.gin'],
                           1, search_paths=['', str(tmp_path / 'mine')])
  command = sweep.command(sweep.runs[0])
  assert command[1:5] == [f'--gin_file={REPO}/t5x_variants/gin/runs/pretrain.gin',
                          f'--gin_file={tmp_path}/mine/norm/deepnorm.gin',
                          f'--gin_file={REPO}/t5x_variants/gin/variants/ffn/swiglu.gin',
                          f'--gin_search_paths={tmp_path}/mine']
  with pytest.raises(grid.SweepError, match='--variants .norm/deep.gin. matches no gin file'):
    grid.Sweep.build('s', ['gin/runs/pretrain.gin'], ['norm/deep.gin'], 1)


def test_bad_grids_are_refused(tmp_path):
  base, a = gin_files(tmp_path, 'base.gin', 'a.gin')
  (tmp_path / 'other').mkdir()
  other_a = gin_files(tmp_path / 'other', 'a.gin')[0]
  with pytest.raises(grid.SweepError, match='matches no gin file'):
    grid.Sweep.build(str(tmp_path / 's'), [base], [str(tmp_path / 'nothing_*.gin')], 1)
  with pytest.raises(grid.SweepError, match='same name'):
    grid.Sweep.build(str(tmp_path / 's'), [base], [f'{a},{other_a}'], 1)
  with pytest.raises(grid.SweepError, match='base gin file not found'):
    grid.Sweep.build(str(tmp_path / 's'), [str(tmp_path / 'missing.gin')], [a], 1)
  grid.Sweep.build(str(tmp_path / 's'), [base], [a], 1).save()
  with pytest.raises(grid.SweepError, match='another --sweep_dir'):
    grid.Sweep.build(str(tmp_path / 's'), [base], [a], 1, bindings=['x = 1']).merge_previous()
  # A run's name holds its files' stems and its grid bindings' last name component only: a run
  # recorded under the same name with another file or binding is not taken for this one.
  with pytest.raises(grid.SweepError, match=r'recorded a-seed0 with other variant files .*/a.gin, now .*/other/a.gin'):
    grid.Sweep.build(str(tmp_path / 's'), [base], [other_a], 1).merge_previous()
  grid.Sweep.build(str(tmp_path / 'g'), [base], [], 1, grid=['schedule.base=1,2']).save()
  with pytest.raises(grid.SweepError, match='recorded base=1-seed0 with other .*schedule.base = 1, now adafactor.base = 1'):
    grid.Sweep.build(str(tmp_path / 'g'), [base], [], 1, grid=['adafactor.base=1,2']).merge_previous()
  grid.Sweep.build(str(tmp_path / 'g'), [base], [], 2, grid=['schedule.base=1,2']).merge_previous()


def fake_sweep(tmp_path, seeds=1):
  files = gin_files(tmp_path, 'base.gin', 'good.gin', 'bad.gin', 'crash.gin', 'fine.gin')
  return grid.Sweep.build(str(tmp_path / 'sweep'), files[:1], [','.join(files[1:])], seeds,
                          paper='glu')


def calls(tmp_path):
  path = tmp_path / 'sweep' / 'calls.txt'
  return path.read_text().split() if path.exists() else []


def test_sweep_records_failures_goes_on_and_resumes(tmp_path):
  trainer = tmp_path / 'fake_trainer.py'
  trainer.write_text(FAKE_TRAINER)
  executable = [sys.executable, str(trainer)]
  sweep = fake_sweep(tmp_path)
  lines = []
  counts = runner.run_sweep(sweep, executable, say=lines.append)
  assert counts == {'done': 2, 'diverged': 1, 'failed': 1}
  saved = json.loads((tmp_path / 'sweep' / 'sweep.json').read_text())
  by_name = {r['name']: r for r in saved['runs']}
  assert by_name['bad-seed0']['status'] == 'diverged' and by_name['bad-seed0']['diverged_step'] == 7
  assert by_name['crash-seed0']['reason'] == 't5xv-train: error: cannot read gin file: no such file'
  assert by_name['fine-seed0']['status'] == 'done'  # the failures did not stop the sweep
  assert lines[0].startswith('[1/4] good seed 0: training in') and 'eta' in lines[0]
  assert 'sweep eta 0:' in lines[2]
  # Again with a second seed: finished and diverged runs are skipped, the failed one is retried.
  again = fake_sweep(tmp_path, seeds=2)
  again.merge_previous()
  assert [r.status for r in again.runs[:4]] == ['done', 'diverged', 'failed', 'done']
  runner.run_sweep(again, executable, say=lambda _: None)
  assert calls(tmp_path) == ['good-seed0', 'bad-seed0', 'crash-seed0', 'fine-seed0', 'crash-seed0',
                             'good-seed1', 'bad-seed1', 'crash-seed1', 'fine-seed1']
  # The report of it: seeds aggregated, the diverged and failed runs kept out of the means.
  group = report.sweep_group(str(tmp_path / 'sweep'))
  assert group.paper is papers.GLU
  text = '\n'.join(report.table(group))
  assert '| good | 2 done | 4/4 |' in text
  # mean ± std, then the 95% t interval: 3.05 ± t(0.975, 1) 0.0707 / sqrt(2) = 3.05 ± 0.635
  assert '| 3.050 ± 0.071 | 3.050 [2.415, 3.685] (n=2) | 3.050 ± 0.071 | no |' in text
  assert '| bad | 2 diverged |' in text and '| — | — | 2/2 (step 7, 7) |' in text


def write_metrics(run_dir, records, total_steps=None, params=None):
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, 'metrics.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)
  if total_steps:
    with open(os.path.join(run_dir, 'config.gin'), 'w') as f:
      f.write(f'TRAIN_STEPS = {total_steps}\n')
  if params:
    with open(os.path.join(run_dir, 'model-info.txt'), 'w') as f:
      f.write(f'...\nTotal number of parameters: {params:,}\n')


def train_record(step, loss, skipped=0.0, tokens_per_second=10.0):
  return {'step': step, 'kind': 'train', 'loss': loss, 'skipped': skipped,
          'tokens_per_second': tokens_per_second}


def test_a_run_directory_read_back(tmp_path):
  records = [train_record(10, 6.0, tokens_per_second=1.0), train_record(20, 5.0),
             {'step': 20, 'kind': 'eval', 'task': 't', 'log_perplexity': 5.5},
             train_record(30, 4.0, tokens_per_second=30.0),
             train_record(30, 4.5, tokens_per_second=20.0),  # resumed: logged again, latest wins
             {'step': 30, 'kind': 'eval', 'task': 't', 'log_perplexity': 5.2},
             {'step': 40, 'kind': 'eval', 'task': 't', 'log_perplexity': 5.3},
             # t5xv-eval's records beside them: its decoded score joins the run's own eval of the
             # step, whose log-perplexity stands; a step the run did not evaluate is its alone
             {'step': 40, 'kind': 'eval', 'task': 't', 'split': 'validation', 'log_perplexity': 4.0,
              'accuracy': 70.0},
             {'step': 50, 'kind': 'eval', 'task': 't', 'split': 'validation', 'log_perplexity': 5.25},
             {'step': 50, 'kind': 'eval', 'task': 't', 'split': 'test', 'log_perplexity': 1.0}]
  write_metrics(tmp_path / 'r', records, total_steps=40, params=1234567)
  run = runs.read_run(str(tmp_path / 'r'))
  assert (run.step, run.total_steps, run.params, run.task) == (30, 40, 1234567, 't')
  assert [r['loss'] for r in run.train] == [6.0, 5.0, 4.5]
  assert [(r['step'], r['log_perplexity'], r.get('accuracy')) for r in run.evals['t']] == [
      (20, 5.5, None), (30, 5.2, None), (40, 5.3, 70.0), (50, 5.25, None)]
  assert (run.final_eval(), run.best_eval()) == (5.25, 5.2)
  assert run.tokens_per_second() == 15.0  # the first window (compilation) left out
  assert run.diverged_at() is None


def test_tokens_per_second_leaves_out_each_sessions_first_window(tmp_path):
  # two trainer sessions (the second resumed at step 20): each one's first window compiled
  session = lambda start, *records: [{**r, 'start_step': start} for r in records]
  write_metrics(tmp_path / 'r', session(0, train_record(10, 6.0, tokens_per_second=1.0),
                                        train_record(20, 5.0, tokens_per_second=10.0))
                + session(20, train_record(30, 4.0, tokens_per_second=2.0),
                          train_record(40, 3.0, tokens_per_second=20.0)), total_steps=40)
  assert runs.read_run(str(tmp_path / 'r')).tokens_per_second() == 15.0


@pytest.mark.parametrize('losses,skipped,expected', [
    ([6.0, 5.0, None], [0, 0, 0], 3),  # non-finite (written as null)
    ([6.0, 5.0, 5.5], [0, 0, 1], 3),  # a skipped step in the window
    ([6.0, 5.0, 6.1], [0, 0, 0], 3),  # 1.1 nat above the lowest: blown up
    ([6.0, 5.0, 5.9], [0, 0, 0], None),  # 0.9 nat: noise, not divergence
    ([6.0, 5.0, 6.5, 5.2], [0, 0, 0, 0], None),  # blown up, then back by the last log
    ([6.0, 5.0, 5.5, 5.2], [0, 1, 0, 0], 2),  # one skipped step counts, even if it trains on
])
def test_divergence(tmp_path, losses, skipped, expected):
  write_metrics(tmp_path, [train_record(i + 1, l, s) for i, (l, s) in enumerate(zip(losses, skipped))])
  assert runs.read_run(str(tmp_path)).diverged_at() == expected


def test_the_diverged_column_counts_finished_runs_only(tmp_path):
  """A run still training whose loss is 1.1 nat above its lowest may recover: not 'diverged'
  in the table (its runs column says it is unfinished) or the depth plot; the same curve at its
  last step is."""
  blown = [train_record(1, 6.0), train_record(2, 5.0), train_record(3, 6.1)]
  write_metrics(tmp_path / 'running-seed0', blown, total_steps=10)
  write_metrics(tmp_path / 'done-seed0', blown + [{'step': 3, 'kind': 'eval', 'task': 't',
                                                   'log_perplexity': 6.0}], total_steps=3)
  group = report.run_dirs_group([str(tmp_path / d) for d in ('running-seed0', 'done-seed0')])
  rows = {line.split(' | ')[0][2:]: line for line in report.table(group)[2:]}
  assert rows['running'].endswith('| no |') and rows['done'].endswith('| 1/1 (step 3) |'), rows
  # The depth plot asks the same (it marked the running run's depth diverged).
  assert {t.variant: report.diverged_step(t) for t in group.trials} == {'running': None, 'done': 3}


def test_spearman_matches_scipy_with_ties():
  rng = np.random.default_rng(0)
  for _ in range(20):
    a, b = rng.integers(0, 5, 8).astype(float), rng.normal(size=8)
    assert statistics.spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic)


def test_ranking_names_a_flipped_pair_only_where_its_paired_interval_excludes_0(tmp_path):
  """rho over the means of the seeds every variant finished; a pair our means order otherwise
  than the paper is named as a flip only where its paired 95% interval excludes 0 (before, any
  difference of the means was)."""
  ours = {'relu': [5.0, 5.02, 4.98], 'geglu': [4.8, 4.82, 4.79], 'swiglu': [4.7, 4.73, 4.68],
          'bilinear': [5.3, 4.8, 5.0]}  # paper: 1.997 1.942 1.944 1.960
  dirs = []
  for name, values in ours.items():
    for seed, value in enumerate(values):
      d = tmp_path / f'{name}-seed{seed}'
      write_metrics(d, [train_record(4, 5.0), {'step': 4, 'kind': 'eval', 'task': 't',
                                               'log_perplexity': value}], total_steps=4)
      dirs.append(str(d))
  group = report.run_dirs_group(dirs, paper='glu')
  names, _, _, rho, flips = report.ranking(group)
  assert len(names) == 4
  assert [(a, b) for a, b, _ in flips] == [('relu', 'bilinear'), ('geglu', 'swiglu')]
  assert statistics.verdict(flips[0][2]).startswith('not distinguishable')  # +0.3, -0.22, +0.02
  assert statistics.verdict(flips[1][2]) == 'worse'  # geglu - swiglu: +0.10, +0.09, +0.11
  means = [np.mean(v) for v in ours.values()]
  assert rho == pytest.approx(stats.spearmanr(means, [1.997, 1.942, 1.944, 1.960]).statistic)
  text = ' '.join(report.ranking_lines(group, resamples=10))
  assert ('excluding 0: geglu/swiglu (geglu - swiglu: +0.100 [+0.075, +0.125] (n=3)); 1 other '
          'pair(s) ordered differently by the means alone, not distinguishable.') in text


def test_a_skipped_step_ends_a_run_only_under_on_nonfinite_stop(tmp_path):
  """A run directory whose last record has a skipped step: diverged (stopped there) when it ran
  with train.on_nonfinite='stop'; under 'skip' it went on (still going), unless every step of the
  window was skipped (its loss not finite)."""
  for mode in ('stop', 'skip'):
    write_metrics(tmp_path / mode, [train_record(2, 5.0), train_record(4, 4.9, skipped=1.0)],
                  total_steps=8)
    with open(tmp_path / mode / 'config.gin', 'a') as f:
      f.write(f"train.on_nonfinite = '{mode}'\n")
  statuses = [t.status for t in report.run_dirs_group([str(tmp_path / m) for m in ('stop', 'skip')]).trials]
  assert statuses == ['diverged', 'incomplete']
  write_metrics(tmp_path / 'all', [train_record(2, 5.0), train_record(4, None, skipped=2.0)], total_steps=8)
  assert report.run_dirs_group([str(tmp_path / 'all')]).trials[0].status == 'diverged'


def test_runs_of_one_variant_and_seed_from_two_sweeps_are_refused_not_merged(tmp_path):
  for sweep in ('a', 'b'):
    write_metrics(tmp_path / sweep / 'relu-seed0', [train_record(4, 5.0)], total_steps=4)
  with pytest.raises(ValueError, match=r'a/relu-seed0 and .*b/relu-seed0 are both relu seed 0'):
    report.run_dirs_group([str(tmp_path / s / 'relu-seed0') for s in ('a', 'b')])


def test_a_run_without_the_eval_of_its_last_step_is_not_finished_nor_given_an_earlier_value(
    tmp_path):
  """A run stopped between its last checkpoint and that step's eval: its last eval is of an
  earlier step, which is not its final value; it is unfinished (a rerun redoes the eval), so a
  sweep reruns it. A non-finite held-out value (written as null) is a divergence there."""
  evals = [{'step': s, 'kind': 'eval', 'task': 't', 'log_perplexity': 5.0} for s in (2, 4)]
  write_metrics(tmp_path / 'stopped', [train_record(6, 4.0)] + evals, total_steps=6)
  stopped = runs.read_run(str(tmp_path / 'stopped'))
  assert (stopped.finished(), stopped.final_eval(), stopped.best_eval()) == (False, None, 5.0)
  nan = dict(evals[1], step=6, log_perplexity=None)
  write_metrics(tmp_path / 'nan', [train_record(6, 4.0)] + evals + [nan], total_steps=6)
  run = runs.read_run(str(tmp_path / 'nan'))
  assert run.finished() and math.isnan(run.final_eval()) and run.best_eval() == 5.0
  assert run.diverged_at() == 6
  trial = report.run_dirs_group([str(tmp_path / 'nan')]).trials[0]
  assert trial.status == 'done' and report.final_value(trial) is None
  write_metrics(tmp_path / 'no_evals', [train_record(6, 4.0)], total_steps=6)
  assert runs.read_run(str(tmp_path / 'no_evals')).finished()  # a run that does not evaluate
  at_start = [dict(evals[0], step=0)]  # train.eval_at_start alone: no eval of the last step due
  write_metrics(tmp_path / 'at_start', [train_record(6, 4.0)] + at_start, total_steps=6)
  assert runs.read_run(str(tmp_path / 'at_start')).finished()
  # Its only eval as it trains is of its last step (eval_period >= total_steps), stopped before it:
  # unfinished, as config.gin says an eval task and period (it was done, and left every mean).
  for period, task, due in (('%EVAL_PERIOD', "'t'", True), ('0', "'t'", False), ('1000', 'None', False)):
    write_metrics(tmp_path / 'last', [train_record(6, 4.0)], total_steps=6)
    with open(tmp_path / 'last' / 'config.gin', 'a') as f:
      f.write(f'EVAL_PERIOD = 1000\ntrain.eval_period = {period}\n'
              f'train_eval/DatasetConfig.mixture_or_task_name = {task}\n')
    assert runs.read_run(str(tmp_path / 'last')).finished() != due, (period, task)
  # t5xv-eval's record of another task, logged first: the run's own task is its task
  beside = [{'step': 2, 'kind': 'eval', 'task': 'u', 'split': 'validation', 'log_perplexity': 1.0}]
  write_metrics(tmp_path / 'beside', [train_record(6, 4.0)] + beside + evals + [dict(evals[1], step=6)],
                total_steps=6)
  both = runs.read_run(str(tmp_path / 'beside'))
  assert both.task == 't' and both.finished() and both.final_eval() == 5.0
  # A sweep that recorded such a run done (as t5xv-sweep did) reruns it; a finished one stays.
  base, relu = gin_files(tmp_path, 'base.gin', 'relu.gin')
  sweep = grid.Sweep.build(str(tmp_path / 's'), [base], [relu], seeds=2)
  for run, evaluated in zip(sweep.runs, (evals, evals + [dict(evals[1], step=6)])):
    write_metrics(sweep.model_dir(run), [train_record(6, 4.0)] + evaluated, total_steps=6)
    run.status = 'done'
  sweep.update_from_run_dirs()
  assert [r.status for r in sweep.runs] == ['interrupted', 'done']


def assert_png(png):
  """``png``: a file's path, or its bytes (an object read from a bucket)."""
  import io  # pylint: disable=g-import-not-at-top
  import matplotlib.image  # pylint: disable=g-import-not-at-top
  if not isinstance(png, bytes):
    with open(png, 'rb') as f:
      png = f.read()
  assert png[:8] == PNG_MAGIC
  image = matplotlib.image.imread(io.BytesIO(png))
  assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
  assert image.std() > 0  # something is drawn


def test_depth_sweep_and_diagnostics_plots(tmp_path):
  dirs = []
  for placement in ('post_ln', 'deepnorm'):
    for depth in (6, 18):
      d = tmp_path / f'{placement}+depth_{depth}-seed0'
      diverged = placement == 'post_ln' and depth == 18
      records = [train_record(2, 6.0), train_record(4, None if diverged else 5.0)]
      records += [{'step': s, 'kind': 'diagnostics', 'update_norm': s * 0.1,
                   **{f'grad_norm/encoder/{i}': 1.0 + i for i in range(depth)},
                   **{f'activation_norm/encoder/{i}': 2.0 + i for i in range(depth)}} for s in (0, 4)]
      records += [] if diverged else [{'step': 4, 'kind': 'eval', 'task': 't', 'log_perplexity': 4.0}]
      write_metrics(d, records, total_steps=4)
      dirs.append(str(d))
  group = report.run_dirs_group(dirs)
  text = report.write_report([group], str(tmp_path / 'out'))
  assert '| post_ln+depth_18 | 1 done | 4/4 |' in text and '1/1 (step 4)' in text
  for name in ('runs_curves', 'runs_final', 'runs_depth', 'runs_diagnostics'):
    assert f'({name}.png)' in text
    assert_png(tmp_path / 'out' / f'{name}.png')
  # A second group of the same name (two sweep directories named alike) gets its own plots (it
  # wrote over the first's, both sections showing them); one of a head's eval loss says so.
  for d in dirs:
    with open(os.path.join(d, 'metrics.jsonl')) as f:
      lines = [l.replace('"log_perplexity"', '"loss"') if '"eval"' in l else l for l in f]
    write_metrics(d.replace(str(tmp_path), str(tmp_path / 'loss')), [json.loads(l) for l in lines],
                  total_steps=4)
  losses = report.run_dirs_group([d.replace(str(tmp_path), str(tmp_path / 'loss')) for d in dirs])
  text = report.write_report([group, losses], str(tmp_path / 'out'))
  assert text.count('(runs_depth.png)') == 1 and '![eval loss by depth](runs_2_depth.png)' in text
  assert '*Final held-out eval loss against layers per stack' in text
  assert plots.depth_figure(losses, report.final_values, report.diverged_step).axes[0].get_ylabel() == (
      'final eval loss')


def test_print_commands_lists_the_unfinished_runs(tmp_path, capsys):
  from t5x_variants.cli import sweep as sweep_cli  # pylint: disable=g-import-not-at-top
  base, a, b = gin_files(tmp_path, 'base.gin', 'a.gin', 'b.gin')
  flags = [f'--sweep_dir={tmp_path}/s', f'--gin_file={base}', f'--variants={a},{b}', '--seeds=2',
           '--gin.train.log_period=5', '--print_commands']
  assert sweep_cli.main(flags) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 4 and lines[0].startswith(f't5xv-train --gin_file={base} --gin_file={a} ')
  assert lines[3].endswith("--gin.MODEL_DIR=\"'" f"{tmp_path}/s/b-seed1'\" --gin.train.seed=1 "
                           '--gin.train/DatasetConfig.seed=1 --gin.train.log_period=5')
  saved = grid.Sweep.load(str(tmp_path / 's'))
  saved.runs[0].status = 'done'  # (with a directory at its last step: one without is trained)
  write_metrics(saved.model_dir(saved.runs[0]), [train_record(4, 4.0)], total_steps=4)
  saved.save()
  assert sweep_cli.main(flags) == 0
  assert [l.split('MODEL_DIR=')[1].split()[0] for l in capsys.readouterr().out.splitlines()] == [
      f"\"'{tmp_path}/s/{n}'\"" for n in ('b-seed0', 'a-seed1', 'b-seed1')]


@pytest.mark.parametrize('flag,message', [
    ('--gin.TransformerConfig.d_modle=32', "doesn't have a parameter named 'd_modle'"),
    ('--grid=learning_rate_schedule.bse=1e-3,3e-3', "doesn't have a parameter named 'bse'"),
    ("--gin.TransformerConfig.placement='prenorm'", "unknown placement 'prenorm'"),
    ('--grid=learning_rate_schedule.base=-1e-3,1e-3', 'learning_rate_schedule.base = -0.001 is '
                                                      'out of range'),  # at each run's start
    ('--grid=train.eval_period=-1,10', 'train.eval_period = -1 is out of range'),  # before
])
def test_a_bad_recipe_is_one_line_before_any_run_starts(flag, message, tmp_path, capsys):
  """Was: sweep.json and a directory per run written, every trainer started, each failing."""
  from t5x_variants.cli import sweep as sweep_cli  # pylint: disable=g-import-not-at-top
  base, a, b = gin_files(tmp_path, 'base.gin', 'a.gin', 'b.gin')
  with pytest.raises(SystemExit) as e:
    sweep_cli.main([f'--sweep_dir={tmp_path}/s', f'--gin_file={base}', f'--variants={a},{b}', flag])
  err = capsys.readouterr().err
  assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err
  assert not (tmp_path / 's').exists()


def test_a_sweep_or_report_directory_that_is_a_file_is_one_line(tmp_path, capsys):
  """'[Errno 17] File exists' before, naming neither the flag nor the fix."""
  from t5x_variants.cli import report as report_cli  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import sweep as sweep_cli  # pylint: disable=g-import-not-at-top
  base, = gin_files(tmp_path, 'base.gin')
  (tmp_path / 'notes').write_text('mine')
  (tmp_path / 'run').mkdir()
  for main, flags, message in (
      (sweep_cli.main, [f'--sweep_dir={tmp_path}/notes/s', f'--gin_file={base}'],
       f'--sweep_dir={tmp_path}/notes/s: {tmp_path}/notes is a file; give a directory'),
      (report_cli.main, [f'--run_dirs={tmp_path}/run', f'--output_dir={tmp_path}/notes'],
       f'--output_dir={tmp_path}/notes: {tmp_path}/notes is a file; give a directory')):
    with pytest.raises(SystemExit) as e:
      main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err
  assert (tmp_path / 'notes').read_text() == 'mine'


def test_report_without_runs_is_a_usage_error(capsys, tmp_path):
  from t5x_variants.cli import report as report_cli  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as exit_info:
    report_cli.main([])
  assert exit_info.value.code == 2 and 'give --sweep_dir or --run_dirs' in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:
    report_cli.main(['--sweep_dir=/nonexistent'])
  assert exit_info.value.code == 2
  assert 'sweep.json not found: not a sweep directory' in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:  # a mistyped run directory: not a row of nothing
    report_cli.main(['--run_dirs=/nonexistent/relu-seed0', '--output_dir=/nonexistent/out'])
  assert exit_info.value.code == 2
  assert 'error: --run_dirs: /nonexistent/relu-seed0 does not exist' in capsys.readouterr().err
  (tmp_path / 'sweep').mkdir()
  (tmp_path / 'sweep' / 'sweep.json').write_text('{}')
  with pytest.raises(SystemExit) as exit_info:  # an existing directory that is no run: was a row
    report_cli.main([f'--run_dirs={tmp_path}/sweep', f'--output_dir={tmp_path}/out'])
  assert exit_info.value.code == 2 and (
      f"error: --run_dirs: {tmp_path}/sweep holds runs and is none (a sweep's directory, or one of "
      "run directories): give the run directories, or a sweep's as --sweep_dir") in capsys.readouterr().err
  write_metrics(tmp_path / 'runs' / 'a-seed0', [train_record(10, 6.0)], total_steps=10)
  with pytest.raises(SystemExit) as exit_info:  # the parent of runs
    report_cli.main([f'--run_dirs={tmp_path}/runs', f'--output_dir={tmp_path}/out'])
  assert exit_info.value.code == 2 and 'holds runs and is none' in capsys.readouterr().err
  (tmp_path / 'starting').mkdir()  # a sweep's run whose trainer has not written its files yet
  (tmp_path / 'starting' / 'train.log').write_text('starting\n')
  assert report_cli.main([f'--run_dirs={tmp_path}/starting', f'--output_dir={tmp_path}/out']) == 0


def test_a_smaller_grid_keeps_the_record_and_runs_trained_elsewhere_count(tmp_path):
  trainer = tmp_path / 'fake_trainer.py'
  trainer.write_text(FAKE_TRAINER)
  executable = [sys.executable, str(trainer)]
  base, good, bad, stopped = gin_files(tmp_path, 'base.gin', 'good.gin', 'bad.gin', 'stopped.gin')
  build = lambda variants: grid.Sweep.build(str(tmp_path / 'sweep'), [base], [variants], 1)
  counts = runner.run_sweep(build(f'{good},{bad},{stopped}'), executable, say=lambda _: None)
  assert counts == {'done': 1, 'diverged': 1, 'interrupted': 1}  # exit 0 before the last step
  smaller = build(good)
  smaller.merge_previous()
  smaller.save()
  assert runner.run_sweep(smaller, executable, say=lambda _: None) == {'done': 1}
  assert calls(tmp_path) == ['good-seed0', 'bad-seed0', 'stopped-seed0']  # nothing retrained
  record = {r.name: r.status for r in grid.Sweep.load(str(tmp_path / 'sweep')).all_runs()}
  assert record == {'good-seed0': 'done', 'bad-seed0': 'diverged', 'stopped-seed0': 'interrupted'}
  # A run trained by a scheduler from --print_commands: its directory reached the last step.
  write_metrics(tmp_path / 'sweep' / 'stopped-seed0', [train_record(4, 4.0)], total_steps=4)
  group = report.sweep_group(str(tmp_path / 'sweep'))
  assert sorted((t.variant, t.status) for t in group.trials) == [
      ('bad', 'diverged'), ('good', 'done'), ('stopped', 'done')]
  again = build(f'{good},{bad},{stopped}')
  again.merge_previous()
  runner.run_sweep(again, executable, say=lambda _: None)
  assert calls(tmp_path) == ['good-seed0', 'bad-seed0', 'stopped-seed0']


def test_no_variants_is_one_run_and_one_sweep_per_directory(tmp_path):
  base, = gin_files(tmp_path, 'base.gin')
  sweep = grid.Sweep.build(str(tmp_path / 's'), [base], [], 2)
  assert [r.name for r in sweep.runs] == ['base-seed0', 'base-seed1']
  holder = runner.lock(str(tmp_path / 's'))
  with pytest.raises(grid.SweepError, match=r'another t5xv-sweep \(or a trainer it started\) is running'):
    runner.run_sweep(sweep, ['true'], say=lambda _: None)
  holder.close()



def test_a_held_sweep_directory_is_refused_before_sweep_json_is_touched(tmp_path, capsys):
  """Was: a second t5xv-sweep (or --print_commands) rewrote sweep.json before finding the lock."""
  from t5x_variants.cli import sweep as sweep_cli  # pylint: disable=g-import-not-at-top
  base, a = gin_files(tmp_path, 'base.gin', 'a.gin')
  flags = [f'--sweep_dir={tmp_path}/s', f'--gin_file={base}', f'--variants={a}', '--print_commands']
  assert sweep_cli.main(flags) == 0
  before = (tmp_path / 's' / 'sweep.json').read_bytes()
  holder = runner.lock(str(tmp_path / 's'))
  capsys.readouterr()
  for more in (['--seeds=3'], ['--seeds=3', '--print_commands']):
    with pytest.raises(SystemExit) as e:
      sweep_cli.main(flags[:3] + more)
    assert e.value.code == 2 and 'another t5xv-sweep' in capsys.readouterr().err
    assert (tmp_path / 's' / 'sweep.json').read_bytes() == before
  holder.close()
  assert sweep_cli.main(flags[:3] + ['--seeds=3', '--print_commands']) == 0


def test_gin_files_and_search_paths_are_recorded_absolute(tmp_path, monkeypatch):
  """Was: as given, so a scheduler starting a printed command elsewhere read other files."""
  (tmp_path / 'inc').mkdir()
  gin_files(tmp_path, 'base.gin', 'a.gin')
  monkeypatch.chdir(tmp_path)
  sweep = grid.Sweep.build('s', ['base.gin'], ['a.gin'], 1, search_paths=['inc'])
  assert sweep.command(sweep.runs[0])[1:4] == [
      f'--gin_file={tmp_path}/base.gin', f'--gin_file={tmp_path}/a.gin',
      f'--gin_search_paths={tmp_path}/inc']


SLOW_TO_STOP_TRAINER = '''
import os, signal, sys, time
model_dir = next(a for a in sys.argv if a.startswith('--gin.MODEL_DIR=')).split('=', 1)[1].strip("'")
signal.signal(signal.SIGTERM, lambda *_: time.sleep(60))  # a checkpoint that takes long to save
open(os.path.join(model_dir, 'pid'), 'w').write(str(os.getpid()))
time.sleep(60)
'''


def test_a_second_signal_while_the_trainers_stop_records_them_interrupted(tmp_path):
  """Was: the second Ctrl-C left sweep.json saying running."""
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  trainer = tmp_path / 'trainer.py'
  trainer.write_text(SLOW_TO_STOP_TRAINER)
  base, a = gin_files(tmp_path, 'base.gin', 'a.gin')
  script = ('import sys; from t5x_variants.sweeps import grid, runner; '
            f'runner.run_sweep(grid.Sweep.build({str(tmp_path / "s")!r}, [{base!r}], [{a!r}], 1), '
            f'[sys.executable, {str(trainer)!r}])')
  sweep = subprocess.Popen([sys.executable, '-c', script], cwd=REPO,
                           env=dict(os.environ, PYTHONPATH=REPO), stderr=subprocess.PIPE)
  pid_file = tmp_path / 's' / 'a-seed0' / 'pid'
  deadline = time.time() + 60
  # (the file exists, empty, before the trainer has written its pid: wait for the pid)
  while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
    time.sleep(0.1)
  trainer_pid = int(pid_file.read_text())
  try:
    sweep.send_signal(signal.SIGTERM)
    time.sleep(1)  # the trainer saving, the sweep waiting for it
    sweep.send_signal(signal.SIGTERM)
    assert 'KeyboardInterrupt' in sweep.communicate(timeout=30)[1].decode()
    assert grid.Sweep.load(str(tmp_path / 's')).runs[0].status == 'interrupted'
  finally:
    os.kill(trainer_pid, signal.SIGKILL)

QUICK_AND_SLOW_TRAINERS = '''
import os, signal, sys, time
model_dir = next(a for a in sys.argv if a.startswith('--gin.MODEL_DIR=')).split('=', 1)[1].strip("'")
if model_dir.endswith('a-seed0'):
  print('t5xv-train: error: boom')
  sys.exit(3)
def stop(*_):
  open(os.path.join(model_dir, 'stopped'), 'w').close()
  sys.exit(1)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(model_dir, 'started'), 'w').close()
time.sleep(60)
'''


def test_a_signal_while_a_run_ends_stops_the_running_trainers(tmp_path, monkeypatch):
  """A signal while the sweep records a run that ended (its sweep.json save, its log's copy to a
  bucket) is passed on to the trainers still running, as one while it waits (was: it left them
  running on their own), and the ended run is recorded as it ended (was: left 'running')."""
  import time  # pylint: disable=g-import-not-at-top
  from t5x_variants.sweeps import runner  # pylint: disable=g-import-not-at-top
  trainer = tmp_path / 'trainer.py'
  trainer.write_text(QUICK_AND_SLOW_TRAINERS)
  base, a, b = gin_files(tmp_path, 'base.gin', 'a.gin', 'b.gin')
  sweep = grid.Sweep.build(str(tmp_path / 's'), [base], [f'{a},{b}'], 1)
  real_end = runner._end  # pylint: disable=protected-access

  signals = [KeyboardInterrupt]

  def interrupted_end(sweep, attempt, returncode, interrupted):
    if signals:  # the quick run's end, once the slow one has started
      while not (tmp_path / 's' / 'b-seed0' / 'started').exists():
        time.sleep(0.1)
      raise signals.pop()
    return real_end(sweep, attempt, returncode, interrupted)
  monkeypatch.setattr(runner, '_end', interrupted_end)
  with pytest.raises(KeyboardInterrupt):
    runner.run_sweep(sweep, [sys.executable, str(trainer)], say=lambda _: None, parallel=2)
  assert (tmp_path / 's' / 'b-seed0' / 'stopped').exists()
  runs = {r.name: r for r in grid.Sweep.load(str(tmp_path / 's')).runs}
  assert runs['b-seed0'].status == 'interrupted'
  assert (runs['a-seed0'].status, runs['a-seed0'].reason) == ('failed', 't5xv-train: error: boom')
  assert runs['a-seed0'].seconds > 0


# --- statistics over seeds ------------------------------------------------------------------------


def trial(variant, seed, value, status='done', diverged=False):
  """A trial whose last evaluation gave ``value`` (none if None); a non-finite loss if diverged."""
  record = runs.RunRecord('unused', [train_record(4, None if diverged else 4.0)],
                          {'t': [{'step': 4, 'log_perplexity': value}]} if value is not None else {},
                          [], 4, None)
  return report.Trial(variant, seed, status, record)


def test_t_interval_against_a_hand_computed_one():
  # 1, 2, 3, 4: mean 2.5, s = sqrt(5/3) = 1.29099, s/sqrt(4) = 0.645497, t(0.975, 3) = 3.182446:
  # 2.5 ± 2.054270.
  interval = statistics.t_interval([1.0, 2.0, 3.0, 4.0])
  assert (interval.mean, interval.n) == (2.5, 4)
  assert interval.low == pytest.approx(0.445730, abs=1e-5)
  assert interval.high == pytest.approx(4.554270, abs=1e-5)
  assert statistics.format_interval(interval) == '2.500 [0.446, 4.554] (n=4)'
  assert statistics.format_interval(interval, 4, mean=False) == '[0.4457, 4.5543]'
  single = statistics.t_interval([3.0])
  assert (single.mean, single.n, single.low, single.high) == (3.0, 1, None, None)
  assert statistics.format_interval(single) == '3.000 (n=1, no interval)'
  assert statistics.format_interval(single, mean=False) == 'n=1, no interval'
  assert statistics.t_interval([]) is None and statistics.format_interval(None) == '—'


def test_t_quantile_matches_scipy():
  for dof in range(1, 400):
    assert statistics.t975(dof) == pytest.approx(stats.t.ppf(0.975, dof), abs=2e-6)
  with pytest.raises(ValueError):
    statistics.t975(0)


def test_pairing_by_seed_drops_seeds_missing_unfinished_or_diverged_in_either():
  baseline = [trial('pre_ln', 0, 3.0), trial('pre_ln', 1, 3.1), trial('pre_ln', 2, 3.2),
              trial('pre_ln', 3, 3.3), trial('pre_ln', 5, None, status='running')]
  variant = [trial('subln', 3, 3.0), trial('subln', 0, 2.9),  # out of order: paired by seed
             trial('subln', 1, 5.0, diverged=True), trial('subln', 4, 2.0),  # no seed 4 in baseline
             trial('subln', 5, 2.0)]  # the baseline's seed 5 is still running
  pairs = report.paired_differences(variant, baseline)
  assert [s for s, _ in pairs] == [0, 3]
  assert [d for _, d in pairs] == pytest.approx([-0.1, -0.3])


def test_verdicts():
  Interval = statistics.Interval
  assert statistics.verdict(Interval(-0.05, 3, -0.07, -0.03)) == 'better'
  assert statistics.verdict(Interval(0.05, 3, 0.01, 0.09)) == 'worse'
  assert statistics.verdict(Interval(-0.05, 3, -0.07, 0.01)) == 'not distinguishable at n=3 seeds'
  assert statistics.verdict(Interval(0.0, 3, 0.0, 0.1)) == 'not distinguishable at n=3 seeds'
  assert statistics.verdict(Interval(-0.1, 1)) == 'not distinguishable at n=1 seeds'
  assert statistics.verdict(None) == 'no seed finished in both'
  same = statistics.t_interval([0.02, 0.02, 0.02])  # a zero-width interval is no evidence
  assert statistics.verdict(statistics.t_interval([3.0 - 3.1, 2.9 - 3.0])).startswith('no verdict')
  assert statistics.verdict(same) == 'no verdict: the same difference at all n=3 seeds (no spread to test)'
  assert statistics.verdict(Interval(-0.1, 3, -0.2, -0.05), 'less', 'more') == 'less'


def test_a_bound_not_0_never_prints_as_0():
  """EXPERIMENTS printed [+0.000, +0.027] beside 'worse' for a lower bound of +0.0004."""
  Interval = statistics.Interval
  assert statistics.format_interval(Interval(0.0137, 3, 0.0004, 0.0270), 3, mean=False,
                                    signed=True) == '[+0.0004, +0.0270]'
  assert statistics.format_interval(Interval(-2e-5, 3, -4e-5, -1e-5), 4, mean=False,
                                    signed=True) == '[-0.00004, -0.00001]'
  assert statistics.format_interval(Interval(3.05, 3, 2.926, 3.174)) == '3.050 [2.926, 3.174] (n=3)'


def paired_group():
  values = {'pre_ln': [3.00, 3.10, 3.05], 'subln': [2.95, 3.04, 3.00],  # 0.05-0.06 lower each seed
            'post_ln': [3.10, None, 2.95],  # seed 1 diverged; +0.10 and -0.10
            'deepnorm': [3.20, 3.31, 3.24], 'rmsnorm': [2.90]}
  trials = [trial(v, seed, x if x is not None else 9.0, diverged=x is None)
            for v, xs in values.items() for seed, x in enumerate(xs)]
  return report.Group('norms', trials)


def test_paired_table_against_a_baseline():
  lines = report.paired_table(paired_group(), 'pre_ln')
  assert lines[:2] == ['| variant | paired seeds | n | mean difference (variant - pre_ln) | 95% CI | '
                       'verdict |', '|---|---|---|---|---|---|']
  # subln: -0.05, -0.06, -0.05: mean -0.0533, s 0.00577, t(0.975, 2) 4.3027: ± 0.0143
  assert lines[2:] == [
      '| subln | 0, 1, 2 | 3 | -0.0533 | [-0.0677, -0.0390] | better |',
      '| post_ln | 0, 2 | 2 | +0.0000 | [-1.2706, +1.2706] | not distinguishable at n=2 seeds; '
      'post_ln diverged at seed 1 (left out) |',
      '| deepnorm | 0, 1, 2 | 3 | +0.2000 | [+0.1752, +0.2248] | worse |',
      '| rmsnorm | 0 | 1 | -0.1000 | n=1, no interval | not distinguishable at n=1 seeds |']


def test_a_verdict_names_the_seeds_a_divergence_left_out_in_either_arm():
  """Was: a variant that diverged at one seed was 'better' on the others with no word of it."""
  values = {'base': [3.0, 3.1, 3.05, 3.2], 'v': [2.9, 3.01, 2.93, None], 'w': [2.9, 3.0, 2.96, 3.1]}
  trials = [trial(v, seed, x if x is not None else 9.0, diverged=x is None)
            for v, xs in values.items() for seed, x in enumerate(xs)]
  trials[3] = trial('base', 3, 9.0, diverged=True)  # the baseline's seed 3 too
  lines = report.paired_table(report.Group('g', trials), 'base')
  assert lines[2].endswith('| better; v diverged at seed 3, base diverged at seed 3 (left out) |')
  assert lines[3].endswith('| better; base diverged at seed 3 (left out) |')


def test_report_with_a_baseline(tmp_path):
  text = report.write_report([paired_group()], str(tmp_path), baseline='pre_ln')
  assert 'Paired differences against `pre_ln`' in text
  assert ('These are 3 intervals at 95% each, not corrected for multiple comparisons: by chance '
          'alone about one in twenty excludes 0.') in text
  assert '| subln | 0, 1, 2 | 3 | -0.0533 | [-0.0677, -0.0390] | better |' in text
  assert '| pre_ln | 3 done | 4/4 | — | — | 3.050 ± 0.050 | 3.050 [2.926, 3.174] (n=3) |' in text
  assert '| rmsnorm | 1 done | 4/4 | — | — | 2.900 | 2.900 (n=1, no interval) |' in text
  assert 'Paired differences' not in report.write_report([paired_group()], str(tmp_path))
  with pytest.raises(ValueError, match=r"'nope' is no variant \(or learning-rate curve\) here; they are: pre_ln, subln"):
    report.write_report([paired_group()], str(tmp_path), baseline='nope')


def test_report_cli_baseline_flag(tmp_path, capsys):
  from t5x_variants.cli import report as report_cli  # pylint: disable=g-import-not-at-top
  dirs = []
  for name, value in (('a-seed0', 3.0), ('a-seed1', 3.1), ('b-seed0', 2.9), ('b-seed1', 3.0)):
    write_metrics(tmp_path / name, [train_record(4, 4.0), {'step': 4, 'kind': 'eval', 'task': 't',
                                                           'log_perplexity': value}], total_steps=4)
    dirs.append(str(tmp_path / name))
  out = tmp_path / 'out'
  assert report_cli.main([f'--run_dirs={",".join(dirs)}', f'--output_dir={out}',
                          '--baseline=a']) == 0
  # b - a = -0.1 on both seeds: zero spread, an interval of width 0, which is no evidence
  assert ('| b | 0, 1 | 2 | -0.1000 | [-0.1000, -0.1000] | no verdict: the same difference at all '
          'n=2 seeds (no spread to test) |') in (out / 'report.md').read_text()
  text = (out / 'report.md').read_text()
  assert '| final log-ppl |' in text and 'Log-perplexity: teacher-forced' in text
  with pytest.raises(SystemExit) as exit_info:
    report_cli.main([f'--run_dirs={",".join(dirs)}', f'--output_dir={out}', '--baseline=c'])
  assert exit_info.value.code == 2 and "--baseline 'c' is no variant (or learning-rate curve) here" in capsys.readouterr().err


def test_a_task_without_log_perplexity_is_reported_as_its_eval_loss(tmp_path):
  """A classification or regression head's evals record a loss and no log-perplexity: the table,
  its caption and the plots name the eval loss, not log-perplexity."""
  from t5x_variants.cli import report as report_cli  # pylint: disable=g-import-not-at-top
  dirs = []
  for name, value in (('a-seed0', 0.7), ('b-seed0', 0.6), ('a-seed1', 0.8), ('b-seed1', 0.75)):
    write_metrics(tmp_path / name, [train_record(4, 4.0), {'step': 4, 'kind': 'eval', 'task': 'stsb',
                                                           'loss': value}], total_steps=4)
    dirs.append(str(tmp_path / name))
  out = tmp_path / 'out'
  assert report_cli.main([f'--run_dirs={",".join(dirs)}', f'--output_dir={out}', '--baseline=a']) == 0
  text = (out / 'report.md').read_text()
  assert '| final eval loss |' in text and '| best eval loss |' in text and 'log-ppl' not in text
  assert 'final held-out eval loss of each variant' in text and 'log-perplexity' not in text
  assert "Eval loss: the head's loss" in text and 'Log-perplexity:' not in text
  assert '![final eval loss]' in text


def test_bootstrap_interval_of_spearman_over_seeds():
  paper = [1.997, 1.942, 1.944, 1.960]  # relu, geglu, swiglu, bilinear
  values = [[5.0, 5.1], [4.8, 4.85], [4.7, 4.9], [4.9, 4.95]]
  low, high, undefined = statistics.bootstrap_spearman(values, paper, resamples=1000, seed=0)
  assert (low, high, undefined) == statistics.bootstrap_spearman(values, paper, resamples=1000, seed=0)
  rho = statistics.spearman([np.mean(v) for v in values], paper)
  assert -1 <= low <= rho <= high <= 1 and low < high
  assert statistics.bootstrap_spearman([[5.0], [4.8], [4.7]], paper[:3]) is None  # n=1: nothing to resample
  # all seeds equal: every resample gives the same means, so the interval is the point
  assert statistics.bootstrap_spearman([[5.0, 5.0], [4.8, 4.8], [4.7, 4.7]], paper[:3]) == (
      pytest.approx(0.5), pytest.approx(0.5), 0)


def test_ranking_lines_carry_the_bootstrap_interval_and_its_n():
  values = {'relu': [5.0, 5.1], 'geglu': [4.8, 4.85], 'swiglu': [4.7, 4.9], 'bilinear': [4.9, 4.95]}
  trials = [trial(v, s, x) for v, xs in values.items() for s, x in enumerate(xs)]
  text = report.ranking_lines(report.Group('glu', trials, papers.GLU))[0]
  assert text.startswith('Ranking against the paper\'s "65,536 steps" column, by our means over '
                         'the 2 seeds finished in every variant: Spearman rho = ')
  assert 'Bootstrap 95% interval of rho over seeds: [' in text
  assert '(n = 2 seeds finished in every variant, resampled with replacement 1000 times' in text
  assert '2 seeds have only 3 distinct resamples: the interval is coarse' in text  # {0,0} {0,1} {1,1}
  one_seed = [t for t in trials if t.variant != 'bilinear' or t.seed == 0]  # bilinear: seed 0 only
  assert 'No bootstrap interval for rho (n = 1 seeds finished in every variant' in (
      report.ranking_lines(report.Group('glu', one_seed, papers.GLU))[0])


def test_the_bootstrap_draws_the_same_seeds_for_every_variant():
  """Seed 1 is worse than seed 0 by the same 0.5 for every variant (a hard data order): drawn
  jointly, the ordering never changes and rho's interval is a point; drawn per variant it would
  not be."""
  paper = [1.0, 2.0, 3.0]
  values = [[4.0, 4.5], [4.1, 4.6], [4.2, 4.7]]
  assert statistics.bootstrap_spearman(values, paper) == (pytest.approx(1.0), pytest.approx(1.0), 0)


# --- --grid: an axis of one gin binding's values ----------------------------------------------


def test_grid_axis_names_and_binds_each_run(tmp_path):
  base, pre, sub = gin_files(tmp_path, 'base.gin', 'pre_ln.gin', 'subln.gin')
  assert grid.parse_grid('learning_rate_schedule.base=1e-4, 3e-4') == [
      ('base=1e-4', 'learning_rate_schedule.base = 1e-4'),
      ('base=3e-4', 'learning_rate_schedule.base = 3e-4')]
  assert grid.parse_grid("decoder/TransformerConfig.ffn='swiglu',@relu/x") == [
      ('ffn=swiglu', "decoder/TransformerConfig.ffn = 'swiglu'"),
      ('ffn=relu_x', 'decoder/TransformerConfig.ffn = @relu/x')]
  sweep = grid.Sweep.build(str(tmp_path / 's'), [base], [f'{pre},{sub}'], seeds=2,
                           grid=['learning_rate_schedule.base=1e-4,3e-4',
                                 'TransformerConfig.num_decoder_layers=6,12'])
  assert [r.name for r in sweep.runs[:5]] == [
      'pre_ln+base=1e-4+num_decoder_layers=6-seed0', 'pre_ln+base=1e-4+num_decoder_layers=12-seed0',
      'pre_ln+base=3e-4+num_decoder_layers=6-seed0', 'pre_ln+base=3e-4+num_decoder_layers=12-seed0',
      'subln+base=1e-4+num_decoder_layers=6-seed0']
  assert len(sweep.runs) == 16 and sweep.runs[8].name.endswith('-seed1')
  run = sweep.runs[2]
  assert run.variant == 'pre_ln+base=3e-4+num_decoder_layers=6' and run.variant_files == [pre]
  assert sweep.command(run)[3:] == [
      "--gin.train.on_nonfinite='stop'", f"--gin.MODEL_DIR='{tmp_path}/s/{run.name}'",
      '--gin.train.seed=0', '--gin.train/DatasetConfig.seed=0',
      '--gin.learning_rate_schedule.base=3e-4', '--gin.TransformerConfig.num_decoder_layers=6']
  only_grid = grid.Sweep.build(str(tmp_path / 't'), [base], [], 1, grid=['NUM_HEADS=4'])
  assert [r.name for r in only_grid.runs] == ['NUM_HEADS=4-seed0']
  assert plots.depth_axis('pre_ln+base=3e-4+num_decoder_layers=12') == ('pre_ln+base=3e-4', 12)


def test_a_grid_value_written_another_way_than_its_recorded_run_is_refused(tmp_path):
  """A sweep rerun with 0.001 where its runs were made with 1e-3 trained that configuration again
  under a new name, and the report counted the rate twice."""
  base, pre = gin_files(tmp_path, 'base.gin', 'pre_ln.gin')
  build = lambda values: grid.Sweep.build(str(tmp_path / 's'), [base], [pre], 1,
                                          grid=[f'learning_rate_schedule.base={values}'])
  build('1e-3').save()
  with pytest.raises(grid.SweepError, match=r"recorded pre_ln\+base=0.001-seed0's configuration as "
                     r'pre_ln\+base=1e-3-seed0 \(a grid value written another way\)'):
    build('0.001,0.01').merge_previous()
  build('1e-3,0.01').merge_previous()
  # A sweep.json that holds both spellings (made before this was refused) takes either.
  both = grid.Sweep.load(str(tmp_path / 's'))
  both.runs.append(dataclasses.replace(build('0.001').runs[0], status='done'))
  both.save()
  build('0.001').merge_previous()
  build('1e-3').merge_previous()
  # Bindings are compared by what they bind: their order changed when --gin. flags stopped going
  # after every --gin_bindings (a sweep made before was refused as of other bindings).
  other = lambda bindings: grid.Sweep.build(str(tmp_path / 'o'), [base], [pre], 1, bindings=bindings)
  other(['a.x = 1', 'b.y = 2']).save()
  other(['b.y = 2', 'a.x = 1']).merge_previous()
  with pytest.raises(grid.SweepError, match='other base gin files or bindings'):
    other(['b.y = 2', 'a.x = 3']).merge_previous()


def test_a_grid_value_that_is_no_hashable_literal_is_taken_as_written():
  """(was: a TypeError from comparing it)"""
  assert [label for label, _ in grid.parse_grid('a.x={[1]:2},3')] == ['x=1_2', 'x=3']


@pytest.mark.parametrize('flags,match', [
    (['lr'], 'expected --grid=BINDING=VALUE1'),
    (['lr='], 'expected --grid=BINDING=VALUE1'),
    (['=1,2'], 'expected --grid=BINDING=VALUE1'),
    (['a.lr=1,1'], '1 and 1 are one value'),
    (['a.lr=1e-3,0.001'], '1e-3 and 0.001 are one value'),  # two runs of one configuration
    (['a.warmup=1000,1e3'], '1000 and 1e3 are one value'),  # (was: int and float, two runs)
    (['a.lr=1,1.0'], '1 and 1.0 are one value'),
    (["a.name='x',x"], 'must name distinct runs'),  # the same run name
    (['train.seed=1,2'], 'sets it for every run'),
    (['a.lr=1,2', 'a.lr=3'], 'its own binding'),
    (['a.lr=1,2', 'b.lr=3'], 'its own'),  # both would be named lr=...
    (['train.log_period=1,2'], 'not also given as --gin'),
    (['a.lr=1e-4 3e-4'], "'1e-4 3e-4' looks like several values; a --grid's values are separated "
                         'by commas: --grid=a.lr=1e-4,3e-4'),  # gin's advice was to quote it
    (['a.lr=3,1 2'], "'1 2' looks like several values"),
])
def test_bad_grid_axes_are_refused(tmp_path, flags, match):
  base, = gin_files(tmp_path, 'base.gin')
  with pytest.raises(grid.SweepError, match=match):
    grid.Sweep.build(str(tmp_path / 's'), [base], [], 1, bindings=['train.log_period = 5'],
                     grid=flags)


def test_print_commands_with_a_grid_and_resuming(tmp_path, capsys):
  from t5x_variants.cli import sweep as sweep_cli  # pylint: disable=g-import-not-at-top
  base, a = gin_files(tmp_path, 'base.gin', 'pre_ln.gin')
  flags = [f'--sweep_dir={tmp_path}/s', f'--gin_file={base}', f'--variants={a}',
           '--grid=learning_rate_schedule.base=1e-4,3e-4', '--seeds=2', '--print_commands']
  assert sweep_cli.main(flags) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 4
  assert lines[1] == (f't5xv-train --gin_file={base} --gin_file={a} '
                      "--gin.train.on_nonfinite=\"'stop'\" "
                      f"--gin.MODEL_DIR=\"'{tmp_path}/s/pre_ln+base=3e-4-seed0'\" "
                      '--gin.train.seed=0 --gin.train/DatasetConfig.seed=0 '
                      '--gin.learning_rate_schedule.base=3e-4')
  saved = grid.Sweep.load(str(tmp_path / 's'))
  assert saved.grid == ['learning_rate_schedule.base=1e-4,3e-4']
  assert saved.runs[1].bindings == ['learning_rate_schedule.base = 3e-4']
  # pre_ln+base=1e-4-seed0 trained by a scheduler (its directory reached the last step), and
  # pre_ln+base=3e-4-seed0 recorded done: both skipped when called again with the same flags
  write_metrics(tmp_path / 's' / 'pre_ln+base=1e-4-seed0', [train_record(4, 4.0)], total_steps=4)
  saved.runs[1].status = 'done'
  write_metrics(saved.model_dir(saved.runs[1]), [train_record(4, 4.0)], total_steps=4)
  saved.save()
  assert sweep_cli.main(flags) == 0
  assert [l.split('MODEL_DIR=')[1].split()[0] for l in capsys.readouterr().out.splitlines()] == [
      f"\"'{tmp_path}/s/{n}'\"" for n in ('pre_ln+base=1e-4-seed1', 'pre_ln+base=3e-4-seed1')]
  # t5xv-report shows the grid values in the variant names
  for name, value in (('pre_ln+base=1e-4-seed0', 3.2), ('pre_ln+base=3e-4-seed0', 3.0)):
    write_metrics(tmp_path / 's' / name, [train_record(4, 4.0), {
        'step': 4, 'kind': 'eval', 'task': 't', 'log_perplexity': value}], total_steps=4)
  group = report.sweep_group(str(tmp_path / 's'))
  assert group.variants() == ['pre_ln+base=1e-4', 'pre_ln+base=3e-4']
  text = '\n'.join(report.table(group))
  assert '| pre_ln+base=3e-4 | 1 done, 1 pending | 4/4 | — | — | 3.000 | 3.000 (n=1, no interval) |' in text


def test_a_sweep_json_written_before_grid_axes_still_loads(tmp_path):
  base, a = gin_files(tmp_path, 'base.gin', 'a.gin')
  sweep = grid.Sweep.build(str(tmp_path / 's'), [base], [a], 1)
  sweep.save()
  path = tmp_path / 's' / 'sweep.json'
  saved = json.loads(path.read_text())
  del saved['grid']
  for r in saved['runs']:
    del r['bindings']
  path.write_text(json.dumps(saved))
  old = grid.Sweep.load(str(tmp_path / 's'))
  assert old.grid == [] and old.runs[0].bindings == []
  assert old.command(old.runs[0]) == sweep.command(sweep.runs[0])
  again = grid.Sweep.build(str(tmp_path / 's'), [base], [a], 1)
  again.merge_previous()
  assert [r.name for r in again.runs] == ['a-seed0'] and not again.kept


# --- plots: palette, legends, t-interval bands, the paper's marks -------------------------------


def plot_trial(variant, seed, offset, steps=(100, 200, 300, 400)):
  """A finished trial whose training loss and held-out log-perplexity fall over ``steps``,
  ``offset`` above a common curve."""
  train = [train_record(s, 5.0 - s / 200 + offset) for s in steps]
  evals = [{'step': s, 'log_perplexity': 4.5 - s / 200 + offset} for s in steps]
  return report.Trial(variant, seed, 'done', runs.RunRecord('unused', train, {'t': evals}, [],
                                                            steps[-1], None))


def plot_group(variants, seeds, paper=None, name='g'):
  return report.Group(name, [plot_trial(v, s, 0.05 * i + 0.02 * s) for s in range(seeds)
                             for i, v in enumerate(variants)], paper)


def drawn(fig):
  fig.draw_without_rendering()  # lays the figure out (constrained layout) as saving it would
  return fig


@pytest.mark.parametrize('seeds', [1, 3])
@pytest.mark.parametrize('variants', [['relu', 'geglu', 'swiglu'], [f'v{i}' for i in range(11)]])
def test_plots_write_small_pngs_for_1_and_3_seeds_and_many_variants(tmp_path, seeds, variants):
  group = plot_group(variants, seeds, papers.GLU)
  written = plots.group_plots(group, str(tmp_path), report.final_values, report.diverged_step)
  assert [t for t, _ in written] == ['loss curves', 'final log-perplexity']
  for _, path in written:
    assert_png(path)
    assert os.path.getsize(path) < 300_000
  # the same plots for a depth sweep and diagnostics
  trials = []
  for i, v in enumerate(['post_ln+depth_6', 'post_ln+depth_12', 'sub_ln+depth_6', 'sub_ln+depth_12']):
    for s in range(seeds):
      t = plot_trial(v, s, 0.1 * i + 0.02 * s)
      t.record.diagnostics = [{'step': 400, 'update_norm': 1.0 + i,
                               **{f'grad_norm/{k}/{j}': 1.0 + i + j for k in ('encoder', 'decoder')
                                  for j in range(6)},
                               **{f'activation_norm/encoder/{j}': 2.0 + j for j in range(6)}}]
      trials.append(t)
  depth = report.Group('d', trials)
  written = plots.group_plots(depth, str(tmp_path), report.final_values, report.diverged_step)
  assert [t for t, _ in written] == ['loss curves', 'final log-perplexity',
                                     'log-perplexity by depth', 'per-layer diagnostics']
  for _, path in written:
    assert_png(path)
    assert os.path.getsize(path) < 300_000


def test_plot_variants_differ_in_colour_and_marker_and_legends_stay_outside():
  variants = [f'v{i}' for i in range(11)]  # more than the palette's 8 colours
  group = plot_group(variants, 3)
  styles = [plots.style(i) for i in range(len(variants))]
  assert len(set(styles)) == len(variants)
  assert {c for c, _ in styles} == set(plots.OKABE_ITO)
  fig = drawn(plots.curves_figure(group))
  for ax in fig.axes:
    lines = [l for l in ax.get_lines() if l.get_label() in {f'{v} (n=3)' for v in variants}]
    assert [l.get_label() for l in lines] == [f'{v} (n=3)' for v in variants]
    assert [(l.get_color(), l.get_marker()) for l in lines] == styles
    assert ax.get_legend() is None
  fig_final = drawn(plots.final_figure(group, report.final_values))
  (ax,) = fig_final.axes
  points = [c.lines[0] for c in ax.containers]  # one error bar per variant
  assert [(l.get_color(), l.get_marker()) for l in points] == styles
  assert [t.get_text() for t in ax.get_xticklabels()] == [f'{v} (n=3)' for v in variants]
  for f in (fig, fig_final):
    (legend,) = f.legends
    for ax in f.axes:
      assert not legend.get_window_extent().overlaps(ax.get_window_extent())


def test_plot_band_and_error_bar_are_the_report_t_interval():
  # 3 seeds at step 10: 4.0, 4.2, 4.4: mean 4.2, s = 0.2, t(0.975, 2) = 4.302653:
  # half-width 4.302653 * 0.2 / sqrt(3) = 0.496828. At step 20 one seed has not got there.
  seeds = [[(10, 4.0), (20, 3.0)], [(10, 4.2), (20, 3.2)], [(10, 4.4)]]
  steps, mean, low, high, n = plots.seed_band(seeds)
  interval = statistics.t_interval([4.0, 4.2, 4.4])
  assert list(steps) == [10, 20] and list(n) == [3, 2]
  assert mean[0] == pytest.approx(4.2) and (high[0] - mean[0]) == pytest.approx(0.496828, abs=1e-6)
  assert (low[0], high[0]) == (pytest.approx(interval.low), pytest.approx(interval.high))
  two = statistics.t_interval([3.0, 3.2])  # t(0.975, 1) = 12.706
  assert (low[1], high[1]) == (pytest.approx(two.low), pytest.approx(two.high))
  # the band drawn is that interval
  trials = [report.Trial('a', s, 'done', runs.RunRecord(
      'unused', [train_record(st, v) for st, v in c], {'t': [
          {'step': st, 'log_perplexity': v} for st, v in c]}, [], 20, None))
            for s, c in enumerate(seeds)]
  fig = plots.curves_figure(report.Group('g', trials))
  for ax in fig.axes:
    (band,) = ax.collections
    vertices = band.get_paths()[0].vertices
    at_10 = vertices[vertices[:, 0] == 10][:, 1]
    assert (at_10.min(), at_10.max()) == (pytest.approx(interval.low), pytest.approx(interval.high))
  # the final chart's error bar: the same interval over the evaluations of the last step (3.0,
  # 3.2; the third seed's eval of step 10 is not its final value)
  fig = plots.final_figure(report.Group('g', trials), report.final_values)
  last = statistics.t_interval([3.0, 3.2])
  ((_, y_low), (_, y_high)), = fig.axes[0].containers[0].lines[2][0].get_segments()
  assert (y_low, y_high) == (pytest.approx(last.low), pytest.approx(last.high))
  # 1 seed: the line alone, the point alone
  fig = plots.curves_figure(report.Group('g', trials[:1]))
  assert all(not ax.collections for ax in fig.axes)
  fig = plots.final_figure(report.Group('g', trials[:1]), report.final_values)
  assert not fig.axes[0].containers[0].has_yerr


def test_final_plot_marks_the_papers_numbers_on_a_same_scale_axis():
  group = plot_group(['relu', 'mine', 'geglu', 'swiglu'], 3, papers.GLU)  # 'mine': not in the paper
  fig = drawn(plots.final_figure(group, report.final_values))
  ours, theirs = fig.axes
  (marks,) = theirs.get_lines()
  assert list(marks.get_xdata()) == [0 + plots.PAPER_OFFSET, 2 + plots.PAPER_OFFSET,
                                     3 + plots.PAPER_OFFSET]
  assert list(marks.get_ydata()) == [1.997, 1.942, 1.944]  # Table 1, 65,536 steps
  assert marks.get_marker() == 'D' and 'D' not in plots.MARKERS
  labels = [t.get_text() for t in fig.legends[0].get_texts()]
  assert any(l.startswith('paper (Shazeer 2020, arXiv:2002.05202, Table 1, 65,536 steps)')
             for l in labels)
  assert np.diff(ours.get_ylim()) == pytest.approx(np.diff(theirs.get_ylim()))  # nats alike
  for ax in fig.axes:
    assert not fig.legends[0].get_window_extent().overlaps(ax.get_window_extent())
  no_paper = drawn(plots.final_figure(plot_group(['relu', 'geglu'], 3), report.final_values))
  assert len(no_paper.axes) == 1 and len(no_paper.legends[0].get_texts()) == 1


def rate_run(run_dir, initial, final=None, diverged_at=None, steps=10):
  """A run of a learning-rate sweep: the eval of its initial parameters at step 0, then either a
  final eval at ``steps`` or a non-finite training loss at ``diverged_at``."""
  evals = [{'step': 0, 'kind': 'eval', 'task': 'lm', 'log_perplexity': initial}]
  if diverged_at:
    write_metrics(run_dir, evals + [train_record(diverged_at, float('nan'))], total_steps=steps)
  else:
    write_metrics(run_dir, evals + [train_record(steps, final),
                                    {'step': steps, 'kind': 'eval', 'task': 'lm',
                                     'log_perplexity': final}], total_steps=steps)


def test_lr_sensitivity_is_wortsman_et_al_s_formula(tmp_path):
  """Two curves over three rates: S = mean over rates of min(final, l_0) - best final, a diverged
  run counting as l_0 (8.0), a final above l_0 clipped to it; a finite run that fell by less than
  a tenth of the largest fall is stalled."""
  from t5x_variants.sweeps import stability
  runs = {'post+base=1e-3': dict(final=6.0), 'post+base=1e-2': dict(final=5.0),
          'post+base=1e-1': dict(diverged_at=4),
          'pre+base=1e-3': dict(final=7.9), 'pre+base=1e-2': dict(final=5.5),
          'pre+base=1e-1': dict(final=8.5)}
  for name, outcome in runs.items():
    rate_run(tmp_path / f'{name}-seed0', 8.0, **outcome)
  group = report.run_dirs_group(sorted(str(p) for p in tmp_path.iterdir()), name='lr')
  assert stability.is_rate_sweep(group)
  curves = {c.label: c for c in stability.curves(group, report.final_value, report.diverged_step)}
  post, pre = curves['post'], curves['pre']
  assert [p.rate for p in post.points] == [1e-3, 1e-2, 1e-1]
  assert post.sensitivity() == pytest.approx((6.0 + 5.0 + 8.0) / 3 - 5.0)
  assert pre.sensitivity() == pytest.approx((7.9 + 5.5 + 8.0) / 3 - 5.5)
  assert [p.stalled for p in pre.points] == [1, 0, 1]  # 0.1 and -0.5 of a 3.0 fall
  assert [p.stalled for p in post.points] == [0, 0, 0]
  # Stalled is a run's state (as documented), not the mean of a rate's runs (a second seed at
  # 1e-2 that fell 0.1 stalls beside one that fell 2.5); a run still going counts as missing,
  # not diverged, whatever its loss has done so far.
  rate_run(tmp_path / 'pre+base=1e-2-seed1', 8.0, final=7.9)
  rate_run(tmp_path / 'pre+base=1e-3-seed1', 8.0, diverged_at=4)
  more = report.run_dirs_group(sorted(str(p) for p in tmp_path.iterdir()), name='lr')
  for t in more.trials:
    if t.variant == 'pre+base=1e-3' and t.seed == 1:
      t.status = 'running'
  pre = {c.label: c for c in stability.curves(more, report.final_value, report.diverged_step)}['pre']
  assert [(p.stalled, p.all_stalled(), p.diverged, p.missing) for p in pre.points] == [
      (1, True, 0, 1), (1, False, 0, 0), (1, True, 0, 0)]
  assert '| pre | 8.000 | 7.900 stalled | 6.700 (1 stalled) | 8.500 stalled |' in (
      '\n'.join(stability.table([pre])))
  for name in ('pre+base=1e-2-seed1', 'pre+base=1e-3-seed1'):
    shutil.rmtree(tmp_path / name)
  os.makedirs(tmp_path / 'out')
  text = '\n'.join(report.group_markdown(group, str(tmp_path / 'out')))
  assert '| post | 8.000 | 6.000 | 5.000 | diverged | 0.01 | 5.000 | 1.333 |' in text
  assert '| pre | 8.000 | 7.900 stalled | 5.500 | 8.500 stalled | 0.01 | 5.500 | 1.633 |' in text
  assert (tmp_path / 'out' / 'lr_lr.png').stat().st_size < 150_000
  other = report.run_dirs_group([str(tmp_path / 'post+base=1e-3-seed0')], name='one')
  assert not stability.is_rate_sweep(other)  # one rate: no curve


def test_lr_sensitivity_waits_for_every_rate_and_for_the_initial_loss(tmp_path):
  from t5x_variants.sweeps import stability
  rate_run(tmp_path / 'a+base=1e-3-seed0', 8.0, final=6.0)
  os.makedirs(tmp_path / 'a+base=1e-2-seed0')  # not started
  write_metrics(tmp_path / 'b+base=1e-3-seed0', [train_record(10, 6.0)], total_steps=10)
  write_metrics(tmp_path / 'b+base=1e-2-seed0', [train_record(10, 6.0)], total_steps=10)
  group = report.run_dirs_group(sorted(str(p) for p in tmp_path.iterdir()), name='lr')
  curves = {c.label: c for c in stability.curves(group, report.final_value, report.diverged_step)}
  assert curves['a'].sensitivity() is None and curves['b'].sensitivity() is None
  assert stability.table(list(curves.values()))[2] == '| a | 8.000 | 6.000 | not finished | 0.001 | 6.000 | — |'
  assert 'no step-0 eval' in '\n'.join(stability.markdown(list(curves.values())))


def test_lr_sensitivity_over_seeds_counts_a_diverged_seed_as_its_initial_loss(tmp_path):
  """Two seeds per rate, each with its own l_0: at 1e-2 one seed diverges, so l(1e-2) = (5.0 +
  9.0) / 2 = 7.0 is worse than l(1e-3) = 6.0, which is the best rate although 1e-2's surviving
  seed is lower; min(l, l_0) is taken per run."""
  from t5x_variants.sweeps import stability
  rate_run(tmp_path / 'c+base=1e-3-seed0', 8.0, final=6.5)
  rate_run(tmp_path / 'c+base=1e-3-seed1', 9.0, final=5.5)
  rate_run(tmp_path / 'c+base=1e-2-seed0', 8.0, final=5.0)
  rate_run(tmp_path / 'c+base=1e-2-seed1', 9.0, diverged_at=3)
  group = report.run_dirs_group(sorted(str(p) for p in tmp_path.iterdir()), name='lr')
  curve, = stability.curves(group, report.final_value, report.diverged_step)
  assert [p.loss() for p in curve.points] == [6.0, 7.0]
  assert curve.best().rate == 1e-3 and curve.initial == 8.5
  assert curve.sensitivity() == pytest.approx((6.0 + 7.0) / 2 - 6.0)
  assert stability.table([curve])[2] == '| c | 8.500 | 6.000 | 5.000 (1 diverged) | 0.001 | 6.000 | 0.500 |'


# A stand-in trainer that waits (at most 20 s) until another run of the sweep is training beside
# it, and records whether one was, and whether JAX was told not to preallocate device memory.
OVERLAP_TRAINER = '''
import json, os, sys, time
args = sys.argv[1:]
model_dir = next(a for a in args if a.startswith('--gin.MODEL_DIR=')).split('=', 1)[1].strip("'")
sweep_dir = os.path.dirname(model_dir)
open(os.path.join(model_dir, 'started'), 'w').close()
deadline = time.time() + 20
while time.time() < deadline:
  started = [d for d in os.listdir(sweep_dir) if os.path.exists(os.path.join(sweep_dir, d, 'started'))]
  if len(started) > 1:
    break
  time.sleep(0.05)
with open(os.path.join(model_dir, 'beside.txt'), 'w') as f:
  f.write(f"{len(started)} {os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')}")
with open(os.path.join(model_dir, 'metrics.jsonl'), 'w') as f:
  f.write(json.dumps({'step': 4, 'kind': 'train', 'loss': 4.0, 'skipped': 0.0}) + '\\n')
  f.write(json.dumps({'step': 4, 'kind': 'eval', 'task': 't', 'log_perplexity': 4.0}) + '\\n')
with open(os.path.join(model_dir, 'config.gin'), 'w') as f:
  f.write('TRAIN_STEPS = 4\\ntrain.total_steps = %TRAIN_STEPS\\n')
if any(a.endswith('bad.gin') for a in args):
  print('t5xv-train: error: non-finite from step 7: the loss or gradients are not finite (loss nan); ...')
  sys.exit(2)
'''


def test_a_parallel_sweep_trains_runs_side_by_side_and_records_each(tmp_path):
  trainer = tmp_path / 'overlap_trainer.py'
  trainer.write_text(OVERLAP_TRAINER)
  base, a, b, bad = gin_files(tmp_path, 'base.gin', 'a.gin', 'b.gin', 'bad.gin')
  sweep = grid.Sweep.build(str(tmp_path / 'sweep'), [base], [f'{a},{b},{bad}'], 2)
  lines = []
  counts = runner.run_sweep(sweep, [sys.executable, str(trainer)], say=lines.append, parallel=2)
  assert counts == {'done': 4, 'diverged': 2}
  for run in sweep.runs:
    beside, preallocate = (tmp_path / 'sweep' / run.name / 'beside.txt').read_text().split()
    assert int(beside) > 1 and preallocate == 'false'
  saved = {r['name']: r for r in json.loads((tmp_path / 'sweep' / 'sweep.json').read_text())['runs']}
  assert saved['bad-seed1']['status'] == 'diverged' and saved['bad-seed1']['diverged_step'] == 7
  assert lines[0].startswith('[1/6] a seed 0: training') and lines[1].startswith('[2/6] b seed 0')
  assert sum(': done in ' in l for l in lines) == 4


def test_a_run_killed_by_sigterm_while_it_starts_is_interrupted_not_failed(tmp_path):
  log = tmp_path / 'train.log'
  log.write_text('')
  run = grid.Run('a-seed0', 'a', [], 0)
  for status in (-15, 130):  # SIGTERM, Ctrl-C (one line and status 130)
    runner._outcome(run, status, False, str(log), 0)
    assert run.status == 'interrupted' and run.reason is None
  runner._outcome(run, -9, False, str(log), 0)
  assert run.status == 'failed' and 'exit status -9' in run.reason


def test_a_run_interrupted_as_it_diverged_keeps_no_divergence_step(tmp_path):
  """A signal while the trainer stops at a non-finite step records the run interrupted; it kept
  the divergence's step, so once resumed and finished the report left it out as diverged."""
  base, relu = gin_files(tmp_path, 'base.gin', 'relu.gin')
  sweep = grid.Sweep.build(str(tmp_path / 's'), [base], [relu], 1)
  run, log = sweep.runs[0], tmp_path / 'train.log'
  log.write_text('t5xv-train: error: non-finite from step 7: the loss or gradients are not finite\n')
  runner._end(sweep, runner._Attempt(run, None, str(log), 0, time.time(), 0.0), 1, interrupted=True)
  assert (run.status, run.diverged_step) == ('interrupted', None)
  run.diverged_step = 7  # (as recorded before): a finished attempt clears it
  runner._outcome(run, 0, True, str(log), len(log.read_text()))
  assert (run.status, run.diverged_step) == ('done', None)


def test_a_run_whose_data_ran_out_before_its_last_step_failed_with_that_line(tmp_path):
  """The trainer exits 0 with a warning when a finite dataset ends: the sweep recorded it
  interrupted, with no reason, at every rerun."""
  log = tmp_path / 'train.log'
  earlier = '2026-12-06 10:00:00 WARNING t5x_variants.train.trainer: the training data ran out after step 2\n'
  log.write_text(earlier)
  run = grid.Run('a-seed0', 'a', [], 0)
  runner._outcome(run, 0, False, str(log), len(earlier))  # an earlier attempt's line: not this one
  assert run.status == 'interrupted' and run.reason is None
  with log.open('a') as f:
    f.write(earlier.replace('step 2', 'step 6'))
  runner._outcome(run, 0, False, str(log), len(earlier))
  assert run.status == 'failed' and run.reason.startswith(
      'the training data ran out after step 6, before its last step: the dataset is finite'), run.reason
  runner._outcome(run, 0, True, str(log), 0)  # (its last step reached: done)
  assert run.status == 'done' and run.reason is None


def test_a_run_stopped_by_any_non_finite_rule_is_recorded_diverged_at_its_first_step(tmp_path):
  """Under train.on_nonfinite='skip' a run stops after max_skipped_in_a_row skipped steps, or at
  its end if none applied: the sweep recorded those 'failed' (its pattern knew only 'stop''s
  message), retried them at every rerun, and the report's diverged column said no."""
  from t5x_variants.train.nonfinite import NonFiniteGuard, NonFiniteStop  # pylint: disable=g-import-not-at-top
  def stop(guard, steps):
    with pytest.raises(NonFiniteStop) as stopped:
      for step, skipped in steps:
        guard.check(step, {'skipped': skipped, 'loss': math.nan if skipped else 1.0})
      guard.check_run(0, steps[-1][0])
    return stopped.value
  stops = {'stop': stop(NonFiniteGuard('stop', 3), [(1, 0), (2, 1)]),
           'in a row': stop(NonFiniteGuard('skip', 3), [(1, 0), (2, 1), (3, 0), (4, 1), (5, 1), (6, 1)]),
           'none applied': stop(NonFiniteGuard('skip', 9), [(1, 1), (2, 1), (3, 1)])}
  log = tmp_path / 'train.log'
  for (rule, stopped), first in zip(stops.items(), (2, 4, 1)):
    log.write_text(f't5xv-train: error: {stopped.message()}; the update was not applied ...\n')
    run = grid.Run('a-seed0', 'a', [], 0)
    runner._outcome(run, 1, False, str(log), 0)
    assert (run.status, run.diverged_step) == ('diverged', first), rule
  log.write_text('t5xv-train: error: a step 7 that is not finite, in another error\n')
  runner._outcome(run, 1, False, str(log), 0)
  assert (run.status, run.diverged_step) == ('failed', None)


def test_lr_sensitivity_per_seed_and_paired_against_a_baseline_curve(tmp_path):
  """Per seed, S_s = mean over rates of min(l, l_0) - min over rates of l from that seed's runs
  alone; curves are compared by the paired differences S_s(curve) - S_s(baseline)."""
  from t5x_variants.sweeps import stability
  finals = {'a': {0: (6.0, 5.0), 1: (6.2, 5.0), 2: (6.1, 5.3)},  # (at 1e-3, at 1e-2) per seed
            'b': {0: (5.5, 5.0), 1: (5.4, 5.2), 2: (9.5, 5.0)}}  # 9.5 > l_0: clipped to 8
  for curve, seeds in finals.items():
    for seed, losses in seeds.items():
      for rate, final in zip(('1e-3', '1e-2'), losses):
        rate_run(tmp_path / f'{curve}+base={rate}-seed{seed}', 8.0, final=final)
  group = report.run_dirs_group(sorted(str(p) for p in tmp_path.iterdir()), name='lr')
  curves = {c.label: c for c in stability.curves(group, report.final_value, report.diverged_step)}
  by_hand = {c: {s: (min(x, 8.0) + min(y, 8.0)) / 2 - min(x, y) for s, (x, y) in seeds.items()}
             for c, seeds in finals.items()}
  assert curves['a'].seed_sensitivities() == pytest.approx(by_hand['a'])
  assert curves['b'].seed_sensitivities() == pytest.approx(by_hand['b'])
  diffs = [by_hand['b'][s] - by_hand['a'][s] for s in range(3)]
  interval = statistics.t_interval(diffs)
  assert report.sensitivity_table(list(curves.values()), 'a')[2] == (
      f'| b | 0, 1, 2 | 3 | {np.mean(diffs):+.4f} | [{interval.low:+.4f}, {interval.high:+.4f}] | '
      f'{statistics.verdict(interval, "less sensitive", "more sensitive")} |')
  text = report.write_report([group], str(tmp_path / 'out'), baseline='a')
  assert 'mean difference of LR sensitivity (curve - a)' in text
  with pytest.raises(ValueError, match=r"no variant \(or learning-rate curve\) here.*: a\+base=1e-2"):
    report.write_report([group], str(tmp_path / 'out'), baseline='c')


def test_batches_dir_reaches_every_run_command_and_write_batches_needs_it(tmp_path, capsys):
  from t5x_variants.cli import sweep as sweep_cli  # pylint: disable=g-import-not-at-top
  base, a = gin_files(tmp_path, 'base.gin', 'a.gin')
  flags = [f'--sweep_dir={tmp_path}/s', f'--gin_file={base}', f'--variants={a}', '--seeds=2']
  assert sweep_cli.main(flags + [f'--batches_dir={tmp_path}/b', '--print_commands']) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 2 and all(l.endswith(f'--batches_dir={tmp_path}/b') for l in lines)
  assert grid.Sweep.load(str(tmp_path / 's')).batches_dir == f'{tmp_path}/b'
  with pytest.raises(SystemExit) as exit_info:
    sweep_cli.main(flags + ['--write_batches'])
  assert exit_info.value.code == 2 and '--write_batches needs --batches_dir' in capsys.readouterr().err
  with pytest.raises(SystemExit):
    sweep_cli.main(flags + ['--parallel=0'])
  assert '--parallel must be at least 1' in capsys.readouterr().err


@needs_data_layer
@pytest.mark.slow
def test_a_sweep_writes_its_batches_once_per_data_and_trains_from_them(tmp_path):
  """2 variants x 2 seeds: --write_batches writes one directory per seed (the variants share
  it) in one process, then the sweep trains all four runs from them, two at a time."""
  bin_dir = os.path.dirname(sys.executable)
  flags = [f'--sweep_dir={tmp_path / "s"}', '--gin_file=gin/experiments/stability/lm_small.gin',
           '--variants=gin/variants/norm/pre_ln.gin,gin/variants/norm/subln.gin', '--seeds=2',
           '--gin.TRAIN_STEPS=3', '--gin.train.eval_batches=1', '--gin.train.log_period=3',
           '--gin.TransformerConfig.num_decoder_layers=1', f'--batches_dir={tmp_path / "b"}']
  sweep = lambda *more: subprocess.run([os.path.join(bin_dir, 't5xv-sweep'), *flags, *more],
                                       cwd=REPO, capture_output=True, text=True)
  out = sweep('--write_batches')
  assert out.returncode == 0, out.stderr
  assert len(os.listdir(tmp_path / 'b')) == 2 and not (tmp_path / 's' / 'sweep.json').exists()
  out = sweep('--parallel=2')
  assert out.returncode == 0, out.stderr
  saved = json.loads((tmp_path / 's' / 'sweep.json').read_text())
  assert [r['status'] for r in saved['runs']] == ['done'] * 4
  assert all(f'--batches_dir={tmp_path / "b"}' in r['command'] for r in saved['runs'])


def test_what_a_sweep_and_its_report_must_not_mix(tmp_path, capsys):
  """From helper-76's audit: a gin file edited between two calls of a sweep made half its runs
  with other content, silently; --gin.MODEL_DIR or a seed given to a sweep overrode every run's
  own (seeds that were one run: a zero-width interval); a diverged run trained from
  --print_commands stayed pending (and printed again); a done run whose metrics were cut
  stayed done, its best value averaged with seeds whose final was not; runs of other lengths
  were one row without a word; an interrupted run left the sweep's exit status 0."""
  from t5x_variants.cli import sweep as sweep_cli  # pylint: disable=g-import-not-at-top
  base, relu = gin_files(tmp_path, 'base.gin', 'relu.gin')
  build = lambda seeds: grid.Sweep.build(str(tmp_path / 's'), [base], [relu], seeds)
  build(1).save()
  (tmp_path / 'base.gin').write_text('learning_rate_schedule.base = 1e-4\n')
  with pytest.raises(grid.SweepError, match=r'base.gin has changed since .* restore it, or use '
                                            'another --sweep_dir'):
    build(2).merge_previous()
  (tmp_path / 'base.gin').write_text('# variant\n')
  build(2).merge_previous()  # restored: the same content
  for binding in ("MODEL_DIR = '/tmp/x'", 'train.seed = 5', 'train/DatasetConfig.seed = 5'):
    with pytest.raises(grid.SweepError, match=f'--gin.{binding.split(" ")[0]}: the sweep sets it'):
      grid.Sweep.build(str(tmp_path / 's'), [base], [relu], 1, bindings=[binding])
  sweep = build(5)
  evaluated = lambda step: {'step': step, 'kind': 'eval', 'task': 't', 'log_perplexity': 5.0 - step / 10}
  write_metrics(sweep.model_dir(sweep.runs[0]), [train_record(2, 4.0), train_record(4, None)],
                total_steps=6)  # diverged under a scheduler
  for run, total in zip(sweep.runs[1:], (60, 6)):  # two lengths: 6 of 60 steps, 6 of 6
    write_metrics(sweep.model_dir(run), [train_record(6, 4.0), evaluated(2), evaluated(6)],
                  total_steps=total)
  # Stopped at its last step (it was recorded done), and at its first logged step 0 (recorded at
  # its last logged step, 6: 'diverged_at() or step').
  write_metrics(sweep.model_dir(sweep.runs[3]), [train_record(2, 4.0), train_record(6, None)],
                total_steps=6)
  write_metrics(sweep.model_dir(sweep.runs[4]), [train_record(0, 4.0, skipped=1.0),
                                                 train_record(6, 4.0, skipped=1.0)], total_steps=9)
  with open(os.path.join(sweep.model_dir(sweep.runs[4]), 'config.gin'), 'a') as f:
    f.write("train.on_nonfinite = 'stop'\n")
  sweep.update_from_run_dirs()
  assert [(r.status, r.diverged_step) for r in sweep.runs] == [
      ('diverged', 4), ('pending', None), ('done', None), ('diverged', 6), ('diverged', 0)]
  # Its last window all skipped under 'skip', and the eval of its last step logged: it finished
  # (a run the trainer stopped never logs that eval).
  write_metrics(sweep.model_dir(sweep.runs[3]), [train_record(2, 4.0), train_record(6, None, skipped=2.0),
                                                 evaluated(2), evaluated(6)], total_steps=6)
  with open(os.path.join(sweep.model_dir(sweep.runs[3]), 'config.gin'), 'a') as f:
    f.write("train.eval_period = 2\ntrain_eval/DatasetConfig.mixture_or_task_name = 't'\n")
  sweep.runs[3].status = 'pending'
  sweep.update_from_run_dirs()
  assert sweep.runs[3].status == 'done'
  sweep.runs[3:] = []
  sweep.save()
  assert '| relu | 1 diverged, 1 pending, 1 done | 6/6 or 60 (runs of other lengths) |' in (
      '\n'.join(report.table(report.sweep_group(str(tmp_path / 's')))))
  write_metrics(sweep.model_dir(sweep.runs[2]), [train_record(2, 4.0), evaluated(2)],
                total_steps=6)  # its metrics cut
  sweep.update_from_run_dirs()
  assert (sweep.runs[2].status, sweep.runs[2].reason) == (
      'interrupted', 'its metrics no longer reach its last step (a rerun trains it from there)')
  import shutil  # pylint: disable=g-import-not-at-top
  sweep.runs[2].status = 'done'
  shutil.rmtree(sweep.model_dir(sweep.runs[2]))  # unreadable (a store's read failing reads so)
  sweep.update_from_run_dirs()
  assert sweep.runs[2].status == 'done'  # no evidence: a finished run is not trained again
  best_only = trial('relu', 0, None)  # a done trial with no final eval has no best value either
  best_only.record.evals['t'] = [{'step': 2, 'log_perplexity': 4.0}]
  assert report.final_value(best_only, best=True) is None
  # The exit status: 1 while a run is left unfinished (here the fake trainer stops one early).
  trainer = tmp_path / 'fake_trainer.py'
  trainer.write_text(FAKE_TRAINER)
  stopped = gin_files(tmp_path, 'stopped.gin')[0]
  argv = [f'--sweep_dir={tmp_path / "exit"}', f'--gin_file={base}', f'--variants={stopped}']
  runner_executable = runner.trainer_executable
  try:
    runner.trainer_executable = lambda: [sys.executable, str(trainer)]
    assert sweep_cli.main(argv) == 1
  finally:
    runner.trainer_executable = runner_executable
  assert '1 interrupted' in capsys.readouterr().out


@pytest.mark.parametrize('text', ['{}', '[]', '{"runs": [{"name": 1}]}', '{"runs": [', 'not json'])
def test_a_damaged_sweep_record_is_one_error_naming_it(tmp_path, text):
  """Was: a KeyError, TypeError or JSONDecodeError traceback (or a line naming no file)."""
  (tmp_path / 'sweep.json').write_text(text)
  with pytest.raises(grid.SweepError, match=rf'{tmp_path}/sweep.json cannot be read as a sweep record '
                                            r'\(.+\): restore it .* or use another --sweep_dir'):
    grid.Sweep.load(str(tmp_path))
