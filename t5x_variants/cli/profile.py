"""``t5xv-bench --profile``: where a train step's device time goes, on a GPU, a TPU or the CPU.

A ``jax.profiler`` trace of a few calls of the compiled step, read back as XPlane: the device's
kernels (a GPU's stream lines, a TPU's 'XLA Ops' line, the CPU's XLA thread-pool threads), each
attributed to its HLO instruction (the event's ``hlo_op``, else its kernel name) and put in one
category by that instruction's text in the compiled module: matmul, fused attention, other
fusions, copies, dtype conversions, reductions, collectives, other. Busy is the union of the device's kernel
intervals over the wall time of the traced steps: near 100% the device never waited on the host.
With several devices every figure is one device's: the mean over this host's devices (each runs
the whole step on its shard; on the CPU they share one thread pool, whose busy time is the host's).
"""
import collections
import glob
import os
import pkgutil
import re
import tempfile
import time

import jax

from t5x_variants.train import hlo_traffic

CATEGORIES = (  # first match wins, on the instruction's HLO text (or the kernel's name)
    # The project's Pallas kernels (tpu_custom_call) are its attention kernels (layers/).
    ('fused attention', r'fmha|flash|cudnn\$|dot_product_attention|tpu_custom_call'),
    ('matmul', r'gemm|\bdot\(|convolution\(|cublas|nvjet|xmma|cutlass|matmul'),
    ('collectives', r'all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all|nccl'),
    ('copies', r'copy|transpose|dynamic[-_]update[-_]slice|memcpy|memset'),
    ('conversions', r'convert'),
    ('reductions', r'reduce|\bkInput\b'),  # XLA's kInput fusions are reductions
    ('other fusions', r'fusion'),
)


PLUMBING = {'parameter', 'constant', 'bitcast', 'broadcast', 'reshape', 'tuple', 'get-tuple-element'}
CONTAINERS = ('while', 'conditional', 'call')  # ops whose events enclose their bodies' events
# XLA on a GPU replays runs of kernels as CUDA graphs ('command buffers'): a trace shows one
# 'command_buffer_N' event per replay and none of the kernels inside (seen on an H200, jax 0.11.2).
NO_COMMAND_BUFFERS = '--xla_gpu_enable_command_buffer='


def expose_gpu_kernels(environ=os.environ, plugins=None) -> bool:
  """Turns XLA's command buffers off for this process when JAX will run on a CUDA GPU (call
  before the backend starts), so the profile sees each kernel; the step is then timed without
  them too. Whether it did (``plugins``: the installed module names, for tests)."""
  platform = environ.get('JAX_PLATFORMS', '').split(',')[0].strip()
  if plugins is None:
    plugins = [m.name for m in pkgutil.iter_modules()]
  if platform not in ('', 'cuda', 'gpu') or not any(p.startswith('jax_cuda') for p in plugins):
    return False
  environ['XLA_FLAGS'] = f'{environ.get("XLA_FLAGS", "")} {NO_COMMAND_BUFFERS}'.strip()
  return True


def categorize(text: str) -> str:
  for name, pattern in CATEGORIES:
    if re.search(pattern, text):
      return name
  return 'other'


def hlo_instructions(hlo: str):
  """{name: (opcode, what names its kind, the opcodes it runs, shape, op_name)}; the kind is the
  name, opcode, fusion kind and custom-call target (XLA names fusions by what they do:
  ``loop_convert_fusion``, ``input_reduce_fusion``, ``transpose_fusion``)."""
  program = hlo_traffic.computations(hlo)
  out = {}
  for body in program.values():
    for name, shape, opcode, rest, line in body:
      kind = ' '.join(re.findall(r'(?:kind=|custom_call_target=)"?([^",}]+)', rest.split(', metadata=')[0]))
      out[name] = (opcode, f'{name} {opcode}( {kind}', hlo_traffic.opcodes(program, opcode, line),
                   shape, (re.search(r'op_name="([^"]+)"', rest) or [None, ''])[1])
  return out


def category(instruction) -> str:
  """What runs a dot is a matmul (XLA GPU's gemm fusions, the CPU's dot fusions), what runs
  reductions alone a reduction (the CPU's ``ynn_fusion``s, named by neither); else by its text."""
  _, text, runs = instruction[:3]
  if runs & hlo_traffic.MATMULS:
    return 'matmul'
  return 'reductions' if runs - PLUMBING == {'reduce'} else categorize(text)


def _device_lines(planes):
  """(plane name, line) of the lines that hold the compiled step's work."""
  for plane in planes:
    if plane.name.startswith('/device:') and not plane.name.startswith('/device:CUSTOM'):
      names = [line.name for line in plane.lines]
      for line in plane.lines:
        if line.name == 'XLA Ops' or ('XLA Ops' not in names and 'Stream' in line.name):
          yield plane.name, line
    elif plane.name.startswith('/host:CPU'):
      for line in plane.lines:
        if line.name.startswith('tf_XLA'):
          yield plane.name, line


def _busy(intervals) -> float:
  """Length of the union of (start, end) intervals."""
  total, end = 0.0, float('-inf')
  for s, e in sorted(intervals):
    if e > end:
      total += e - max(s, end)
      end = e
  return total


def profile(step, state, data, rng, calls: int = 3, top: int = 15):
  """(report dict, state) for ``calls`` calls of the compiled ``step``: device milliseconds per
  step by category and the ``top`` instructions, busy fraction, kernels per step."""
  with tempfile.TemporaryDirectory() as logdir:
    with jax.profiler.trace(logdir):
      start = time.perf_counter()
      for _ in range(calls):
        state, metrics = step(state, data, rng)
        jax.block_until_ready(metrics['loss'])
      wall = time.perf_counter() - start
    trace = jax.profiler.ProfileData.from_file(
        sorted(glob.glob(f'{logdir}/**/*.xplane.pb', recursive=True))[-1])
  hlo = hlo_instructions(step.as_text())
  by_op, count, intervals = collections.Counter(), collections.Counter(), collections.defaultdict(list)
  for plane, line in _device_lines(trace.planes):
    for event in line.events:
      stats = dict(event.stats)
      if event.duration_ns <= 0 or (line.name.startswith('tf_XLA') and 'hlo_op' not in stats):
        continue
      op = str(stats.get('hlo_op') or event.name)
      if op in hlo and hlo[op][0] in CONTAINERS:
        continue
      by_op[op] += event.duration_ns
      count[op] += 1
      intervals[plane].append((event.start_ns, event.start_ns + event.duration_ns))
  devices = jax.local_device_count()
  per_step = lambda ns: ns / calls / devices / 1e6
  by_category = collections.Counter()
  ops = []
  for op, ns in by_op.most_common():
    instruction = hlo.get(op, ('', op, set(), '', ''))
    by_category[category(instruction)] += ns
    if len(ops) < top:
      ops.append({'ms': per_step(ns), 'op': op, 'calls': count[op] // (calls * devices),
                  'category': category(instruction), 'shape': instruction[3], 'op_name': instruction[4]})
  planes = [v for k, v in intervals.items() if k.startswith('/device:')] or list(intervals.values())
  busy = sum(_busy(v) for v in planes) / max(len(planes), 1) / calls / 1e6
  return {'wall_ms': wall / calls * 1e3, 'busy_ms': busy, 'busy_fraction': busy / (wall / calls * 1e3),
          'devices': devices, 'device_ms': per_step(sum(by_op.values())),
          'kernels_per_step': sum(count.values()) // (calls * devices),
          'by_category': {k: per_step(v) for k, v in by_category.most_common()}, 'top_ops': ops}, state


def format_report(report) -> str:
  each = f' (each of {report["devices"]} devices)' if report.get('devices', 1) > 1 else ''
  lines = [f'profile{each}: {report["wall_ms"]:.1f} ms per step, device busy {report["busy_ms"]:.1f} ms '
           f'({report["busy_fraction"]:.0%}; the rest waiting on the host), '
           f'{report["kernels_per_step"]} kernels per step',
           'by category (ms per step): ' + ', '.join(f'{k} {v:.1f}' for k, v in report['by_category'].items())]
  for op in report['top_ops']:
    lines.append(f'{op["ms"]:9.2f} ms x{op["calls"]:<4d} {op["category"]:15s} {op["op"][:40]:40s} '
                 f'{op["shape"][:28]:28s} {op["op_name"][-70:]}')
  return '\n'.join(lines)
