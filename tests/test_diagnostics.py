"""train/diagnostics.py: per-layer gradient and residual-stream norms and the model update norm on
a fixed batch, against direct computations; in the trainer: no effect on training, the update
norm against the checkpoints' parameters, and a resume that continues the values."""
import functools
import json

import flax.linen as nn
import gin
import jax
import numpy as np
import optax
import pytest

from conftest import init_params, tiny
from t5x_variants.models import build_model, init_inputs
from t5x_variants.models.block import TransformerLayer
from t5x_variants.models.stack import Stack
from t5x_variants.train import diagnostics, train_step, trainer  # noqa: F401 (gin: train)
from train_helpers import records_of, run_train, saved_state, step_batch

ARCHITECTURES = {'encoder_decoder': {}, 'decoder_only': dict(remat='full'), 'encoder_only': {}}
LOSS = dict(label_smoothing=0.1, z_loss=1e-4)


def padded_batch(config):
  """4 rows with padding at the end of row 0's encoder input and row 1's targets."""
  batch = train_step.synthetic_batch(config, 4, {'inputs': 8, 'targets': 6})
  for row, (stack, tokens) in enumerate(diagnostics.TOKENS.items()):
    if tokens in batch:
      batch[tokens][row, -3:] = 0
  prefix = train_step.TARGETS[config.architecture]
  batch[f'{prefix}_loss_weights'] = (batch[f'{prefix}_target_tokens'] != 0).astype(np.float32)
  return batch


def unrolled(config, params):
  """A scanned model's parameters as the unrolled model's (``layers_<i>``)."""
  params = dict(params)
  for s in config.stacks:
    stack = dict(params[s])
    layers = stack.pop('layers')
    for i in range(config.num_layers(s)):
      stack[f'layers_{i}'] = jax.tree_util.tree_map(lambda a: a[i], layers)
    params[s] = stack
  return params


def outputs(config, params, batch):
  """{(stack, layer index or 'output'): float64 output} from Flax's own capture of each layer's
  and stack's ``__call__`` (an unrolled model)."""
  model = build_model(config)
  _, state = jax.jit(lambda p: model.apply(
      {'params': p}, **train_step.model_inputs(config, batch),
      capture_intermediates=lambda m, _: isinstance(m, (Stack, TransformerLayer))))(params)
  inter = state['intermediates']
  out = {(s, 'output'): inter[s]['__call__'][0] for s in config.stacks}
  out.update({(s, i): inter[s][f'layers_{i}']['__call__'][0][0]
              for s in config.stacks for i in range(config.num_layers(s))})
  return {k: np.asarray(v, np.float64) for k, v in out.items()}


def compute(config, params, batch, reference=0.0):
  fn = functools.partial(diagnostics.compute, build_model(config), config, **LOSS)
  last = config.stacks[-1]
  reference = np.broadcast_to(np.float32(reference), batch[diagnostics.TOKENS[last]].shape + (config.d_model,))
  values, f = jax.jit(fn)(params, {**batch, diagnostics.REFERENCE: reference})
  return {k: float(v) for k, v in values.items()}, np.asarray(f)


@pytest.mark.parametrize('architecture', list(ARCHITECTURES))
def test_per_layer_norms_equal_direct_computations_scanned_and_unrolled(architecture):
  """2-layer stacks, batch with padding: the scanned and unrolled models give the same numbers;
  each layer's gradient norm is that of a direct jax.grad of the training loss, and their squares
  sum to the squared norm of the scanned layers' gradient; the activation norm is the RMS of each
  layer's captured output over non-padding positions; with F(x; theta_0) = 0 the update norm is
  ||F(x; theta)|| over those positions."""
  scanned = tiny(architecture=architecture, **ARCHITECTURES[architecture])
  flat = tiny(architecture=architecture, scan_layers=False, **ARCHITECTURES[architecture])
  batch = padded_batch(scanned)
  _, params = init_params(scanned, *init_inputs(scanned))
  flat_params = unrolled(scanned, params)
  assert (jax.tree_util.tree_structure(flat_params)
          == jax.tree_util.tree_structure(init_params(flat, *init_inputs(flat))[1]))
  values, f = compute(scanned, params, batch)
  flat_values, _ = compute(flat, flat_params, batch)
  keys = {f'{kind}/{s}/{i}' for kind in ('grad_norm', 'activation_norm') for s in scanned.stacks
          for i in range(2)} | {'update_norm', 'update_norm_per_token'}
  assert set(values) == set(flat_values) == keys
  for k in keys:
    assert flat_values[k] == pytest.approx(values[k], rel=1e-5), k

  def loss(model, p):
    total, sums = train_step.summed_loss(model, scanned, p, batch, None, **LOSS)
    return total / sums['num_tokens']
  grads = jax.jit(jax.grad(functools.partial(loss, build_model(scanned))))(params)
  flat_grads = jax.jit(jax.grad(functools.partial(loss, build_model(flat))))(flat_params)
  captured = outputs(flat, flat_params, batch)
  for s in scanned.stacks:
    mask = batch[diagnostics.TOKENS[s]] != 0
    assert not mask.all()
    per_layer = [values[f'grad_norm/{s}/{i}'] for i in range(2)]
    np.testing.assert_allclose(per_layer, [float(optax.tree_utils.tree_norm(flat_grads[s][f'layers_{i}']))
                                           for i in range(2)], rtol=1e-5)
    np.testing.assert_allclose(np.sum(np.square(per_layer)),
                               float(optax.tree_utils.tree_norm(grads[s]['layers']))**2, rtol=1e-5)
    for i in range(2):
      rms = np.sqrt(np.mean(np.square(captured[s, i][mask])))
      assert values[f'activation_norm/{s}/{i}'] == pytest.approx(rms, rel=1e-5)
  last = scanned.stacks[-1]
  mask = batch[diagnostics.TOKENS[last]] != 0
  np.testing.assert_allclose(f, captured[last, 'output'], rtol=1e-5, atol=1e-6)
  norm = np.linalg.norm(captured[last, 'output'][mask])
  assert values['update_norm'] == pytest.approx(norm, rel=1e-5)
  assert values['update_norm_per_token'] == pytest.approx(norm / np.sqrt(mask.sum()), rel=1e-5)


@pytest.mark.parametrize('placement', ['post', 'deepnorm'])
def test_the_activation_norm_of_a_post_norm_layer_is_the_stream_entering_its_last_norm(placement):
  """Post-LN and DeepNorm end each layer with a norm: ``activation_norm`` is the RMS of what
  enters it, x + f(x) (alpha x + f(x)), over non-padding positions, as DeepNet's Fig. 3 (the
  layer's output, the norm's, has an RMS of about its gain whatever the weights do)."""
  config = tiny(placement=placement, scan_layers=False)
  batch = padded_batch(config)
  model, params = init_params(config, *init_inputs(config))
  values, _ = compute(config, params, batch)
  entering = {}

  def record(next_fun, args, kwargs, context):
    if context.method_name == '__call__' and context.module.name == 'post_mlp_layer_norm':
      stack, layer = context.module.scope.path[:2]
      entering[stack, int(layer.split('_')[1])] = np.asarray(args[0], np.float64)
    return next_fun(*args, **kwargs)
  with nn.intercept_methods(record):
    model.apply({'params': params}, **train_step.model_inputs(config, batch))
  assert len(entering) == 4
  for (s, i), x in entering.items():
    rms = np.sqrt(np.mean(np.square(x[batch[diagnostics.TOKENS[s]] != 0])))
    assert values[f'activation_norm/{s}/{i}'] == pytest.approx(rms, rel=1e-5), (s, i)


def run(model_dir, steps, period=1):
  """A 2-layer encoder-decoder run (train_helpers.run_train), diagnostics every ``period`` steps."""
  gin.clear_config()
  if period:
    gin.bind_parameter('train.diagnostics_period', period)
  return run_train(model_dir, steps, config=tiny())


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """{'on': 4 steps with diagnostics every step, 'off': the same without, 'resumed': 2 steps with
  diagnostics, step 2's record then lost (as by a stop between that step's checkpoint and its
  diagnostics), then resumed to 4} (their model directories), and the diagnostics.npz bytes of
  'resumed' before its resumption."""
  dirs = {name: tmp_path_factory.mktemp(name) for name in ('on', 'off', 'resumed')}
  run(dirs['on'], 4)
  run(dirs['off'], 4, period=0)
  run(dirs['resumed'], 2)
  saved = (dirs['resumed'] / diagnostics.FILE).read_bytes()
  log = dirs['resumed'] / 'metrics.jsonl'
  lines = log.read_text().splitlines(keepends=True)
  lost = [line for line in lines if '"kind": "diagnostics"' in line and json.loads(line)['step'] == 2]
  assert len(lost) == 1
  log.write_text(''.join(line for line in lines if line not in lost))
  run(dirs['resumed'], 4)
  gin.clear_config()
  return dirs, saved


def diagnostics_records(model_dir):
  return [{k: v for k, v in r.items() if k != 'time'} for r in records_of(model_dir, 'diagnostics')]


def test_diagnostics_leave_training_identical(runs):
  dirs, _ = runs
  timing = ('time', 'tokens_per_second', 'sequences_per_second', 'step_time')
  strip = lambda d: [{k: v for k, v in r.items() if k not in timing} for r in records_of(d)]
  assert strip(dirs['on']) == strip(dirs['off']) and len(strip(dirs['on'])) == 4
  jax.tree_util.tree_map(np.testing.assert_array_equal, saved_state(dirs['on'] / 'checkpoint_4'),
                         saved_state(dirs['off'] / 'checkpoint_4'))
  assert not (dirs['off'] / diagnostics.FILE).exists() and not records_of(dirs['off'], 'diagnostics')


def test_update_norm_is_zero_at_step_0_then_the_distance_of_the_outputs(runs):
  """Step 0: exactly 0. Step 4: ||F(x; theta_4) - F(x; theta_0)|| by hand, with theta_4 from
  checkpoint_4, theta_0 the initialisation and x the first batch (saved in diagnostics.npz)."""
  dirs, _ = runs
  logged = {r['step']: r for r in diagnostics_records(dirs['on'])}
  assert sorted(logged) == [0, 1, 2, 3, 4]
  assert logged[0]['update_norm'] == 0.0 and logged[0]['update_norm_per_token'] == 0.0
  config = tiny()
  x = step_batch(1)
  with np.load(dirs['on'] / diagnostics.FILE) as saved:
    for k, v in x.items():
      np.testing.assert_array_equal(saved[k], v)
  _, theta_0 = init_params(config, *init_inputs(config))
  theta_4 = saved_state(dirs['on'] / 'checkpoint_4')['params']
  flat = tiny(scan_layers=False)
  f = lambda p: outputs(flat, unrolled(config, p), x)['decoder', 'output']
  expected = np.linalg.norm(f(theta_4) - f(theta_0))
  assert logged[4]['update_norm'] == pytest.approx(expected, rel=1e-4)
  assert logged[4]['update_norm_per_token'] == pytest.approx(expected / np.sqrt(x['decoder_target_tokens'].size), rel=1e-4)
  assert 0 < logged[1]['update_norm'] < logged[4]['update_norm']
  events = list((dirs['on'] / 'tensorboard').glob('events.out.tfevents.*'))
  assert b'diagnostics/grad_norm/decoder/1' in events[0].read_bytes()


def test_a_resumed_run_continues_with_the_saved_batch_and_outputs(runs):
  """2 steps, then resumed to 4 (its first batch is batch 3): the diagnostics of steps 0-4 are
  those of the straight run (step 2's, lost, redone at the resumption), and diagnostics.npz was
  reloaded, not rewritten."""
  dirs, saved = runs
  assert [r['step'] for r in diagnostics_records(dirs['resumed'])] == [0, 1, 2, 3, 4]
  assert diagnostics_records(dirs['resumed']) == diagnostics_records(dirs['on'])
  assert (dirs['resumed'] / diagnostics.FILE).read_bytes() == saved
