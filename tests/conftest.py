"""Shared helpers: tiny configs and init/apply shortcuts; a persistent JAX compilation cache for
the test session and the processes it starts (they inherit the environment), so a computation
compiled by one test, subprocess or earlier session is read back instead of compiled again."""
import dataclasses
import importlib.util
import os

os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(
    os.environ.get('XDG_CACHE_HOME', os.path.expanduser('~/.cache')), 't5x_variants', 'jax_tests'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.2')
# The suite runs on the CPU; libtpu (extra 'tpu') serves only t5xv-compile's compile-only TPU
# devices, and would otherwise be started first and warn.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Read from the setting, not from JAX: processes that import this module may still have to call
# jax.distributed.initialize, which must come before the backend starts.
ON_GPU = os.environ['JAX_PLATFORMS'].split(',')[0] in ('cuda', 'gpu')
if ON_GPU:
  # On a GPU (JAX_PLATFORMS=cuda): float32 matmuls in float32, as on the CPU (JAX's default there
  # is TF32 on Hopper, which the equivalence tests' tolerances do not assume; bfloat16 tests name
  # their own), and memory taken as needed, so the processes the tests start find the GPU free.
  os.environ.setdefault('JAX_DEFAULT_MATMUL_PRECISION', 'highest')
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  # The tests that resume a run compare it bit for bit with an unbroken one; XLA's GPU kernels
  # may add with atomics (the embedding's gradient), whose order differs from run to run.
  os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} --xla_gpu_deterministic_ops=true'.strip()
# On the CPU the suite compiles far more than it runs (thousands of programs of tiny models): for
# it and the processes it starts, XLA's backend optimisation and its CPU fusion emitters are off,
# which compiles the same programs 2-3x faster (measured in README's Tests). Values agree within
# the tests' tolerances either way; TPU programs compiled here for t5xv-compile are unaffected
# (their memory figures are the same byte for byte); a GPU run keeps every optimisation.
# Decided by the suite's own process and inherited: a process a test starts on the host's devices
# (JAX_PLATFORMS=cpu on a GPU machine) that imports this module takes the flags only where the
# suite does (the GPU image's jaxlib stops at the fusion-emitter flag: below).
CPU_COMPILE_FLAGS = '--xla_cpu_use_fusion_emitters=false'
ON_CPU = os.environ.setdefault('T5XV_SUITE_PLATFORM', os.environ['JAX_PLATFORMS'].split(',')[0]) == 'cpu'
if ON_CPU:
  os.environ.setdefault('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')
  os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {CPU_COMPILE_FLAGS}'.strip()
# A restore without target shardings (unsafe on another topology) is an error here and in the
# processes the tests start; pyproject.toml's filterwarnings says the same to pytest.
# A process that stands a mesh on 8 host devices: the CPU's, also on a GPU machine (a process on
# the GPU would see one device). It takes the CPU compile flags where this process runs with them:
# the GPU image's jaxlib (0.11.2) no longer knows the fusion-emitter flag, and XLA stops at an
# unknown flag.
HOST_DEVICES = {'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': ' '.join(
    [CPU_COMPILE_FLAGS] * ON_CPU + ['--xla_force_host_platform_device_count=8'])}
RESTORE_WITHOUT_SHARDINGS = 'error:Sharding info not provided when restoring:UserWarning'
os.environ['PYTHONWARNINGS'] = ','.join(
    w for w in (os.environ.get('PYTHONWARNINGS'), RESTORE_WITHOUT_SHARDINGS) if w)

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_variants.models import TransformerConfig, build_model

TINY = dict(vocab_size=50, d_model=32, num_heads=4, head_dim=8, d_ff=64, num_encoder_layers=2,
            num_decoder_layers=2, encoder_max_length=12, decoder_max_length=12)


# The TPU kernels' interpreter runs on the CPU only: on a GPU (an H200, jax 0.11.2) flax's layer
# scan refused the interpreted kernel at trace time ('broadcasted variable has a data dependency
# on the scan body'; the interpreter runs the kernel through ordered host callbacks).
tpu_interpreter = pytest.mark.skipif(ON_GPU, reason='the TPU interpreter runs on the CPU only')
# The data layer (TensorFlow, seqio: pip install -e '.[data]'), which an accelerator image may lack
# (the project trains there from pre-built batches).
HAS_DATA_LAYER = all(importlib.util.find_spec(m) for m in ('tensorflow', 'seqio'))
NO_DATA_LAYER = "no data layer on this host: TensorFlow and seqio (pip install -e '.[data]')"
needs_data_layer = pytest.mark.skipif(not HAS_DATA_LAYER, reason=NO_DATA_LAYER)


def parse_recipe(files, bindings=()):
  """Gin files parsed as t5xv-train parses them; on a host without the data layer its bindings
  are skipped, as t5xv-info and t5xv-bench do."""
  from t5x_variants.cli import recipe  # pylint: disable=g-import-not-at-top
  recipe.parse_recipe(list(files), list(bindings), with_data=HAS_DATA_LAYER)


def tiny(**overrides) -> TransformerConfig:
  return TransformerConfig(**{**TINY, **overrides})


def tokens(batch, length, vocab=50, seed=0):
  """Random ids in [1, vocab): no padding."""
  return jnp.asarray(np.random.RandomState(seed).randint(1, vocab, (batch, length)), jnp.int32)


def init_params(config, *inputs, seed=0):
  model = build_model(config)
  variables = jax.jit(model.init)(jax.random.PRNGKey(seed), *inputs)
  return model, nn.unbox(variables['params'])


def jit_apply(model, **static):
  """model.apply compiled once (eager Flax dispatches op by op, which is slow on 2 cores)."""
  return jax.jit(lambda variables, *args: model.apply(variables, *args, **static))


def count(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nn.unbox(tree)))


@pytest.fixture(scope='session')
def gcs():
  """A Cloud Storage API server on loopback for the whole session, every client pointed at it
  (tests/gcs_server.py); a real bucket where T5XV_TEST_BUCKET names one."""
  from gcs_server import GcsServer, INSTALL  # pylint: disable=g-import-not-at-top
  if not os.environ.get('T5XV_TEST_BUCKET'):
    pytest.importorskip('gcp_storage_emulator', reason=f'no GCS API server: {INSTALL}')
  server = GcsServer().start()
  yield server
  server.stop()


@pytest.fixture(autouse=True)
def _clear_gin():
  import gin
  gin.clear_config()
  yield
  gin.clear_config()


__all__ = ['tiny', 'tokens', 'init_params', 'jit_apply', 'count', 'dataclasses']
