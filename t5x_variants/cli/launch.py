"""Console-script entry points and host start-up, before any command imports JAX's backend.

XLA CPU allocates a step's temporaries afresh on every call: one block of gigabytes that glibc
maps anew and the kernel faults in 4 KiB at a time (about a million page faults per step on the
CPU reference shape of BENCHMARKS.md, 1-2 s of kernel time). glibc's ``hugetlb`` tunable advises
transparent huge pages on such blocks, cutting the faults ~10x. Tunables are read only at
process start, so an entry point re-executes itself once with the tunable set, only where JAX's
backend will be the CPU: never on a GPU or TPU host, whose host memory this does not concern.
``T5XV_HUGEPAGES=0`` turns it off; it is also skipped where glibc or the kernel's THP are absent.

With libtpu installed on a host without TPUs (extra 'tpu', for t5xv-compile), every command goes
to the CPU directly (``skip_absent_tpu``, called by ``cli/common.py`` at import).
"""
import glob
import importlib
import importlib.util
import os
import pkgutil
import sys
from typing import Callable

TUNABLE = 'glibc.malloc.hugetlb=1'
_THP = '/sys/kernel/mm/transparent_hugepage/enabled'
# Module name prefixes of GPU plugins. libtpu is not one: it is also installed on CPU hosts (extra
# 'tpu', for t5xv-compile), and a TPU host is known by its device nodes.
_ACCELERATOR_PLUGINS = ('jax_cuda', 'jax_rocm')
_ACCELERATOR_DEVICES = ('/dev/nvidia[0-9]*', '/dev/kfd', '/dev/accel[0-9]*', '/dev/vfio/[0-9]*')


def huge_pages_on(environ=os.environ) -> bool:
  """Whether this process was started with the tunable."""
  return TUNABLE in environ.get('GLIBC_TUNABLES', '')


def backend_is_cpu(environ=os.environ, plugins=None, devices=None) -> bool:
  """Whether JAX will run on the CPU, decided without starting a backend: ``JAX_PLATFORMS`` if
  set (its first platform), else no GPU plugin installed (CUDA, ROCm) and no accelerator device
  node (``plugins`` / ``devices``: what is found, for tests)."""
  platforms = environ.get('JAX_PLATFORMS', '').strip()
  if platforms:
    return platforms.split(',')[0].strip() == 'cpu'
  if plugins is None:
    plugins = [m.name for m in pkgutil.iter_modules()]
  plugins = [p for p in plugins if p.startswith(_ACCELERATOR_PLUGINS)]
  if devices is None:
    devices = [d for pattern in _ACCELERATOR_DEVICES for d in glob.glob(pattern)]
  return not plugins and not devices


def skip_absent_tpu():
  """With libtpu installed on a host without TPUs (extra 'tpu', for t5xv-compile), jax would
  start libtpu first and print its C++ warnings before falling back to the CPU: go to the CPU
  directly (also in the processes this one starts). ``JAX_PLATFORMS`` set by the user wins."""
  if ('JAX_PLATFORMS' not in os.environ and backend_is_cpu()
      and importlib.util.find_spec('libtpu') is not None):
    os.environ['JAX_PLATFORMS'] = 'cpu'
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update('jax_platforms', 'cpu')



def wants_reexec(environ=os.environ, **found) -> bool:
  if environ.get('T5XV_HUGEPAGES', '1') == '0' or huge_pages_on(environ):
    return False
  try:
    glibc = os.confstr('CS_GNU_LIBC_VERSION') or ''
    with open(_THP) as f:
      thp = f.read()
  except (OSError, ValueError):
    return False
  return glibc.startswith('glibc') and '[never]' not in thp and backend_is_cpu(environ, **found)


def reexec_with_hugepages():
  """Replaces this process (same pid, arguments and environment plus the tunable) if needed."""
  if wants_reexec():
    tunables = os.environ.get('GLIBC_TUNABLES')
    os.environ['GLIBC_TUNABLES'] = f'{tunables}:{TUNABLE}' if tunables else TUNABLE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable] + sys.orig_argv[1:])


def launcher(command: str) -> Callable[[], int]:
  """The console-script entry point of ``t5x_variants.cli.<command>``."""
  def launch():
    reexec_with_hugepages()
    return importlib.import_module(f't5x_variants.cli.{command}').main()
  return launch


train, evaluate, infer, bench, quickstart = (
    launcher(c) for c in ('train', 'eval', 'infer', 'bench', 'quickstart'))
