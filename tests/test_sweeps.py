"""t5xv-sweep and t5xv-report: the grid and its commands, resuming and recording failures (with a
stand-in trainer), reading run directories (divergence, resumed steps), Spearman's rho and the
flipped pairs, the report's table and plots; and a 2-variant x 1-seed sweep of a tiny recipe end
to end through the real trainer."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from t5x_variants.sweeps import grid, papers, report, runs

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
  print('t5xv-train: error: the loss or gradients at step 7 are not finite (loss nan); ...')
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
  counts = grid.run_sweep(sweep, executable, say=lines.append)
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
  grid.run_sweep(again, executable, say=lambda _: None)
  assert calls(tmp_path) == ['good-seed0', 'bad-seed0', 'crash-seed0', 'fine-seed0', 'crash-seed0',
                             'good-seed1', 'bad-seed1', 'crash-seed1', 'fine-seed1']
  # The report of it: seeds aggregated, the diverged and failed runs kept out of the means.
  group = report.sweep_group(str(tmp_path / 'sweep'))
  assert group.paper is papers.GLU
  text = '\n'.join(report.table(group))
  assert '| good | 2 done | 4/4 |' in text and '| 3.050 ± 0.071 | 3.050 ± 0.071 | no |' in text
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
             {'step': 40, 'kind': 'eval', 'task': 't', 'log_perplexity': 5.3}]
  write_metrics(tmp_path / 'r', records, total_steps=40, params=1234567)
  run = runs.read_run(str(tmp_path / 'r'))
  assert (run.step, run.total_steps, run.params, run.task) == (30, 40, 1234567, 't')
  assert [r['loss'] for r in run.train] == [6.0, 5.0, 4.5]
  assert (run.final_eval(), run.best_eval()) == (5.3, 5.2)
  assert run.tokens_per_second() == 15.0  # the first window (compilation) left out
  assert run.diverged_at() is None


@pytest.mark.parametrize('losses,skipped,expected', [
    ([6.0, 5.0, None], [0, 0, 0], 3),  # non-finite (written as null)
    ([6.0, 5.0, 5.5], [0, 0, 1], 3),  # a skipped step in the window
    ([6.0, 5.0, 6.1], [0, 0, 0], 3),  # 1.1 nat above the lowest: blown up
    ([6.0, 5.0, 5.9], [0, 0, 0], None),  # 0.9 nat: noise, not divergence
])
def test_divergence(tmp_path, losses, skipped, expected):
  write_metrics(tmp_path, [train_record(i + 1, l, s) for i, (l, s) in enumerate(zip(losses, skipped))])
  assert runs.read_run(str(tmp_path)).diverged_at() == expected


def test_spearman_matches_scipy_with_ties():
  rng = np.random.default_rng(0)
  for _ in range(20):
    a, b = rng.integers(0, 5, 8).astype(float), rng.normal(size=8)
    assert report.spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic)


def test_ranking_names_the_flipped_pairs(tmp_path):
  ours = {'relu': 5.0, 'geglu': 4.8, 'swiglu': 4.7, 'bilinear': 4.9}  # paper: 1.997 1.942 1.944 1.960
  dirs = []
  for name, value in ours.items():
    d = tmp_path / f'{name}-seed0'
    write_metrics(d, [train_record(4, 5.0), {'step': 4, 'kind': 'eval', 'task': 't',
                                             'log_perplexity': value}], total_steps=4)
    dirs.append(str(d))
  group = report.run_dirs_group(dirs, paper='glu')
  rho, flips, n = report.ranking(group)
  assert n == 4
  assert flips == [('geglu', 'swiglu')]
  assert rho == pytest.approx(stats.spearmanr(list(ours.values()), [1.997, 1.942, 1.944, 1.960]).statistic)
  assert rho == pytest.approx(0.8)


def assert_png(path):
  import matplotlib.image  # pylint: disable=g-import-not-at-top
  with open(path, 'rb') as f:
    assert f.read(8) == PNG_MAGIC
  image = matplotlib.image.imread(path)
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


@pytest.mark.slow
def test_a_tiny_sweep_end_to_end(tmp_path):
  """2 FFN variants x 1 seed of the small GLU recipe cut to 4 steps, through t5xv-sweep and the
  real t5xv-train; then t5xv-report."""
  bin_dir = os.path.dirname(sys.executable)
  sweep_dir = tmp_path / 'sweep'
  tiny = ['--gin.TRAIN_STEPS=4', '--gin.BATCH_SIZE=4', '--gin.train.log_period=2',
          '--gin.train.eval_period=2', '--gin.train.eval_batches=1', '--gin.Checkpointer.period=2',
          '--gin.learning_rate_schedule.warmup_steps=1']
  out = subprocess.run([os.path.join(bin_dir, 't5xv-sweep'), f'--sweep_dir={sweep_dir}',
                        '--gin_file=gin/experiments/glu_variants/small.gin',
                        '--variants=gin/variants/ffn/relu.gin,gin/variants/ffn/swiglu.gin',
                        '--paper=glu', *tiny], cwd=REPO, capture_output=True, text=True)
  assert out.returncode == 0, out.stdout + out.stderr
  assert '[2/2] swiglu seed 0: done' in out.stdout and 'sweep' in out.stdout.splitlines()[-1]
  saved = json.loads((sweep_dir / 'sweep.json').read_text())
  assert [(r['name'], r['status']) for r in saved['runs']] == [('relu-seed0', 'done'),
                                                               ('swiglu-seed0', 'done')]
  assert (sweep_dir / 'swiglu-seed0' / 'checkpoint_4').exists()
  out = subprocess.run([os.path.join(bin_dir, 't5xv-report'), f'--sweep_dir={sweep_dir}'],
                       cwd=REPO, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  text = (sweep_dir / 'report.md').read_text()
  for variant in ('relu', 'swiglu'):
    row = next(l for l in text.splitlines() if l.startswith(f'| {variant} |'))
    cells = [c.strip() for c in row.strip('|').split('|')]
    assert cells[1:3] == ['1 done', '4/4'] and cells[7] == 'no'
    assert 0 < float(cells[5]) < 9  # a log-perplexity below ln(4224) = 8.35
  assert 'Spearman' not in text  # fewer than 3 variants: no ranking
  for name in ('sweep_curves', 'sweep_final'):
    assert_png(sweep_dir / f'{name}.png')


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
  saved.runs[0].status = 'done'
  saved.save()
  assert sweep_cli.main(flags) == 0
  assert [l.split('MODEL_DIR=')[1].split()[0] for l in capsys.readouterr().out.splitlines()] == [
      f"\"'{tmp_path}/s/{n}'\"" for n in ('b-seed0', 'a-seed1', 'b-seed1')]


def test_report_without_runs_is_a_usage_error(capsys):
  from t5x_variants.cli import report as report_cli  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as exit_info:
    report_cli.main([])
  assert exit_info.value.code == 2 and 'give --sweep_dir or --run_dirs' in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:
    report_cli.main(['--sweep_dir=/nonexistent'])
  assert exit_info.value.code == 2
  assert 'sweep.json not found: not a sweep directory' in capsys.readouterr().err


def test_a_smaller_grid_keeps_the_record_and_runs_trained_elsewhere_count(tmp_path):
  trainer = tmp_path / 'fake_trainer.py'
  trainer.write_text(FAKE_TRAINER)
  executable = [sys.executable, str(trainer)]
  base, good, bad, stopped = gin_files(tmp_path, 'base.gin', 'good.gin', 'bad.gin', 'stopped.gin')
  build = lambda variants: grid.Sweep.build(str(tmp_path / 'sweep'), [base], [variants], 1)
  counts = grid.run_sweep(build(f'{good},{bad},{stopped}'), executable, say=lambda _: None)
  assert counts == {'done': 1, 'diverged': 1, 'interrupted': 1}  # exit 0 before the last step
  smaller = build(good)
  smaller.merge_previous()
  smaller.save()
  assert grid.run_sweep(smaller, executable, say=lambda _: None) == {'done': 1}
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
  grid.run_sweep(again, executable, say=lambda _: None)
  assert calls(tmp_path) == ['good-seed0', 'bad-seed0', 'stopped-seed0']


def test_no_variants_is_one_run_and_one_sweep_per_directory(tmp_path):
  base, = gin_files(tmp_path, 'base.gin')
  sweep = grid.Sweep.build(str(tmp_path / 's'), [base], [], 2)
  assert [r.name for r in sweep.runs] == ['base-seed0', 'base-seed1']
  holder = grid._lock(str(tmp_path / 's'))  # pylint: disable=protected-access
  with pytest.raises(grid.SweepError, match='another t5xv-sweep is running'):
    grid.run_sweep(sweep, ['true'], say=lambda _: None)
  holder.close()
