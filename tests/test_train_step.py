"""Loss, Adafactor with scanned layers, and the train step (accumulation, NaN skip,
sharded == single device)."""
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from conftest import init_params, tiny, tokens
from t5x_variants.models import losses
from t5x_variants.train import optimizer, partitioning, train_step
from train_helpers import setup, synthetic_batch


def test_cross_entropy_with_label_smoothing_and_z_loss_matches_the_formula():
  rng = np.random.RandomState(0)
  logits, targets = rng.randn(2, 3, 5), rng.randint(0, 5, (2, 3))
  ls, zl = 0.1, 1e-3
  per_token, z = losses.cross_entropy(jnp.asarray(logits), jnp.asarray(targets), None, ls, zl)
  log_z = np.log(np.exp(logits).sum(-1))
  q = np.full((2, 3, 5), ls / 4)
  np.put_along_axis(q, targets[..., None], 1 - ls, -1)
  want = -(q * (logits - log_z[..., None])).sum(-1) + (q * np.log(q)).sum(-1) + zl * log_z**2
  np.testing.assert_allclose(per_token, want, rtol=1e-5)
  np.testing.assert_allclose(z, zl * log_z**2, rtol=1e-5)
  # A prediction equal to the smoothed target costs (almost) nothing.
  perfect, _ = losses.cross_entropy(jnp.log(jnp.asarray(q)), jnp.asarray(targets), None, ls)
  np.testing.assert_allclose(perfect, 0, atol=1e-5)
  weights = np.asarray([[1, 1, 0], [1, 0, 0]])
  m = losses.loss_and_metrics(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
  nll = -(logits - log_z[..., None])[np.arange(2)[:, None], np.arange(3)[None], targets]
  np.testing.assert_allclose(m['loss'], (nll * weights).sum() / 3, rtol=1e-5)
  assert float(m['num_tokens']) == 3
  hits = (logits.argmax(-1) == targets) * weights
  np.testing.assert_allclose(m['token_accuracy'], hits.sum() / 3)
  assert float(losses.normalizing_factor(2048.0, 3.0)) == 2048.0
  assert losses.normalizing_factor(None, 3.0) == losses.normalizing_factor('none', 3.0) == 1.0
  with pytest.raises(ValueError, match="loss_normalizing_factor must be .* not 'tokens'"):
    losses.normalizing_factor('tokens', 3.0)


def test_average_per_sequence_sums_each_sequences_mean_token_loss():
  """T5X's AVERAGE_PER_SEQUENCE: the loss is the sum over sequences (a row's, or a packed row's
  segments) of each one's mean token loss; token counts and accuracy stay per token. A packed
  row of two sequences has the loss of the two as rows of their own; in the train step, rows of
  equal token counts have rows x the per-token loss, microbatched or not."""
  rng = np.random.RandomState(1)
  logits, targets = jnp.asarray(rng.randn(2, 6, 5)), jnp.asarray(rng.randint(0, 5, (2, 6)))
  weights = jnp.asarray([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
  per_token, _ = losses.cross_entropy(logits, targets)
  m = losses.loss_and_metrics(logits, targets, weights, loss_normalizing_factor='average_per_sequence')
  np.testing.assert_allclose(m['loss'], per_token[0, :4].mean() + per_token[1, :2].mean(), rtol=1e-5)
  assert float(m['num_tokens']) == 6 and float(losses.normalizing_factor('average_per_sequence', 6.0)) == 1.0
  segments = jnp.asarray([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
  np.testing.assert_allclose(losses.per_sequence_weights(weights, segments),
                             [[1 / 3, 1 / 3, 1 / 3, 1, 0, 0], [0.5, 0.5, 0, 0, 0, 0]])
  packed = losses.loss_and_metrics(logits[:1], targets[:1], weights[:1], 0.0, 0.0,
                                   'average_per_sequence', segments[:1])
  np.testing.assert_allclose(packed['loss'], per_token[0, :3].mean() + per_token[0, 3], rtol=1e-5)

  mesh = partitioning.make_mesh(devices=jax.devices()[:1])
  batch, key = synthetic_batch(), jax.random.PRNGKey(0)
  rows = len(batch['decoder_loss_weights'])
  assert len(set(np.sum(batch['decoder_loss_weights'], 1))) == 1
  state, step = setup(mesh)
  _, per_token_step = step(state, batch, key)
  for micro in (1, 2):
    state, step = setup(mesh, loss_normalizing_factor='average_per_sequence', num_microbatches=micro)
    _, m = step(state, batch, key)
    np.testing.assert_allclose(m['loss'], rows * per_token_step['loss'], rtol=1e-5)
    assert m['num_tokens'] == per_token_step['num_tokens']
    assert m['token_accuracy'] == per_token_step['token_accuracy']


def test_adafactor_never_factors_the_layers_axis_and_equals_per_layer_updates():
  c = tiny(d_model=128, num_heads=2, head_dim=64, d_ff=256, vocab_size=16,
           num_encoder_layers=3, architecture='encoder_only')
  _, params = init_params(c, tokens(1, 4, vocab=16))
  tx = optimizer.make_optimizer(params, learning_rate=0.01)
  state = tx.init(params)
  shapes = {tuple(x.shape) for x in jax.tree_util.tree_leaves(state)}
  assert (3, 128) in shapes and (3, 256) in shapes  # v_row / v_col of wi (3, 128, 256), per layer
  grads = jax.tree_util.tree_map(lambda p: jnp.sin(jnp.arange(p.size).reshape(p.shape) * 1.0), params)
  updates, _ = tx.update(grads, state, params)
  wi = params['encoder']['layers']['mlp']['wi']['kernel']
  g = grads['encoder']['layers']['mlp']['wi']['kernel']
  single = optax.adafactor(0.01, decay_rate=0.8, clipping_threshold=1.0, momentum=None)
  for layer in range(3):
    u, _ = single.update(g[layer], single.init(wi[layer]), wi[layer])
    np.testing.assert_allclose(updates['encoder']['layers']['mlp']['wi']['kernel'][layer], u, rtol=1e-5)


def test_fixed_random_synthesizer_gets_no_update():
  c = tiny(architecture='encoder_only', self_attention=('fixed_random', 'dot_product'))
  _, params = init_params(c, tokens(1, 4))
  tx = optimizer.make_optimizer(params, learning_rate=0.01)
  grads = jax.tree_util.tree_map(jnp.ones_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  sa = updates['encoder']['layers']['self_attention']
  assert float(jnp.abs(sa['fixed_random']['random_logits']).sum()) == 0
  assert float(jnp.abs(sa['query']['kernel']).sum()) > 0


def test_loss_falls_and_microbatches_equal_the_full_batch():
  mesh = partitioning.make_mesh(devices=jax.devices()[:1])
  state, step = setup(mesh)
  batch, rng = synthetic_batch(), jax.random.PRNGKey(0)
  first = None
  for _ in range(20):
    state, m = step(state, batch, rng)
    first = first if first is not None else float(m['loss'])
  assert float(m['loss']) < 0.8 * first and int(state.step) == 20
  # Microbatches with unequal numbers of target tokens (the odd rows, one microbatch, keep 2):
  # the full batch's mean over its tokens, not a mean of the microbatches' means (T5X's sum of
  # per-microbatch normalised losses would weight the short one's tokens more).
  weights = np.array(batch['decoder_loss_weights'])
  weights[1::2, 2:] = 0
  batch = {**batch, 'decoder_loss_weights': weights}
  one, step1 = setup(mesh)
  two, step2 = setup(mesh, num_microbatches=2)
  one, m1 = step1(one, batch, rng)
  two, m2 = step2(two, batch, rng)
  np.testing.assert_allclose(m1['loss'], m2['loss'], rtol=1e-6)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                         one.params, two.params)


def test_a_skipped_step_logs_the_norm_of_the_parameters_kept():
  """A NaN loss weight: the step is skipped, and its param_norm is of the parameters kept (it
  was the rejected update's: nan)."""
  mesh = partitioning.make_mesh(devices=jax.devices()[:1])
  state, step = setup(mesh)
  norm = float(optax.tree_utils.tree_norm(state.params))
  batch = synthetic_batch()
  batch['decoder_loss_weights'] = np.asarray(batch['decoder_loss_weights'], np.float32)
  batch['decoder_loss_weights'][0, 0] = np.nan
  _, m = step(state, batch, jax.random.PRNGKey(0))
  assert int(m['skipped']) == 1 and float(m['param_norm']) == pytest.approx(norm, rel=1e-6)


def test_a_non_finite_step_is_skipped():
  mesh = partitioning.make_mesh(devices=jax.devices()[:1])
  state, step = setup(mesh)
  bad = state.replace(params=jax.tree_util.tree_map(lambda p: p, state.params))
  bad.params['token_embedder']['embedding'] = bad.params['token_embedder']['embedding'].at[3].set(jnp.nan)
  before = jax.tree_util.tree_map(np.asarray, bad.params)
  statistics = jax.tree_util.tree_map(np.asarray, bad.opt_state)  # the step donates its state
  after, m = step(bad, synthetic_batch(), jax.random.PRNGKey(0))
  assert int(m['skipped']) == 1 and int(after.step) == 1  # counted, not applied
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.tree_util.tree_map(np.asarray, after.params), before)
  # The schedule's and Adafactor's step counts advance with the state's (the schedule's rate
  # logged is the one the next step applies); its statistics are kept.
  leaves = jax.tree_util.tree_leaves_with_path
  for (path, was), (_, now) in zip(leaves(statistics), leaves(after.opt_state)):
    if getattr(path[-1], 'name', None) == 'count':
      np.testing.assert_array_equal(now, np.asarray(was) + 1)
    else:
      np.testing.assert_array_equal(now, was)


def test_a_skipped_step_leaves_adams_update_as_if_it_had_not_been():
  """Adam's count stays with its moments: a skipped step, then a finite one, updates the
  parameters as the finite one alone (its count had advanced, so the first applied update was
  bias-corrected for two steps: 0.744 of Adam's first step)."""
  mesh = partitioning.make_mesh(devices=jax.devices()[:1])
  state, step = setup(mesh, optimizer_fn=optimizer.adam)
  copy = lambda tree: jax.tree_util.tree_map(jnp.array, tree)  # (the step donates its state)
  nan = synthetic_batch()
  nan['decoder_loss_weights'] = np.asarray(nan['decoder_loss_weights'], np.float32)
  nan['decoder_loss_weights'][0, 0] = np.nan
  alone, _ = step(copy(state), synthetic_batch(), jax.random.PRNGKey(0))
  skipped, m = step(copy(state), nan, jax.random.PRNGKey(0))
  after, _ = step(skipped, synthetic_batch(), jax.random.PRNGKey(0))
  assert int(m['skipped']) == 1 and (int(alone.step), int(after.step)) == (1, 2)
  jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7),
                         after.params, alone.params)


@pytest.mark.slow
def test_sharded_mesh_matches_a_single_device():
  """data=4 x model=2 on 8 host-platform devices gives the losses of one device, with Adafactor,
  Adam and AdamW; their statistics are sharded like the parameter. Microbatches on data=8 too."""
  script = os.path.join(os.path.dirname(__file__), 'mesh_equivalence.py')
  out = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True)
  results = json.loads(out.stdout.strip().splitlines()[-1])
  micro = results.pop('microbatches')
  # 4 microbatches on data=8: the full batch's losses, and no row gathered across devices (each
  # device's rows hold its share of every microbatch; contiguous microbatches were all-gathered).
  np.testing.assert_allclose(micro['data8_nm4'][0], micro['one_device'], rtol=1e-5)
  assert micro['data8_nm4'][1] == micro['data8_nm1'][1]
  assert sorted(results) == ['adafactor', 'adam', 'adamw']
  for result in results.values():
    assert result['spec'] == ['None', 'None', 'model']  # (layers, embed, mlp): mlp over 'model'
    assert result['stat_spec'] == ['None', 'None', 'model']  # its optimizer statistic: the same
    np.testing.assert_allclose(result['sharded'], result['single'], rtol=1e-5)
    assert result['sharded'][2] < result['sharded'][0]


LOWERED_STEP = """
import hashlib, sys
sys.path.insert(0, sys.argv[1])
import jax
from t5x_variants.train import partitioning
from train_helpers import setup, synthetic_batch
state, step = setup(partitioning.make_mesh(devices=jax.devices()[:1]))
print(hashlib.sha256(step.lower(state, synthetic_batch(), jax.random.PRNGKey(0)).as_text().encode()).hexdigest())
"""


def test_the_train_step_is_the_same_program_in_every_process():
  """Python salts string hashes per process: nothing that builds the step may follow a set's
  order, or each host of a pod traces its own program (and the compilation cache misses). The
  lowered step under two hash seeds (which gave 4 different programs for 4 seeds while the
  optimizer's transforms followed a set of labels) is the same text."""
  texts = {subprocess.run([sys.executable, '-c', LOWERED_STEP, os.path.dirname(__file__)],
                          env={**os.environ, 'PYTHONHASHSEED': seed}, capture_output=True,
                          text=True, check=True).stdout.split()[-1] for seed in ('0', '1')}
  assert len(texts) == 1


def test_factored_adafactor_statistics_follow_their_parameter_sharding():
  """A (layers, 256, 512) kernel split over 'model' on its last axis: the per-layer factored
  statistics drop one axis each, and keep 'model' exactly where the kept axis carries it."""
  mesh = partitioning.make_mesh(devices=jax.devices()[:1])
  spec = PartitionSpec(None, None, 'model')
  params = {'k': jax.ShapeDtypeStruct((2, 256, 512), jnp.float32,
                                      sharding=NamedSharding(mesh, spec))}
  stats = jax.eval_shape(optimizer.make_optimizer(params, learning_rate=0.01).init, params)
  specs = {jax.tree_util.keystr(p): tuple(s.spec) for p, s in jax.tree_util.tree_leaves_with_path(
      partitioning.follow_param_shardings(stats, params, mesh))}
  shapes = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(stats)}
  by_shape = {shapes[k]: specs[k] for k in specs}
  assert by_shape[(2, 256)] == (None, None)        # v_row: the 512 axis was reduced
  assert by_shape[(2, 512)] == (None, 'model')     # v_col: the sharded axis kept
  assert all(specs[k] == () for k in specs if len(shapes[k]) < 2)  # counters, placeholders


def test_adafactor_statistics_of_attention_projections_follow_their_heads_sharding():
  """Adafactor sees a projection as T5's (d_model, heads x head_dim) matrix (or (heads x
  head_dim, d_model) for out): its statistics were replicated on every device (no shape of the
  kernel matched), the full second moments too below 128. Scanned (a layers axis) and not; square
  (T5's d_model = heads x head_dim), where v_row keeps the matrix's first axis as optax's does."""
  mesh = partitioning.make_mesh(devices=jax.devices()[:1])
  kernel = lambda shape, *spec: jax.ShapeDtypeStruct(shape, jnp.float32,
                                                      sharding=NamedSharding(mesh, PartitionSpec(*spec)))
  params = {'encoder': {'layers': {'self_attention': {
                'query': {'kernel': kernel((2, 192, 4, 64), None, 'data', 'model', None)},
                'out': {'kernel': kernel((2, 4, 16, 96), None, 'model', None, 'data')}}}},
            'decoder': {'self_attention': {'key': {'kernel': kernel((192, 4, 64), 'data', 'model')},
                                           'value': {'kernel': kernel((256, 4, 64), 'data', 'model')}}}}
  stats = jax.eval_shape(optimizer.make_optimizer(params, learning_rate=0.01).init, params)
  found = {}
  for (path, s), x in zip(jax.tree_util.tree_leaves_with_path(
      partitioning.follow_param_shardings(stats, params, mesh)), jax.tree_util.tree_leaves(stats)):
    names = [str(getattr(k, 'key', '')) for k in path]
    if 'kernel' in names and x.size > 2 and 'value' not in names:
      found[names[names.index('kernel') - 1], x.shape] = tuple(s.spec)
  assert found == {
      ('query', (2, 192)): (None, 'data'), ('query', (2, 256)): (None, 'model'),  # factored
      ('out', (2, 64, 96)): (None, 'model', 'data'),  # (64, 96): below 128, not factored
      ('key', (192,)): ('data',), ('key', (256,)): ('model',)}  # not scanned
  square = [tuple(s.spec) for (path, s), x in zip(
      jax.tree_util.tree_leaves_with_path(partitioning.follow_param_shardings(stats, params, mesh)),
      jax.tree_util.tree_leaves(stats)) if 'value' in jax.tree_util.keystr(path) and x.size > 2]
  assert square == [('data',), ('model',)]  # v_row (d_model), v_col (heads x head_dim)


@pytest.mark.parametrize('architecture', ['encoder_decoder', 'decoder_only'])
def test_a_synthetic_packed_batch_shifts_each_example_as_seqio(architecture):
  """The decoder's input is each packed example's targets shifted right, a 0 at its start (seqio's
  autoregressive inputs), not the previous example's last token."""
  b = train_step.synthetic_batch(tiny(architecture=architecture), 2, {'inputs': 6, 'targets': 8},
                                 packed=True)
  targets, starts = b['decoder_target_tokens'], b['decoder_positions'] == 0
  assert starts.sum() == 4
  np.testing.assert_array_equal(b['decoder_input_tokens'][starts], 0)
  np.testing.assert_array_equal(b['decoder_input_tokens'][:, 1:][~starts[:, 1:]],
                                targets[:, :-1][~starts[:, 1:]])


@pytest.mark.parametrize('packed', [False, True])
def test_a_synthetic_prefix_lm_batch_has_seqios_layout(packed):
  """The bench's and t5xv-compile's prefix LM rows: per example the inputs then the targets, fully
  visible up to the position reading the inputs' last token, the loss on the targets."""
  c = tiny(architecture='decoder_only', prefix_lm=True)
  b = train_step.synthetic_batch(c, 2, {'inputs': 6, 'targets': 4}, packed=packed)
  example = ([1] * 4 + [0], [0] * 3 + [1] * 2) if packed else ([1] * 7 + [0] * 3, [0] * 6 + [1] * 4)
  repeat = 2 if packed else 1
  np.testing.assert_array_equal(b['decoder_causal_attention'], [example[0] * repeat] * 2)
  np.testing.assert_array_equal(b['decoder_loss_weights'], [example[1] * repeat] * 2)
  assert b['decoder_target_tokens'].shape == (2, 10)


def test_evaluation_counts_every_token_of_a_large_split_exactly():
  """Each batch's sums (float32 on the device) are added on the host: kept as float32 totals on
  the device they stopped counting exactly past 2**24 tokens, biasing the loss (2,000 batches of
  16,383 tokens counted 32,766,976 tokens)."""
  from t5x_variants.train import evaluation  # pylint: disable=g-import-not-at-top
  mesh = partitioning.MeshConfig().mesh()
  step = jax.jit(lambda params, batch: {k: jnp.sum(batch['tokens'], dtype=jnp.float32) * v for k, v in
                                        {'loss': 2.5, 'z_loss': 0.0, 'correct': 0.5, 'num_tokens': 1.0}.items()})
  batch = {'tokens': np.full((1, 16383), 1, np.int32)}
  out = evaluation.evaluate(step, None, (batch for _ in range(2000)), mesh)
  assert out == {'loss': 2.5, 'log_perplexity': 2.5, 'token_accuracy': 0.5, 'num_tokens': 32766000.0}


def test_the_mesh_check_sees_every_size_a_logical_name_has():
  """It kept the first parameter of each logical name: a later one of another size went unchecked
  (every name has one size today, so this was latent)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from jax.sharding import AbstractMesh  # pylint: disable=g-import-not-at-top
  boxed = {'a': nn.LogicallyPartitioned(jnp.zeros((8,)), ('mlp',)),
           'b': nn.LogicallyPartitioned(jnp.zeros((6,)), ('mlp',))}
  mesh = AbstractMesh((1, 1, 4), partitioning.MESH_AXES)
  with pytest.raises(ValueError, match=r"mesh axis 'model' of size 4 does not divide mlp = 6 \(e\.g\. b\); "
                                       r".*\(mlp 8, mlp 6\) and the 4 devices: 1, 2 \(set MeshConfig.model\)"):
    partitioning.check_mesh(boxed, mesh, partitioning.logical_axis_rules())
