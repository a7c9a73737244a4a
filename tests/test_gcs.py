"""Run directories on a Cloud Storage API server on loopback (tests/gcs_server.py): the clients a
run writes a bucket with (gcsfs through epath for every file, tensorstore through orbax for the
arrays) against a GCS JSON API, each scenario checked on what the server holds afterwards, read
from the server itself; and the storage rows of the README's reliability table on a bucket."""
import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import needs_data_layer
from gcs_server import FaultProxy, client_environment
from t5x_variants.sweeps.runs import read_run
from t5x_variants.train import checkpoints, storage
from test_faults import STEPS, reference  # noqa: F401 (a fixture: 6 straight local steps)
from test_sweeps import assert_png
from test_trainer import subprocess_train  # noqa: F401 (a fixture)
from train_helpers import eval_batches, run_train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RUN = ["--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", '--gin.BATCH_SIZE=4',
            '--gin.train.log_period=2', '--gin.train.eval_period=4', '--gin.train.eval_batches=1',
            '--gin.Checkpointer.period=4', '--gin.train.diagnostics_period=4']


def _main(command, *args):
  """A command's main in this process, reading its own gin files as in its own process."""
  import gin  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  return command.main(list(args))


def _losses(run):
  """{step: loss} of the train records of ``run`` (every writer session's), the latest per step."""
  return {r['step']: r['loss'] for r in read_run(run).train}


def _committed(run):
  return [p.name for p in checkpoints.list_checkpoints(run)]


@pytest.fixture(autouse=True)
def no_appends(monkeypatch):
  """Opening an object for append is an error in these tests: gcsfs does not refuse it, it
  replaces the object with the appended bytes alone (seen against the server: 'x' then append
  'y' leaves 'y'), so a run must never do it (train/storage.py's AppendedFile)."""
  from etils.epath import gpath  # pylint: disable=g-import-not-at-top
  real = gpath.PosixGPath.open

  def refuse_append(self, mode='r', *args, **kwargs):
    if 'a' in mode and str(self).startswith('gs://'):
      raise AssertionError(f'append to {self} on a bucket')
    return real(self, mode, *args, **kwargs)
  monkeypatch.setattr(gpath.PosixGPath, 'open', refuse_append)


@pytest.fixture
def proxy(gcs):
  """A FaultProxy in front of the test server (none in front of a real bucket: skipped there)."""
  if gcs.url is None:
    pytest.skip('needs the GCS API server on loopback (T5XV_TEST_BUCKET names a real bucket)')
  fault_proxy = FaultProxy(gcs.url)
  yield fault_proxy
  fault_proxy.close()


@pytest.fixture
def local_cwd(tmp_path, monkeypatch):
  """The working directory, where a write through a local call to a name made from a URI would
  land (``gs:/...``): checked empty of such names at the end."""
  monkeypatch.chdir(tmp_path)
  yield tmp_path
  assert not [p for p in os.listdir(tmp_path) if p.startswith('gs:')], os.listdir(tmp_path)


def test_every_client_reaches_the_server_and_the_server_holds_what_they_wrote(gcs):
  root = gcs.new_bucket()
  storage.write_text(f'{root}/run/config.gin', 'x = 1\n')
  storage.copy(f'{root}/run/config.gin', f'{root}/run/copy.gin')
  assert sorted(p.name for p in storage.path(f'{root}/run').iterdir()) == ['config.gin', 'copy.gin']
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  array = ts.open({'driver': 'zarr', 'kvstore': f'{root}/run/array'}, create=True,
                  dtype=ts.float32, shape=[4]).result()
  array.write(np.arange(4, dtype=np.float32)).result()
  objects = gcs.objects(f'{root}/run')
  assert set(objects) == {'config.gin', 'copy.gin', 'array/.zarray', 'array/0'}, objects
  assert gcs.read(f'{root}/run/copy.gin') == b'x = 1\n'
  storage.path(f'{root}/run/copy.gin').unlink()
  assert 'copy.gin' not in gcs.objects(f'{root}/run')


def test_a_listing_sees_what_another_process_wrote_since_the_last_one(gcs):
  """gcsfs caches listings by default: t5xv-eval beside a run would never see its new
  checkpoints. train/storage.py turns the cache off."""
  run = storage.path(gcs.new_bucket()) / 'run'
  (run / 'checkpoint_2' / 'a').write_text('a')
  assert [p.name for p in run.iterdir()] == ['checkpoint_2']
  subprocess.run([sys.executable, '-c', 'import sys; from t5x_variants.train import storage; '
                  'storage.write_text(sys.argv[1], "b")', str(run / 'checkpoint_4' / 'a')], check=True)
  assert sorted(p.name for p in run.iterdir()) == ['checkpoint_2', 'checkpoint_4']


@pytest.mark.parametrize('name', ['run', 'run[1]*'])
def test_each_writer_session_of_an_appended_file_is_its_own_object(gcs, name):
  """Also in a directory whose name has glob characters (read back as nothing, before: a glob on
  a store matches its whole path)."""
  run = f'{gcs.new_bucket()}/{name}'
  first = storage.AppendedFile(f'{run}/metrics.jsonl', flush_secs=3600)
  first.write('{"step": 1}\n')
  assert gcs.objects(run) == {}  # held until the period or close
  second = storage.AppendedFile(f'{run}/metrics.jsonl')
  second.write('{"step": 2}\n')
  second.close()
  first.close()
  names = sorted(gcs.objects(run))
  assert len(names) == 2 and all(n.startswith('metrics.') and n.endswith('.jsonl') for n in names)
  records = [json.loads(l) for l in storage.read_appended(f'{run}/metrics.jsonl').splitlines()]
  assert sorted(r['step'] for r in records) == [1, 2]
  with storage.staged_read(f'{run}/metrics') as stem:  # the data position's objects alike
    assert sorted(os.path.basename(f) for f in os.listdir(os.path.dirname(stem))) == sorted(
        'x' + n[len('metrics'):] for n in names)


@needs_data_layer
@pytest.mark.slow
def test_pretrain_resume_eval_infer_and_finetune_on_a_bucket(gcs, local_cwd):
  """t5xv-train (4 steps, then resumed to 8: the losses of a straight 8-step run), t5xv-eval
  --gin.EVAL_ALL=True beside it, t5xv-infer, and a fine-tuning run from INITIAL_CHECKPOINT_PATH
  on the bucket, all on gs://; the server holds every object of the run directories."""
  from t5x_variants.cli import eval as eval_cli, infer, train  # pylint: disable=g-import-not-at-top
  root = gcs.new_bucket()
  run, straight, ft = f'{root}/run', f'{root}/straight', f'{root}/finetune'
  args = ['--gin_file=gin/experiments/quickstart.gin', *TINY_RUN]
  os.symlink(os.path.join(REPO, 'gin'), local_cwd / 'gin')
  assert _main(train, *args, f"--gin.MODEL_DIR='{run}'", '--gin.TRAIN_STEPS=4') == 0
  assert _committed(run) == ['checkpoint_4']
  assert _main(train, *args, f"--gin.MODEL_DIR='{run}'", '--gin.TRAIN_STEPS=8') == 0
  assert _main(train, *args, f"--gin.MODEL_DIR='{straight}'", '--gin.TRAIN_STEPS=8') == 0
  assert _losses(run) == _losses(straight) and sorted(_losses(run)) == [2, 4, 6, 8]

  assert _main(eval_cli, f'--gin_file={run}/config.gin', '--gin_file=gin/runs/eval.gin',
               f"--gin.CHECKPOINT_PATH='{run}'", '--gin.EVAL_ALL=True',
               '--gin.evaluate_checkpoints.max_batches=1',
               '--gin.evaluate_checkpoints.max_examples=2') == 0
  results = json.loads(gcs.read(f'{run}/eval_results.json'))['validation']
  assert {'4', '8'} <= set(results)
  storage.write_text(f'{root}/texts.txt', 'Return the number of items.\n')
  assert _main(infer, f'--gin_file={run}/config.gin', '--gin_file=gin/runs/infer.gin',
               f"--gin.CHECKPOINT_PATH='{run}'", f"--gin.INPUT_FILE='{root}/texts.txt'",
               f"--gin.INFER_OUTPUT='{run}/predictions.jsonl'") == 0
  (row,) = [json.loads(l) for l in gcs.read(f'{run}/predictions.jsonl').decode().splitlines()]
  # (an 8-step model's prediction may be empty: EOS first)
  assert row['inputs'] == 'Return the number of items.' and isinstance(row['prediction'], str)
  assert math.isfinite(row['score'])

  assert _main(train, f'--gin_file={run}/config.gin', '--gin_file=gin/runs/finetune.gin', *TINY_RUN,
               f"--gin.INITIAL_CHECKPOINT_PATH='{run}'", f"--gin.MODEL_DIR='{ft}'",
               "--gin.MIXTURE_OR_TASK_NAME='embedded_span_corruption'", '--gin.TRAIN_STEPS=4') == 0
  assert sorted(_losses(ft)) == [2, 4]  # a fresh step count, parameters from the pretrained run

  objects = gcs.objects(run)
  for name in ('config.gin', 'model-info.txt', 'vocab.model', 'diagnostics.npz',
               'eval_results.json', 'predictions.jsonl'):
    assert name in objects, sorted(objects)
  for step in (4, 8):  # orbax's commit marker on a bucket (no rename there), state and data
    for name in ('commit_success.txt', 'state/_METADATA', 'state/commit_success.txt',
                 'data/host-00000-of-00001.index'):
      assert f'checkpoint_{step}/{name}' in objects, sorted(objects)
  # two training sessions and the evaluation: one metrics object and one event file each
  assert len([n for n in objects if n.startswith('metrics.') and n.endswith('.jsonl')]) == 3
  assert len([n for n in objects if n.startswith('tensorboard/events.out.tfevents')]) == 3
  assert not [n for n in objects if '.t5xv-access-check' in n or 'tmp' in n.split('/')[-1]]
  assert {'checkpoint_4/commit_success.txt', 'config.gin'} <= set(gcs.objects(ft))


@needs_data_layer
def test_an_evaluation_stopped_by_an_error_keeps_the_records_its_results_list(gcs, local_cwd,
                                                                             monkeypatch):
  """t5xv-eval on a bucket stopped by an error at its second checkpoint: eval_results.json listed
  the first as evaluated (a rerun skips it) while its metrics.jsonl record, held for the 30 s
  flush period, was lost with the process."""
  from conftest import tiny  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import common, eval as eval_cli  # pylint: disable=g-import-not-at-top
  from test_schedules_and_checkpoints import state  # pylint: disable=g-import-not-at-top
  common.import_data_layer()
  run = f'{gcs.new_bucket()}/run'
  ckpt = checkpoints.Checkpointer(run, period=10, keep=None)
  for step in (10, 20):
    ckpt.save(step, state(step))
  ckpt.close()

  class Predictor:  # no model: the checkpoint's step is the "loss"
    def __init__(self, config, **kwargs):
      del config, kwargs

    def check_run(self, run_dir):  # (no model-info.txt here)
      del run_dir

    def load(self, path):
      self.step = int(str(path).rsplit('_', 1)[-1])
      return self

  def teacher_forced(predictor, *args, **kwargs):
    del args, kwargs
    if predictor.step == 20:
      raise RuntimeError('out of memory')
    return {'loss': float(predictor.step)}
  monkeypatch.setattr(eval_cli, 'Predictor', Predictor)
  monkeypatch.setattr(eval_cli, 'teacher_forced', teacher_forced)
  with pytest.raises(RuntimeError, match='out of memory'):
    eval_cli.evaluate_checkpoints(
        tiny(vocab_size=4224), checkpoint_path=run, all_checkpoints=True,
        mixture_or_task_name='embedded_span_corruption',
        task_feature_lengths={'inputs': 64, 'targets': 16}, inference=False)
  listed = json.loads(gcs.read(f'{run}/eval_results.json'))['validation']
  assert sorted(k for k in listed if k.isdigit()) == ['10']
  records = [json.loads(l) for l in storage.read_appended(f'{run}/metrics.jsonl').splitlines()]
  assert [(r['kind'], r['step'], r['loss']) for r in records] == [('eval', 10, 10.0)], records


@needs_data_layer
@pytest.mark.slow
def test_a_sweep_and_its_report_on_a_bucket(gcs, local_cwd):
  """The suite's sweep end to end: t5xv-sweep of 2 FFN variants x 1 seed of the small GLU recipe
  cut to 4 steps through the real t5xv-train, its sweep directory on the bucket, then t5xv-report
  there: sweep.json, each run's directory and train.log, report.md and its plots are objects on
  the server, and the report's rows are those of one finished seed."""
  bin_dir = os.path.dirname(sys.executable)
  sweep_dir = gcs.new_bucket() + '/sweep'
  tiny = ['--gin.TRAIN_STEPS=4', '--gin.BATCH_SIZE=4', '--gin.train.log_period=2',
          '--gin.train.eval_period=2', '--gin.train.eval_batches=1', '--gin.Checkpointer.period=2',
          '--gin.learning_rate_schedule.warmup_steps=1']
  out = subprocess.run([os.path.join(bin_dir, 't5xv-sweep'), f'--sweep_dir={sweep_dir}',
                        f'--gin_file={REPO}/gin/experiments/glu_variants/small.gin',
                        f'--variants={REPO}/gin/variants/ffn/relu.gin,{REPO}/gin/variants/ffn/swiglu.gin',
                        '--paper=glu', *tiny], capture_output=True, text=True)
  assert out.returncode == 0, out.stdout + out.stderr
  assert '[2/2] swiglu seed 0: done' in out.stdout and 'sweep' in out.stdout.splitlines()[-1]
  saved = json.loads(gcs.read(f'{sweep_dir}/sweep.json'))
  assert [(r['name'], r['status']) for r in saved['runs']] == [('relu-seed0', 'done'),
                                                               ('swiglu-seed0', 'done')]
  out = subprocess.run([os.path.join(bin_dir, 't5xv-report'), f'--sweep_dir={sweep_dir}'],
                       capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  objects = gcs.objects(sweep_dir)
  for run in ('relu-seed0', 'swiglu-seed0'):
    assert {f'{run}/train.log', f'{run}/config.gin',
            f'{run}/checkpoint_4/commit_success.txt'} <= set(objects)
    assert not [n for n in objects if n.startswith(f'{run}/checkpoint_2/')]  # the recipe keeps 1
    assert b'done: step 4' in gcs.read(f'{sweep_dir}/{run}/train.log')
  assert {'report.md', 'sweep_curves.png', 'sweep_final.png'} <= set(objects), sorted(objects)
  for name in ('sweep_curves', 'sweep_final'):
    assert_png(gcs.read(f'{sweep_dir}/{name}.png'))
  text = gcs.read(f'{sweep_dir}/report.md').decode()
  for variant in ('relu', 'swiglu'):
    row = next(l for l in text.splitlines() if l.startswith(f'| {variant} |'))
    cells = [c.strip() for c in row.strip('|').split('|')]
    assert cells[1:3] == ['1 done', '4/4'] and cells[6] == f'{cells[5]} (n=1, no interval)'
    assert cells[8] == 'no'
    assert 0 < float(cells[5]) < 9  # a log-perplexity below ln(4224) = 8.35
  assert 'Spearman' not in text  # fewer than 3 variants: no ranking


@pytest.mark.slow
def test_import_and_export_to_and_from_a_bucket(gcs, tmp_path):
  """t5xv-import of a transformers T5 held on the bucket into a run directory there, and
  t5xv-export of that run back to the bucket: the same weights both ways."""
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import hf as hf_cli  # pylint: disable=g-import-not-at-top
  from test_hf import hf_model  # pylint: disable=g-import-not-at-top
  _, local = hf_model(tmp_path, 'geglu', tied=False)
  root = gcs.new_bucket()
  for f in local.iterdir():
    storage.copy(f, f'{root}/hf/{f.name}')
  assert hf_cli.import_main([f'--hf_dir={root}/hf', f'--model_dir={root}/run']) == 0
  assert hf_cli.export_main([f'--checkpoint_path={root}/run', f'--output_dir={root}/out']) == 0
  assert {'config.json', 'model.safetensors', 'spiece.model'} <= set(gcs.objects(f'{root}/out'))
  theirs = st_numpy.load(gcs.read(f'{root}/hf/model.safetensors'))
  ours = st_numpy.load(gcs.read(f'{root}/out/model.safetensors'))
  assert set(ours) <= set(theirs) and ours
  for name, value in ours.items():
    np.testing.assert_array_equal(value, theirs[name], err_msg=name)


# --- the storage rows of the reliability table, on a bucket ----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize('phase, resumes_from', [('save', 2), ('committed', 4)])
def test_sigkill_during_an_asynchronous_save_on_a_bucket_then_rerun(phase, resumes_from, gcs,
                                                                   reference, subprocess_train):
  """Killed while checkpoint_4 is written (its objects there, its commit_success.txt not) or just
  after its commit: the rerun resumes from the newest committed checkpoint and logs the losses of
  an uninterrupted run, step for step; the uncommitted one is never listed or read. The rerun
  keeps 2 checkpoints: the older ones are deleted from the bucket."""
  _, ref = reference
  run = gcs.new_bucket() + '/run'
  proc = subprocess_train('kill', run, STEPS, phase, 4)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == -signal.SIGKILL and f'KILL {phase} 4' in out, out[-3000:]
  objects = gcs.objects(run)
  assert _committed(run) == [f'checkpoint_{s}' for s in range(2, resumes_from + 1, 2)]
  if phase == 'save':
    assert 'checkpoint_4/commit_success.txt' not in objects
    assert any(n.startswith('checkpoint_4/state/') for n in objects), sorted(objects)
    with pytest.raises(checkpoints.CheckpointError, match='checkpoint_4 is a checkpoint whose save '
                       'did not finish'):  # named, not listed: it was read
      checkpoints.checkpoint_path(f'{run}/checkpoint_4')
  assert str(checkpoints.checkpoint_path(f'{run}/checkpoint_2')) == f'{run}/checkpoint_2'
  run_train(run, STEPS, eval_data=eval_batches, eval_period=2, keep=2)
  assert _losses(run) == ref
  assert _committed(run) == ['checkpoint_4', 'checkpoint_6']  # keep 2: checkpoint_2 deleted
  assert not [n for n in gcs.objects(run) if n.startswith('checkpoint_2/')]
  assert read_run(run).step == STEPS


def test_keep_n_on_a_bucket_unlists_a_checkpoint_before_deleting_its_objects(gcs, monkeypatch,
                                                                            caplog):
  """Keep-N stopped while it deletes checkpoint_1's objects (an outage, or a kill there): it is no
  longer listed and every listed checkpoint reads; the failure is a warning and the next call
  deletes the rest. Before, orbax deleted its objects in place, in batches in no set order,
  commit_success.txt among them, so a stop could leave it listed without its arrays."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import pretrained  # pylint: disable=g-import-not-at-top
  run = gcs.new_bucket() + '/run'
  ckpt = checkpoints.Checkpointer(run, period=1, keep=1, async_save=False)
  ckpt.save(1, {'params': {'w': jnp.full((2, 3), 1.0)}})

  def stopped(path, missing_ok=False):
    raise OSError(f'stopped while deleting {path}')
  monkeypatch.setattr(type(storage.path(run)), 'rmtree', stopped)
  ckpt.save(2, {'params': {'w': jnp.full((2, 3), 2.0)}})
  ckpt._wait_for_deletions()  # pylint: disable=protected-access
  monkeypatch.undo()
  assert 'could not delete the checkpoints before the newest' in caplog.text
  assert _committed(run) == ['checkpoint_2']
  assert any(n.startswith('checkpoint_1/state/') for n in gcs.objects(run))  # left, unlisted
  np.testing.assert_array_equal(pretrained.read_on_host(f'{run}/checkpoint_2')['w'],
                                np.full((2, 3), 2.0))
  ckpt.close()
  assert not [n for n in gcs.objects(run) if n.startswith('checkpoint_1/')]


def test_a_checkpointer_deletes_what_a_killed_keep_n_left_on_a_bucket(gcs):
  """A checkpoint_<step> without commit_success.txt older than the newest committed one (keep-N
  killed mid-deletion) is deleted when the next run starts; a newer one (an unfinished save, which
  its error message names) and the committed ones are kept."""
  from test_schedules_and_checkpoints import state  # pylint: disable=g-import-not-at-top
  run = gcs.new_bucket() + '/run'
  ckpt = checkpoints.Checkpointer(run, period=1, keep=None, async_save=False)
  for step in (1, 2, 3, 4):
    ckpt.save(step, state(step))
  ckpt.close()
  for step in (1, 4):  # 1: keep-N killed after its commit_success.txt; 4: an unfinished save
    (storage.path(run) / f'checkpoint_{step}' / checkpoints.COMMITTED).unlink()
  checkpoints.Checkpointer(run, period=1, keep=None).close()
  left = {n.split('/')[0] for n in gcs.objects(run)}
  assert left == {'checkpoint_2', 'checkpoint_3', 'checkpoint_4'}
  assert _committed(run) == ['checkpoint_2', 'checkpoint_3']


@pytest.mark.slow
def test_a_server_answering_503_for_a_while_is_retried(gcs, proxy, reference, subprocess_train):
  """Four requests in a row answered 503 from the first one of checkpoint_4's save on: the
  clients retry them, the run ends as an uninterrupted one and every checkpoint is committed."""
  _, ref = reference
  run = gcs.new_bucket() + '/run'
  proxy.fail(503, 4, after='checkpoint_4')
  os.environ.update(client_environment(proxy.url))
  try:
    proc = subprocess_train('plain', run, STEPS)
  finally:
    os.environ.update(client_environment(gcs.url))
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  assert proxy.failed == 4
  assert _losses(run) == ref
  assert _committed(run) == ['checkpoint_2', 'checkpoint_4', 'checkpoint_6']


def _console_lines(stderr):
  """The lines a command printed on stderr, but tensorstore's note that it uses the test token
  (GOOGLE_AUTH_TOKEN_FOR_TESTING, set only by these tests) and orbax's note that a save waited
  over a second for the one before it (which the proxy's slow answers may cause, or not)."""
  return [l for l in stderr.splitlines() if l.strip() and 'GOOGLE_AUTH_TOKEN_FOR_TESTING' not in l
          and 'Waiting for previous save to complete took' not in l]


def _train_command(model_dir, env, steps=4):
  return subprocess.run([sys.executable, '-m', 't5x_variants.cli.train',
                         '--gin_file=gin/experiments/quickstart.gin', *TINY_RUN,
                         f"--gin.MODEL_DIR='{model_dir}'", f'--gin.TRAIN_STEPS={steps}'],
                        cwd=REPO, capture_output=True, text=True, env=env, timeout=300)


@needs_data_layer
@pytest.mark.slow
def test_an_outage_longer_than_the_retries_at_a_commit_is_one_line_and_the_last_checkpoint_intact(
    gcs, proxy):
  """Every write of checkpoint_8's commit_success.txt answered 503: gcsfs gives up after its
  retries (about half a minute), t5xv-train stops with one line saying checkpoint_4 is intact and
  exit status 2; the rerun, the server healthy again, resumes from it and finishes."""
  root = gcs.new_bucket()
  proxy.fail(503, only='checkpoint_8/commit_success.txt')
  out = _train_command(f'{root}/run', dict(os.environ, **client_environment(proxy.url)), steps=8)
  assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
  errors = _console_lines(out.stderr)
  assert len(errors) == 1 and 'saving a checkpoint in' in errors[0], out.stderr[-3000:]
  assert 'checkpoint_4 (and those before it) is intact' in errors[0]
  assert 'without a commit_success.txt' in errors[0]
  assert _committed(f'{root}/run') == ['checkpoint_4']
  rerun = _train_command(f'{root}/run', os.environ, steps=8)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert _committed(f'{root}/run') == ['checkpoint_4', 'checkpoint_8']


@needs_data_layer
@pytest.mark.slow
@pytest.mark.parametrize('status', [403, 401])
def test_403_or_401_on_the_bucket_is_one_line_before_any_step(gcs, proxy, status):
  """Forbidden, or no (or expired) credentials: gcsfs raises a PermissionError for the one and
  its own HttpError for the other."""
  root = gcs.new_bucket()
  bucket = root[len('gs://'):]
  proxy.fail(status, bucket=bucket)
  out = _train_command(f'{root}/run', dict(os.environ, **client_environment(proxy.url)))
  assert out.returncode == 2, out.stdout + out.stderr
  errors = _console_lines(out.stderr)
  assert len(errors) == 1 and errors[0].startswith('t5xv-train: error: '), out.stderr
  assert f'may not use bucket {bucket}' in errors[0] and 'storage.objects.create' in errors[0]
  assert 'step' not in out.stdout and gcs.objects(root) == {}


def test_a_bucket_whose_metadata_the_credentials_may_not_read_is_named_at_start_up(gcs, proxy):
  """Object permissions alone passed the start-up check; orbax then read the bucket's metadata
  (storage.buckets.get) at its first listing of the checkpoints and failed in a traceback."""
  root = gcs.new_bucket()
  bucket = root[len('gs://'):]
  check = ('from t5x_variants.train import storage; '
           f'print(storage.store_unusable("{root}/run"))')
  env = dict(os.environ, **client_environment(proxy.url))
  assert subprocess.run([sys.executable, '-c', check], env=env, capture_output=True, text=True,
                        check=True).stdout.strip() == 'None'
  proxy.fail(403, bucket=bucket, only=f'/b/{bucket}?')  # the bucket's own metadata only
  out = subprocess.run([sys.executable, '-c', check], env=env, capture_output=True, text=True,
                       check=True).stdout
  assert f'may not read the metadata of bucket {bucket} (storage.buckets.get)' in out, out


def test_a_retried_delete_answered_404_is_no_missing_bucket(gcs, proxy):
  """The start-up check deletes its probe object; a retry of that delete whose first answer was
  lost finds it gone (404). That was read as 'bucket does not exist'."""
  root = gcs.new_bucket()
  check = ('from t5x_variants.train import storage; '
           f'print(storage.store_unusable("{root}/run"))')
  proxy.fail(404, count=1, method='DELETE')
  out = subprocess.run([sys.executable, '-c', check], env=dict(os.environ, **client_environment(proxy.url)),
                       capture_output=True, text=True, check=True).stdout
  assert out.strip() == 'None' and proxy.failed == 1, out


@needs_data_layer
def test_a_bucket_that_does_not_exist_is_one_line_at_start_up(gcs, capsys, local_cwd):
  from t5x_variants.cli import train  # pylint: disable=g-import-not-at-top
  os.symlink(os.path.join(REPO, 'gin'), local_cwd / 'gin')
  with pytest.raises(SystemExit) as e:
    _main(train, '--gin_file=gin/experiments/quickstart.gin', *TINY_RUN,
          "--gin.MODEL_DIR='gs://t5xv-no-such-bucket/run'", '--gin.TRAIN_STEPS=4')
  assert e.value.code == 2
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert len(err) == 1 and 'bucket t5xv-no-such-bucket does not exist' in err[0], err
