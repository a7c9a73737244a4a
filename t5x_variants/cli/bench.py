"""t5xv-bench: train-step throughput, FLOP utilisation, memory and compile time.

  t5xv-bench --gin_file=gin/models/t5_small.gin --gin_file=gin/variants/ffn/geglu.gin \\
    --batch=8 --inputs_length=512 --targets_length=114 --steps=10 [--hf] [--output=bench.json]
  t5xv-bench --gin_file=gin/experiments/foundation/lm.gin --gin_file=gin/variants/norm/subln.gin

Takes the same gin as ``t5xv-train`` (run file, size, variants, recipe, ``--gin.`` bindings); the
batch and lengths are the flags', else the run's (``BATCH_SIZE``, ``TASK_FEATURE_LENGTHS``), else
8 and 512 / 114.

Runs the step t5xv-train would (``sharded_model.ShardedModel``: the same mesh (``MeshConfig``),
optimizer (``make_optimizer``), schedule, dtype, ``train.num_microbatches`` and loss options, all
from gin, and dropout when the model has any) on synthetic batches, so it needs no TensorFlow.
Reports tokens/s (input + target positions), sequences/s, the median step time, achieved TFLOP/s
by ``models/flops.py`` (whose docstring says what is counted) and MFU against a named peak, peak
memory, and compile time.
``--profile`` adds where the step's device time goes (cli/profile.py). ``--hf`` also times Hugging
Face PyTorch ``T5ForConditionalGeneration`` on the same shape, device, dtype and optimizer, with
dropout 0 and one microbatch (cli/bench_hf.py; extra ``hf``: torch, transformers),
``--hf_compile`` under ``torch.compile``, and prints the ratio of step times (saying so where our
step differs: dropout on, several microbatches, another optimizer).
"""
import json
import os
import resource
import statistics
import sys
import time

import gin
import jax
import numpy as np

from t5x_variants import is_positive_number
from t5x_variants.cli import common, launch, profile, ranges, recipe
from t5x_variants.layers import dense
from t5x_variants.models import flops
from t5x_variants.train import aot, partitioning, sharded_model, targets, train_step

DEFAULT_LENGTHS = {'inputs': 512, 'targets': 114}  # without a flag or a run file


def measured_matmul_peak(n: int = 2048) -> float:
  """TFLOP/s of a jitted n x n fp32 matmul on the first device (best of 5)."""
  a = jax.device_put(np.ones((n, n), np.float32))
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(5))
  return 2 * n ** 3 / best / 1e12


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def peak_tflops(config):
  """(peak TFLOP/s of all devices, where it comes from)."""
  device = jax.devices()[0]
  bf16 = config.dtype == 'bfloat16'
  peak = targets.published_peak(device.device_kind, bf16)
  if peak:
    return (peak * jax.device_count(),
            f'published {device.device_kind} dense {"bf16" if bf16 else "fp32"} peak')
  return (measured_matmul_peak() * jax.device_count(),
          f'measured 2048x2048 fp32 matmul on {device.device_kind}')


def peak_memory():
  """(bytes, what they are): the accelerator's peak bytes in use, or the process's peak RSS."""
  stats = jax.devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:
    return stats['peak_bytes_in_use'], 'device peak_bytes_in_use'
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'process peak RSS (host)'


def bench(config, batch: int, lengths, steps: int = 10, warmup: int = 2,
          mesh: partitioning.MeshConfig = None, num_microbatches: int = None, peak=None,
          with_profile: bool = False, packed: bool = False) -> dict:
  """Times ``steps`` train steps after ``warmup``; returns every figure and the FLOP formula.
  The step is t5xv-train's: its gin-bound mesh, optimizer, microbatches (unless given) and loss
  options, dropout when the config has any; ``packed``: on packed rows (two examples each), as
  a pretraining run's step with packing."""
  sharded = sharded_model.ShardedModel.build(config, mesh or partitioning.MeshConfig(), 0)
  mesh, rng = sharded.mesh, sharded.rng
  options = aot.train_options()
  num_microbatches = options['num_microbatches'] = num_microbatches or options['num_microbatches']
  partitioning.check_batch(batch, mesh, num_microbatches)
  state = train_step.create_state(sharded.layout, sharded.model, rng, sharded.inputs)
  step = sharded.make_train_step(**options)
  data = partitioning.global_batch(train_step.synthetic_batch(config, batch, lengths, packed=packed), mesh)
  start = time.perf_counter()
  step = step.lower(state, data, rng).compile()
  compile_seconds = time.perf_counter() - start
  times = []
  for i in range(warmup + steps):
    start = time.perf_counter()
    state, metrics = step(state, data, rng)
    jax.block_until_ready(metrics['loss'])
    if i >= warmup:
      times.append(time.perf_counter() - start)
  report = None
  if with_profile:  # after the timing, which a failure here must not cost
    try:
      report, state = profile.profile(step, state, data, rng)
    except Exception as e:  # pylint: disable=broad-except  (a trace format this parser misreads)
      print(f't5xv-bench: warning: --profile failed ({type(e).__name__}: {e}); the timing stands',
            file=sys.stderr)
  median = statistics.median(times)
  tokens = batch * sum(lengths[k] for k in ('inputs', 'targets') if k in lengths)
  flop = flops.train_flops(config, batch, lengths)
  peak_value, peak_source = peak if peak else peak_tflops(config)
  memory, memory_source = peak_memory()
  return {
      'device': jax.devices()[0].device_kind, 'devices': jax.device_count(),
      'architecture': config.architecture, 'dtype': str(config.dtype), 'batch': batch,
      'num_microbatches': num_microbatches, 'dropout': config.uses_dropout, 'packed': packed,
      'remat': config.remat_policy(jax.default_backend()),
      'attention_kernel': config.attention_kernel, 'z_loss': options['z_loss'],
      'label_smoothing': options['label_smoothing'],
      'dense_contraction': os.environ.get(dense.CONTRACTION, "the platform's"),
      'parameters': sum(int(x.size) for x in jax.tree_util.tree_leaves(state.params)),
      'lengths': dict(lengths), 'steps': steps, 'median_step_seconds': median,
      'step_seconds': times, 'tokens_per_second': tokens / median,
      'sequences_per_second': batch / median, 'train_flops_per_step': flop,
      'flops_breakdown_forward': flops.forward_flops(config, batch, lengths),
      'tflops_per_second': flop / median / 1e12, 'peak_tflops': peak_value,
      'peak_source': peak_source, 'mfu': flop / median / 1e12 / peak_value,
      'peak_memory_bytes': memory, 'memory_source': memory_source,
      'host_huge_pages': launch.huge_pages_on(),
      'compile_seconds': compile_seconds, 'final_loss': float(metrics['loss']),
      'flop_formula': flops.__doc__.strip(), 'profile': report,
  }


def optimizer_kind() -> str:
  """'adafactor' or 'adamw' (or the bound optimizer's name): ``make_optimizer.optimizer``."""
  try:
    bound = gin.query_parameter('make_optimizer.optimizer')
  except ValueError:
    return 'adafactor'
  return str(bound).strip('@').split('.')[-1]


def unlike(result, hf, ours: str) -> str:
  """' (...)' naming what our timed step does that the HF peer's does not, else ''."""
  differ = ([] if hf['optimizer'] == ours else ['different optimizers']) + (
      ['dropout on in ours only'] if result['dropout'] else []) + (
      [f"{result['num_microbatches']} microbatches in ours"] if result['num_microbatches'] > 1 else []) + (
      ['packed rows in ours'] if result.get('packed') else []) + (
      [f"z-loss {result['z_loss']:g} in ours"] if result.get('z_loss') else []) + (
      [f"label smoothing {result['label_smoothing']:g} in ours"] if result.get('label_smoothing') else []) + (
      [f"{result['parameters']:,} parameters in ours, {hf['parameters']:,} in the peer's"]
      if hf.get('parameters', result.get('parameters')) != result.get('parameters') else [])
  return f" ({', '.join(differ)})" if differ else ''


def _check_flags(args):
  """ValueError, one line, for a flag out of range, a peer's flag without --hf (ignored before) or
  an --output that cannot be written, before anything compiles (a bad --output failed after the
  run; --batch=0 ran the default batch)."""
  ranges.check_flags(args, {'batch': 1, 'inputs_length': 1, 'targets_length': 1, 'steps': 1,
                            'warmup': 0})
  if args.peak_tflops is not None and not is_positive_number(args.peak_tflops):
    raise ValueError(f'--peak_tflops={args.peak_tflops} is out of range: it must be a number > 0 '
                     '(leave it out for the device\'s own)')
  peer_flags = [f for f in ('hf_compile', 'hf_optimizer') if getattr(args, f)]
  if peer_flags and not args.hf:
    raise ValueError(f'--{peer_flags[0]} sets the Hugging Face peer, which runs only with --hf: add '
                     '--hf, or leave it out')
  if args.output:
    parent = os.path.dirname(os.path.abspath(args.output))
    if os.path.isdir(args.output) or not os.path.isdir(parent):
      raise ValueError(f'--output={args.output} cannot be written: it must name a file in an '
                       'existing directory')
    common.check_json_output(args.output, 't5xv-bench', 'median_step_seconds')


def main(argv=None):
  parser = common.parser('t5xv-bench', __doc__)
  parser.add_argument('--batch', type=int, default=None, help='default: the run\'s, else 8')
  parser.add_argument('--inputs_length', type=int, default=None, help='default: the run\'s, else 512')
  parser.add_argument('--targets_length', type=int, default=None, help='default: the run\'s, else 114')
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument('--peak_tflops', type=float, default=None,
                      help='one device\'s peak (times the device count); default: the published one')
  parser.add_argument('--hf', action='store_true', help='also time HF PyTorch T5 on the same shape')
  parser.add_argument('--hf_compile', action='store_true', help='the HF peer under torch.compile')
  parser.add_argument('--hf_optimizer', default=None,
                      help="the HF peer's: adafactor or adamw (fused); default: the run's own kind")
  parser.add_argument('--profile', action='store_true', help='device time by category and top ops')
  parser.add_argument('--packed', action='store_true',
                      help='packed rows (two examples each), as a pretraining run with packing reads')
  parser.add_argument('--output', default=None, help='write the results as JSON here')
  with common.clear_errors('t5xv-bench'):
    no_command_buffers = parser.parse_known_args(argv)[0].profile and profile.expose_gpu_kernels()
    args, config = recipe.setup(parser, argv, with_data=False)
    _check_flags(args)
    batch = args.batch or recipe.gin_macro('BATCH_SIZE') or 8
    run_lengths = recipe.gin_macro('TASK_FEATURE_LENGTHS') or {}
    lengths = {f: getattr(args, f'{f}_length') or run_lengths.get(f) or DEFAULT_LENGTHS[f]
               for f in config.task_features}
    ours = optimizer_kind()
    hf = None
    if args.hf:  # first: JAX's backend would take most of the accelerator's memory
      from t5x_variants.cli import bench_hf  # pylint: disable=g-import-not-at-top
      hf = bench_hf.run(config, batch, lengths, args.steps, args.warmup, args.hf_compile,
                        args.hf_optimizer or ours)
      memory = hf['peak_memory_bytes']
      print(f'HF PyTorch T5 ({"torch.compile" if hf["compile"] else "eager"}, {hf["optimizer"]}, '
            f'{hf["device"]}, torch {hf["torch"]}): median step {hf["median_step_seconds"] * 1000:.1f} ms, '
            f'{hf["tokens_per_second"]:,.0f} tok/s'
            + (f', peak memory {memory / 2**30:.2f} GiB' if memory else ''), flush=True)
    # After the peer: jax.device_count() starts JAX's backend, which takes the accelerator's memory.
    peak = ((args.peak_tflops * jax.device_count(), f'given with --peak_tflops, x{jax.device_count()} devices')
            if args.peak_tflops else None)
    result = bench(config, batch, lengths, args.steps, args.warmup, peak=peak,
                   with_profile=args.profile, packed=args.packed)
    result['optimizer'] = ours
    result['xla_command_buffers'] = not no_command_buffers
  print(f'{result["device"]} x{result["devices"]} (remat {result["remat"]}): '
        f'{result["tokens_per_second"]:,.0f} tok/s, '
        f'{result["sequences_per_second"]:.2f} seq/s, median step {result["median_step_seconds"] * 1000:.1f} ms, '
        f'{result["tflops_per_second"]:.3f} TFLOP/s, MFU {result["mfu"]:.1%} of '
        f'{result["peak_tflops"]:.2f} ({result["peak_source"]}), peak memory '
        f'{result["peak_memory_bytes"] / 2**30:.2f} GiB ({result["memory_source"]}), compile '
        f'{result["compile_seconds"]:.1f} s, host huge pages {"on" if result["host_huge_pages"] else "off"}')
  if result['profile']:
    print(profile.format_report(result['profile']))
  if no_command_buffers:
    print(f'(--profile on a GPU: XLA command buffers off ({profile.NO_COMMAND_BUFFERS}) so the trace '
          'shows each kernel; the step above was timed without them)')
  if hf:
    result['hf'] = hf
    result['speedup_vs_hf'] = hf['median_step_seconds'] / result['median_step_seconds']
    print(f't5x_variants ({ours}) is {result["speedup_vs_hf"]:.2f}x the speed of HF PyTorch T5'
          + (f' in {result["peak_memory_bytes"] / memory:.2f}x its memory' if memory else '')
          + unlike(result, hf, ours))
  if args.output:
    with open(args.output, 'w') as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
