"""Where a train step is compiled for: a named Cloud TPU slice without a TPU attached, or an
N-device host mesh.

A TPU target (``v5e:4x4``, ``v4:2x2x2``, ``v5p:2x2x4``, ``v6e:8x8``: generation, then chips
per dimension) is described by libtpu's compile-only topology (``jax.experimental.topologies``,
extra ``tpu``); its devices can be compiled for but hold no data. A v5e or v6e slice is one that
Cloud TPU offers, one host up to 8 chips (``v5e:2x4``), hosts of 4 chips above. v4 and v5p chips
are one "megacore" device each (two TensorCores), as on Cloud TPU. Several such slices (multislice)
are described together, each device with its slice. The memory per chip is what the TPU
compiler allows, the dense bf16 peak of a chip or GPU its published figure (``PUBLISHED_PEAKS``).
A host target (``--devices=N``) uses N accelerators of this host when it has them, else N
virtual CPU devices (which compile the same sharded program for XLA's CPU backend: its memory
figures are the CPU compiler's).
"""
import dataclasses
import math
import os
import re
from typing import List, Optional

GIB = 2**30

# generation -> (topology prefix, chip_config_name, dimensions, HBM GiB per chip that the TPU
# compiler lets a program use). The HBM figures are those the compiler of libtpu 0.0.42.1 states
# when a program exceeds them (of 32 / 16 / 95 / 32 GiB physical).
TPU_GENERATIONS = {
    'v4': ('v4', 'megacore', 3, 30.75),
    'v5e': ('v5e', 'default', 2, 15.75),
    'v5p': ('v5p', 'megacore', 3, 95.74),
    'v6e': ('v6e', 'default', 2, 31.25),
}

# The slices Cloud TPU offers of the 2-D generations (v5e, v6e: up to a 256-chip pod); those of
# up to 8 chips are one host (1, 4 or 8 chips), larger ones hosts of 4 chips (libtpu's default).
SLICES_2D = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))
ONE_HOST_CHIPS = 8

# Published dense peak TFLOP/s per device, (bf16, fp32), by jax's ``device_kind``: a TPU's exactly
# ('TPU v5' is a v5p chip, 'TPU v5 lite' a v5e), a GPU's by its model in the name ('NVIDIA H100
# 80GB HBM3'; the first match in this order, so a PCIe or NVL card before the SXM one). The fp32
# peak is what JAX's default matmul precision gives a float32 matmul: a GPU's TF32 tensor-core
# peak, a TPU's bf16 peak (one bfloat16 pass).
PUBLISHED_PEAKS = {
    'TPU v4': (275.0, 275.0), 'TPU v5 lite': (197.0, 197.0), 'TPU v5': (459.0, 459.0),
    'TPU v6 lite': (918.0, 918.0),
    'H100 PCIe': (756.0, 378.0), 'H100 NVL': (835.0, 417.5), 'H200 NVL': (835.0, 417.5),
    'H100': (989.0, 495.0), 'H200': (989.0, 495.0), 'A100': (312.0, 156.0),
}


def published_peak(device_kind: str, bf16: bool = True) -> Optional[float]:
  """The published dense peak TFLOP/s of one device of this kind, None where none is known."""
  for name, (p16, p32) in PUBLISHED_PEAKS.items():
    if (device_kind == name) if name.startswith('TPU') else (name in device_kind):
      return p16 if bf16 else p32
  return None


@dataclasses.dataclass
class Target:
  """Devices to compile for, with what is known of each: memory and peak (None: unknown)."""
  name: str
  platform: str  # 'tpu', 'cpu', 'gpu'
  devices: List
  device_kind: str
  memory_bytes: Optional[int]
  peak_tflops: Optional[float]  # dense bf16 per device
  memory_source: str

  @property
  def num_devices(self) -> int:
    return len(self.devices)


def deviceless_environment():
  """What libtpu needs to describe a slice on a host without TPUs, set before jax starts a
  backend: no metadata server to ask, this host as the only worker, no lock on the (absent) chips,
  so that several compiles can run at once, and the CPU as jax's own platform (the TPU devices are
  compile-only). Existing values are kept."""
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', 'v5litepod-16')
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_platforms', os.environ['JAX_PLATFORMS'])


def parse_topology(spec: str):
  """'v5e:4x4' -> (generation, (4, 4)); ValueError naming the valid forms otherwise."""
  m = re.fullmatch(r'(v\w+):(\d+(?:x\d+)*)', spec.strip())
  gens = ', '.join(TPU_GENERATIONS)
  if not m or m.group(1) not in TPU_GENERATIONS:
    raise ValueError(f'unknown topology {spec!r}: give a TPU generation ({gens}) and its chips per '
                     'dimension, e.g. v5e:4x4, v5e:16x16, v4:2x2x2, v5p:2x2x4, v6e:8x8')
  gen, shape = m.group(1), tuple(int(d) for d in m.group(2).split('x'))
  dims = TPU_GENERATIONS[gen][2]
  if len(shape) != dims or min(shape) < 1:
    example = 'x'.join(['2'] * dims)
    raise ValueError(f'topology {spec!r}: {gen} slices have {dims} dimensions (e.g. {gen}:{example})')
  if dims == 2 and shape not in SLICES_2D:
    offered = ', '.join('x'.join(map(str, s)) for s in SLICES_2D)
    raise ValueError(f'topology {spec!r}: {gen} slices are {offered} (a pod is 16x16)')
  return gen, shape


def tpu_target(spec: str, num_slices: int = 1) -> Target:
  """The compile-only devices of a named TPU slice (libtpu needed), or of ``num_slices`` such
  slices joined by the data-center network (multislice: each device has its ``slice_index``)."""
  gen, shape = parse_topology(spec)
  prefix, chip_config, dims, hbm_gib = TPU_GENERATIONS[gen]
  try:
    import libtpu  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise ValueError('compiling for a TPU slice needs libtpu: pip install -e ".[tpu]" (the libtpu '
                     'that matches the installed jax)') from e
  deviceless_environment()
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  name = f'{prefix}:{"x".join(map(str, shape))}'
  one_host = dims == 2 and math.prod(shape) <= ONE_HOST_CHIPS
  hosts = {'chips_per_host_bounds': [*shape, 1]} if one_host else {}
  try:
    devices = topologies.get_topology_desc(name, 'tpu', chip_config_name=chip_config,
                                           num_slices=num_slices, **hosts).devices
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'libtpu cannot describe topology {spec!r}: {str(e).splitlines()[0]}') from e
  kind = devices[0].device_kind
  if num_slices > 1:
    name += f' x {num_slices} slices'
  return Target(name, 'tpu', list(devices), kind, int(hbm_gib * GIB), published_peak(kind),
                f'what the TPU compiler allows a {gen} chip')


def host_target(num_devices: int, accelerators: bool = True) -> Target:
  """``num_devices`` accelerators of this host if it has as many (``accelerators``: look for
  them), else as many virtual CPU devices, which must be asked for before jax starts its CPU
  backend."""
  import jax  # pylint: disable=g-import-not-at-top
  if num_devices < 1:
    raise ValueError(f'--devices must be >= 1, not {num_devices}')
  try:  # before any backend starts (listing the accelerators starts the CPU's too)
    jax.config.update('jax_num_cpu_devices', num_devices)
  except RuntimeError:  # jax has started already: its CPU devices are what there is
    pass
  accelerators = [d for d in jax.devices() if d.platform != 'cpu'] if accelerators else []
  if len(accelerators) >= num_devices:
    devices = accelerators[:num_devices]
    limit = (devices[0].memory_stats() or {}).get('bytes_limit')
    source = 'the device\'s allocator limit'
  else:
    devices = jax.devices('cpu')
    if len(devices) < num_devices:
      raise ValueError(f'--devices={num_devices}: this process already started jax with '
                       f'{len(devices)} CPU devices')
    devices, limit, source = devices[:num_devices], None, 'none known'
  kind = devices[0].device_kind
  return Target(f'{num_devices}x {kind}', devices[0].platform, devices, kind, limit,
                published_peak(kind), source)
