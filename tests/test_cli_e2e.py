"""The command-line tools end to end, each in its own process as a researcher runs them:
pretrain (loss falls, run files and checkpoints written) -> t5xv-eval reads the checkpoints back
(and skips them the second time) -> t5xv-infer decodes -> fine-tune from the checkpoint on a
local GLUE task -> t5xv-eval computes the task's accuracy from decoded text. Plus the one-line
error of an unknown gin binding."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RUN = ['--gin_file=gin/experiments/quickstart.gin', '--gin.TRAIN_STEPS=40',
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 16}", '--gin.BATCH_SIZE=8',
            '--gin.train.log_period=5', '--gin.train.eval_period=20', '--gin.train.eval_batches=2',
            '--gin.Checkpointer.period=20', '--gin.learning_rate_schedule.base=0.03']
SST2 = [('a gorgeous , witty film', 1), ('dull and lifeless', 0), ('a triumph of style', 1),
        ('tedious , boring mess', 0), ('warm and funny', 1), ('painfully slow', 0)]


def run(tool, *args, env=None, check=True):
  out = subprocess.run([sys.executable, '-m', f't5x_variants.{tool}', *args], cwd=REPO,
                       capture_output=True, text=True, env={**os.environ, **(env or {})})
  if check and out.returncode:
    raise AssertionError(f'{tool} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}')
  return out


def records(run_dir, kind):
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [r for r in map(json.loads, f) if r['kind'] == kind]


@pytest.fixture(scope='module')
def pretrained(tmp_path_factory):
  run_dir = str(tmp_path_factory.mktemp('pretrain'))
  out = run('train', *TINY_RUN, f"--gin.MODEL_DIR='{run_dir}'")
  assert 'tok/s' in out.stdout and 'eta' in out.stdout
  return run_dir


def test_pretraining_writes_a_run_whose_loss_falls(pretrained):
  losses = [r['loss'] for r in records(pretrained, 'train')]
  assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
  assert [r['step'] for r in records(pretrained, 'eval')] == [20, 40]
  names = set(os.listdir(pretrained))
  assert {'config.gin', 'model-info.txt', 'vocab.model', 'checkpoint_20', 'checkpoint_40',
          'metrics.jsonl', 'tensorboard'} <= names, names


def test_eval_reads_checkpoints_back_and_skips_done_ones(pretrained):
  args = [f'--gin_file={pretrained}/config.gin', '--gin_file=gin/runs/eval.gin',
          f"--gin.CHECKPOINT_PATH='{pretrained}'", '--gin.EVAL_ALL=True']
  run('eval', *args)
  with open(os.path.join(pretrained, 'eval_results.json')) as f:
    results = json.load(f)
  assert set(results) == {'20', '40'}
  loss = {s: r['embedded_span_corruption']['loss'] for s, r in results.items()}
  assert loss['40'] < loss['20']  # the later checkpoint is the better model: weights were read
  assert 'already evaluated, skipped' in run('eval', *args).stdout


def test_infer_writes_jsonl_greedy_and_beam(pretrained, tmp_path):
  texts = tmp_path / 'texts.txt'
  texts.write_text('The file is opened in binary mode.\nReturn the number of items.\n')
  for method in ('greedy', 'beam'):
    out = tmp_path / f'{method}.jsonl'
    run('infer', f'--gin_file={pretrained}/config.gin', '--gin_file=gin/runs/infer.gin',
        f"--gin.CHECKPOINT_PATH='{pretrained}'", f"--gin.INFER_OUTPUT='{out}'",
        f"--gin.INPUT_FILE='{texts}'", f"--gin.DecodeOptions.method='{method}'")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r['inputs'] for r in rows] == texts.read_text().splitlines()
    assert all(r['prediction'] and r['score'] < 0 for r in rows)


def test_finetune_on_local_glue_and_eval_its_accuracy(pretrained, tmp_path):
  glue = tmp_path / 'glue' / 'SST-2'
  glue.mkdir(parents=True)
  lines = ['sentence\tlabel'] + [f'{s}\t{y}' for s, y in SST2]
  for split in ('train', 'dev'):
    (glue / f'{split}.tsv').write_text('\n'.join(lines) + '\n')
  env = {'GLUE_DIR': str(tmp_path / 'glue')}
  run_dir = str(tmp_path / 'finetune')
  run('train', f'--gin_file={pretrained}/config.gin', '--gin_file=gin/runs/finetune.gin',
      f"--gin.INITIAL_CHECKPOINT_PATH='{pretrained}'", f"--gin.MODEL_DIR='{run_dir}'",
      "--gin.MIXTURE_OR_TASK_NAME='glue_sst2_local'", '--gin.TRAIN_STEPS=30', '--gin.BATCH_SIZE=6',
      "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 4}", '--gin.train.log_period=10',
      '--gin.train.eval_period=0', '--gin.Checkpointer.period=30',
      '--gin.learning_rate_schedule.base=0.01', "--gin.adafactor.frozen=['token_embedder']", env=env)
  first = records(run_dir, 'train')[0]
  assert first['step'] == 10  # a fresh step count: parameters only came from the checkpoint
  run('eval', f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/eval.gin',
      f"--gin.CHECKPOINT_PATH='{run_dir}'", env=env)
  metrics = json.loads(open(os.path.join(run_dir, 'eval_results.json')).read())['30']['glue_sst2_local']
  assert 0.0 <= metrics['accuracy'] <= 100.0 and 'loss' in metrics
  assert metrics['loss'] < 3.0, metrics  # learnt the label words ('positive' / 'negative')


def test_unknown_gin_binding_is_named(tmp_path):
  out = run('train', *TINY_RUN, f"--gin.MODEL_DIR='{tmp_path}'", '--gin.train.totl_steps=3',
            check=False)
  assert out.returncode == 2
  assert 'totl_steps' in out.stderr and 'Valid parameters' in out.stderr
  errors = [line for line in out.stderr.splitlines()  # TensorFlow's start-up lines are not ours
            if 'error' in line.lower() and not line.startswith(('I0000', 'W0000', 'E0000'))]
  assert len(errors) == 1 and errors[0].startswith('t5xv-train: error:'), out.stderr
