"""The command-line tools end to end, as a researcher runs them: ``t5xv-quickstart`` (its own
process, through the console script: pretrain -> evaluate every checkpoint -> decode two
examples, with only the project's lines on the console) -> ``t5xv-eval`` skips the checkpoints
already evaluated -> ``t5xv-infer`` greedy and beam -> fine-tune from the checkpoint on a local
GLUE task (its own process: GLUE_DIR is read when tasks are registered) -> ``t5xv-eval`` computes
the task's accuracy from decoded text. Plus the one-line error of an unknown gin binding."""
import json
import os
import subprocess
import sys

import pytest
from etils import epath

from t5x_variants.cli import eval as eval_cli, infer, train
from train_helpers import records_of as records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
TINY_RUN = ['--gin.TRAIN_STEPS=40', "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 16}",
            '--gin.BATCH_SIZE=8', '--gin.train.log_period=5', '--gin.train.eval_period=20',
            '--gin.train.eval_batches=2', '--gin.Checkpointer.period=20',
            '--gin.learning_rate_schedule.base=0.03']
SST2 = [('a gorgeous , witty film', 1), ('dull and lifeless', 0), ('a triumph of style', 1),
        ('tedious , boring mess', 0), ('warm and funny', 1), ('painfully slow', 0)]
# What TensorFlow, XLA and seqio print at start-up when nobody quiets them.
NOISE = ('cuInit', 'cuda drivers', 'oneDNN', 'uncached', 'absl::InitializeLog', 'TF-TRT')


def command(name, *args, env=None):
  """Runs the installed console script ``name`` in the repository; (stdout, stderr)."""
  out = subprocess.run([os.path.join(BIN, name), *args], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
  if out.returncode:
    raise AssertionError(f'{name} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}')
  return out.stdout, out.stderr


@pytest.fixture(scope='module')
def quickstart(tmp_path_factory):
  """(run directory, stdout, stderr) of a 40-step ``t5xv-quickstart``."""
  run_dir = str(tmp_path_factory.mktemp('quickstart'))
  return (run_dir, *command('t5xv-quickstart', f'--model_dir={run_dir}', *TINY_RUN))


@pytest.mark.slow
def test_quickstart_trains_evaluates_and_decodes_quietly(quickstart):
  run_dir, out, err = quickstart
  losses = [r['loss'] for r in records(run_dir, 'train')]
  assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
  assert [r['step'] for r in records(run_dir, 'eval')][:2] == [20, 40]  # training's evals
  names = set(os.listdir(run_dir))
  assert {'config.gin', 'model-info.txt', 'vocab.model', 'checkpoint_20', 'checkpoint_40',
          'metrics.jsonl', 'tensorboard', 'eval_results.json', 'predictions.jsonl'} <= names, names
  with open(os.path.join(run_dir, 'eval_results.json')) as f:
    results = json.load(f)['validation']
  best = results.pop('best')['embedded_span_corruption']
  loss = {s: r['embedded_span_corruption']['loss'] for s, r in results.items()}
  assert set(loss) == {'20', '40'} and loss['40'] < loss['20']  # the checkpoints' weights were read
  assert best['loss'] == {'value': loss['40'], 'step': 40}  # the best checkpoint per metric
  assert 'best of 2 checkpoint(s), embedded_span_corruption (validation): log_perplexity' in out
  assert 'tok/s' in out and 'eta' in out and 'evaluated 2 checkpoint(s)' in out
  assert out.count('prediction: ') == 2 and 'wrote 2 predictions' in out
  assert not [n for n in NOISE if n in out + err], err  # only the project's lines


@pytest.mark.slow
def test_eval_skips_checkpoints_already_evaluated(quickstart, capsys):
  run_dir = quickstart[0]
  assert eval_cli.main([f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/eval.gin',
                        f"--gin.CHECKPOINT_PATH='{run_dir}'", '--gin.EVAL_ALL=True']) == 0
  assert capsys.readouterr().out.count('already evaluated on validation, skipped') == 2


@pytest.mark.slow
@pytest.mark.parametrize('method', ['greedy', 'beam'])
def test_infer_writes_jsonl(quickstart, method, tmp_path):
  run_dir = quickstart[0]
  texts = tmp_path / 'texts.txt'
  texts.write_text('The file is opened in binary mode.\nReturn the number of items.\n')
  out = tmp_path / f'{method}.jsonl'
  assert infer.main([f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/infer.gin',
                     f"--gin.CHECKPOINT_PATH='{run_dir}'", f"--gin.INFER_OUTPUT='{out}'",
                     f"--gin.INPUT_FILE='{texts}'", f"--gin.DecodeOptions.method='{method}'"]) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r['inputs'] for r in rows] == texts.read_text().splitlines()
  assert all(r['prediction'] and r['score'] < 0 for r in rows)


@pytest.mark.slow
def test_finetune_on_local_glue_and_eval_its_accuracy(quickstart, tmp_path):
  pretrained = quickstart[0]
  glue = tmp_path / 'glue' / 'SST-2'
  glue.mkdir(parents=True)
  lines = ['sentence\tlabel'] + [f'{s}\t{y}' for s, y in SST2]
  for split in ('train', 'dev'):
    (glue / f'{split}.tsv').write_text('\n'.join(lines) + '\n')
  env = {'GLUE_DIR': str(tmp_path / 'glue')}
  run_dir = str(tmp_path / 'finetune')
  command('t5xv-train', f'--gin_file={pretrained}/config.gin', '--gin_file=gin/runs/finetune.gin',
          f"--gin.INITIAL_CHECKPOINT_PATH='{pretrained}'", f"--gin.MODEL_DIR='{run_dir}'",
          "--gin.MIXTURE_OR_TASK_NAME='glue_sst2_local'", '--gin.TRAIN_STEPS=30', '--gin.BATCH_SIZE=6',
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 4}", '--gin.train.log_period=10',
          '--gin.train.eval_period=0', '--gin.Checkpointer.period=30',
          '--gin.learning_rate_schedule.base=0.01', "--gin.make_optimizer.frozen=['token_embedder']", env=env)
  first = records(run_dir, 'train')[0]
  assert first['step'] == 10  # a fresh step count: parameters only came from the checkpoint
  command('t5xv-eval', f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/eval.gin',
          f"--gin.CHECKPOINT_PATH='{run_dir}'", env=env)
  metrics = json.loads(open(os.path.join(run_dir, 'eval_results.json')).read())['validation']['30']['glue_sst2_local']
  assert 0.0 <= metrics['accuracy'] <= 100.0 and 'loss' in metrics  # percent, of the decoded labels
  assert 0.0 <= metrics['token_accuracy'] <= 1.0  # a fraction, teacher-forced
  assert metrics['loss'] < 3.0, metrics  # learnt the label words ('positive' / 'negative')


def test_unknown_gin_binding_is_one_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    train.main(['--gin_file=gin/experiments/quickstart.gin', *TINY_RUN,
                f"--gin.MODEL_DIR='{tmp_path}'", '--gin.train.totl_steps=3'])
  err = capsys.readouterr().err
  assert e.value.code == 2
  assert 'totl_steps' in err and 'Valid parameters' in err
  assert err.startswith('t5xv-train: error:') and err.count('error') == 1, err
  assert not os.listdir(tmp_path)  # nothing was written


def test_a_model_vocabulary_smaller_than_the_data_is_one_line(tmp_path, capsys):
  """The embedded vocabulary has 4100 ids: a 4000-row embedding is refused before any step."""
  with pytest.raises(SystemExit) as e:
    train.main(['--gin_file=gin/experiments/quickstart.gin', *TINY_RUN,
                f"--gin.MODEL_DIR='{tmp_path}'", '--gin.TransformerConfig.vocab_size=4000'])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count('\n') == 1, err
  assert 'the model vocab_size 4000 is smaller than the vocabulary of embedded_span_corruption ' \
         '(4100 ids); set TransformerConfig.vocab_size >= 4100 (e.g. 4224' in err
  assert not os.listdir(tmp_path)


def test_best_over_checkpoints_takes_the_lowest_loss_and_the_highest_score():
  results = {'10': {'rte': {'loss': 1.0, 'accuracy': 60.0, 'num_tokens': 5.0}},
             '20': {'rte': {'loss': 0.5, 'accuracy': 55.0, 'num_tokens': 5.0},
                    'cola': {'mcc': 30.0, 'log_perplexity': 2.0}},
             '30': {'cola': {'mcc': 42.0, 'log_perplexity': 2.5}},
             'best': {'stale': {}}}
  assert eval_cli.best_over_checkpoints(results) == {
      'rte': {'loss': {'value': 0.5, 'step': 20}, 'accuracy': {'value': 60.0, 'step': 10}},
      'cola': {'mcc': {'value': 42.0, 'step': 30}, 'log_perplexity': {'value': 2.0, 'step': 20}}}


def test_results_written_before_the_split_key_are_read_as_validation(tmp_path):
  old = {'10': {'rte': {'loss': 1.0}}, 'best': {'rte': {'loss': {'value': 1.0, 'step': 10}}}}
  path = tmp_path / 'eval_results.json'
  path.write_text(json.dumps(old))
  assert eval_cli.read_results(epath.Path(path)) == {'validation': old}
  path.write_text(json.dumps({'test': old}))
  assert eval_cli.read_results(epath.Path(path)) == {'test': old}
  assert eval_cli.read_results(epath.Path(tmp_path / 'missing.json')) == {}


@pytest.mark.slow
@pytest.mark.parametrize('name', ['t5xv-train', 't5xv-eval', 't5xv-infer', 't5xv-bench', 't5xv-compile'])
def test_a_model_axis_that_splits_heads_unevenly_is_one_line_in_every_command(quickstart, name, tmp_path):
  """On an 8-device host, 8-way 'model' and the tiny model's 4 heads: every command stops before
  compiling with the same line, exit status 2."""
  run_dir = quickstart[0]
  args = {
      't5xv-train': ['--gin_file=gin/experiments/quickstart.gin', f"--gin.MODEL_DIR='{tmp_path}/run'"],
      't5xv-eval': [f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/eval.gin',
                    f"--gin.CHECKPOINT_PATH='{run_dir}'"],
      't5xv-infer': [f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/infer.gin',
                     f"--gin.CHECKPOINT_PATH='{run_dir}'", f"--gin.INFER_OUTPUT='{tmp_path}/p.jsonl'"],
      't5xv-bench': ['--gin_file=gin/models/t5_tiny.gin', '--batch=8', '--steps=1'],
      't5xv-compile': ['--gin_file=gin/runs/pretrain.gin', '--gin_file=gin/models/t5_tiny.gin',
                       '--devices=8'],
  }[name]
  out = subprocess.run([os.path.join(BIN, name), *args, '--gin.MeshConfig.model=8'], cwd=REPO,
                       capture_output=True, text=True,
                       env={**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=8'})
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.startswith(f"{name}: error: mesh axis 'model' of size 8 does not divide heads = 4 ")
  assert out.stderr.strip().endswith('and the 8 devices: 1, 2, 4 (set MeshConfig.model)'), out.stderr
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr
