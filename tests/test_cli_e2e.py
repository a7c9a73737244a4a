"""The command-line tools end to end, as a researcher runs them: ``t5xv-quickstart`` (its own
process, through the console script: pretrain -> evaluate every checkpoint -> decode two
examples, with only the project's lines on the console) -> ``t5xv-eval`` skips the checkpoints
already evaluated -> ``t5xv-infer`` greedy and beam -> fine-tune from the checkpoint on a local
GLUE task (its own process: GLUE_DIR is read when tasks are registered) -> ``t5xv-eval`` computes
the task's accuracy from decoded text. Plus the one-line errors of bad input (an unknown gin
binding, numbers out of range, a MODEL_DIR that cannot hold the run), and ``EVAL_ALL`` beside a
training run whose keep-N cleanup removes a checkpoint it listed."""
import functools
import json
import os
import shutil
import subprocess
import sys
import types

import gin
import numpy as np
import pytest
from etils import epath

from conftest import HOST_DEVICES, needs_data_layer
from t5x_variants.features import EOS_ID
from t5x_variants.cli import eval as eval_cli, eval_passes, eval_results, infer, train
from train_helpers import records_of as records

# The tools train on the embedded corpus through the data layer.
pytestmark = needs_data_layer
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
  settings = results.pop('settings')['embedded_span_corruption']  # how its results were made
  assert settings['decoding']['method'] == 'greedy' and 'batch_size' not in settings  # all batches
  assert results.pop('average') == {}  # no GLUE or SuperGLUE task
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
  events = os.listdir(os.path.join(run_dir, 'tensorboard'))
  assert eval_cli.main([f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/eval.gin',
                        f"--gin.CHECKPOINT_PATH='{run_dir}'", '--gin.EVAL_ALL=True']) == 0
  out = capsys.readouterr().out
  assert out.count('already evaluated on validation, skipped') == 2
  assert os.listdir(os.path.join(run_dir, 'tensorboard')) == events  # no empty events file


@pytest.mark.slow
@pytest.mark.parametrize('name', ['t5xv-eval', 't5xv-infer'])
def test_eval_and_infer_refuse_a_configuration_of_another_model(quickstart, name, tmp_path, capsys):
  """A configuration that changes what the run's model computes but no parameter's shape: t5xv-eval
  reported the results already in eval_results.json as this configuration's (every checkpoint
  skipped), and both tools read the checkpoints into another function."""
  run_dir = quickstart[0]
  main, flags = {
      't5xv-eval': (eval_cli.main, ['--gin_file=gin/runs/eval.gin', '--gin.EVAL_ALL=True']),
      't5xv-infer': (infer.main, ['--gin_file=gin/runs/infer.gin', "--gin.INPUT_FILE='README.md'",
                                  f"--gin.INFER_OUTPUT='{tmp_path}/p.jsonl'"])}[name]
  with pytest.raises(SystemExit) as e:
    main([f'--gin_file={run_dir}/config.gin', *flags, f"--gin.CHECKPOINT_PATH='{run_dir}'",
          '--gin.TransformerConfig.norm_epsilon=1e-5'])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count('\n') == 1, err
  assert (f'{name}: error: {run_dir} holds a run of another model than this configuration '
          '(norm placement.epsilon: saved 1e-06, this configuration 1e-05; 1 difference(s)') in err
  assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_eval_computes_a_tasks_metrics_of_scores(quickstart, tmp_path, monkeypatch):
  """A task's score_metric_fns (rank classification's) get each example's log-likelihood of its
  targets, in the split's order with its postprocessed target: summed over the split and divided
  by its target tokens, the teacher-forced log-perplexity of the same pass (was: not computed,
  a line said so)."""
  import seqio  # pylint: disable=g-import-not-at-top
  seen = {}

  def sum_of_scores(targets, scores):
    seen.update(targets=targets, scores=scores)
    return {'sum_of_scores': float(np.sum(scores))}
  monkeypatch.setattr(seqio.Task, 'score_metric_fns', property(lambda task: [sum_of_scores]))
  run_dir = tmp_path / 'run'
  shutil.copytree(quickstart[0], run_dir, ignore=shutil.ignore_patterns('eval_results.json'))
  assert eval_cli.main([f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/eval.gin',
                        f"--gin.CHECKPOINT_PATH='{run_dir}/checkpoint_40'"]) == 0
  with open(run_dir / 'eval_results.json') as f:
    metrics = json.load(f)['validation']['40']['embedded_span_corruption']
  assert len(seen['targets']) == len(seen['scores']) and isinstance(seen['targets'][0], str)
  assert -metrics['sum_of_scores'] / metrics['num_tokens'] == pytest.approx(
      metrics['log_perplexity'], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('method', ['greedy', 'beam'])
def test_infer_writes_jsonl(quickstart, method, tmp_path, capsys, monkeypatch):
  """Also: a text longer than the inputs length is cut to it, still ending in its EOS as seqio cuts
  inputs, and a line says so."""
  run_dir = quickstart[0]
  decoded = []
  real_decode = infer.decode_examples
  monkeypatch.setattr(infer, 'decode_examples', lambda predictor, vocab, examples, *args: decoded.extend(
      examples) or real_decode(predictor, vocab, examples, *args))
  texts = tmp_path / 'texts.txt'
  texts.write_text('The file is opened in binary mode.\nReturn the number of items.\n'
                   + 'item ' * 2000 + '\n')
  out = tmp_path / f'{method}.jsonl'
  assert infer.main([f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/infer.gin',
                     f"--gin.CHECKPOINT_PATH='{run_dir}'", f"--gin.INFER_OUTPUT='{out}'",
                     f"--gin.INPUT_FILE='{texts}'", f"--gin.DecodeOptions.method='{method}'"]) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r['inputs'] for r in rows] == texts.read_text().splitlines()
  assert all(r['prediction'] and r['score'] < 0 for r in rows)
  assert '1 of the 3 texts of ' in capsys.readouterr().out
  cut = decoded[2]['inputs']  # TINY_RUN's inputs length
  assert len(cut) == 64 and cut[-1] == EOS_ID and EOS_ID not in cut[:-1]
  assert len(decoded[1]['inputs']) < 64 and decoded[1]['inputs'][-1] == EOS_ID  # whole, as it was


@pytest.mark.slow
def test_a_prefix_lm_trains_evaluates_and_decodes(tmp_path):
  """T5's prefix LM on span corruption (rows of inputs then targets): the loss falls, t5xv-eval
  reads its checkpoints teacher-forced, t5xv-infer prompts it with texts and their EOS, and it
  fine-tunes on a GLUE task and is evaluated by decoding."""
  run_dir = str(tmp_path / 'prefix_lm')
  command('t5xv-train', '--gin_file=gin/experiments/quickstart.gin',
          '--gin_file=gin/architectures/prefix_lm.gin', f"--gin.MODEL_DIR='{run_dir}'", *TINY_RUN)
  losses = [r['loss'] for r in records(run_dir, 'train')]
  assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
  command('t5xv-eval', f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/eval.gin',
          f"--gin.CHECKPOINT_PATH='{run_dir}'")
  with open(os.path.join(run_dir, 'eval_results.json')) as f:
    metrics = json.load(f)['validation']['40']['embedded_span_corruption']
  assert metrics['loss'] < losses[0] and metrics['num_tokens'] > 0
  texts, out = tmp_path / 'texts.txt', tmp_path / 'out.jsonl'
  texts.write_text('The file is opened in binary mode.\nReturn the number of items.\n')
  assert infer.main([f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/infer.gin',
                     f"--gin.CHECKPOINT_PATH='{run_dir}'", f"--gin.INFER_OUTPUT='{out}'",
                     f"--gin.INPUT_FILE='{texts}'", "--gin.DecodeOptions.method='beam'"]) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r['inputs'] for r in rows] == texts.read_text().splitlines()
  assert all(r['prediction'] and r['score'] < 0 for r in rows)
  _finetune_on_local_sst2(run_dir, tmp_path)  # GLUE's inputs then its label word, by decoding


def _finetune_on_local_sst2(pretrained, tmp_path):
  """Fine-tunes the run in ``pretrained`` on a local SST-2 for 30 steps and evaluates it by
  decoding; the fine-tuned checkpoint's SST-2 metrics. The run's own eval at step 30 decodes as
  t5xv-eval does (finetune.gin's ``train.infer_eval``): the same accuracy and loss."""
  glue = tmp_path / 'glue' / 'SST-2'
  glue.mkdir(parents=True)
  lines = ['sentence\tlabel'] + [f'{s}\t{y}' for s, y in SST2]
  for split in ('train', 'dev'):
    (glue / f'{split}.tsv').write_text('\n'.join(lines) + '\n')
  env = {'GLUE_DIR': str(tmp_path / 'glue')}
  run_dir = str(tmp_path / 'finetune')
  _, err = command('t5xv-train', f'--gin_file={pretrained}/config.gin', '--gin_file=gin/runs/finetune.gin',
          f"--gin.INITIAL_CHECKPOINT_PATH='{pretrained}'", f"--gin.MODEL_DIR='{run_dir}'",
          "--gin.MIXTURE_OR_TASK_NAME='glue_sst2_local'", '--gin.TRAIN_STEPS=30', '--gin.BATCH_SIZE=6',
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 4}", '--gin.train.log_period=10',
          '--gin.train.eval_period=30', '--gin.Checkpointer.period=30',
          '--gin.learning_rate_schedule.base=0.01', "--gin.make_optimizer.frozen=['token_embedder']", env=env)
  assert 'WARNING' not in err, err  # (seqio's packing note on GLUE's idx and label was one)
  first = records(run_dir, 'train')[0]
  assert first['step'] == 10  # the fine-tuning steps count from 0
  command('t5xv-eval', f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/eval.gin',
          f"--gin.CHECKPOINT_PATH='{run_dir}'", env=env)
  metrics = json.loads(open(os.path.join(run_dir, 'eval_results.json')).read())['validation']['30']['glue_sst2_local']
  assert 0.0 <= metrics['accuracy'] <= 100.0 and 'loss' in metrics  # percent, of the decoded labels
  assert 0.0 <= metrics['token_accuracy'] <= 1.0  # a fraction, teacher-forced
  assert metrics['loss'] < 3.0, metrics  # learnt the label words ('positive' / 'negative')
  own = [r for r in records(run_dir, 'eval') if 'split' not in r]
  assert [r['step'] for r in own] == [30], own
  assert own[0]['accuracy'] == metrics['accuracy'], (own, metrics)
  assert own[0]['loss'] == pytest.approx(metrics['loss'], rel=1e-5), (own, metrics)
  # each example's prediction, as T5X's inference_eval files: t5xv-eval's, and the run's own
  read = lambda *where: [json.loads(line) for line in open(os.path.join(
      run_dir, 'inference_eval', *where, 'glue_sst2_local-validation-000030.jsonl'))]
  rows = read()
  assert len(rows) == len(SST2) and {r['targets'] for r in rows} == {'negative', 'positive'}
  assert read('train') == rows
  assert rows[0]['inputs'].startswith('sst2 sentence: ')
  assert 100 * np.mean([r['prediction'] == r['targets'] for r in rows]) == pytest.approx(metrics['accuracy'])
  return metrics


@pytest.mark.slow
def test_finetune_on_local_glue_and_eval_its_accuracy(quickstart, tmp_path):
  _finetune_on_local_sst2(quickstart[0], tmp_path)


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


def _other_models_run(run, monkeypatch):
  """A run directory of the quickstart model with GELU instead of ReLU (the same parameter shapes),
  as its trainer left it before any checkpoint: config.gin and model-info.txt."""
  del monkeypatch
  from t5x_variants.cli import recipe  # pylint: disable=g-import-not-at-top
  from t5x_variants.models.summary import model_info  # pylint: disable=g-import-not-at-top
  recipe.parse_gin(['gin/experiments/quickstart.gin', 'gin/variants/ffn/gelu.gin'], [],
                   configurables=recipe.library_configurables())
  run.mkdir()
  (run / 'model-info.txt').write_text(model_info(recipe.build_config()) + '\n')
  (run / 'config.gin').write_text('# the GELU run\n')
  gin.clear_config()


def _data_axis_of_4(run, monkeypatch):
  """A mesh whose 'data' axis has 4 devices (this process has one)."""
  del run
  from t5x_variants.train import partitioning  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(partitioning.MeshConfig, 'mesh',
                      lambda self, devices=None: types.SimpleNamespace(shape={'replica': 1, 'data': 4, 'model': 1}))


# (MODEL_DIR, its setup, flags, the error line): every bad input of t5xv-train stops before any
# data is built or anything compiles, with one line that names it and what to do.
BAD_TRAIN_INPUTS = [
    ('{tmp}/run', lambda run, _: run.write_text('notes'), [],
     "MODEL_DIR (train.model_dir) = '{tmp}/run' is a file, not a directory; set --gin.MODEL_DIR to "
     'a writable directory (a new one for a new run)'),
    ('{tmp}/notes/run', lambda run, _: run.parent.write_text('notes'), [],
     "MODEL_DIR (train.model_dir) = '{tmp}/notes/run' cannot be created: {tmp}/notes is a file; "
     'set --gin.MODEL_DIR to a writable directory'),
    ('/proc/t5xv_test/run', None, [],  # not writable, even by root
     "MODEL_DIR (train.model_dir) = '/proc/t5xv_test/run' cannot be created in /proc: "),
    ('{tmp}/run', _other_models_run, [],
     "MODEL_DIR (train.model_dir) = '{tmp}/run' holds a run of another model (ffn: saved gelu, "
     'this configuration relu; 2 difference(s), see its model-info.txt); resume it with its own '
     'config.gin (--gin_file={tmp}/run/config.gin) or set --gin.MODEL_DIR to a new directory'),
    ('{tmp}/run', None, ['--gin.BATCH_SIZE=0'],
     'BATCH_SIZE (train/DatasetConfig.batch_size) = 0 is out of range: the global batch size must '
     'be an integer >= 1; set --gin.BATCH_SIZE accordingly'),
    ('{tmp}/run', None, ['--gin.BATCH_SIZE=-8'],
     'BATCH_SIZE (train/DatasetConfig.batch_size) = -8 is out of range'),
    ('{tmp}/run', _data_axis_of_4, ['--gin.BATCH_SIZE=6'],
     "BATCH_SIZE (train/DatasetConfig.batch_size) = 6: batch size 6 does not split over mesh axis "
     "'data' of size 4: use a multiple of 4 (e.g. 4) or another MeshConfig.data"),
    ('{tmp}/run', None, ['--gin.train.num_microbatches=3'],
     "BATCH_SIZE (train/DatasetConfig.batch_size) = 8: batch size 8 does not split over mesh axis "
     "'data' of size 1 x 3 microbatches: use a multiple of 3 (e.g. 6)"),
    ('{tmp}/run', None, ["--gin.TASK_FEATURE_LENGTHS={'inputs': 0, 'targets': 16}"],
     "TASK_FEATURE_LENGTHS (train/DatasetConfig.task_feature_lengths) = {'inputs': 0, 'targets': "
     "16} is out of range ('inputs' is 0): every feature length must be an integer >= 1; set "
     '--gin.TASK_FEATURE_LENGTHS accordingly'),
    ('{tmp}/run', None, ["--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': -16}"],
     "('targets' is -16): every feature length must be an integer >= 1"),
    ('{tmp}/run', None, ['--gin.TRAIN_STEPS=0'],
     'TRAIN_STEPS (train.total_steps) = 0 is out of range: the number of training steps must be an '
     'integer >= 1; set --gin.TRAIN_STEPS accordingly'),
    ('{tmp}/run', None, ['--gin.TRAIN_STEPS=-5'], 'TRAIN_STEPS (train.total_steps) = -5 is out of range'),
    ('{tmp}/run', None, ['--gin.train.log_period=0'],
     'train.log_period = 0 is out of range: the steps between logs must be an integer >= 1; set '
     '--gin.train.log_period accordingly'),
    ('{tmp}/run', None, ['--gin.train.eval_period=-20'],
     'train.eval_period = -20 is out of range: the steps between evals (0: none) must be an integer '
     '>= 0'),
    ('{tmp}/run', None, ['--gin.Checkpointer.period=0'],
     'Checkpointer.period = 0 is out of range: the steps between checkpoints must be an integer >= 1'),
    ('{tmp}/run', None, ['--gin.Checkpointer.keep=0'],  # orbax would delete every checkpoint
     'Checkpointer.keep = 0 is out of range: the checkpoints kept (None: all) must be an integer '
     '>= 1 or None'),
    ('{tmp}/run', None, ["--gin.MIXTURE_OR_TASK_NAME='c4_span_corruption'"],  # C4 not prepared here
     'TFDS dataset(s) c4/en:3.1.0 not prepared in '),
    ('{tmp}/run', None, ['--gin.MeshConfig.model=0'],  # a ZeroDivisionError
     'MeshConfig.model = 0 is out of range: the model axis must be an integer >= 1'),
    ('{tmp}/run', None, ["--gin.MeshConfig.data='2'"],  # a TypeError
     "MeshConfig.data = '2' is out of range: the data axis (-1: the devices model and replica leave) "
     'must be '),
    ('{tmp}/run', None, ["--gin.train.seed='a'"],  # JAX's TypeError from PRNGKey
     "train.seed = 'a' is out of range: the random seed must be an integer >= 0 or None"),
    ('{tmp}/run', None, ['--gin.make_optimizer.global_norm_clip=-1'],  # trained uphill, exit 0
     'make_optimizer.global_norm_clip = -1 is out of range: it must be a number > 0, or None'),
    ('{tmp}/run', None, ["--gin.TransformerConfig.self_attention='random'",  # failed at step 1
                         '--gin.TransformerConfig.encoder_max_length=32'],
     "TASK_FEATURE_LENGTHS (train/DatasetConfig.task_feature_lengths) = {'inputs': 64, 'targets': 16} "
     'makes encoder rows of 64 tokens, more than this model reads (encoder_max_length 32: its learned '
     'positions or synthesizer are sized by it); set TransformerConfig.encoder_max_length = 64, or '
     'shorter lengths'),
    ('{tmp}/run', None, ['--gin.train.infer_eval=True', "--gin.DecodeOptions.method='beem'"],
     "DecodeOptions.method = 'beem' is out of range: it must be 'greedy' or 'sample' or 'beam'"),
]


@pytest.mark.parametrize('model_dir,setup,flags,message', BAD_TRAIN_INPUTS, ids=[
    'dir_is_a_file', 'dir_under_a_file', 'dir_unwritable', 'dir_of_another_model', 'batch_0',
    'batch_negative', 'batch_vs_data_axis', 'batch_vs_microbatches', 'inputs_length_0',
    'targets_length_negative', 'steps_0', 'steps_negative', 'log_period_0', 'eval_period_negative',
    'checkpoint_period_0', 'keep_0', 'data_not_prepared', 'mesh_model_0', 'mesh_data_string',
    'seed_string', 'negative_clip', 'rows_longer_than_the_synthesizer', 'infer_eval_decoding'])
def test_bad_train_input_is_one_line_before_any_work(model_dir, setup, flags, message, tmp_path,
                                                     monkeypatch, capsys):
  model_dir, message = (x.replace('{tmp}', str(tmp_path)) for x in (model_dir, message))
  if model_dir.startswith('/proc/') and not os.path.isdir('/proc/self'):
    pytest.skip('no /proc here')
  run = epath.Path(model_dir)
  if setup:
    setup(run, monkeypatch)
  existed = run.exists()
  before = {str(p): p.read_bytes() for p in tmp_path.rglob('*') if p.is_file()}
  with pytest.raises(SystemExit) as e:
    train.main(['--gin_file=gin/experiments/quickstart.gin', *TINY_RUN,
                f"--gin.MODEL_DIR='{model_dir}'", *flags])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count('\n') == 1, err
  assert err.startswith('t5xv-train: error: ') and message in err, err
  after = {str(p): p.read_bytes() for p in tmp_path.rglob('*') if p.is_file()}
  assert after == before and run.exists() == existed  # nothing written, nothing lost


@pytest.mark.parametrize('name,flags,message', [
    ('t5xv-eval', ['--gin_file=gin/runs/eval.gin', '--gin.EVAL_BATCH_SIZE=0'],
     'EVAL_BATCH_SIZE (evaluate_checkpoints.batch_size) = 0 is out of range: the eval batch size '
     'must be an integer >= 1; set --gin.EVAL_BATCH_SIZE accordingly'),
    ('t5xv-eval', ['--gin_file=gin/runs/eval.gin', '--gin.PROMPT_LENGTH=-3'],
     'PROMPT_LENGTH (evaluate_checkpoints.prompt_length) = -3 is out of range: the prompt length '
     '(None: no prompt) must be an integer >= 1 or None'),
    ('t5xv-infer', ['--gin_file=gin/runs/infer.gin', "--gin.INFER_OUTPUT='{tmp}/p.jsonl'",
                    '--gin.infer.batch_size=0'],
     'infer.batch_size = 0 is out of range: the decoding batch size must be an integer >= 1'),
    ('t5xv-infer', ['--gin_file=gin/runs/infer.gin', "--gin.INFER_OUTPUT='{tmp}/p.jsonl'",
                    "--gin.INPUT_FILE='/dev/null'", '--gin.DecodeOptions.num_beams=0'],
     'DecodeOptions.num_beams = 0 is out of range: it must be an integer >= 1'),
    ('t5xv-infer', ['--gin_file=gin/runs/infer.gin', "--gin.INFER_OUTPUT='{tmp}/p.jsonl'",
                    "--gin.INPUT_FILE='/dev/null'"],
     'INPUT_FILE /dev/null has no text to decode (one input per line)'),
    ('t5xv-infer', ['--gin_file=gin/runs/infer.gin', "--gin.INFER_OUTPUT='{tmp}/p.jsonl'",
                    "--gin.INPUT_FILE='/no/such/texts.txt'"],  # bare errno messages before
     'INPUT_FILE /no/such/texts.txt cannot be read as text (FileNotFoundError: '),
    ('t5xv-infer', ['--gin_file=gin/runs/infer.gin', "--gin.INFER_OUTPUT='{tmp}/p.jsonl'",
                    "--gin.INPUT_FILE='{tmp}'"],
     'INPUT_FILE {tmp} cannot be read as text (IsADirectoryError: '),
    ('t5xv-infer', ['--gin_file=gin/runs/infer.gin', "--gin.INFER_OUTPUT='{tmp}/p.jsonl'",
                    "--gin.INPUT_FILE='docs/experiments/lr_depth2_h100_lr.png'"],
     'INPUT_FILE docs/experiments/lr_depth2_h100_lr.png cannot be read as text (UnicodeDecodeError: '),
    ('t5xv-infer', ['--gin_file=gin/runs/infer.gin', "--gin.INFER_OUTPUT='README.md/p.jsonl'",
                    "--gin.INPUT_FILE='/dev/null'"],  # found only after decoding before
     'INFER_OUTPUT README.md/p.jsonl cannot be written: /'),  # (the file, absolute: README.md)
])
def test_bad_eval_and_infer_numbers_are_one_line_before_any_work(name, flags, message, tmp_path,
                                                                 capsys):
  main = {'t5xv-eval': eval_cli.main, 't5xv-infer': infer.main}[name]
  with pytest.raises(SystemExit) as e:  # the quickstart's file stands for a run's config.gin
    main(['--gin_file=gin/experiments/quickstart.gin', f"--gin.CHECKPOINT_PATH='{tmp_path}'",
          *[f.replace('{tmp}', str(tmp_path)) for f in flags]])
  err = capsys.readouterr().err
  message = message.replace('{tmp}', str(tmp_path))
  assert e.value.code == 2 and err.count('\n') == 1 and err.startswith(f'{name}: error: {message}'), err
  assert not os.listdir(tmp_path)


def test_a_quickstart_step_that_fails_is_named_and_advises_the_quickstarts_flags(tmp_path, capsys):
  """The training step's refusal of a directory holding another model's run: it was labelled
  t5xv-train and advised --gin.MODEL_DIR, which t5xv-quickstart refuses."""
  from t5x_variants.cli import quickstart  # pylint: disable=g-import-not-at-top
  (tmp_path / 'model-info.txt').write_text('ffn: a_former_ffn\n')
  with pytest.raises(SystemExit) as e:
    quickstart.main([f'--model_dir={tmp_path}'])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count('\n') == 1, err
  assert err.startswith(f"t5xv-quickstart (t5xv-train step): error: --model_dir='{tmp_path}' holds "
                        'a run of another model (ffn: saved a_former_ffn, this configuration '), err
  assert 'or set --model_dir to a new directory' in err and '--gin.' not in err.split('config.gin')[-1]
  assert os.listdir(tmp_path) == ['model-info.txt']
  with pytest.raises(SystemExit) as e:  # a flag its training step does not know: was "t5xv-train: error"
    quickstart.main([f'--model_dir={tmp_path}', '--modeldir=x'])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err == ('t5xv-quickstart (t5xv-train step): error: unrecognized '
                                       'arguments: --modeldir=x (see --help)\n'), err


def test_a_resume_with_another_vocabulary_is_refused(tmp_path, capsys):
  """A run of the embedded SentencePiece vocabulary resumed with bytes went on training (other
  ids for the same embeddings), its vocab.model left to mislead t5xv-eval."""
  import gin  # pylint: disable=g-import-not-at-top
  run = ['--gin_file=gin/experiments/quickstart.gin', f"--gin.MODEL_DIR='{tmp_path}'",
         '--gin.TRAIN_STEPS=2', '--gin.Checkpointer.period=2', '--gin.train.eval_period=0',
         "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", '--gin.BATCH_SIZE=2']
  assert train.main(run) == 0
  vocab = (tmp_path / 'vocab.model').read_bytes()
  gin.clear_config()
  with pytest.raises(SystemExit) as e:
    train.main([*run, '--gin.TRAIN_STEPS=4', "--gin.vocabulary.kind='bytes'"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count('\n') == 1, err
  assert err.startswith(f't5xv-train: error: {tmp_path} holds a run trained with another vocabulary '
                        "(its vocab.model, not this run's, which has no SentencePiece file"), err
  assert sorted(p.name for p in tmp_path.glob('checkpoint_*')) == ['checkpoint_2']
  assert (tmp_path / 'vocab.model').read_bytes() == vocab
  advice = err.split('resume it with its own (')[1].split(')')[0].split()
  assert advice == ['--gin.vocabulary.kind="\'file\'"',
                    f'--gin.vocabulary.path="\'{tmp_path}/vocab.model\'"'], err
  gin.clear_config()  # the advice (as a shell would pass it: its quotes removed) resumes the run
  assert train.main([*run, '--gin.TRAIN_STEPS=4',
                     *(a.replace('"', '') for a in advice)]) == 0
  assert (tmp_path / 'vocab.model').read_bytes() == vocab
  assert 'checkpoint_4' in os.listdir(tmp_path)
  gin.clear_config()


def test_a_second_trainer_on_a_run_directory_is_refused_before_it_writes(tmp_path, capsys):
  """The same t5xv-train twice (here: the lock held by another open file, as another process
  holds it) trained both into one directory, saving the same checkpoints."""
  from t5x_variants.train import locks  # pylint: disable=g-import-not-at-top
  run_dir = tmp_path / 'run'
  lock_file = locks.host_file('t5xv-run', str(run_dir)) + '.lock'
  (tmp_path / 'link').symlink_to(run_dir)  # one directory by any name, a bucket's with a slash
  assert locks.host_file('t5xv-run', str(tmp_path / 'link')) + '.lock' == lock_file
  assert locks.host_file('x', 'gs://b/run/') == locks.host_file('x', 'gs://b/run')
  held = locks.exclusive(lock_file)
  try:
    assert locks.exclusive(lock_file) is None
    with pytest.raises(SystemExit) as e:
      train.main(['--gin_file=gin/experiments/quickstart.gin', f"--gin.MODEL_DIR='{run_dir}'",
                  '--gin.TRAIN_STEPS=2'])
  finally:
    held.close()
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count('\n') == 1, err
  assert err.startswith(f't5xv-train: error: another t5xv-train is training in {run_dir} on this '
                        'host; wait for it'), err
  assert not run_dir.exists()  # (a trainer that ends releases it: the resume tests train twice)
  gin.clear_config()


@pytest.mark.parametrize('existing', ['metrics.jsonl', 'a_directory', 'a_json_string', 'binary'])
def test_infer_replaces_no_file_but_its_own_output(existing, tmp_path, capsys):
  """INFER_OUTPUT naming a run's metrics.jsonl (or a directory) is refused before any work, the
  file untouched; an earlier t5xv-infer output would be replaced."""
  target = tmp_path / existing
  if existing == 'a_directory':
    target.mkdir()
    message = f'INFER_OUTPUT {target} is a directory: give a file path in it'
  else:
    target.write_bytes({'metrics.jsonl': b'{"step": 1, "loss": 2.5}\n',
                        'a_json_string': b'"no prediction here"\n', 'binary': b'\xff\xfe\x00'}[existing])
    message = f'INFER_OUTPUT {target} exists and is not an earlier t5xv-infer output'
  before = None if existing == 'a_directory' else target.read_bytes()
  with pytest.raises(SystemExit) as e:
    infer.main(['--gin_file=gin/experiments/quickstart.gin', '--gin_file=gin/runs/infer.gin',
                f"--gin.CHECKPOINT_PATH='{tmp_path / 'no_run'}'", f"--gin.INFER_OUTPUT='{target}'",
                "--gin.INPUT_FILE='/dev/null'"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith(f't5xv-infer: error: {message}'), err
  assert existing == 'a_directory' or target.read_bytes() == before
  (tmp_path / 'earlier.jsonl').write_text('{"inputs": "a", "prediction": "b", "score": -1.0}\n')
  infer.check_output(str(tmp_path / 'earlier.jsonl'))  # no error


def test_a_run_of_the_same_model_passes_the_model_dir_check(tmp_path):
  """model-info.txt compared field by field: the same model (another execution line: a resumed
  run may change remat or dtype) passes, and a field only one version of the summary has is no
  difference."""
  from t5x_variants.cli import recipe  # pylint: disable=g-import-not-at-top
  from t5x_variants.models.summary import model_fields, model_info  # pylint: disable=g-import-not-at-top
  recipe.parse_gin(['gin/experiments/quickstart.gin'], [],
                   configurables=recipe.library_configurables())
  config = recipe.build_config()
  text = model_info(config).replace('execution: scan_layers=True remat=auto', 'execution: remat=full')
  (tmp_path / 'model-info.txt').write_text(text.replace(', init: t5)', ')') + '\n')
  train.check_model_dir(str(tmp_path), config)  # no error
  assert model_fields(text)['ffn'] == 'relu'
  assert model_fields(text)['norm placement.init'] == 't5'


@pytest.mark.parametrize('change, field', [
    (dict(relative_attention_max_distance=64), 'positions.max_distance: saved 128'),
    (dict(relative_attention_bidirectional=False), 'positions.bidirectional: saved None'),
    (dict(scale_embeddings=True), 'embeddings.scaled: saved False'),
    (dict(scale_tied_logits=False), 'embeddings.scale_tied_logits: saved True'),
    (dict(norm_epsilon=1e-5), 'norm placement.epsilon: saved 1e-06'),
])
def test_a_change_that_keeps_the_parameters_shapes_is_another_model(tmp_path, change, field):
  """Fields that change what the model computes but no parameter's shape: a resume with one
  changed went on training another function (model-info.txt did not hold them)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from conftest import tiny  # pylint: disable=g-import-not-at-top
  from t5x_variants.models.summary import model_info  # pylint: disable=g-import-not-at-top
  config = tiny(tie_embeddings=True)
  (tmp_path / 'model-info.txt').write_text(model_info(config) + '\n')
  train.check_model_dir(str(tmp_path), config)  # the same model
  with pytest.raises(ValueError, match=f'holds a run of another model \\({field}'):
    train.check_model_dir(str(tmp_path), dataclasses.replace(config, **change))


@pytest.mark.parametrize('vanished', [True, False])
def test_eval_all_skips_a_checkpoint_removed_after_listing(vanished, tmp_path, monkeypatch, capsys):
  """A training run's keep-N cleanup removes checkpoint_10 between the listing and the read (here
  right after the listing, deterministically): it is skipped with one line and checkpoint_20 is
  evaluated. A checkpoint that is still there but cannot be read stops the evaluation as before."""
  from conftest import tiny  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import common  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import checkpoints, pretrained  # pylint: disable=g-import-not-at-top
  from test_schedules_and_checkpoints import state  # pylint: disable=g-import-not-at-top
  common.import_data_layer()
  run = tmp_path / 'run'
  ckpt = checkpoints.Checkpointer(str(run), period=10, keep=None)
  for step in (10, 20):
    ckpt.save(step, state(step))
  ckpt.close()

  class Predictor:  # reads the checkpoint's parameters as t5xv-eval does; no model is built
    def __init__(self, config, **kwargs):
      del config, kwargs

    def check_run(self, run_dir):  # (no model-info.txt here)
      del run_dir

    def load(self, path):
      self.params = pretrained.restore_params(path, state(0).params)
      return self

  listing = checkpoints.list_checkpoints

  def list_then_cleanup(run_dir):
    paths = listing(run_dir)
    if vanished:
      paths[0].rmtree()  # the trainer's keep-N cleanup, right after the listing
    else:
      for f in (paths[0] / 'state').iterdir():  # damaged in place
        f.unlink() if f.is_file() else f.rmtree()
    return paths

  monkeypatch.setattr(checkpoints, 'list_checkpoints', list_then_cleanup)
  monkeypatch.setattr(eval_cli, 'Predictor', Predictor)
  monkeypatch.setattr(eval_cli, 'VANISH_WAIT_SECS', 0.1)
  monkeypatch.setattr(eval_cli, 'teacher_forced',
                      lambda predictor, *a, **k: {'loss': float(predictor.params['w'][0, 0])})
  evaluate = lambda: eval_cli.evaluate_checkpoints(
      tiny(vocab_size=4224), checkpoint_path=str(run), all_checkpoints=True,
      mixture_or_task_name='embedded_span_corruption',
      task_feature_lengths={'inputs': 64, 'targets': 16}, inference=False)
  if not vanished:
    with pytest.raises(checkpoints.CheckpointError, match='cannot read the parameters of .*checkpoint_10'):
      evaluate()
    return
  assert evaluate() == {20: {'embedded_span_corruption': {'loss': 20.0}}}
  out = capsys.readouterr().out
  assert ('checkpoint 10: checkpoint_10 was removed before it could be read (e.g. by the training '
          "run's keep-N cleanup), skipped") in out
  assert 'best of 1 checkpoint(s)' in out


def test_best_over_checkpoints_takes_the_lowest_loss_and_the_highest_score():
  """An undefined score (NaN: a constant prediction's correlation, as STS-B early on) is no best."""
  results = {'10': {'rte': {'loss': 1.0, 'accuracy': 60.0, 'num_tokens': 5.0},
                    'stsb': {'pearson': float('nan')}},
             '20': {'rte': {'loss': 0.5, 'accuracy': 55.0, 'num_tokens': 5.0},
                    'cola': {'mcc': 30.0, 'log_perplexity': 2.0}, 'stsb': {'pearson': 85.0}},
             '30': {'cola': {'mcc': 42.0, 'log_perplexity': 2.5}, 'stsb': {'pearson': float('nan')}},
             'best': {'stale': {}}}
  assert eval_cli.best_over_checkpoints(results) == {
      'rte': {'loss': {'value': 0.5, 'step': 20}, 'accuracy': {'value': 60.0, 'step': 10}},
      'cola': {'mcc': {'value': 42.0, 'step': 30}, 'log_perplexity': {'value': 2.0, 'step': 20}},
      'stsb': {'pearson': {'value': 85.0, 'step': 20}}}


def test_a_model_or_task_that_cannot_score_targets_says_why():
  """The line t5xv-eval prints where a task's metrics of scores are left out."""
  task = lambda *features: types.SimpleNamespace(output_features=dict.fromkeys(features))
  model = lambda architecture: types.SimpleNamespace(architecture=architecture)
  assert eval_passes.unscored(task('inputs', 'targets'), model('encoder_decoder')) is None  # pylint: disable=protected-access
  assert 'encoder-only' in eval_passes.unscored(task('inputs', 'targets'), model('encoder_only'))  # pylint: disable=protected-access
  assert 'no inputs' in eval_passes.unscored(task('targets'), model('decoder_only'))  # pylint: disable=protected-access


def test_metrics_t5xv_eval_does_not_compute_are_named():
  """A seqio task's predict_with_aux_metric_fns and its own metric objects were skipped without a
  word; its plain metric functions are computed (none named)."""
  import seqio  # pylint: disable=g-import-not-at-top
  def accuracy(targets, predictions):
    return {'accuracy': 0.0}
  def with_aux(targets, predictions, aux_values):
    return {'aux': 0.0}
  source = seqio.FunctionDataSource(lambda split, shuffle_files, seed=None: None, splits=['v'])
  features = {'targets': seqio.Feature(seqio.PassThroughVocabulary(10))}
  task = lambda **metrics: seqio.Task('t5xv_metric_kinds', source, features, **metrics)
  assert eval_cli.uncomputed_metrics(task(metric_fns=[accuracy])) is None
  assert eval_cli.uncomputed_metrics(task(metric_fns=[accuracy, with_aux])) == (
      'predict_with_aux_metric_fns with_aux')
  passthrough = seqio.metrics.PassthroughLegacyMetric.empty()
  assert eval_cli.uncomputed_metrics(task(metric_objs=[passthrough])) == (
      '1 metric object(s) (metric_objs)')


def test_max_examples_keeps_a_rank_classification_question_whole():
  """Rank classification's rows of one question (its choices) share idx[0]: a limit that falls
  inside one leaves it out (was: scored from some of its choices, or t5's metric's assertion);
  rows without such an idx are cut at the limit."""
  rows = [{'idx': np.array([q, c])} for q in range(3) for c in range(2)]
  questions = lambda kept: [int(ex['idx'][0]) for ex in kept]
  whole = functools.partial(eval_passes.whole_questions, question=eval_passes._choices_question)
  assert questions(whole(rows, 3)) == [0, 0]
  assert questions(whole(rows, 4)) == [0, 0, 1, 1]
  assert questions(whole(rows, None)) == [0, 0, 1, 1, 2, 2]
  assert whole(rows[:1], 1) == rows[:1]
  assert len(whole([{'idx': 7}] * 5, 3)) == 3


def test_max_examples_keeps_a_multirc_question_whole_in_the_predictions():
  """MultiRC's exact match judges a question's answer options together (its postprocessed
  targets' group): a limit inside one leaves that question out of the decoded predictions too
  (was: scored from its first options, EM 100 where the whole question scored 0)."""
  from t5x_variants.data import super_glue  # pylint: disable=g-import-not-at-top
  task = types.SimpleNamespace(postprocess_fn=super_glue.multirc_postprocess)
  rows = [{'idx': {'paragraph': 0, 'question': q, 'answer': a}, 'targets_pretokenized': b'True'}
          for q, n in ((0, 2), (1, 3)) for a in range(n)]
  kept = eval_passes.whole_questions(rows, 4, functools.partial(eval_passes._group, task))
  assert [(r['idx']['question'], r['idx']['answer']) for r in kept] == [(0, 0), (0, 1)]
  assert eval_passes.whole_questions(rows, 5, functools.partial(eval_passes._group, task)) == rows


def test_benchmark_averages_are_t5s_best_step_and_each_tasks_best_step():
  """As T5's eval_utils: a task's score is its metrics' mean (MNLI's matched and mismatched one
  task), the benchmark's the mean over its tasks at a step where all have one, reported at its
  best step; each task also at its own best step. WNLI, teacher-forced figures and NaN left out."""
  results = {'10': {'glue_mrpc': {'loss': 0.1, 'f1': 80.0, 'accuracy': 70.0, 'num_tokens': 9.0},
                    'glue_cola': {'matthews_corrcoef': 20.0}, 'glue_wnli': {'accuracy': 99.0},
                    'glue_mnli': {'accuracy': 60.0}, 'glue_mnli_mismatched': {'accuracy': 62.0},
                    'super_glue_cb': {'f1': 50.0, 'accuracy': 60.0}},
             '20': {'glue_mrpc': {'loss': 0.2, 'f1': 84.0, 'accuracy': 68.0},  # 76 > 75
                    'glue_cola': {'matthews_corrcoef': 10.0},
                    'glue_mnli': {'accuracy': 70.0}, 'glue_mnli_mismatched': {'accuracy': 68.0},
                    'embedded_lm': {'log_perplexity': 3.0}},
             '30': {'glue_mrpc': {'f1': 90.0, 'accuracy': 90.0},  # a step without every task
                    'glue_cola': {'matthews_corrcoef': float('nan')}},
             '40': {'glue_mrpc': {'f1': 95.0, 'accuracy': 95.0}, 'glue_cola': {'matthews_corrcoef': 90.0},
                    'glue_mnli': {'accuracy': 99.0}},  # MNLI's mismatched half missing: no MNLI score
             'best': {}, 'settings': {}}
  averages = eval_cli.benchmark_averages(results)
  assert averages['GLUE']['tasks'] == {'glue_cola': {'value': 90.0, 'step': 40},
                                       'glue_mnli': {'value': 69.0, 'step': 20},
                                       'glue_mrpc': {'value': 95.0, 'step': 40}}
  # step 10: (75 + 20 + 61) / 3 = 52; step 20: (76 + 10 + 69) / 3 = 51.67; 30 and 40 lack a task
  assert (averages['GLUE']['value'], averages['GLUE']['step']) == (pytest.approx(52.0), 10)
  # A mean over fewer than the benchmark's tasks says which are missing (T5 gives no score).
  assert averages['GLUE']['missing'] == ['qnli', 'qqp', 'rte', 'sst2', 'stsb']
  assert averages['SuperGLUE'] == {'value': 55.0, 'step': 10,
                                   'tasks': {'super_glue_cb': {'value': 55.0, 'step': 10}},
                                   'missing': ['boolq', 'copa', 'multirc', 'record', 'rte', 'wic', 'wsc']}
  assert set(averages) == {'GLUE', 'SuperGLUE'}
  every = {f'glue_{t}_local': {'accuracy': 50.0} for t in eval_results.BENCHMARK_TASKS['GLUE']}
  every['glue_mnli_mismatched_local'] = {'accuracy': 50.0}
  assert eval_cli.benchmark_averages({'10': every})['GLUE']['missing'] == []
  # a classification task is its benchmark's task too
  assert 'rte' not in eval_cli.benchmark_averages(
      {'10': {'glue_rte_cls_local': {'accuracy': 50.0}}})['GLUE']['missing']


def test_results_written_before_the_split_key_are_read_as_validation(tmp_path):
  old = {'10': {'rte': {'loss': 1.0}}, 'best': {'rte': {'loss': {'value': 1.0, 'step': 10}}}}
  path = tmp_path / 'eval_results.json'
  path.write_text(json.dumps(old))
  assert eval_cli.read_results(epath.Path(path)) == {'validation': old}
  path.write_text(json.dumps({'test': old}))
  assert eval_cli.read_results(epath.Path(path)) == {'test': old}
  assert eval_cli.read_results(epath.Path(tmp_path / 'missing.json')) == {}


@pytest.mark.parametrize('text', ['[]', '{"validation": 3}', '{"validation": {', '\u00ff'])
def test_a_damaged_results_file_is_one_error_naming_it(tmp_path, text):
  """Was: an AttributeError traceback, or a JSON error naming no file."""
  path = tmp_path / 'eval_results.json'
  path.write_text(text)
  with pytest.raises(ValueError, match=rf'{path} cannot be read as t5xv-eval results \(.+\): move it '
                                       'aside to start its results afresh'):
    eval_cli.read_results(epath.Path(path))


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
                       env={**os.environ, **HOST_DEVICES})
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.startswith(f"{name}: error: mesh axis 'model' of size 8 does not divide heads = 4 ")
  assert out.stderr.strip().endswith('and the 8 devices: 1, 2, 4 (set MeshConfig.model)'), out.stderr
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def in_two_processes(tool, *args, each=lambda i: ()):
  """Runs console script ``tool`` as two processes joined by jax.distributed (one CPU device
  each), ``each(i)`` adding process i's own flags; (outputs, exit codes)."""
  from test_trainer import _free_port  # pylint: disable=g-import-not-at-top
  port = _free_port()
  procs = [subprocess.Popen(
      [os.path.join(BIN, tool), *args, *each(i), '--multiprocess_gpu',
       f'--coordinator_address=127.0.0.1:{port}', '--process_count=2', f'--process_index={i}'],
      cwd=REPO, env={**os.environ, 'JAX_PLATFORMS': 'cpu'}, text=True, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT) for i in range(2)]
  try:
    return [p.communicate(timeout=240)[0] for p in procs], [p.returncode for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


@pytest.mark.slow
def test_infer_in_two_processes_decodes_once_or_stops_both_on_different_inputs(quickstart,
                                                                                tmp_path):
  """Two processes run ``t5xv-infer``: each reads INPUT_FILE itself and feeds its rows of every
  batch. With the same file, process 0 writes the predictions; with another file on process 1,
  both stop with one line before decoding (before, the two decoded one batch made of rows of both
  files and wrote it); with no file on process 1, each stops with its line (before, process 0
  waited for process 1 until jax aborted both)."""
  run_dir = quickstart[0]
  texts = [tmp_path / 'a.txt', tmp_path / 'b.txt']
  texts[0].write_text('The file is opened in binary mode.\nReturn the number of items.\n')
  texts[1].write_text('The file is opened in binary mode.\nReturn the items.\n')
  out = tmp_path / 'predictions.jsonl'
  infer_in_two = lambda inputs: in_two_processes(
      't5xv-infer', f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/infer.gin',
      f"--gin.CHECKPOINT_PATH='{run_dir}'", f"--gin.INFER_OUTPUT='{out}'",
      each=lambda i: [f"--gin.INPUT_FILE='{inputs[i]}'"])
  outs, codes = infer_in_two([texts[0], texts[0]])
  assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
  assert 'process 1 of 2: joining the others at 127.0.0.1:' in outs[1]  # said before jax's wait
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r['inputs'] for r in rows] == texts[0].read_text().splitlines()
  out.unlink()
  outs, codes = infer_in_two(texts)
  assert codes == [2, 2] and not out.exists(), outs[0][-3000:] + outs[1][-3000:]
  for text in outs:
    assert ('t5xv-infer: error: the processes disagree on the examples to decode: process 0 has '
            'one, process 1 has another;') in text, text[-3000:]
  outs, codes = infer_in_two([texts[0], tmp_path / 'missing.txt'])  # a path on process 0's disk only
  assert codes == [2, 2] and not out.exists(), outs[0][-3000:] + outs[1][-3000:]
  assert ('t5xv-infer: error: reading INPUT_FILE failed on process 1 (its log says why); every '
          'process stopped here') in outs[0], outs[0][-3000:]
  assert ('t5xv-infer: error: INPUT_FILE ' + str(tmp_path / 'missing.txt') + ' cannot be read as text '
          '(FileNotFoundError: [Errno 2] No such file or directory') in outs[1], outs[1][-3000:]


@pytest.mark.slow
def test_eval_in_two_processes_gives_the_results_of_one(quickstart, tmp_path):
  """``t5xv-eval --gin.EVAL_ALL=True`` as two processes (each evaluation batch split between
  them, checked the same on both; eval_results.json read and written by process 0) on a copy of
  the quickstart's run gives the quickstart's own one-process results, to float32 rounding."""
  run_dir = tmp_path / 'run'
  shutil.copytree(quickstart[0], run_dir)
  (run_dir / eval_cli.RESULTS).unlink()
  outs, codes = in_two_processes(
      't5xv-eval', f'--gin_file={run_dir}/config.gin', '--gin_file=gin/runs/eval.gin',
      f"--gin.CHECKPOINT_PATH='{run_dir}'", '--gin.EVAL_ALL=True')
  assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
  one = eval_cli.read_results(epath.Path(quickstart[0]) / eval_cli.RESULTS)['validation']
  two = eval_cli.read_results(run_dir / eval_cli.RESULTS)['validation']
  steps = sorted(k for k in one if k.isdigit())
  assert steps == sorted(k for k in two if k.isdigit()) and len(steps) >= 2
  for step in steps:
    for task, metrics in one[step].items():
      assert metrics.keys() == two[step][task].keys()
      for name, value in metrics.items():
        assert two[step][task][name] == pytest.approx(value, rel=1e-5), (step, task, name)
