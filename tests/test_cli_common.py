"""What every command shares: the launcher's transparent huge pages (CPU hosts only), one-line
usage errors, and quiet start-up."""
import dataclasses
import os
import subprocess
import sys

import gin
import pytest

from t5x_variants.cli import common, hf, info, launch, report


def test_reexec_is_skipped_when_set_or_turned_off():
  assert not launch.wants_reexec({'GLIBC_TUNABLES': f'glibc.malloc.arena_max=2:{launch.TUNABLE}'})
  assert not launch.wants_reexec({'T5XV_HUGEPAGES': '0'})


def test_huge_pages_only_where_jax_runs_on_the_cpu():
  """JAX_PLATFORMS decides when set; else an installed accelerator plugin or device node means
  a GPU/TPU host, where the CPU tuning is never applied."""
  assert launch.backend_is_cpu({'JAX_PLATFORMS': 'cpu'}, plugins=['jax_cuda12_plugin'])
  assert not launch.backend_is_cpu({'JAX_PLATFORMS': 'cuda,cpu'}, plugins=[], devices=[])
  assert not launch.backend_is_cpu({'JAX_PLATFORMS': 'tpu'}, plugins=[], devices=[])
  assert not launch.backend_is_cpu({}, plugins=['jax_cuda13_plugin'], devices=[])
  assert launch.backend_is_cpu({}, plugins=['libtpu'], devices=[])  # t5xv-compile's libtpu on a CPU host
  assert not launch.backend_is_cpu({}, plugins=['libtpu'], devices=['/dev/accel0'])
  assert not launch.backend_is_cpu({}, plugins=[], devices=['/dev/nvidia0'])
  assert launch.backend_is_cpu({}, plugins=[], devices=[])
  assert not launch.wants_reexec({}, plugins=['jax_cuda12_plugin'], devices=[])


@pytest.mark.skipif(not launch.wants_reexec({}), reason='no glibc, no transparent huge pages, or '
                    'an accelerator here')
def test_reexec_runs_the_same_command_once_with_the_tunable():
  code = ('import os; from t5x_variants.cli import launch; print("start", os.getpid(), flush=True); '
          'launch.reexec_with_hugepages(); print("tunables", os.getpid(), os.environ["GLIBC_TUNABLES"])')
  env = {k: v for k, v in os.environ.items() if k not in ('GLIBC_TUNABLES', 'T5XV_HUGEPAGES')}
  env['GLIBC_TUNABLES'] = 'glibc.malloc.arena_max=4'
  out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, check=True)
  lines = out.stdout.split()
  assert lines.count('start') == 2 and lines.count('tunables') == 1, out.stdout
  starts = [lines[i + 1] for i, w in enumerate(lines) if w == 'start']
  assert starts[0] == starts[1] == lines[lines.index('tunables') + 1]  # same process, replaced
  assert lines[-1] == f'glibc.malloc.arena_max=4:{launch.TUNABLE}'


def test_console_script_runs_through_the_launcher():
  script = os.path.join(os.path.dirname(sys.executable), 't5xv-bench')
  if not os.path.exists(script):
    pytest.skip('package not installed as console scripts')
  out = subprocess.run([script, '--help'], capture_output=True, text=True, check=True)
  assert 't5xv-bench' in out.stdout


@pytest.mark.parametrize('argv, message', [
    (['--no_such_flag'], 'unrecognized arguments: --no_such_flag'),
    (['--gin.TransformerConfig.d_model'], 'expected --gin.KEY=VALUE'),
])
def test_a_usage_error_is_one_line_with_status_2(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    info.main(['--gin_file=gin/models/t5_tiny.gin', *argv])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count('\n') == 1 and err.startswith('t5xv-info: error:')
  assert message in err


@pytest.mark.parametrize('main, prog', [(report.main, 't5xv-report'), (hf.import_main, 't5xv-import'),
                                        (hf.export_main, 't5xv-export')])
def test_commands_without_gin_give_one_line_usage_errors_too(main, prog, capsys):
  with pytest.raises(SystemExit) as e:
    main(['--no_such_flag'])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count('\n') == 1 and err.startswith(f'{prog}: error:'), err
  assert 'unrecognized arguments: --no_such_flag' in err or 'required' in err


@pytest.mark.parametrize('argv, message', [
    ([], 'the following arguments are required: command'),
    (['convert'], "invalid choice: 'convert'"),
    (['import', '--model_dir=/tmp/x'], 't5xv-import: error: the following arguments are required: --hf_dir'),
    (['export'], 't5xv-export: error: the following arguments are required: --checkpoint_path')])
def test_python_m_hf_dispatches_to_import_or_export(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    hf.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count('\n') == 1 and message in err, err


def test_multiprocess_flags_missing_are_one_error():
  args = common.parser('t5xv-x', 'doc').parse_args(['--multiprocess_gpu', '--process_count=2'])
  with pytest.raises(common.UsageError, match='needs --coordinator_address, --process_index'):
    common.initialize_processes(args)


@pytest.mark.parametrize('flags,message', [
    (['--multiprocess_gpu', '--multiprocess_tpu'], '--multiprocess_tpu and --multiprocess_gpu exclude'),
    (['--local_device_ids=0'], '--local_device_ids names the GPUs of one of several processes'),
    # a forgotten --multiprocess_gpu: each of N hosts trained alone into one directory
    (['--process_count=2', '--process_index=1'], '--process_count is for one of several processes: '
                                                 'give it with --multiprocess_gpu'),
    (['--multiprocess_gpu', '--coordinator_address=localhost', '--process_count=2',
      '--process_index=0'], '--coordinator_address=localhost needs a port'),  # (jax: IndexError)
    (['--multiprocess_tpu'], '--multiprocess_tpu found no Cloud TPU pod to join'),  # a CPU host
])
def test_multiprocess_flags_that_cannot_work_here_are_one_error(flags, message, monkeypatch):
  """Before: both flags took the TPU path (jax's 'coordinator_address should be defined'), and
  --local_device_ids alone was ignored."""
  import jax  # pylint: disable=g-import-not-at-top

  def off_a_pod():  # what jax.distributed.initialize() raises off a pod, before any other jax call
    raise ValueError('coordinator_address should be defined.')
  monkeypatch.setattr(jax.distributed, 'initialize', off_a_pod)
  with pytest.raises(common.UsageError, match=message):
    common.initialize_processes(common.parser('t5xv-x', 'doc').parse_args(flags))


def test_one_process_per_gpu_names_its_devices(monkeypatch, capsys):
  """--local_device_ids reaches jax.distributed.initialize (one process per GPU of a host)."""
  import jax  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda *a, **kw: calls.append((a, kw)))
  monkeypatch.setattr(jax.config, 'update', lambda *a: None)
  flags = ['--multiprocess_gpu', '--coordinator_address=h:1234', '--process_count=8', '--process_index=3']
  for extra, ids in (([], None), (['--local_device_ids=3'], [3]), (['--local_device_ids=2,3'], [2, 3])):
    common.initialize_processes(common.parser('t5xv-x', 'doc').parse_args(flags + extra))
    assert calls.pop() == (('h:1234', 8, 3), {'local_device_ids': ids,
                                              'initialization_timeout': common.JOIN_WAIT_SECS})
    assert capsys.readouterr().out.startswith('process 3 of 8: joining the others at h:1234 (jax '
                                              f'waits {common.JOIN_WAIT_SECS} s')
  with pytest.raises(SystemExit) as e:
    common.parser('t5xv-x', 'doc').parse_args(flags + ['--local_device_ids=gpu3'])
  assert e.value.code == 2 and capsys.readouterr().err == (
      "t5xv-x: error: argument --local_device_ids: 'gpu3' is not a list of GPU ids such as 0,1 "
      '(see --help)\n')


@gin.configurable('test_cli_common_write')
def _configurable_write(write):
  """``write()`` as trainer.train runs: a configurable, which gin re-raises without errno."""
  write()


@pytest.mark.skipif(not os.path.exists('/dev/full'), reason='needs /dev/full (a device that is always full)')
def test_a_full_disk_under_metrics_jsonl_is_one_line_raised_once(capsys):
  """metrics.jsonl appended on a full disk: the write raises once (nothing left buffered for
  close to raise again, hiding the first error), and a command says it in one line."""
  from t5x_variants.train import storage  # pylint: disable=g-import-not-at-top
  appended = storage.AppendedFile('/dev/full')
  with pytest.raises(OSError) as e:
    appended.write('{"step": 1}\n')
  appended.close()  # no second error

  def write(_=None):
    raise OSError(e.value.errno, os.strerror(e.value.errno), '/runs/r/metrics.jsonl')
  for raise_it in (write, _configurable_write):
    with pytest.raises(SystemExit) as exit_:
      with common.clear_errors('t5xv-train'):
        raise_it(write)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == (
        't5xv-train: error: No space left on device writing /runs/r/metrics.jsonl: free space and '
        'rerun the same command (a training run resumes from its last checkpoint)\n'), raise_it


def test_ctrl_c_outside_the_training_steps_is_one_line(capsys):
  """Ctrl-C while a command starts (jax tracing) was a 200-line KeyboardInterrupt traceback."""
  with pytest.raises(SystemExit) as exit_:
    with common.clear_errors('t5xv-eval'):
      raise KeyboardInterrupt
  assert exit_.value.code == 130 and capsys.readouterr().err == (
      't5xv-eval: interrupted; rerun the same command (a training run resumes from its last '
      'checkpoint)\n')


def test_a_closed_pipe_ends_a_command_quietly(capsys, monkeypatch):
  """``t5xv-data ... | head``: the reader leaving is no error to report (it was a traceback); a
  broken pipe elsewhere (a socket, a subprocess) is one line."""
  class Closed:
    def flush(self):
      raise BrokenPipeError(32, 'Broken pipe')
  for stdout, code, err in ((Closed(), 1, ''), (sys.stdout, 2, 't5xv-data: error: [Errno 32] Broken pipe\n')):
    monkeypatch.setattr(sys, 'stdout', stdout)  # restored after the test
    with pytest.raises(SystemExit) as exit_:
      with common.clear_errors('t5xv-data'):
        raise BrokenPipeError(32, 'Broken pipe')
    assert (exit_.value.code, capsys.readouterr().err) == (code, err)


def test_a_run_bounded_by_epochs_over_several_processes_is_refused(monkeypatch):
  """Each host's share of the data ends at its own step: the first host out would leave the
  others alone in the step's collectives (a hang)."""
  import jax  # pylint: disable=g-import-not-at-top
  from conftest import tiny  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import train  # pylint: disable=g-import-not-at-top
  from t5x_variants.data.config import DatasetConfig  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import trainer  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  with pytest.raises(ValueError, match=r'num_epochs = 3 with 2 processes: .*train.total_steps'):
    train.check_inputs(tiny(), DatasetConfig(num_epochs=3, batch_size=8), DatasetConfig())
  with pytest.raises(ValueError, match=r'seed = None with 2 processes: .*set a seed'):  # shares overlap
    train.check_inputs(tiny(), DatasetConfig(seed=None, batch_size=8), DatasetConfig())


def test_a_loss_on_the_inputs_is_refused_before_the_run_for_a_model_without_a_prefix_lm_row(capsys):
  """``loss_on_targets_only=False`` of either scope on an encoder-decoder: one error naming the
  scope, before any data is built (the eval scope's would otherwise fail at the first eval). A
  prefix LM takes it, with a warning where its inputs are fully visible (their loss can be met
  by copying), none where they are read causally (T5's language model)."""
  from conftest import tiny  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import train  # pylint: disable=g-import-not-at-top
  from t5x_variants.data.config import DatasetConfig  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import trainer  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  whole_row = DatasetConfig(batch_size=8, loss_on_targets_only=False)
  for train_cfg, eval_cfg, scope in ((whole_row, DatasetConfig(), 'train'),
                                     (DatasetConfig(batch_size=8), whole_row, 'train_eval')):
    with pytest.raises(ValueError, match=rf'^{scope}/DatasetConfig.loss_on_targets_only=False .*'
                                         r'\(this model: encoder_decoder\)'):
      train.check_inputs(tiny(), train_cfg, eval_cfg)
  prefix_lm = dataclasses.replace(tiny(), architecture='decoder_only', prefix_lm=True)
  capsys.readouterr()
  train.check_inputs(prefix_lm, whole_row, whole_row)
  assert 'warning: a prefix LM with train/DatasetConfig.loss_on_targets_only=False' in capsys.readouterr().err
  train.check_inputs(dataclasses.replace(prefix_lm, inputs_bidirectional_attention=False), whole_row, whole_row)
  train.check_inputs(prefix_lm, DatasetConfig(batch_size=8), whole_row)
  assert 'warning' not in capsys.readouterr().err


def test_quickstart_takes_its_directory_either_way():
  """``--model_dir DIR`` was passed on to t5xv-train, which named itself in the error."""
  from t5x_variants.cli import quickstart  # pylint: disable=g-import-not-at-top
  for argv in (['--model_dir', '/tmp/q', '--gin.TRAIN_STEPS=4'],
               ['--model_dir=/tmp/q', '--gin.TRAIN_STEPS=4']):
    assert quickstart.split_args(argv) == ('/tmp/q', ['--gin.TRAIN_STEPS=4'])
  assert quickstart.split_args([]) == (quickstart.DEFAULT_DIR, [])
  # Was: training went to --gin.MODEL_DIR, eval and decoding to --model_dir's (another run), exit 0
  for flag in ("--gin.MODEL_DIR='/tmp/r'", "--gin_bindings=MODEL_DIR = '/tmp/r'",
               "--gin.train.model_dir='/tmp/r'", "--gin_bindings= train.model_dir='/tmp/r'"):
    with pytest.raises(SystemExit) as e:
      quickstart.split_args(['--model_dir=/tmp/q', flag])
    assert e.value.code == 2


def test_gin_flags_of_both_forms_apply_in_their_command_line_order():
  """The later of two bindings of one key wins, as in T5X: every --gin.KEY=VALUE went after all
  --gin_bindings, so a --gin_bindings given after it was silently overridden."""
  parser = common.parser('t5xv-x', 'doc')
  flags = ['--gin.d_model=8', '--gin_bindings=d_model=16', '--gin.heads=2']
  assert common.parse_args(parser, flags).gin_bindings == ['d_model = 8', 'd_model=16', 'heads = 2']
  with pytest.raises(SystemExit):
    common.parse_args(parser, ['--gin.d_model', '8'])
