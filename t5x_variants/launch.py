"""Console-script entry points that first put host memory on transparent huge pages.

XLA CPU allocates a step's temporaries afresh on every call: one block of gigabytes that glibc
maps anew and the kernel faults in 4 KiB at a time (about a million page faults per step on the
CPU reference shape of BENCHMARKS.md, 1-2 s of kernel time). glibc's ``hugetlb`` tunable advises
transparent huge pages on such blocks, cutting the faults ~10x. Tunables are read only at process
start, so an entry point re-executes itself once with the tunable set. ``T5XV_HUGEPAGES=0`` turns
this off; it is also skipped where glibc or the kernel's THP support are absent.
"""
import importlib
import os
import sys

TUNABLE = 'glibc.malloc.hugetlb=1'
_THP = '/sys/kernel/mm/transparent_hugepage/enabled'


def huge_pages_on(environ=os.environ) -> bool:
  """Whether this process was started with the tunable."""
  return TUNABLE in environ.get('GLIBC_TUNABLES', '')


def wants_reexec(environ=os.environ) -> bool:
  if environ.get('T5XV_HUGEPAGES', '1') == '0' or huge_pages_on(environ):
    return False
  try:
    glibc = os.confstr('CS_GNU_LIBC_VERSION') or ''
    with open(_THP) as f:
      thp = f.read()
  except (OSError, ValueError):
    return False
  return glibc.startswith('glibc') and '[never]' not in thp


def reexec_with_hugepages():
  """Replaces this process (same pid, arguments and environment plus the tunable) if needed."""
  if wants_reexec():
    tunables = os.environ.get('GLIBC_TUNABLES')
    os.environ['GLIBC_TUNABLES'] = f'{tunables}:{TUNABLE}' if tunables else TUNABLE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable] + sys.orig_argv[1:])


def _launch(module: str):
  reexec_with_hugepages()
  return importlib.import_module(module).main()


def train():
  return _launch('t5x_variants.run_train')


def evaluate():
  return _launch('t5x_variants.eval')


def infer():
  return _launch('t5x_variants.infer')


def bench():
  return _launch('t5x_variants.bench')
