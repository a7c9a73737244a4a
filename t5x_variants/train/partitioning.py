"""Device mesh and logical-axis rules: the one place that says how arrays are sharded.

``MeshConfig`` (gin) is the one mesh description every command uses (train, eval, infer, bench):
axes ('replica', 'data', 'model') and whether parameters are also split over 'data' (fsdp). Logical
names on every parameter (``embed``, ``mlp``, ``heads``, ...) map to mesh axes by T5X's standard
rules: with model=1 this is data parallelism with replicated parameters; with model>1 the heads /
mlp / vocab dimensions are split over 'model' (1-D parameter partitioning) and, with
``fsdp=True``, ``embed`` is also split over 'data' (2-D). Axes absent from the rules (``layers``,
``kv``, synthesizer ``length`` ...) are replicated. The batch is split over 'replica' and 'data'
together; parameters never over 'replica': each of its groups holds a whole copy, split within
the group (hybrid sharding: FSDP's gathers stay within a group, only the gradient reduction
crosses groups). TPU devices are ordered by slice (``make_mesh``), so replica = the number of
slices keeps FSDP's gathers off the network between slices; replica=1 (the default) is one group.
"""
import dataclasses
import math
import numbers
from typing import Dict, Optional, Sequence, Tuple

import flax.linen as nn
import gin
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5x_variants import path_keys
from t5x_variants.train import optimizer

MESH_AXES = ('replica', 'data', 'model')
BATCH_AXES = ('replica', 'data')  # the mesh axes that split the batch, outermost first


def logical_axis_rules(fsdp: bool = False) -> Tuple[Tuple[str, object], ...]:
  """(logical name, mesh axes) pairs, first match wins; activations use 'batch' and 'length'."""
  return (('batch', BATCH_AXES), ('vocab', 'model'), ('mlp', 'model'), ('heads', 'model'),
          ('embed', 'data' if fsdp else None), ('kv', None), ('length', None), ('layers', None))


def _sizes(shape: Dict[str, int]) -> str:
  """'data=4 x model=2' ('replica' named only when it splits)."""
  return ' x '.join(f'{k}={v}' for k, v in shape.items() if k != 'replica' or v != 1)


def slice_index(device) -> int:
  """The TPU slice of ``device`` in a multislice run (0 otherwise: a multi-process GPU or CPU run's
  devices carry a per-host ``slice_index``, not a slice)."""
  return getattr(device, 'slice_index', 0) if device.platform == 'tpu' else 0


def make_mesh(data: int = -1, model: int = 1, devices: Sequence = None, replica: int = 1) -> Mesh:
  """A (replica, data, model) mesh over ``devices`` (all by default); data=-1 takes the rest. TPU
  devices are ordered by slice (stably), so that the batch axes run slice by slice in a
  multislice run, and replica = the number of slices gives each slice one replica."""
  devices = list(jax.devices() if devices is None else devices)
  devices.sort(key=slice_index)
  if data == -1:
    if len(devices) % (model * replica):
      raise ValueError(f'{len(devices)} devices cannot be split into '
                       f'{_sizes(dict(replica=replica, model=model))} groups')
    data = len(devices) // (model * replica)
  shape = dict(replica=replica, data=data, model=model)
  if math.prod(shape.values()) != len(devices):
    raise ValueError(f'mesh {_sizes(shape)} needs {math.prod(shape.values())} devices, '
                     f'found {len(devices)}: set --gin.MeshConfig.data=-1 (the devices left after '
                     'model and replica) or a product equal to the devices')
  return Mesh(np.asarray(devices).reshape(replica, data, model), MESH_AXES)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """``replica`` x ``data`` x ``model`` devices (data -1: the rest). model > 1 splits heads, mlp
  and vocab over 'model' (1-D parameter partitioning); ``fsdp`` also splits embed over 'data'
  (2-D); ``replica`` > 1 splits the batch further into groups that each hold whole parameters
  (hybrid sharding; e.g. one group per TPU slice or per GPU host)."""
  data: int = -1
  model: int = 1
  fsdp: bool = False
  replica: int = 1

  def mesh(self, devices: Sequence = None) -> Mesh:
    return make_mesh(self.data, self.model, devices, self.replica)

  def rules(self) -> Tuple[Tuple[str, object], ...]:
    return logical_axis_rules(self.fsdp)


def param_shardings(abstract_params, mesh: Mesh, rules) -> object:
  """NamedShardings of a boxed (LogicallyPartitioned) parameter tree."""
  return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_params), mesh, rules)


def divisors(n: int):
  return [d for d in range(1, n + 1) if n % d == 0]


def check_mesh(boxed_params, mesh: Mesh, rules):
  """Every parameter dimension split over a mesh axis must divide by that axis's size: else one
  ValueError naming the dimension (its logical name, size and a parameter that has it), the axis
  and the axis sizes that would divide every dimension split over it. Runs before any compile
  (the compiler's own message names only an array axis). ``mesh``: a Mesh or an AbstractMesh."""
  split: Dict[str, Dict[Tuple[str, int], str]] = {}  # mesh axis -> (logical name, size) -> a path
  rule = dict(rules)
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      boxed_params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)):
    if not isinstance(leaf, nn.LogicallyPartitioned):
      continue
    for name, size in zip(leaf.names, leaf.value.shape):
      axis = rule.get(name)
      if axis is not None and mesh.shape[axis] > 1:
        split.setdefault(axis, {}).setdefault((name, size), '/'.join(path_keys(path)))
  for axis, dims in split.items():
    n = mesh.shape[axis]
    bad = [(name, size, where) for (name, size), where in dims.items() if size % n]
    if bad:
      name, size, where = bad[0]
      common = math.gcd(*(size for _, size in dims))
      fits = [d for d in divisors(common) if mesh.size % d == 0]
      listed = ', '.join(f'{k} {size}' for k, size in dims)
      raise ValueError(
          f"mesh axis '{axis}' of size {n} does not divide {name} = {size} (e.g. {where}); "
          f"'{axis}' sizes that divide every dimension split over it ({listed}) and the "
          f"{mesh.size} devices: {', '.join(map(str, fits))} (set MeshConfig.{axis})")


def _process_count(mesh) -> int:
  """The processes of the mesh's devices; this run's for a mesh without devices (abstract)."""
  try:
    devices = mesh.devices
  except (AttributeError, ValueError):  # jax's AbstractMesh raises ValueError
    return jax.process_count()
  return len({d.process_index for d in np.asarray(devices).flat})


def batch_shards(mesh) -> int:
  """The shards the batch is split into: replica x data."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_processes(mesh: Mesh, process_count: Optional[int] = None):
  """With several processes, each must feed the rows of its own contiguous block of batch shards
  (replica-major), in process order (what ``global_batch`` and ``host_rows`` assume); else one
  ValueError: a batch shard that spans processes (a 'model' axis wider than a host's devices)
  would get other rows from each (replicas that disagree, eval rows counted once, predictions
  lost). The processes are those of the mesh's devices: a run's, or the hosts of a slice
  compiled for ahead of time."""
  count = _process_count(mesh) if process_count is None else process_count
  if count == 1:
    return
  data, shards = mesh.shape['data'], batch_shards(mesh)
  blocks = {}
  for (r, d, _), device in np.ndenumerate(mesh.devices):  # MESH_AXES' order
    blocks.setdefault(device.process_index, set()).add(r * data + d)
  size = shards // count
  if shards % count or any(blocks.get(p) != set(range(p * size, (p + 1) * size)) for p in range(count)):
    raise ValueError(f"the mesh ({_sizes(mesh.shape).replace(' x ', ', ')}) over {count} "
                     "processes: each process must hold whole shards of the batch's mesh axes, its "
                     "own block in process order; make MeshConfig.replica x MeshConfig.data a "
                     "multiple of the process count and MeshConfig.model at most one host's devices")


def check_batch(batch_size: int, mesh: Mesh, num_microbatches: int = 1):
  """The global batch splits into ``num_microbatches`` equal microbatches, each split evenly over
  the batch shards; else one ValueError with the batch sizes that would (or ``check_processes``')."""
  if not isinstance(num_microbatches, numbers.Integral) or isinstance(num_microbatches, bool) or (
      num_microbatches < 1):
    raise ValueError(f'train.num_microbatches must be a whole number of at least 1, not '
                     f'{num_microbatches!r}')
  check_processes(mesh)
  shards = batch_shards(mesh)
  unit = shards * num_microbatches
  if batch_size < 1 or batch_size % unit:
    micro = f' x {num_microbatches} microbatches' if num_microbatches > 1 else ''
    axes = (f"mesh axis 'data' of size {shards}" if mesh.shape['replica'] == 1 else
            f"mesh axes replica x data of size {mesh.shape['replica']} x {mesh.shape['data']}")
    raise ValueError(f"batch size {batch_size} does not split over {axes}{micro}: use a multiple "
                     f"of {unit} (e.g. {max(unit, batch_size // unit * unit)}) or another "
                     f"MeshConfig.data{' / MeshConfig.replica' * (mesh.shape['replica'] > 1)} / "
                     "train.num_microbatches")


def sharded_abstract_params(model, init_inputs, mesh: Mesh, rules, rng=None):
  """(boxed abstract parameters, the same unboxed as ShapeDtypeStructs carrying their shardings);
  ValueError if the mesh does not fit the parameters (``check_mesh``) or the processes
  (``check_processes``)."""
  check_processes(mesh)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  boxed = jax.eval_shape(lambda: model.init(rng, *init_inputs)['params'])
  check_mesh(boxed, mesh, rules)
  shardings = param_shardings(boxed, mesh, rules)
  return boxed, jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), shardings)


def _forms(path, shape: Tuple[int, ...], spec: Tuple):
  """A parameter's (shape, spec) and, for an attention projection, those of the matrix Adafactor
  sees (``optimizer.as_matrix``, after any leading layers axis): its heads and head_dim axes as
  one, split as the heads axis (head_dim is never split)."""
  yield shape, spec
  lead = len(shape) - 3
  if lead >= 0 and optimizer.as_matrix(path, shape[lead:]) != shape[lead:]:
    i = lead if path_keys(path)[-2] == 'out' else lead + 1  # the heads axis
    if spec[i + 1] is None:
      yield shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2:], spec[:i + 1] + spec[i + 2:]


def follow_param_shardings(abstract_tree, abstract_params, mesh: Mesh):
  """Shardings for optimizer statistics, whose trees end in the parameters' paths. A leaf with its
  parameter's shape (or its ``_forms``' other) takes the parameter's sharding; one with a single
  axis fewer (Adafactor's factored row / column second moments) takes it without that axis: the
  one axis that fits or, where two do (a square matrix), the one optax reduces for that statistic
  (``v_row`` drops the later, ``v_col`` the earlier: its stable argsort of the shape); anything
  else (counters, placeholders) is replicated."""
  params = {tuple(k.key for k in path): (tuple(x.shape), tuple(x.sharding.spec))
            for path, x in jax.tree_util.tree_leaves_with_path(abstract_params)}

  def sharding(path, leaf):
    keys = []
    for k in reversed(path):
      if not isinstance(k, jax.tree_util.DictKey):
        break
      keys.insert(0, k.key)
    shape, spec = params.get(tuple(keys), ((), ()))
    spec = spec + (None,) * (len(shape) - len(spec))
    fits = []  # (the axis dropped, None if none; the spec)
    for shape, spec in _forms(keys, shape, spec):
      fits += [(None, spec)] if tuple(leaf.shape) == shape else [
          (i, spec[:i] + spec[i + 1:]) for i in range(len(shape)) if shape[:i] + shape[i + 1:] == tuple(leaf.shape)]
    field = next((k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)
                  and k.name in ('v_row', 'v_col')), None)
    if len({s for _, s in fits}) > 1 and field and all(i is not None for i, _ in fits):
      fits = [(max if field == 'v_row' else min)(fits, key=lambda f: f[0])]
    specs = {s for _, s in fits}
    return NamedSharding(mesh, PartitionSpec(*specs.pop()) if len(specs) == 1 else PartitionSpec())
  return jax.tree_util.tree_map_with_path(sharding, abstract_tree)


def jit(fn, mesh: Mesh, **kwargs):
  """``jax.jit(fn, **kwargs)`` with ``fn`` traced under ``mesh`` as the abstract mesh and the
  logical-axis rules in flax's context, so that a layer which splits its work per device itself
  (the TPU attention kernel under ``shard_map``, layers/fused_attention.py) sees the mesh, the
  platform it is compiled for and which mesh axes split the batch and the heads (the same with
  and without fsdp, which only moves parameters' ``embed``)."""
  def traced(*args, **kw):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(logical_axis_rules()):
      return fn(*args, **kw)
  # The HLO module and its ops are named after fn (profiles find the step by that name).
  traced.__name__ = traced.__qualname__ = getattr(fn, '__name__', None) or fn.func.__name__
  return jax.jit(traced, **kwargs)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Input batches: the leading (batch) dimension split over 'replica' and 'data'."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def global_batch(batch, mesh: Mesh):
  """This process's rows of a batch as arrays split over the batch axes that hold every process's
  rows."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def host_rows(batch, mesh: Mesh):
  """From a global batch that every process holds: zero rows appended so that it splits evenly
  over the batch shards, then this process's contiguous share (what ``global_batch`` expects)."""
  n, shards = len(next(iter(batch.values()))), batch_shards(mesh)
  rows = -(-n // shards) * shards
  local = rows // jax.process_count()
  start = jax.process_index() * local
  pad = lambda x: np.concatenate([x, np.zeros((rows - n,) + x.shape[1:], x.dtype)])
  return {k: pad(v)[start:start + local] for k, v in batch.items()}


def to_host(tree):
  """Replicated (e.g. scalar metric) arrays as numpy, also when other processes hold copies."""
  return jax.tree_util.tree_map(lambda x: np.asarray(x.addressable_data(0)), tree)
