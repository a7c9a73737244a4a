"""Ahead-of-time readiness for accelerators (``t5xv-compile``): mesh checks before any compile, on
a forced 8-device CPU host; the real train step compiled for a TPU slice through libtpu's
compile-only devices (skipped where libtpu is absent: ``pip install -e '.[tpu]'``), its memory
against the chip's, the compiler's out-of-memory refusal read back as "does not fit", and
``--suggest`` finding plans that do fit."""
import importlib.util
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import HOST_DEVICES, ON_GPU, needs_data_layer
from t5x_variants.train import aot, partitioning, targets

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
HAS_LIBTPU = importlib.util.find_spec('libtpu') is not None
# The suite's persistent compilation cache stores executables for compile-only TPU devices but
# cannot load them back (it warns and compiles again).
pytestmark = pytest.mark.filterwarnings('ignore:Error reading persistent compilation cache')
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install -e '.[tpu]')")
TINY = dict(vocab_size=256, d_model=64, num_heads=4, head_dim=16, d_ff=128, num_encoder_layers=2,
            num_decoder_layers=2, encoder_max_length=64, decoder_max_length=16)
LENGTHS = {'inputs': 64, 'targets': 16}


def run(*args, env=None):
  return subprocess.run(list(args), cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, **(env or {})})


def test_mesh_checks_on_an_8_device_host():
  """Every dimension a mesh axis splits must divide by its size; the error names the dimension,
  its size, a parameter that has it, the axis and the sizes that would divide everything."""
  script = textwrap.dedent('''
    import jax
    from t5x_variants.models import TransformerConfig, build_model, init_inputs
    from t5x_variants.train import partitioning
    assert jax.device_count() == 8
    def check(mesh_config, **overrides):
      config = TransformerConfig(**{**dict(d_model=96, num_heads=12, head_dim=8, d_ff=192,
                                           vocab_size=256, num_encoder_layers=1,
                                           num_decoder_layers=1), **overrides})
      mesh = mesh_config.mesh()
      try:
        partitioning.sharded_abstract_params(build_model(config), init_inputs(config), mesh,
                                             mesh_config.rules())
        return 'ok'
      except ValueError as e:
        return str(e)
    M = partitioning.MeshConfig
    print(check(M(model=8)))
    print(check(M(model=4)))
    print(check(M(model=2), vocab_size=255))
    print(check(M(fsdp=True), d_model=100, head_dim=8))
    print(check(M(model=8), num_heads=16, d_ff=196))
    mesh = M(data=8).mesh()
    for batch, micro in ((16, 1), (12, 1), (16, 4)):
      try:
        partitioning.check_batch(batch, mesh, micro)
        print('ok')
      except ValueError as e:
        print(e)
  ''')
  out = run(sys.executable, '-c', script, env=HOST_DEVICES)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  assert lines[0].startswith("mesh axis 'model' of size 8 does not divide heads = 12 (e.g. ")
  assert lines[0].endswith("'model' sizes that divide every dimension split over it (heads 12, "
                           "mlp 192, vocab 256) and the 8 devices: 1, 2, 4 (set MeshConfig.model)"), lines[0]
  assert lines[1] == 'ok'
  assert "does not divide vocab = 255" in lines[2] and 'devices: 1 (set' in lines[2]
  assert lines[3].startswith("mesh axis 'data' of size 8 does not divide embed = 100")
  assert lines[3].endswith('devices: 1, 2, 4 (set MeshConfig.data)'), lines[3]
  assert 'does not divide mlp = 196' in lines[4] and 'devices: 1, 2, 4 (set' in lines[4]
  assert lines[5] == 'ok'
  assert lines[6].startswith("batch size 12 does not split over mesh axis 'data' of size 8: use a multiple of 8")
  assert lines[7].startswith("batch size 16 does not split over mesh axis 'data' of size 8 x 4 "
                             "microbatches: use a multiple of 32")


def test_topology_names():
  assert targets.parse_topology('v5e:4x4') == ('v5e', (4, 4))
  assert targets.parse_topology('v4:2x2x2') == ('v4', (2, 2, 2))
  for bad, says in (('v9:2x2', 'unknown topology'), ('v5e-16', 'unknown topology'),
                    ('v4:4x4', 'v4 slices have 3 dimensions'), ('v5e:32x32', 'v5e slices are 1x1, '),
                    ('v6e:4x2', 'v6e slices are 1x1, ')):
    with pytest.raises(ValueError, match=says):
      targets.parse_topology(bad)


@needs_libtpu
def test_every_tpu_generation_and_gpu_gets_its_published_peak():
  """The peak table is keyed by the device kind libtpu gives each generation (a v5p chip is 'TPU
  v5', a v5e chip 'TPU v5 lite'); a GPU is known by its model in its kind."""
  for spec, peak in (('v4:2x2x1', 275.0), ('v5e:2x2', 197.0), ('v5p:2x2x1', 459.0),
                     ('v6e:2x2', 918.0)):
    assert targets.tpu_target(spec).peak_tflops == peak, spec
  assert targets.published_peak('NVIDIA H100 80GB HBM3') == 989.0
  assert targets.published_peak('NVIDIA H100 80GB HBM3', bf16=False) == 495.0  # TF32
  assert targets.published_peak('NVIDIA H100 PCIe') == 756.0  # not the SXM card's 989
  assert targets.published_peak('NVIDIA H200 NVL', bf16=False) == 417.5
  assert targets.published_peak('TPU v5', bf16=False) == 459.0  # f32 matmuls: one bf16 pass
  assert targets.published_peak('cpu') is None


def test_compiler_out_of_memory_messages():
  gib = 2**30
  assert aot.compiler_oom('RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory '
                          'in memory space hbm. Used 16.41G of 15.75G hbm. Exceeded hbm capacity '
                          'by 673.93M.') == ('needed per chip', 'total_bytes', 16.41 * gib,
                                             15.75 * gib)
  assert aot.compiler_oom('RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required '
                          'for HLO temporaries (43.94G) exceeds available HBM (15.75G).') == (
                              'of temporaries needed per chip', 'temp_bytes', 43.94 * gib,
                              15.75 * gib)
  assert aot.compiler_oom('INVALID_ARGUMENT: something else') is None


def test_a_refusal_on_temporaries_is_shown_as_temporaries_not_as_the_total():
  """Was: the compiler's figure of temporaries alone in the table's total row."""
  import json  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import compile as compile_cli  # pylint: disable=g-import-not-at-top
  with open(os.path.join(REPO, 'docs/compile/T5-large_v5e-4x4.json')) as f:
    result = json.load(f)
  rows = dict(re.split(r'\s{2,}', line, maxsplit=1) for line in compile_cli._table(result).splitlines())
  assert rows['temporaries per device'] == '17.98 GiB' and rows['total per device'] == 'n/a'
  assert aot.fit_line(result) == ('does not fit: 17.98 GiB of temporaries needed per chip, '
                                  '15.75 GiB available')


def test_a_host_with_too_few_accelerators_compiles_for_virtual_cpu_devices():
  """Listing the accelerators starts every backend, the CPU's too: the CPU device count is set
  before (was: after, which jax refused, so --devices=N on a host with fewer GPUs failed)."""
  code = ('from t5x_variants.train import targets; '
          't = targets.host_target(4); print(t.platform, t.num_devices)')
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=REPO,
                       env={**env, 'JAX_PLATFORMS': 'cpu'})
  assert out.stdout.split() == ['cpu', '4'], out.stderr[-2000:]


def test_the_cost_model_counts_the_whole_step_only_unrolled_and_in_one_microbatch():
  """Was: an unrolled step of 4 microbatches got an estimate (the loop's body counted once: the
  time of one microbatch, an MFU 4 times too high)."""
  from t5x_variants.cli import compile as compile_cli  # pylint: disable=g-import-not-at-top
  target = targets.host_target(1, accelerators=False)
  for k, whole in ((1, True), (2, False)):
    plan = aot.Plan(_plan(scan_layers=False).config, partitioning.MeshConfig(), k)
    result = aot.compile_plan(plan, target, 4, LENGTHS, {**OPTIONS, 'num_microbatches': k})
    assert result['cost_model']['counts_whole_step'] is whole
  assert 'microbatch loop' in compile_cli._no_estimate(result)


def test_suggest_does_not_prune_a_plan_that_holds_fewer_rows_per_device():
  """A wider model axis splits the parameters but leaves each device more rows of the residual
  stream: its failing to fit says nothing of data parallelism (was: taken to save as much)."""
  config = _plan(remat='none').config
  wide = aot.Plan(config, partitioning.MeshConfig(data=2, model=2), 1)
  narrow = aot.Plan(config, partitioning.MeshConfig(data=4, model=1), 1)
  assert not aot._saves_as_much(wide, narrow)  # pylint: disable=protected-access
  assert aot._saves_as_much(aot.Plan(config, wide.mesh, 2), narrow)  # pylint: disable=protected-access


@pytest.fixture(scope='module')
def v5e_2x2():
  return targets.tpu_target('v5e:2x2')


def _plan(**overrides):
  from t5x_variants.models import TransformerConfig
  return aot.Plan(TransformerConfig(**{**TINY, **overrides}), partitioning.MeshConfig())


OPTIONS = {'num_microbatches': 1, 'label_smoothing': 0.0, 'z_loss': 1e-4,
           'loss_normalizing_factor': 'num_tokens'}


@needs_libtpu
def test_tiny_step_compiles_for_a_v5e_slice(v5e_2x2):
  """The compiled program's memory adds up, the figures beside it are the model's, and its
  traffic names the attention kernel."""
  from t5x_variants.models import flops
  assert v5e_2x2.num_devices == 4 and v5e_2x2.device_kind == 'TPU v5 lite'
  plan = _plan(dtype='bfloat16')
  r = aot.compile_plan(plan, v5e_2x2, 8, LENGTHS, OPTIONS, traffic=1000)
  assert r['fits'] is True and r['mesh_shape'] == {'replica': 1, 'data': 4, 'model': 1}
  # t5xv-compile --traffic: the attention kernels and the matmuls among the program's traffic
  assert {'kernel', 'matmul'} <= set(r['traffic']['by_kind'])
  sources = r['traffic']['by_source']
  assert any(k == 'kernel' and s.endswith('encoder/layers/self_attention/pallas_call')
             for k, s, _, _ in sources), sources
  # q, k, v reach the kernel heads-first, and their gradients leave it, with no copy between:
  # the projections' matmuls write the layout the kernel reads (layers/dense.py; a 2-D matmul
  # here had the backward's padded q, k, v copied).
  assert not [row for row in sources
              if row[0] == 'copy' and re.search(r'_attention/(pad|transpose)$', row[1])], sources
  assert r['total_bytes'] == (r['argument_bytes'] + r['output_bytes'] - r['alias_bytes']
                              + r['temp_bytes'] + r['code_bytes'])
  # The donated state is aliased to the new state: what is counted once is at least the state.
  state_bytes = 4 * r['parameters']  # float32 parameters alone
  assert r['argument_bytes'] >= state_bytes and r['alias_bytes'] >= state_bytes
  assert r['model_flops_per_step'] == flops.train_flops(plan.config, 8, LENGTHS)
  assert aot.fit_line(r).startswith('fits: ') and '15.75 GiB' in aot.fit_line(r)


@needs_libtpu
def test_a_packed_runs_step_compiles_with_its_segments_through_the_row_kernel(v5e_2x2):
  """A run that packs (DatasetConfig.pack, the pretraining default) is compiled with packed rows:
  segment ids and restarting positions, whose attention runs the row kernel with segment ids
  (compiled through Mosaic), not the reference path's float32 logits nor JAX's flash kernel."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  plan = dataclasses.replace(_plan(dtype='bfloat16'), packed=True)
  r = aot.compile_plan(plan, v5e_2x2, 8, LENGTHS, OPTIONS, traffic=1000)
  assert r['fits'] is True and r['packed'] is True
  sources = r['traffic']['by_source']
  assert any(k == 'kernel' and s.endswith('encoder/layers/self_attention/pallas_call')
             for k, s, _, _ in sources), sources
  assert not [s for _, s, _, _ in sources if 'flash_mha' in s], sources
  data = aot.abstract_batch(plan.config, 8, LENGTHS, None, packed=True)
  assert {'encoder_segment_ids', 'decoder_segment_ids', 'encoder_positions', 'decoder_positions'} <= set(data)


def test_suggest_search_returns_the_cheapest_plans_that_fit_within_its_budget(monkeypatch):
  """The search alone, on 40 ranked candidates whose memory falls along the list (a limit of 50
  is first met at index 25) but for a cheap outlier at index 3: the bisection finds index 25; the
  scan back towards cheaper candidates skips those that save no more than one that failed, and
  finds the outlier only where no failure rules it out; nothing is compiled past the budget."""
  plans = [aot.Plan(None, None, i) for i in range(40)]
  memory = {i: 100 - 2 * i for i in range(40)}
  memory[3] = 10
  compiled = []

  def fake_compile(plan, *_):
    compiled.append(plan.num_microbatches)
    return {'fits': memory[plan.num_microbatches] <= 50, 'total_bytes': memory[plan.num_microbatches],
            'memory_limit_bytes': 50, 'i': plan.num_microbatches}
  monkeypatch.setattr(aot, 'candidate_plans', lambda *_: plans)
  monkeypatch.setattr(aot, 'compile_plan', fake_compile)
  monkeypatch.setattr(aot, 'fit_line', lambda _: '')
  monkeypatch.setattr(aot.Plan, 'flags', lambda self: '')
  suggest = lambda **kw: [f['i'] for f in aot.suggest(None, None, 0, {}, {}, log=lambda _: None, **kw)]
  # A total order of economy: a failure at 24 rules out everything cheaper, the outlier too.
  monkeypatch.setattr(aot, '_saves_as_much', lambda a, b: a.num_microbatches >= b.num_microbatches)
  assert suggest(want=2, max_compiles=40) == [25, 26]
  assert compiled[0] == 39 and len(compiled) == 7  # the last, then a bisection of 40
  # No order (independent knobs): the scan back compiles cheaper candidates while the budget lasts.
  monkeypatch.setattr(aot, '_saves_as_much', lambda a, b: False)
  compiled.clear()
  assert suggest(want=2, max_compiles=40) == [3, 25]
  assert len(compiled) == len(set(compiled)) == 7 + 25 - 2  # each once: 24 and 19 were bisected
  compiled.clear()
  assert suggest(want=2, max_compiles=9) == [25, 26] and len(compiled) == 9
  memory.update({i: 99 for i in range(40)})  # nothing fits: one compile says so
  compiled.clear()
  assert suggest() == [] and compiled == [39]


@needs_libtpu
def test_candidate_plans_are_ordered_and_divide(v5e_2x2):
  plans = aot.candidate_plans(_plan(num_heads=2, head_dim=32), v5e_2x2, 16)
  first, last = plans[0], plans[-1]
  assert (first.config.remat, first.mesh.model, first.mesh.fsdp, first.num_microbatches) == ('none', 1, False, 1)
  assert last.config.remat == 'full' and last.mesh.model == 2 and last.num_microbatches == 8
  assert all(p.mesh.model in (1, 2) for p in plans)  # 2 heads: no 4-way model axis
  assert all(16 % (p.mesh.data * p.num_microbatches) == 0 for p in plans)
  assert not any(p.mesh.fsdp and p.mesh.data == 1 for p in plans)


@needs_libtpu
def test_a_model_axis_wider_than_a_host_is_refused_for_a_multi_host_slice():
  """A v5litepod-16 is 4 hosts of 4 chips: a model axis of 8 spans hosts, which the run refuses
  ('each process must hold whole shards'); compiling for it from one process refused nothing and
  --suggest offered model 8 and 16."""
  pod = targets.tpu_target('v5e:4x4')
  assert len({d.process_index for d in pod.devices}) == 4
  plans = aot.candidate_plans(_plan(num_heads=16, head_dim=8), pod, 64)
  assert {p.mesh.model for p in plans} == {1, 2, 4}
  mesh = partitioning.MeshConfig(data=2, model=8).mesh(pod.devices)
  with pytest.raises(ValueError, match="over 4 processes: each process must hold whole shards"):
    partitioning.check_batch(64, mesh)


@needs_libtpu
def test_a_2d_slice_of_up_to_8_chips_is_one_host():
  """v5litepod-1 and -8 are one host (libtpu's default hosts of 2x2 chips refused 1x1 and made
  2x4 two hosts, so a model axis of 8 was refused there); v5e:4x4 stays 4 hosts of 4."""
  hosts = lambda spec: len({d.process_index for d in targets.tpu_target(spec).devices})
  assert targets.tpu_target('v5e:1x1').num_devices == 1
  assert hosts('v5e:2x4') == 1 and hosts('v6e:2x4') == 1 and hosts('v5e:4x4') == 4


@needs_libtpu
def test_several_slices_split_data_across_them(v5e_2x2):
  """Multislice: 'data' runs slice by slice, each slice's hosts in process order (jax numbers a
  multislice run's processes so), however the devices are listed; the step compiles for it."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  two = targets.tpu_target('v5e:2x2', num_slices=2)
  assert two.name == 'v5e:2x2 x 2 slices' and two.num_devices == 8
  mesh = partitioning.MeshConfig(model=2).mesh(two.devices[4:] + two.devices[:4])
  assert np.vectorize(lambda d: d.slice_index)(mesh.devices).tolist() == [[[0, 0], [0, 0], [1, 1], [1, 1]]]
  pods = targets.tpu_target('v5e:4x4', num_slices=2)  # 4 hosts a slice
  assert {(d.slice_index, d.process_index // 4) for d in pods.devices} == {(0, 0), (1, 1)}
  partitioning.check_batch(32, partitioning.MeshConfig().mesh(pods.devices[16:] + pods.devices[:16]))
  r = aot.compile_plan(_plan(dtype='bfloat16'), two, 16, LENGTHS, OPTIONS)
  assert r['fits'] is True and r['mesh_shape'] == {'replica': 1, 'data': 8, 'model': 1} and r['target'] == two.name
  plans = aot.candidate_plans(_plan(), two, 16)  # --suggest: FSDP within each slice
  assert {(p.mesh.fsdp, p.mesh.replica) for p in plans} == {(False, 1), (True, 2)}


# The compiled multislice program's transfers to other slices (send ops to the network between
# slices), by the collective they serve.
BETWEEN_SLICES = re.compile(r' send\(.*_xla_megascale_transfer_type="(\w+)"')


@needs_libtpu
def test_a_replica_per_slice_keeps_fsdp_gathers_within_the_slice():
  """On 2 slices with fsdp: with replica=1 the parameters are all-gathered over the network
  between slices; with replica=2 (one group a slice) they are gathered within each slice and
  only the gradients' all-reduce crosses. The batch is split over both axes, 32 rows / 8 chips."""
  two = targets.tpu_target('v5e:2x2', num_slices=2)
  crossing = {}
  for replica in (1, 2):
    plan = aot.Plan(_plan(dtype='bfloat16').config, partitioning.MeshConfig(fsdp=True, replica=replica))
    lowered, _ = aot.lower(plan, two, 32, LENGTHS, OPTIONS)
    crossing[replica] = set(BETWEEN_SLICES.findall(lowered.compile().as_text()))
  assert 'ALL_GATHER' in crossing[1] and crossing[2] == {'ALL_REDUCE'}, crossing
  mesh = partitioning.MeshConfig(fsdp=True, replica=2).mesh(two.devices[4:] + two.devices[:4])
  assert [{d.slice_index for d in group.flat} for group in mesh.devices] == [{0}, {1}]
  with pytest.raises(ValueError, match=r"batch size 12 does not split over mesh axes replica x data "
                                       r"of size 2 x 4: use a multiple of 8"):
    partitioning.check_batch(12, mesh)


def _compile_cli(*args):
  return run(os.path.join(BIN, 't5xv-compile'), *args)


@pytest.fixture
def compile_main(capsys, monkeypatch):
  """t5xv-compile's main in this process (its bad input fails before any compile; a process of its
  own would spend most of its time importing TensorFlow): (exit status, stderr). Gin and the
  compilation cache, which the command sets for itself, are restored."""
  import gin  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import compile as compile_cli  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(REPO)
  cache = jax.config.jax_enable_compilation_cache

  def main(*args):
    gin.clear_config()
    try:
      with pytest.raises(SystemExit) as e:
        compile_cli.main(list(args))
    finally:
      jax.config.update('jax_enable_compilation_cache', cache)
      gin.clear_config()
    return e.value.code, capsys.readouterr().err
  return main


@needs_libtpu
@pytest.mark.parametrize('args, says', [
    (['--topology=v9:2x2'], "unknown topology 'v9:2x2'"),
    (['--topology=v5e:2x2', '--batch=0'], '--batch=0 is out of range: it must be at least 1'),
    (['--topology=v5e:2x2', '--device_memory_gib=-1'], '--device_memory_gib=-1.0 is out of range'),
    (['--topology=v5e:2x2', '--gin_file=gin/architectures/decoder_only.gin', '--inputs_length=8'],
     '--inputs_length: this model (decoder_only) reads targets only'),
    (['--topology=v5e:2x2', '--device_memory_gib=inf'], 'must be more than 0 and finite'),
    (['--devices=2', '--num_slices=2'], '--num_slices is for TPU slices: give it with --topology'),
    (['--topology=v5e:2x2', '--num_slices=0'], '--num_slices=0 is out of range: it must be at least 1'),
    (['--topology=v5e:2x2', '--num_slices=2', '--gin.MeshConfig.model=8'],
     'the mesh (data=1, model=8) over 2 processes: each process must hold whole shards'),
    pytest.param(['--devices=1', '--suggest'], 'has no known limit: give --device_memory_gib',
                 marks=pytest.mark.skipif(ON_GPU, reason="a GPU's allocator gives its limit")),
    (['--topology=v5e:2x2', '--gin.MeshConfig.data=8'], 'mesh data=8 x model=1 needs 8 devices, found 4'),
    (['--topology=v5e:2x2', '--gin.TransformerConfig.nonsense=1'], "doesn't have a parameter"),
    (['--topology=v5e:2x2', '--gin.MeshConfig.model=4', '--gin.TransformerConfig.num_heads=6'],
     "mesh axis 'model' of size 4 does not divide heads = 6"),
])
def test_compile_bad_input_is_one_line(compile_main, args, says):
  status, err = compile_main('--gin_file=gin/runs/pretrain.gin', '--gin_file=gin/models/t5_tiny.gin', *args)
  assert status == 2, err[-2000:]
  assert err.startswith('t5xv-compile: error: ') and says in err, err
  assert len(err.strip().splitlines()) == 1, err


@needs_libtpu
def test_compile_keeps_a_file_that_is_no_earlier_result(compile_main, tmp_path):
  """--output naming the user's own file replaced it with the result."""
  notes = tmp_path / 'notes.txt'
  notes.write_text('my notes\n')
  status, err = compile_main('--gin_file=gin/runs/pretrain.gin', '--gin_file=gin/models/t5_tiny.gin',
                             '--topology=v5e:2x2', f'--output={notes}')
  assert status == 2 and err.count('\n') == 1, err
  assert f'--output={notes} exists and is not an earlier t5xv-compile result, which it would' in err
  assert notes.read_text() == 'my notes\n'


def test_estimate_with_microbatches_compiles_once_and_says_why(compile_main, monkeypatch, capsys):
  """The cost model counts a microbatch loop's body once, unrolled or not: --estimate then makes
  no unrolled compile (was: a second whole compile whose figures replaced the first's)."""
  import gin  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import compile as compile_cli  # pylint: disable=g-import-not-at-top
  compiled = []
  real = aot.compile_plan
  monkeypatch.setattr(aot, 'compile_plan', lambda plan, *a, **k: compiled.append(plan) or real(plan, *a, **k))
  gin.clear_config()
  try:
    assert compile_cli.main(['--gin_file=gin/runs/pretrain.gin', '--gin_file=gin/models/t5_tiny.gin',
                             '--devices=1', '--estimate', '--gin.train.num_microbatches=2',
                             '--batch=4', '--inputs_length=32', '--targets_length=8']) == 0
  finally:
    gin.clear_config()
  assert [p.config.scan_layers for p in compiled] == [True]
  assert 'n/a: the cost model counts the microbatch loop' in capsys.readouterr().out


def test_compile_reads_a_fine_tune_run_without_its_checkpoint(compile_main):
  """The trainer's run macros (``recipe.RUN_MACROS``) are not the compiler's: a fine-tune run
  file parses without ``INITIAL_CHECKPOINT_PATH`` (it stops here for want of lengths, before a
  compile)."""
  status, err = compile_main('--gin_file=gin/runs/finetune.gin', '--gin_file=gin/models/t5_tiny.gin',
                             '--devices=1', '--gin.TASK_FEATURE_LENGTHS=None')
  assert status == 2 and 'INITIAL_CHECKPOINT_PATH' not in err, err
  assert 'no sequence lengths' in err, err


@pytest.mark.slow
@needs_libtpu
def test_compile_cli_does_not_fit_exits_2_with_suggestions(tmp_path):
  """A batch whose float32 logits alone need 32 GiB per chip: the compiler refuses it (with its
  own figures), one line says so, and the most economical candidate compiles and fits."""
  out = _compile_cli('--gin_file=gin/runs/pretrain.gin', '--gin_file=gin/models/t5_tiny.gin',
                     '--topology=v5e:2x2', '--gin.TransformerConfig.vocab_size=32768',
                     '--batch=16384', '--inputs_length=64', '--targets_length=64',
                     '--max_compiles=1', f'--output={tmp_path}/c.json')
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.startswith('t5xv-compile: error: does not fit: ') and 'GiB available' in out.stderr
  # the search's compiles, then what it found, cheapest first
  searched, found_lines = out.stdout.split('configurations that fit v5e:2x2, cheapest first:\n')
  assert 'compiled: fits: ' in searched and found_lines.startswith('  fits: ')
  import json
  result = json.loads((tmp_path / 'c.json').read_text())
  assert result['fits'] is False and result['compiler_refused']
  line = aot.fit_line(result)
  assert line.startswith('does not fit: ') and line.endswith('15.75 GiB available'), line
  assert aot.needed_bytes(result) > result['memory_limit_bytes'] == int(15.75 * 2**30)
  (found,) = result['suggestions']  # --max_compiles=1: the one plan compiled
  assert found['fits'] is True and found['total_bytes'] <= found['memory_limit_bytes']
  assert found['remat'] == 'full' and found['num_microbatches'] == aot.MAX_MICROBATCHES


@pytest.mark.slow
def test_compile_for_an_8_device_host_mesh():
  out = _compile_cli('--gin_file=gin/runs/pretrain.gin', '--gin_file=gin/models/t5_tiny.gin',
                     '--devices=8', '--device_memory_gib=1', '--batch=16', '--gin.MeshConfig.model=2')
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'data 4 x model 2' in out.stdout and 'fits: ' in out.stdout and '1.00 GiB' in out.stdout


@needs_data_layer
@pytest.mark.slow
@needs_libtpu
def test_the_readme_pod_command_compiles_and_fits_its_slice():
  """README: T5-base with runs/pretrain.gin on a v5litepod-16 (v5e:4x4), data parallel."""
  import gin  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import recipe  # pylint: disable=g-import-not-at-top
  with open(os.path.join(REPO, 'README.md')) as f:
    readme = f.read()
  assert 'topology v5e:4x4' in readme and '--gin_file=gin/models/t5_base.gin \\\n    --gin.MODEL_DIR' in readme
  gin.clear_config()
  recipe.parse_gin(['gin/runs/pretrain.gin', 'gin/models/t5_base.gin'], ["MODEL_DIR = 'gs://b/r'"],
                   configurables=recipe.library_configurables(with_data=True))
  config = recipe.build_config()
  assert config.dtype == 'bfloat16' and config.num_heads == 12
  r = aot.compile_plan(aot.Plan(config, partitioning.MeshConfig(), 1), targets.tpu_target('v5e:4x4'),
                       128, {'inputs': 512, 'targets': 114}, aot.train_options())
  assert r['fits'] and r['mesh_shape'] == {'replica': 1, 'data': 16, 'model': 1}, aot.fit_line(r)


@needs_libtpu
def test_a_tpu_slice_gets_the_tpu_attention_kernel_from_any_host(v5e_2x2):
  """Compiled for a TPU slice from this CPU host, 'auto' attention is the Pallas TPU kernel (the
  platform is the mesh's, not the host's), once per attention kind and direction; 'xla' has none."""
  texts = {k: aot.lower(_plan(dtype='bfloat16', attention_kernel=k), v5e_2x2, 8, LENGTHS, OPTIONS)[0]
           .as_text() for k in ('auto', 'xla')}
  assert texts['xla'].count('tpu_custom_call') == 0
  # forward and backward row kernels for the encoder, decoder and cross-attention (scanned layers)
  assert texts['auto'].count('tpu_custom_call') == 6


# An HLO collective's output type (one array or a tuple of them) and its kind.
COLLECTIVES = re.compile(r'= (.*?) (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(')


@needs_libtpu
def test_fsdp_moves_parameters_not_activations(v5e_2x2):
  """With fsdp each weight is gathered for its matmul: no collective of the compiled step is
  larger than the largest parameter (a matmul split over embed instead all-reduces activations:
  one chip's 16 rows of 64 target tokens have logits 16 times the size of the embedding table)."""
  plan = aot.Plan(_plan(dtype='bfloat16').config, partitioning.MeshConfig(fsdp=True))
  lowered, _ = aot.lower(plan, v5e_2x2, 64, {'inputs': 64, 'targets': 64}, OPTIONS)
  largest = TINY['vocab_size'] * TINY['d_model']
  sizes = [(kind, math.prod(int(n) for n in dims.split(',') if n))
           for output, kind in COLLECTIVES.findall(lowered.compile().as_text())
           for dims in re.findall(r'\w+\[([\d,]*)\]', output)]
  assert sizes and all(size <= largest for _, size in sizes), sorted(sizes, key=lambda s: -s[1])[:5]
