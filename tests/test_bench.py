"""t5xv-bench: the FLOP formula against a hand count and against XLA's own count, and the bench
end to end on CPU (the same train step as the trainer, on a synthetic batch)."""
import dataclasses
import json

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU, init_params, parse_recipe, tiny, tokens
from t5x_variants.cli import bench, common, launch, recipe
from t5x_variants.models import flops, summary


def test_flops_match_a_hand_count():
  """Tiny T5 (d 32, 4 heads x 8, ReLU d_ff 64, 2+2 layers, vocab 50), batch 2, 6 -> 4 tokens."""
  c = tiny(ffn='relu')
  enc_attention = 4 * 2 * 12 * 32 * 32 + 2 * (2 * 2 * 4 * 6 * 6 * 8)  # q k v o; QK^T and PV
  enc_ffn = 2 * 2 * 12 * 32 * 64
  dec_self = 4 * 2 * 8 * 32 * 32 + 2 * (2 * 2 * 4 * 4 * 4 * 8)
  dec_cross = 2 * 2 * 8 * 32 * 32 + 2 * 2 * 12 * 32 * 32 + 2 * (2 * 2 * 4 * 4 * 6 * 8)  # q o; k v
  dec_ffn = 2 * 2 * 8 * 32 * 64
  logits = 2 * 8 * 32 * 50
  forward = 2 * (enc_attention + enc_ffn) + 2 * (dec_self + dec_cross + dec_ffn) + logits
  assert forward == 883712
  got = flops.forward_flops(c, 2, {'inputs': 6, 'targets': 4})
  assert got['total'] == forward and got['logits'] == logits
  assert flops.train_flops(c, 2, {'inputs': 6, 'targets': 4}) == 3 * forward


def test_flops_count_a_shared_query_once():
  """D+V: under synthesizer_hidden 'query' the dense hidden layer is the dot product's query, so
  'w1' costs one more query-sized projection, 2 tokens d (h d_h), per layer."""
  c = tiny(architecture='decoder_only', self_attention=('dense', 'dot_product'))
  total = lambda hidden: flops.forward_flops(
      dataclasses.replace(c, synthesizer_hidden=hidden), 2, {'targets': 4})['total']
  shared, own = total('query'), total('w1')
  assert own - shared == c.num_decoder_layers * 2 * (2 * 4) * c.d_model * c.num_heads * c.head_dim


@pytest.mark.parametrize('arch, attention, ffn', [
    ('encoder_decoder', 'dot_product', 'geglu'),
    ('decoder_only', ('dense', 'factorized_random', 'dot_product'), 'relu'),
    ('decoder_only', 'factorized_random', 'relu'),  # R_1 R_2^T once, not per example
    ('encoder_only', 'factorized_dense', 'swiglu'), ('prefix_lm', 'dot_product', 'relu')])
@pytest.mark.skipif(ON_GPU, reason="XLA's GPU cost analysis counted 3-4% of the formula's "
                    "FLOPs on an H100 (by our reading it skips the cuBLAS calls); the CPU's counts "
                    "every dot")
def test_flops_agree_with_xla_cost_analysis(arch, attention, ffn):
  """XLA counts every dot plus the elementwise work the formula leaves out: the formula is at most
  XLA's count and within 5% of it (unrolled layers: XLA counts a scan body once), for the forward
  pass and for the training step's loss and gradient (3x the forward)."""
  prefix_lm = arch == 'prefix_lm'  # one row of the inputs and the targets
  c = tiny(architecture='decoder_only' if prefix_lm else arch, self_attention=attention, ffn=ffn,
           d_model=128, head_dim=32, d_ff=256, vocab_size=512, encoder_max_length=64,
           decoder_max_length=32, synthesizer_factor=8, scan_layers=False, prefix_lm=prefix_lm)
  enc, dec = tokens(4, 64, 512), tokens(4, 32, 512)
  inputs = {'encoder_decoder': (enc, dec), 'decoder_only': (dec,), 'encoder_only': (enc,),
            'prefix_lm': (tokens(4, 96, 512), None, None, jnp.arange(96)[None] <= 64)}[arch]
  model, params = init_params(c, *inputs)
  forward = lambda p, *a: model.apply({'params': p}, *a)
  # The step's loss, cross-entropy against labels, and its gradient (XLA's count of a gradient
  # alone falls below 3x its forward count on the CPU; the softmax over the vocabulary adds more).
  labels = jax.random.randint(jax.random.PRNGKey(1), jax.eval_shape(forward, params, *inputs).shape[:-1], 0, 2)
  backward = jax.value_and_grad(lambda p, *a: -jnp.take_along_axis(
      jax.nn.log_softmax(forward(p, *a).astype(jnp.float32)), labels[..., None], -1).mean())
  for fn, ours in ((forward, flops.forward_flops(c, 4, {'inputs': 64, 'targets': 32})['total']),
                   (backward, flops.train_flops(c, 4, {'inputs': 64, 'targets': 32}))):
    cost = jax.jit(fn).lower(params, *inputs).compile().cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)['flops']
    assert 0.95 * xla <= ours <= xla, (fn is backward, ours / xla)


@pytest.mark.skipif(ON_GPU, reason='the CPU run of the bench; on a GPU: scripts/gpu_bench.sh')
def test_bench_runs_end_to_end_on_cpu(tmp_path, capsys):
  out = tmp_path / 'bench.json'
  assert bench.main(['--gin_file=gin/models/t5_tiny.gin', '--gin.TransformerConfig.vocab_size=512',
                     '--batch=2', '--inputs_length=16', '--targets_length=8', '--steps=2',
                     '--warmup=1', '--profile', f'--output={out}']) == 0
  result = json.loads(out.read_text())
  assert result['tokens_per_second'] == pytest.approx(2 * 24 / result['median_step_seconds'])
  assert result['train_flops_per_step'] == 3 * result['flops_breakdown_forward']['total']
  # what the HF ratio's comparison needs to know of our step (the trainer's default z-loss)
  assert (result['z_loss'], result['label_smoothing'], result['attention_kernel']) == (1e-4, 0.0, 'auto')
  assert result['parameters'] > 0 and result['dense_contraction'] == "the platform's"
  assert 0 < result['mfu'] < 1 and result['compile_seconds'] > 0 and result['peak_memory_bytes'] > 0
  assert 'measured' in result['peak_source'] and 'MFU' in capsys.readouterr().out
  assert result['host_huge_pages'] == launch.huge_pages_on()
  report = result['profile']
  ops = report['top_ops']  # largest first
  assert len(ops) == 15 and ops[0]['ms'] >= ops[-1]['ms']
  assert any('train_step' in op['op_name'] for op in ops)  # named after the HLO of the timed step
  # Every kernel in one category; the step's matmuls found (the CPU's dot fusions included).
  assert sum(report['by_category'].values()) == pytest.approx(report['device_ms'])
  assert report['by_category']['matmul'] > 0 and 0 < report['busy_ms'] <= report['wall_ms']
  assert not any(op['op'].startswith('while') for op in ops)  # a loop's event encloses its body's


def test_bench_flags_out_of_range_and_an_unwritable_output_are_one_line_before_any_work(tmp_path, capsys):
  """--batch=0 ran the default batch; --output naming a directory failed after the run; the peer's
  flags without --hf were ignored."""
  base = ['--gin_file=gin/models/t5_tiny.gin', '--steps=1', '--warmup=0']
  (tmp_path / 'notes.txt').write_text('my notes\n')  # replaced by the run's JSON before
  (tmp_path / 'list.json').write_text('[1, 2]\n')
  for flags, message in ((['--batch=0'], '--batch=0 is out of range: it must be at least 1'),
                         ([f'--output={tmp_path}/notes.txt'], 'notes.txt exists and is not an '
                          'earlier t5xv-bench result, which it would replace: give another path'),
                         ([f'--output={tmp_path}/list.json'], 'is not an earlier t5xv-bench result'),
                         (['--steps=0'], '--steps=0 is out of range'),
                         ([f'--output={tmp_path}'], 'cannot be written: it must name a file in an existing'),
                         ([f'--output={tmp_path}/no/such.json'], 'cannot be written'),
                         (['--peak_tflops=-5'], '--peak_tflops=-5.0 is out of range: it must be a '
                                                'number > 0'),  # MFU -0.1% before
                         (['--peak_tflops=nan'], '--peak_tflops=nan is out of range'),
                         (['--hf_compile'], '--hf_compile sets the Hugging Face peer, which runs only '
                                            'with --hf'),  # silently ignored before
                         (['--hf_optimizer=adamw'], '--hf_optimizer sets the Hugging Face peer')):
    gin.clear_config()
    with pytest.raises(SystemExit) as e:
      bench.main(base + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1 and message in err, err
  assert (tmp_path / 'notes.txt').read_text() == 'my notes\n'
  (tmp_path / 'empty.json').write_text('')  # mktemp's: nothing to lose
  common.check_json_output(str(tmp_path / 'empty.json'), 't5xv-bench', 'median_step_seconds')


@pytest.mark.skipif(ON_GPU, reason='the CPU run of the bench; on a GPU: scripts/gpu_bench.sh')
def test_bench_times_a_packed_step(tmp_path):
  """--packed: two examples per row with their segment ids and positions, as a packing
  pretraining run's step; the same tokens and FLOPs as the unpacked step."""
  out = tmp_path / 'bench.json'
  assert bench.main(['--gin_file=gin/models/t5_tiny.gin', '--gin.TransformerConfig.vocab_size=512',
                     '--batch=2', '--inputs_length=16', '--targets_length=8', '--steps=1',
                     '--warmup=1', '--packed', f'--output={out}']) == 0
  result = json.loads(out.read_text())
  assert result['packed'] is True and result['tokens_per_second'] == pytest.approx(
      2 * 24 / result['median_step_seconds'])
  from t5x_variants.models import TransformerConfig  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import train_step  # pylint: disable=g-import-not-at-top
  batch = train_step.synthetic_batch(TransformerConfig(vocab_size=64), 2, {'inputs': 5, 'targets': 4},
                                     packed=True)
  np.testing.assert_array_equal(batch['encoder_segment_ids'], [[1, 1, 2, 2, 2]] * 2)
  np.testing.assert_array_equal(batch['encoder_positions'], [[0, 1, 0, 1, 2]] * 2)
  np.testing.assert_array_equal(batch['decoder_segment_ids'], [[1, 1, 2, 2]] * 2)


HLO = """HloModule m

%fused_dot (p: bf16[8,8]) -> bf16[8,8] {
  %p = bf16[8,8]{1,0} parameter(0)
  ROOT %d = bf16[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

fused_conv (p: bf16[8,8]) -> bf16[8,8] {
  ROOT %c = bf16[8,8]{1,0} convolution(%p, %p), dim_labels=bf_io->bf
}

ENTRY %main (a: bf16[8,8]) -> bf16[8,8] {
  %a = bf16[8,8]{1,0} parameter(0)
  %gemm_fusion = bf16[8,8]{1,0} fusion(%a), kind=kCustom, calls=%fused_dot
  %fusion.4 = bf16[8,8]{1,0} fusion(%a), kind=kCustom, calls=fused_conv
  %custom-call.1 = (bf16[8,8]{1,0}, u8[0]{0}) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax"
  %loop_convert_fusion = f32[8,8]{1,0} fusion(%copy.1), kind=kLoop, calls=%other
  %input_reduce_fusion = f32[8]{0} fusion(%a), kind=kInput, calls=%r
  %fusion.9 = f32[8]{0} fusion(%a), kind=kInput, calls=%r
  %all-reduce.2 = f32[8]{0} all-reduce(%a), to_apply=%add
  %shard_map.952 = bf16[8,8]{1,0} custom-call(%a), custom_call_target="tpu_custom_call"
  ROOT %copy.3 = bf16[8,8]{0,1} copy(%a), metadata={op_name="jit(f)/dot_general"}
}
"""


def test_profile_categories():
  from t5x_variants.cli import profile
  found = {n: profile.category(i) for n, i in profile.hlo_instructions(HLO).items()}
  assert found['gemm_fusion'] == 'matmul' and found['custom-call.1'] == 'fused attention'
  assert found['fusion.4'] == 'matmul'  # its body's header printed without '%'
  assert found['loop_convert_fusion'] == 'conversions'  # not its operand's name 'copy.1'
  assert found['input_reduce_fusion'] == 'reductions' and found['all-reduce.2'] == 'collectives'
  assert found['fusion.9'] == 'reductions'  # by its kind alone
  assert found['copy.3'] == 'copies'  # not its metadata's 'dot_general'
  assert found['shard_map.952'] == 'fused attention'  # a Pallas kernel on a TPU (was 'other')


def test_the_hf_ratio_names_what_our_step_does_that_the_peers_does_not():
  """The peer runs dropout 0, one microbatch: a ratio against a heavier step of ours says so, and
  against another model (a shared encoder-decoder's, which the peer's T5 cannot share)."""
  same = {'dropout': False, 'num_microbatches': 1}
  assert bench.unlike(same, {'optimizer': 'adafactor'}, 'adafactor') == ''
  assert bench.unlike({'dropout': True, 'num_microbatches': 4, 'packed': True}, {'optimizer': 'adamw'},
                      'adafactor') == (' (different optimizers, dropout on in ours only, 4 microbatches '
                                       'in ours, packed rows in ours)')
  assert bench.unlike({**same, 'z_loss': 1e-4, 'label_smoothing': 0.1}, {'optimizer': 'adafactor'},
                      'adafactor') == ' (z-loss 0.0001 in ours, label smoothing 0.1 in ours)'
  # another model than the peer's (a shared encoder-decoder: the peer has two stacks)
  assert bench.unlike({**same, 'parameters': 10}, {'optimizer': 'adafactor', 'parameters': 10},
                      'adafactor') == ''
  assert bench.unlike({**same, 'parameters': 10}, {'optimizer': 'adafactor', 'parameters': 1234},
                      'adafactor') == " (10 parameters in ours, 1,234 in the peer's)"


def test_profile_turns_command_buffers_off_only_for_a_cuda_backend():
  """On a GPU the trace shows XLA's command buffers, not kernels ('command_buffer_N': every op
  'other'); --profile turns them off there, keeping the user's XLA flags, and nowhere else."""
  from t5x_variants.cli import profile
  env = {'XLA_FLAGS': '--xla_dump_to=/tmp/x'}
  assert profile.expose_gpu_kernels(env, plugins=['jax_cuda13_plugin'])
  assert env['XLA_FLAGS'] == '--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer='
  for env, plugins in (({}, ['jax_plugins']), ({'JAX_PLATFORMS': 'cpu'}, ['jax_cuda13_plugin']),
                       ({'JAX_PLATFORMS': 'tpu'}, ['jax_cuda13_plugin'])):
    assert not profile.expose_gpu_kernels(env, plugins=plugins) and 'XLA_FLAGS' not in env


@pytest.mark.skipif(ON_GPU, reason='the CPU run of the bench; on a GPU: scripts/gpu_bench.sh')
def test_bench_times_the_hf_peer_on_the_same_shape(tmp_path, capsys):
  """--hf: the peer in its own process, same batch and lengths, the same optimizer kind."""
  pytest.importorskip('transformers')
  out = tmp_path / 'bench.json'
  assert bench.main(['--gin_file=gin/models/t5_tiny.gin', '--gin.TransformerConfig.vocab_size=512',
                     '--batch=2', '--inputs_length=16', '--targets_length=8', '--steps=2',
                     '--warmup=1', '--hf', f'--output={out}']) == 0
  result = json.loads(out.read_text())
  hf = result['hf']
  assert (hf['device'], hf['optimizer'], hf['compile']) == ('cpu', 'adafactor', False)
  ours = recipe.build_config()  # the same model: untied, as ours (transformers 5 would tie it)
  assert not ours.tie_embeddings
  assert hf['parameters'] == sum(r[3] for r in summary.param_rows(summary.abstract_params(ours)))
  assert result['optimizer'] == 'adafactor'
  assert hf['tokens_per_second'] == pytest.approx(2 * 24 / hf['median_step_seconds'])
  assert result['speedup_vs_hf'] == pytest.approx(hf['median_step_seconds'] / result['median_step_seconds'])
  assert 'x the speed of HF PyTorch T5' in capsys.readouterr().out


def test_bench_takes_a_recipe_its_model_batch_and_lengths(tmp_path):
  """As t5xv-train takes it: the model, and the batch and lengths of its macros (BATCH_SIZE here
  overridden by a binding, TASK_FEATURE_LENGTHS the recipe's); no MODEL_DIR needed."""
  files = ['gin/experiments/foundation/lm_small.gin', 'gin/variants/norm/subln.gin']
  out = tmp_path / 'bench.json'
  assert bench.main([*(f'--gin_file={f}' for f in files), '--gin.BATCH_SIZE=4', '--steps=1',
                     '--warmup=0', '--peak_tflops=1', f'--output={out}']) == 0
  result = json.loads(out.read_text())
  assert (result['architecture'], result['dtype']) == ('decoder_only', 'float32')
  assert result['batch'] == 4 and result['lengths'] == {'targets': 128}
  gin.clear_config()
  parse_recipe(files, ["MODEL_DIR = '/tmp/x'"])
  config = recipe.build_config()
  assert config.placement == 'subln' and config.num_decoder_layers == 4
  assert result['train_flops_per_step'] == flops.train_flops(config, 4, {'targets': 128})
  gin.clear_config()  # a flag beats the recipe
  assert bench.main([*(f'--gin_file={f}' for f in files), '--batch=2', '--targets_length=64',
                     '--steps=1', '--warmup=0', '--peak_tflops=1', f'--output={out}']) == 0
  result = json.loads(out.read_text())
  assert result['batch'] == 2 and result['lengths'] == {'targets': 64}


def test_profile_reports_one_devices_time_when_several_run_the_step(monkeypatch, tmp_path):
  """Was: two GPUs each running a 6 ms dot and a 4 ms fusion per step gave matmul 12 ms and 4
  kernels per step (both devices' summed) beside a busy time of 10 ms."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import profile
  calls = 3
  event = lambda name, start, ms: types.SimpleNamespace(
      name=name, start_ns=int(start * 1e6), duration_ns=int(ms * 1e6), stats=[('hlo_op', name)])
  plane = lambda i: types.SimpleNamespace(name=f'/device:GPU:{i}', lines=[types.SimpleNamespace(
      name='XLA Ops', events=[e for c in range(calls) for e in (event('dot.1', 10 * c, 6),
                                                                 event('fusion.2', 10 * c + 6, 4))])])

  @contextlib.contextmanager
  def trace(logdir):
    (tmp_path / 'a.xplane.pb').touch()
    monkeypatch.setattr(profile.glob, 'glob', lambda *a, **k: [str(tmp_path / 'a.xplane.pb')])
    yield
  monkeypatch.setattr(profile.jax.profiler, 'trace', trace)
  monkeypatch.setattr(profile.jax.profiler, 'ProfileData', types.SimpleNamespace(
      from_file=lambda f: types.SimpleNamespace(planes=[plane(0), plane(1)])))
  monkeypatch.setattr(profile.jax, 'local_device_count', lambda: 2)
  monkeypatch.setattr(profile, 'hlo_instructions', lambda text: {
      'dot.1': ('dot', 'dot.1 dot( ', {'dot'}, 'f32[8,8]', ''),
      'fusion.2': ('fusion', 'fusion.2 fusion( kLoop', {'add', 'parameter'}, 'f32[8]', '')})
  step = lambda state, data, rng: (state, {'loss': np.float32(0)})
  step.as_text = lambda: ''
  report, _ = profile.profile(step, None, None, None, calls=calls)
  assert report['by_category'] == pytest.approx({'matmul': 6.0, 'other fusions': 4.0})
  assert (report['busy_ms'], report['device_ms'], report['kernels_per_step'], report['devices']) == (
      pytest.approx(10.0), pytest.approx(10.0), 2, 2)
  assert [(op['op'], op['calls']) for op in report['top_ops']] == [('dot.1', 1), ('fusion.2', 1)]
  assert profile.format_report(report).startswith('profile (each of 2 devices): ')


def test_profile_counts_a_fusion_of_reductions_alone_as_reductions():
  """The CPU's ynn_fusion of a reduce was 'other fusions' (its name says nothing)."""
  from t5x_variants.cli import profile
  assert profile.category(('fusion', 'ynn_fusion fusion( ', {'parameter', 'reduce'})) == 'reductions'
  assert profile.category(('fusion', 'ynn_fusion.2 fusion( ', {'parameter', 'dot'})) == 'matmul'
  assert profile.category(('fusion', 'fusion.3 fusion( kLoop', {'reduce', 'exponential'})) == 'other fusions'
