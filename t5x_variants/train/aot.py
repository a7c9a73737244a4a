"""Ahead-of-time compilation of the real train step for a target (``targets.py``): memory per
device, whether it fits, compile time, and the compiler's cost-model estimate; and a search over
the usual memory knobs for configurations that fit.

The step is the trainer's own (``sharded_model.ShardedModel``'s, with the run's mesh, shardings,
optimizer, schedule, microbatches, dtype and remat), lowered on abstract arrays: no parameter,
batch or data is ever materialised, so a 3B-parameter step compiles on a laptop.

Memory per device is XLA's for the compiled program: arguments (the state, a batch shard) +
temporaries + outputs not aliased to donated arguments + generated code; it fits when that total
is within the target's memory. A TPU compile that exceeds HBM may fail in the compiler; that
failure is reported as "does not fit" with the compiler's own figure (its total, or its
temporaries alone). XLA's cost analysis counts a loop body once, so its FLOPs and
``optimal_seconds`` describe the step only when layers are unrolled (``scan_layers=False``) and
the batch is one microbatch (``num_microbatches=1``); they are estimates of the compiler's
model, never measurements.
"""
import dataclasses
import inspect
import math
import re
import time
from typing import Dict, List, Optional

import gin
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from t5x_variants.models import flops, summary
from t5x_variants.models.config import REMAT, TransformerConfig
from t5x_variants.train import hlo_traffic, partitioning, sharded_model, train_step, trainer
from t5x_variants.train.targets import GIB, Target

STEP_OPTIONS = ('num_microbatches', 'label_smoothing', 'z_loss', 'loss_normalizing_factor')


def train_options() -> Dict:
  """The gin-bound arguments of ``trainer.train`` that shape the step (its defaults otherwise)."""
  defaults = {k: p.default for k, p in inspect.signature(trainer.train).parameters.items()}
  bound = gin.get_bindings(trainer.train)
  return {k: bound.get(k, defaults[k]) for k in STEP_OPTIONS}


@dataclasses.dataclass(frozen=True)
class Plan:
  """One way to run the step: model (its remat and dtype), mesh and microbatches, on the run's
  batches (``packed``: packed rows, whose attention mask is the segments')."""
  config: TransformerConfig
  mesh: partitioning.MeshConfig
  num_microbatches: int = 1
  packed: bool = False

  def flags(self) -> str:
    """The ``--gin.`` flags that select this plan."""
    return (f'--gin.TransformerConfig.remat="\'{self.config.remat}\'" '
            f'--gin.MeshConfig.replica={self.mesh.replica} '
            f'--gin.MeshConfig.data={self.mesh.data} --gin.MeshConfig.model={self.mesh.model} '
            f'--gin.MeshConfig.fsdp={self.mesh.fsdp} --gin.train.num_microbatches={self.num_microbatches}')


_SIZE = r'([\d.]+)([KMGT]?)'
# The TPU compiler's two forms of "out of memory" (figures in binary units): (pattern, what its
# figure counts, the result's key for it).
_OOM = ((rf'Used {_SIZE} of {_SIZE} hbm', 'needed per chip', 'total_bytes'),
        (rf'HLO temporaries \({_SIZE}\) exceeds available HBM \({_SIZE}\)',
         'of temporaries needed per chip', 'temp_bytes'))


def _bytes(number: str, unit: str) -> float:
  return float(number) * 1024 ** ' KMGT'.index(unit or ' ')


def compiler_oom(message: str) -> Optional[tuple]:
  """(what the figure counts, its key, bytes needed, bytes available) from the TPU compiler's
  out-of-memory message, or None if ``message`` is not one."""
  for pattern, what, key in _OOM:
    m = re.search(pattern, message)
    if m:
      return what, key, _bytes(*m.group(1, 2)), _bytes(*m.group(3, 4))
  return None


def needed_bytes(result: Dict) -> float:
  """The bytes per device that decided the fit: the total, or where the compiler refused the
  program on its temporaries, those."""
  return result['total_bytes'] if result.get('total_bytes') is not None else result['temp_bytes']


def abstract_batch(config: TransformerConfig, batch: int, lengths, sharding,
                   packed: bool = False) -> Dict:
  """ShapeDtypeStructs of a global batch of the architecture's features (with ``packed``, the
  segment ids and positions of packed rows), split over the batch axes."""
  one = train_step.synthetic_batch(config, 1, lengths, packed=packed)
  return {k: jax.ShapeDtypeStruct((batch,) + v.shape[1:], v.dtype, sharding=sharding)
          for k, v in one.items()}


def lower(plan: Plan, target: Target, batch: int, lengths, options: Dict):
  """(the lowered train step of ``plan`` on ``target``, its parameter count); ValueError if the
  mesh does not fit the devices, the parameters or the batch (checked before tracing the step)."""
  sharded = sharded_model.ShardedModel.build(plan.config, plan.mesh, 0, target.devices)
  mesh, layout, rng = sharded.mesh, sharded.layout, sharded.rng
  partitioning.check_batch(batch, mesh, plan.num_microbatches)
  step = sharded.make_train_step(**{**options, 'num_microbatches': plan.num_microbatches})
  data = abstract_batch(plan.config, batch, lengths, partitioning.batch_sharding(mesh), plan.packed)
  key = jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
  count = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(layout.abstract.params))
  return step.lower(layout.abstract, data, key), count


def _cost(compiled) -> Dict:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return dict(cost or {})


def compile_plan(plan: Plan, target: Target, batch: int, lengths, options: Dict,
                 traffic: int = 0) -> Dict:
  """Compiles ``plan`` for ``target``: a dict of per-device memory (bytes), fit, compile seconds,
  model FLOPs and, where the cost model gives one, the estimated step time and MFU; with
  ``traffic``, the compiled program's memory traffic and its ``traffic`` largest sources
  (hlo_traffic.py). A compile that the TPU compiler refuses for lack of memory returns
  ``fits: False`` with its figures."""
  lowered, parameters = lower(plan, target, batch, lengths, options)
  result = {'target': target.name, 'devices': target.num_devices, 'device_kind': target.device_kind,
            'mesh': dataclasses.asdict(plan.mesh),
            'mesh_shape': dict(plan.mesh.mesh(target.devices).shape),
            'remat': plan.config.remat_policy(target.platform), 'dtype': plan.config.dtype,
            'scan_layers': plan.config.scan_layers, 'num_microbatches': plan.num_microbatches,
            'packed': plan.packed,
            'batch': batch, 'lengths': dict(lengths), 'memory_limit_bytes': target.memory_bytes,
            'memory_limit_source': target.memory_source, 'flags': plan.flags(),
            'model_flops_per_step': flops.train_flops(plan.config, batch, lengths),
            'parameters': parameters}
  start = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    oom = compiler_oom(str(e))
    if oom is None:
      raise
    result.update({'compile_seconds': time.perf_counter() - start, 'fits': False,
                   'compiler_refused': True, 'needed': oom[0], oom[1]: oom[2],
                   'memory_limit_bytes': oom[3],
                   'memory_limit_source': 'the TPU compiler\'s HBM limit'})
    return result
  result['compile_seconds'] = time.perf_counter() - start
  m = compiled.memory_analysis()
  sizes = {'argument_bytes': m.argument_size_in_bytes, 'output_bytes': m.output_size_in_bytes,
           'alias_bytes': m.alias_size_in_bytes, 'temp_bytes': m.temp_size_in_bytes,
           'code_bytes': m.generated_code_size_in_bytes}
  sizes['total_bytes'] = (sizes['argument_bytes'] + sizes['output_bytes'] - sizes['alias_bytes']
                          + sizes['temp_bytes'] + sizes['code_bytes'])
  result.update(sizes, compiler_refused=False)
  limit = target.memory_bytes
  result['fits'] = None if limit is None else sizes['total_bytes'] <= limit
  cost = _cost(compiled)
  seconds = cost.get('optimal_seconds')
  result['cost_model'] = {'flops_per_device': cost.get('flops'), 'optimal_seconds': seconds,
                          'bytes_accessed_per_device': cost.get('bytes accessed'),
                          'counts_whole_step': (not plan.config.scan_layers
                                                and plan.num_microbatches == 1)}
  if traffic:
    result['traffic'] = hlo_traffic.summary(compiled.as_text(), top=traffic)
  if seconds and seconds > 0 and result['cost_model']['counts_whole_step'] and target.peak_tflops:
    result['estimated_step_seconds'] = seconds
    result['estimated_mfu'] = (result['model_flops_per_step'] / seconds
                               / (target.num_devices * target.peak_tflops * 1e12))
  return result


def fit_line(result: Dict) -> str:
  """'fits: ... GiB of ... (margin ...)' or 'does not fit: X GiB needed per chip, Y available'."""
  total, limit = needed_bytes(result) / GIB, result['memory_limit_bytes']
  if limit is None:
    return f'{total:.2f} GiB per device (no memory limit known: give --device_memory_gib)'
  limit /= GIB
  if result['fits']:
    return f'fits: {total:.2f} GiB per device of {limit:.2f} GiB (margin {limit - total:.2f} GiB)'
  return f'does not fit: {total:.2f} GiB {result.get("needed", "needed per chip")}, {limit:.2f} GiB available'


# --- which configurations fit ------------------------------------------------------------------

# Least recomputation first. The search keeps to these four; the other named policies
# (models/stack.py) are chosen by measuring on a device.
REMAT_ORDER = ('none', 'minimal', 'dots_and_probs', 'full')
MAX_MICROBATCHES = 64
assert set(REMAT_ORDER) <= set(REMAT)


def candidate_plans(plan: Plan, target: Target, batch: int) -> List[Plan]:
  """Plans that vary remat, FSDP, the model-axis size and the microbatch count, in order of the
  work they add: a rank of 0 for no remat, data parallelism and one microbatch, +1 per remat step
  (minimal, dots_and_probs, full), +1 for FSDP, +log2(model) for a model axis, +log2(microbatches);
  ties: less remat first. Meshes that split a parameter or the batch unevenly, or a 'data' shard
  over the slice's hosts, are left out (no compile needed to know). On several TPU slices FSDP
  keeps to each slice (one replica a slice), so its gathers stay off the network between them."""
  boxed = summary.abstract_params(plan.config)
  n = target.num_devices
  slices = len({partitioning.slice_index(d) for d in target.devices})
  ranked = []
  for size in partitioning.divisors(n):
    for fsdp in (False, True) if n // size // slices > 1 else (False,):  # FSDP splits over 'data'
      replica = slices if fsdp else 1
      mesh_config = partitioning.MeshConfig(data=n // size // replica, model=size, fsdp=fsdp,
                                            replica=replica)
      mesh = mesh_config.mesh(target.devices)
      try:
        partitioning.check_mesh(boxed, mesh, mesh_config.rules())
        partitioning.check_processes(mesh)  # a model axis within one host of the slice
      except ValueError:
        continue
      k = 1
      while batch % (replica * mesh_config.data * k) == 0 and k <= MAX_MICROBATCHES:
        for r, remat in enumerate(REMAT_ORDER):
          rank = r + fsdp + math.log2(size) + math.log2(k)
          ranked.append((rank, r, Plan(dataclasses.replace(plan.config, remat=remat), mesh_config, k,
                                       plan.packed)))
        k *= 2
  ranked.sort(key=lambda x: x[:2])
  return [p for _, _, p in ranked]


def suggest(plan: Plan, target: Target, batch: int, lengths, options: Dict, want: int = 3,
            max_compiles: int = 12, log=print) -> List[Dict]:
  """Up to ``want`` plans that fit, cheapest first, in at most ``max_compiles`` compiles.

  The candidates (``candidate_plans``) are nearly ordered by memory too, the most economical
  last: if it does not fit, nothing does. Otherwise a bisection for the cheapest candidate that
  fits (as if memory fell monotonically along the list), then the cheaper ones not yet compiled,
  nearest first, skipping those that save no more on any knob than one that did not fit. Every
  plan returned was compiled and fits; the list is the best found within the budget, not a proof
  that nothing cheaper fits."""
  plans = candidate_plans(plan, target, batch)
  results: Dict[int, Dict] = {}

  def fits(i: int) -> bool:
    if i not in results:
      results[i] = compile_plan(plans[i], target, batch, lengths, options)
      log(f'  compiled: {fit_line(results[i])}: {plans[i].flags()}')
    return bool(results[i]['fits'])

  if not plans or not fits(len(plans) - 1):
    return []
  lo, hi = 0, len(plans) - 1
  while lo < hi and len(results) < max_compiles:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
  for i in range(hi - 1, -1, -1):  # cheaper than the bisection's answer, nearest first
    if len(results) >= max_compiles:
      break
    if not any(_saves_as_much(plans[j], plans[i]) for j, r in results.items() if not r['fits']):
      fits(i)
  found = [results[i] for i in sorted(results) if results[i]['fits']]
  return found[:want]


def _saves_as_much(a: Plan, b: Plan) -> bool:
  """Whether ``a`` is at least as economical as ``b`` on every knob (so if ``a`` does not fit,
  ``b`` is taken not to fit either): remat, FSDP, the parameters split over a model axis, and
  the rows each device holds at once (batch x model / (devices x microbatches): a larger model
  axis leaves each device more rows of the residual stream, which it does not split)."""
  return (REMAT_ORDER.index(a.config.remat) >= REMAT_ORDER.index(b.config.remat)
          and a.mesh.fsdp >= b.mesh.fsdp and a.mesh.model >= b.mesh.model
          and a.mesh.model * b.num_microbatches <= b.mesh.model * a.num_microbatches)
