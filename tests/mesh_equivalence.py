"""Run in a subprocess with 8 host-platform devices: prints, per optimizer, the losses of 3 steps
on a data=4 x model=2 mesh and on a single device, and those of 4 microbatches on data=8 (with
the all-gathers of each compiled step), as JSON."""
import json
import os
import sys

os.environ.update(JAX_PLATFORMS='cpu', XLA_FLAGS=f'{os.environ.get("XLA_FLAGS", "")} '
                  '--xla_force_host_platform_device_count=8')
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

from t5x_variants.train import optimizer, partitioning  # noqa: E402
from train_helpers import setup, synthetic_batch  # noqa: E402


def losses(mesh, optimizer_fn):
  state, step = setup(mesh, optimizer_fn=optimizer_fn)
  out = []
  for i in range(3):
    state, metrics = step(state, synthetic_batch(seed=i), jax.random.PRNGKey(0))
    out.append(float(metrics['loss']))
  kernel = state.params['decoder']['layers']['mlp']['wi']['kernel']
  stats = [x for x in jax.tree_util.tree_leaves(state.opt_state) if x.shape == kernel.shape]
  return out, [[str(s) for s in x.sharding.spec] for x in [kernel] + stats[:1]]


def microbatched(mesh, num_microbatches):
  """The losses of 3 steps of batch 32 in ``num_microbatches``, and the all-gathers of the
  compiled step."""
  state, step = setup(mesh, num_microbatches=num_microbatches)
  batch = synthetic_batch(batch=32)
  gathers = step.lower(state, partitioning.global_batch(batch, mesh),
                       jax.random.PRNGKey(0)).compile().as_text().count(' all-gather(')
  out = []
  for i in range(3):
    state, metrics = step(state, synthetic_batch(batch=32, seed=i), jax.random.PRNGKey(0))
    out.append(float(metrics['loss']))
  return out, gathers


assert len(jax.devices()) == 8
result = {}
data8 = partitioning.make_mesh(data=8)
result['microbatches'] = {
    'one_device': microbatched(partitioning.make_mesh(devices=jax.devices()[:1]), 1)[0],
    **{f'data8_nm{n}': microbatched(data8, n) for n in (1, 4)}}
for name in ('adafactor', 'adam', 'adamw'):
  fn = getattr(optimizer, name)
  sharded, spec = losses(partitioning.make_mesh(data=4, model=2), fn)
  single, _ = losses(partitioning.make_mesh(devices=jax.devices()[:1]), fn)
  result[name] = {'sharded': sharded, 'single': single, 'spec': spec[0], 'stat_spec': spec[1]}
print(json.dumps(result))
