"""The optimizers as gin objects: Adam and AdamW against their update formulas (per layer of a
scanned stack too), global-norm clipping, frozen paths, and exact resume for every optimizer."""
import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from t5x_variants.models import build_model
from t5x_variants.train import optimizer, partitioning
from conftest import tiny, tokens
from train_helpers import records_of, run_train, saved_state, setup, synthetic_batch, train_losses

PARAMS = {'decoder': {'layers': {'w': jnp.array([[1.0, -2.0], [0.5, 3.0]])}},  # 2 scanned layers
          'token_embedder': {'embedding': jnp.array([0.3, -0.7])}}
GRADS = {'decoder': {'layers': {'w': jnp.array([[0.2, -0.1], [4.0, 0.0]])}},
         'token_embedder': {'embedding': jnp.array([-0.5, 0.25])}}


def two_steps(tx):
  """The updates of two steps with the same gradients."""
  state = tx.init(PARAMS)
  u1, state = tx.update(GRADS, state, PARAMS)
  u2, _ = tx.update(GRADS, state, optax.apply_updates(PARAMS, u1))
  return u1, u2


@pytest.mark.parametrize('name', ['adam', 'adamw'])
def test_adam_and_adamw_follow_their_formulas(name):
  """m_t = b1 m + (1 - b1) g, v_t = b2 v + (1 - b2) g^2, step -lr m_t / (1 - b1^t) /
  (sqrt(v_t / (1 - b2^t)) + eps); AdamW also -lr wd theta (Loshchilov & Hutter 2019)."""
  lr, b1, b2, eps, wd = 0.1, 0.9, 0.98, 1e-6, 0.05
  kw = dict(b1=b1, b2=b2, eps=eps) | (dict(weight_decay=wd) if name == 'adamw' else {})
  tx = optimizer.make_optimizer(PARAMS, lr, optimizer=lambda r: getattr(optimizer, name)(r, **kw))
  got = two_steps(tx)
  theta = jax.tree_util.tree_map(np.asarray, PARAMS)
  m = v = jax.tree_util.tree_map(np.zeros_like, theta)
  for t, u in enumerate(got, start=1):
    g = jax.tree_util.tree_map(np.asarray, GRADS)
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
    want = jax.tree_util.tree_map(
        lambda m, v, p: -lr * (m / (1 - b1**t) / (np.sqrt(v / (1 - b2**t)) + eps)
                               + (wd * p if name == 'adamw' else 0)), m, v, theta)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), u, want)
    theta = jax.tree_util.tree_map(lambda p, d: p + d, theta, want)


def test_adamw_without_bias_correction_is_berts_optimizer():
  """bias_correction=False: BERT's AdamWeightDecayOptimizer, step -lr (m_t / (sqrt(v_t) + eps) +
  wd theta) with the moments as Adam's but never divided by 1 - b^t (0.1 / sqrt(0.001) = 3.2x
  Adam's first step for b1 0.9, b2 0.999); its state the same tree as optax.adamw's, so a
  checkpoint of either reads as the other."""
  lr, b1, b2, eps, wd = 0.1, 0.9, 0.999, 1e-6, 0.05
  bert = lambda r: optimizer.adamw(r, b1=b1, b2=b2, eps=eps, weight_decay=wd, bias_correction=False)
  tx = optimizer.make_optimizer(PARAMS, lr, optimizer=bert)
  got = two_steps(tx)
  theta = jax.tree_util.tree_map(np.asarray, PARAMS)
  m = v = jax.tree_util.tree_map(np.zeros_like, theta)
  for u in got:
    g = jax.tree_util.tree_map(np.asarray, GRADS)
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
    want = jax.tree_util.tree_map(lambda m, v, p: -lr * (m / (np.sqrt(v) + eps) + wd * p), m, v, theta)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), u, want)
    theta = jax.tree_util.tree_map(lambda p, d: p + d, theta, want)
  corrected = optimizer.make_optimizer(PARAMS, lr, optimizer=lambda r: optimizer.adamw(r))
  assert (jax.tree_util.tree_structure(tx.init(PARAMS))
          == jax.tree_util.tree_structure(corrected.init(PARAMS)))


def test_global_norm_clip_and_frozen_paths():
  """With clipping c the gradient is scaled by min(1, c / ||g||) before the optimizer (here
  SGD, so the update shows it); a frozen path gets a zero update."""
  norm = float(optax.tree_utils.tree_norm(GRADS))
  sgd = lambda lr: optax.sgd(lr)
  u, _ = two_steps(optimizer.make_optimizer(PARAMS, 1.0, optimizer=sgd, global_norm_clip=1.0))
  jax.tree_util.tree_map(lambda a, g: np.testing.assert_allclose(a, -g / norm, rtol=1e-6), u, GRADS)
  u, _ = two_steps(optimizer.make_optimizer(PARAMS, 1.0, optimizer=sgd, global_norm_clip=10 * norm))
  jax.tree_util.tree_map(lambda a, g: np.testing.assert_allclose(a, -g, rtol=1e-6), u, GRADS)
  u, _ = two_steps(optimizer.make_optimizer(PARAMS, 1.0, optimizer=sgd, frozen=['token_embedder']))
  assert not np.asarray(u['token_embedder']['embedding']).any()
  np.testing.assert_allclose(u['decoder']['layers']['w'], -GRADS['decoder']['layers']['w'])
  # Clipped by the trained parameters' norm alone: a frozen path's gradient is no update.
  w = GRADS['decoder']['layers']['w']
  u, _ = two_steps(optimizer.make_optimizer(PARAMS, 1.0, optimizer=sgd, frozen=['token_embedder'],
                                            global_norm_clip=1.0))
  np.testing.assert_allclose(u['decoder']['layers']['w'], -w / float(jnp.linalg.norm(w)), rtol=1e-6)
  assert not np.asarray(u['token_embedder']['embedding']).any()


def test_a_frozen_path_is_matched_by_whole_parts():
  """'encoder/layers_1' freezes layers_1 alone (it also froze layers_10 and layers_11: a match
  of any part of a name); a part matches wherever it sits in the path."""
  params = {'encoder': {f'layers_{i}': {'w': 0.0} for i in (0, 1, 2, 10, 11)},
            'token_embedder': {'embedding': 0.0}}
  labels = optimizer.param_labels(params, frozen=['encoder/layers_1', 'embedding'])
  assert {k: v['w'] for k, v in labels['encoder'].items()} == {
      'layers_0': 'default', 'layers_1': 'frozen', 'layers_2': 'default', 'layers_10': 'default',
      'layers_11': 'default'}
  assert labels['token_embedder']['embedding'] == 'frozen'


def test_grad_norm_is_over_the_trained_parameters():
  """The logged gradient norm leaves a frozen path's gradient out, as the clip does."""
  tx = optimizer.make_optimizer(PARAMS, 1.0, frozen=['token_embedder'])
  np.testing.assert_allclose(tx.trained_norm(GRADS), jnp.linalg.norm(GRADS['decoder']['layers']['w']),
                             rtol=1e-6)
  mesh, batch = partitioning.MeshConfig().mesh(), synthetic_batch()
  norms = [float(step(state, batch, jax.random.PRNGKey(0))[1]['grad_norm'])
           for state, step in (setup(mesh), setup(mesh, frozen=['token_embedder']))]
  assert 0 < norms[1] < 0.999 * norms[0], norms  # the embedding's gradient: 8% of the square


def test_adafactor_factors_attention_projections_as_t5_stored_them():
  """T5 stored query / key / value as (d_model, heads x head_dim) and out transposed (Mesh
  TensorFlow's combined dims; T5X factors heads and head_dim as one column): a scanned
  (layers, d_model, heads, head_dim) kernel gets per layer a row of d_model and a column of
  heads x head_dim, no full second moment, and Adafactor's update on that matrix."""
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {'encoder': {'layers': {'attention': {
      'query': {'kernel': jax.random.normal(k1, (2, 384, 4, 64))},
      'out': {'kernel': jax.random.normal(k2, (2, 4, 64, 384))}}}}}
  grads = {'encoder': {'layers': {'attention': {
      'query': {'kernel': jax.random.normal(k3, (2, 384, 4, 64))},
      'out': {'kernel': jax.random.normal(k4, (2, 4, 64, 384))}}}}}
  tx = optimizer.make_optimizer(params, 0.01)
  state = tx.init(params)
  # (layers, 1): optax's placeholder for the full moment of a factored parameter
  assert {x.shape for x in jax.tree_util.tree_leaves(state) if x.ndim > 1} == {(2, 1), (2, 384), (2, 256)}
  updates, _ = tx.update(grads, state, params)
  t5 = optax.adafactor(0.01, min_dim_size_to_factor=128, decay_rate=0.8, clipping_threshold=1.0,
                       multiply_by_parameter_scale=True, momentum=None, factored=True)
  for name in ('query', 'out'):
    shape = (384, 256) if name == 'query' else (256, 384)
    p, g = (tree['encoder']['layers']['attention'][name]['kernel'][1].reshape(shape)
            for tree in (params, grads))
    want, _ = t5.update(g, t5.init(p), p)
    got = updates['encoder']['layers']['attention'][name]['kernel'][1]
    np.testing.assert_allclose(got, want.reshape(got.shape), rtol=1e-5, atol=1e-7)

  # combine_heads False: optax's own layout, the whole second moment of each kernel
  tx = optimizer.make_optimizer(params, 0.01, optimizer=lambda lr: optimizer.adafactor(lr, combine_heads=False))
  assert (2, 384, 4, 64) in {x.shape for x in jax.tree_util.tree_leaves(tx.init(params))}


def test_adafactor_factors_a_dense_synthesizers_w1_as_a_query_projection():
  """The paper's reading of the dense synthesizers (``synthesizer_hidden='w1'``) has a W_1 per
  synthesizer, (layers, d_model, heads, head_dim) like the query: its second moment factors over
  d_model and heads x head_dim (it was kept whole: optax factors the two largest axes, d_model
  and head_dim, and head_dim 64 is below 128)."""
  config = tiny(d_model=128, num_heads=2, head_dim=64, d_ff=128, encoder_max_length=8,
                decoder_max_length=8, self_attention=('dense', 'factorized_dense'),
                synthesizer_hidden='w1')
  model = build_model(config)
  params = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens(1, 8),
                                   tokens(1, 8))['params'])
  found = {'/'.join(map(str, optimizer.path_keys(path))): x.shape
           for path, x in jax.tree_util.tree_leaves_with_path(params)
           if str(optimizer.path_keys(path)[-2]).endswith('_w1')}
  assert len(found) == 4 and all(s[-3:] == (128, 2, 64) for s in found.values()), found
  state = jax.eval_shape(optimizer.make_optimizer(params, 0.01).init, params)
  moments = {x.shape for x in jax.tree_util.tree_leaves(state)}
  layers = next(iter(found.values()))[:-3]
  assert layers + (128,) in moments and not any(len(s) >= 3 and s[-2:] == (2, 64) for s in moments)


def test_adafactor_clips_decays_and_scales_each_layer_of_a_scanned_stack_alone():
  """Three steps of a scanned (layers, d_model, d_ff) kernel whose second layer's gradient spikes
  100x at step 2: each layer's update is optax's Adafactor with T5's settings (decay 0.8, update
  clipping 1.0, the parameter's RMS) on that layer alone. A first step cannot show it (its
  clipped RMS is about 1 and its decay 0 whatever the rate): clipping or parameter scale taken
  over the whole stack, or another decay rate, changes later steps."""
  keys = jax.random.split(jax.random.PRNGKey(1), 4)
  scale = jnp.asarray([1.0, 0.05])[:, None, None]
  params = {'decoder': {'layers': {'mlp': {'wi': {'kernel': jax.random.normal(keys[0], (2, 128, 256)) * scale}}}}}
  grads = [jax.random.normal(k, (2, 128, 256)) for k in keys[1:]]
  grads[1] = grads[1].at[1].mul(100.0)
  tx = optimizer.make_optimizer(params, 0.01)
  state = tx.init(params)
  t5 = optax.adafactor(0.01, min_dim_size_to_factor=128, decay_rate=0.8, clipping_threshold=1.0,
                       multiply_by_parameter_scale=True, momentum=None, factored=True)
  alone = [(params['decoder']['layers']['mlp']['wi']['kernel'][i], None) for i in range(2)]
  alone = [(p, t5.init(p)) for p, _ in alone]
  for g in grads:
    updates, state = tx.update({'decoder': {'layers': {'mlp': {'wi': {'kernel': g}}}}}, state, params)
    params = optax.apply_updates(params, updates)
    for i, (p, s) in enumerate(alone):
      want, s = t5.update(g[i], s, p)
      alone[i] = (optax.apply_updates(p, want), s)
      np.testing.assert_allclose(updates['decoder']['layers']['mlp']['wi']['kernel'][i], want,
                                 rtol=1e-4, atol=1e-7)


def test_adafactors_momentum_and_weight_decay_follow_t5xs_formulas():
  """With the parameter scale off (so a step's scaled update A_t depends on the gradients
  alone): momentum b1 gives U_1 = (1 - b1) A_1, U_2 = b1 U_1 + (1 - b1) A_2 (no bias
  correction), kept in ``dtype_momentum``; weight decay w adds -w theta to each step, not scaled
  by the learning rate; per layer of a scanned stack as elsewhere."""
  b1, w = 0.9, 0.01
  make = lambda **kw: optimizer.make_optimizer(PARAMS, 0.1, optimizer=lambda lr: optimizer.adafactor(
      lr, multiply_by_parameter_scale=False, **kw))
  a1, a2 = two_steps(make())
  u1, u2 = two_steps(make(momentum=b1))
  tree = jax.tree_util.tree_map
  tree(lambda u, a: np.testing.assert_allclose(u, (1 - b1) * a, rtol=1e-6), u1, a1)
  tree(lambda u, p, a: np.testing.assert_allclose(u, b1 * p + (1 - b1) * a, rtol=1e-6), u2, u1, a2)
  d1, _ = two_steps(make(weight_decay_rate=w))
  tree(lambda d, a, p: np.testing.assert_allclose(d, a - w * p, rtol=1e-6), d1, a1, PARAMS)
  state = make(momentum=b1, dtype_momentum='bfloat16').init(PARAMS)
  momenta = [x for path, x in jax.tree_util.tree_leaves_with_path(state)
             if any(getattr(k, 'name', None) == 'ema' for k in path)]
  assert [(x.shape, x.dtype) for x in momenta] == [((2, 2), jnp.bfloat16), ((2,), jnp.bfloat16)]


def test_an_adafactor_checkpoint_of_the_earlier_layout_resumes_with_combine_heads_false(tmp_path):
  """Checkpoints saved before Adafactor combined the heads hold whole moments: resuming them is
  one error naming the switch, and with it they resume."""
  from t5x_variants.train import checkpoints  # pylint: disable=g-import-not-at-top
  config = tiny(d_model=128, num_heads=2, head_dim=64, num_encoder_layers=1, num_decoder_layers=1)
  gin.bind_parameter('adafactor.combine_heads', False)
  run_train(tmp_path, 2, config=config)
  gin.clear_config()
  with pytest.raises(checkpoints.CheckpointError, match='--gin.adafactor.combine_heads=False'):
    run_train(tmp_path, 4, config=config)
  gin.bind_parameter('adafactor.combine_heads', False)
  assert run_train(tmp_path, 4, config=config)['step'] == 4


def test_the_attention_layout_hint_only_for_a_statistic_saved_with_another_shape():
  """Another optimizer (Adam's moments where Adafactor's are wanted) is not the attention layout:
  no combine_heads hint there (it was given for any projection kernel's entry)."""
  kernel = 'opt_state/0/v_row/encoder/layers/attention/query/kernel'
  assert 'combine_heads' in optimizer.optimizer_hint(kernel, reshaped=True)
  assert optimizer.optimizer_hint(kernel, reshaped=False) == ''
  w1 = 'opt_state/0/v/encoder/layers/self_attention/dense_w1/kernel'
  assert 'init_optimizer=False' in optimizer.optimizer_hint(w1, reshaped=True)
  assert optimizer.optimizer_hint(w1, reshaped=False) == ''


def test_adamw_leaves_norms_and_biases_undecayed_as_bert_when_asked():
  """With zero gradients AdamW's update is the decay -lr wd theta alone: on every parameter by
  default (fairseq, PyTorch), on none of the norms' parameters and biases with
  decay_norms_and_biases False (BERT; T5's relative position bias is a bias), in a scanned
  stack too."""
  ones = lambda *shape: jnp.ones(shape)
  params = {'encoder': {'relpos_bias': {'rel_embedding': ones(2, 8)},
                        'layers': {'pre_attention_layer_norm': {'scale': ones(2, 4)},
                                   'attention': {'query': {'kernel': ones(2, 4, 4), 'bias': ones(2, 4)}}},
                        'encoder_norm': {'scale': ones(4)}},
            'classifier': {'kernel': ones(4, 2), 'bias': ones(2)}}
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  for flag, decayed in ((True, 7), (False, 2)):
    adamw = lambda lr: optimizer.adamw(lr, weight_decay=0.5, decay_norms_and_biases=flag)
    tx = optimizer.make_optimizer(params, 0.1, optimizer=adamw)
    updates, _ = tx.update(zeros, tx.init(params), params)
    moved = {'/'.join(str(k.key) for k in path): float(jnp.max(jnp.abs(u)))
             for path, u in jax.tree_util.tree_leaves_with_path(updates)}
    assert sum(v == pytest.approx(0.05) for v in moved.values()) == decayed, moved
    if not flag:
      assert {k for k, v in moved.items() if v} == {'encoder/layers/attention/query/kernel',
                                                     'classifier/kernel'}


@pytest.mark.parametrize('name,setting', [('adam', 'b2 = 0.98'), ('adamw', 'b2 = 0.98'),
                                          ('adafactor', 'momentum = 0.9')])
def test_every_optimizer_resumes_exactly_and_keeps_frozen_paths(name, setting, tmp_path):
  """2 steps + a resumed 2 equal 4 straight steps (losses and saved state, optimizer statistics
  included) with the gin-bound optimizer; the frozen embedding never moves. (Adafactor without
  momentum: the trainer tests.)"""
  def bind():
    gin.parse_config([f'make_optimizer.optimizer = @{name}', "make_optimizer.frozen = ['token_embedder']",
                      f'{name}.{setting}'])
  bind()
  run_train(tmp_path / 'straight', 4)
  run_train(tmp_path / 'resumed', 2)
  gin.clear_config()
  bind()
  run_train(tmp_path / 'resumed', 4)
  assert [r['step'] for r in records_of(tmp_path / 'resumed')] == [1, 2, 3, 4]
  assert train_losses(tmp_path / 'resumed') == train_losses(tmp_path / 'straight')
  final = saved_state(tmp_path / 'straight' / 'checkpoint_4')
  jax.tree_util.tree_map(np.testing.assert_array_equal, saved_state(tmp_path / 'resumed' / 'checkpoint_4'), final)
  first = saved_state(tmp_path / 'straight' / 'checkpoint_2')
  np.testing.assert_array_equal(first['params']['token_embedder']['embedding'],
                                final['params']['token_embedder']['embedding'])
  assert not np.array_equal(first['params']['decoder']['decoder_norm']['scale'],
                            final['params']['decoder']['decoder_norm']['scale'])


@pytest.mark.parametrize('name', ['noam', 'linear', 'rsqrt'])
def test_no_warmup_ramp_keeps_the_warmed_up_schedules_level(name):
  """warmup_ramp=False: the peak from step 0, then exactly the twin's rate after the warmup."""
  kw = dict(name=name, base=5e-4 if name != 'rsqrt' else 1.0, warmup_steps=100, total_steps=1000)
  twin, flat = optimizer.learning_rate_schedule(**kw), optimizer.learning_rate_schedule(**kw, warmup_ramp=False)
  peak = float(twin(100))
  for step in (0, 1, 50, 99):
    assert float(flat(step)) == pytest.approx(peak)
  for step in (100, 101, 400, 999):
    assert float(flat(step)) == pytest.approx(float(twin(step)))
  assert float(twin(0)) < peak or name == 'rsqrt'


def test_any_optax_optimizer_through_gins_dynamic_registration(tmp_path):
  """A gin file importing optax binds ``make_optimizer.optimizer = @optax.lion`` (and its own
  settings): the run's optimizer is optax's Lion, per layer as any other (first step: -lr (sign(g)
  + wd theta), Chen et al. 2023, Alg. 2)."""
  from t5x_variants.cli import recipe  # pylint: disable=g-import-not-at-top
  (tmp_path / 'lion.gin').write_text(
      'from __gin__ import dynamic_registration\nimport optax\n'
      'from t5x_variants.train import optimizer\n'
      'optimizer.make_optimizer.optimizer = @optax.lion\noptax.lion.weight_decay = 0.01\n')
  recipe.parse_recipe(['gin/models/t5_tiny.gin', str(tmp_path / 'lion.gin')], [], [], with_data=False)
  tx = optimizer.make_optimizer(PARAMS, 0.1)
  state = tx.init(PARAMS)
  assert any(isinstance(x, optax.ScaleByLionState) for x in jax.tree_util.tree_leaves(
      state, is_leaf=lambda x: isinstance(x, optax.ScaleByLionState)))
  updates, _ = tx.update(GRADS, state, PARAMS)
  jax.tree_util.tree_map(lambda u, g, p: np.testing.assert_allclose(u, -0.1 * (np.sign(g) + 0.01 * p), rtol=1e-6),
                         updates, GRADS, PARAMS)
