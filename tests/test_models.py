"""Architecture-level equivalences: causality, cached decoding, packing, scan vs unrolled, remat,
dropout, bf16 and a very deep scanned model."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import count, init_params, jit_apply, tiny, tokens
from t5x_variants.layers import fused_attention
from t5x_variants.layers.synthesizer import SYNTHESIZERS
from t5x_variants.models import build_model
from t5x_variants.models.encoder_decoder import unshared_params
from t5x_variants.models.config import REMAT

VARIANTS = ['dot_product', *SYNTHESIZERS, ('random', 'dense', 'dot_product')]
ALL_COMPONENTS = ('dot_product', *SYNTHESIZERS)
# The decoder's self-attention code is shared by both architectures: every variant runs in the
# decoder-only model, and the encoder-decoder runs dot-product and a mixture of every component.
CASES = [('decoder_only', v) for v in VARIANTS] + [('encoder_decoder', 'dot_product'),
                                                   ('encoder_decoder', ALL_COMPONENTS)]
L = 8


def _ids(v):
  return v if isinstance(v, str) else '+'.join(v)


@pytest.mark.parametrize('arch,variant', CASES, ids=lambda v: _ids(v))
def test_changing_future_tokens_leaves_earlier_outputs_unchanged(arch, variant):
  c = tiny(architecture=arch, self_attention=variant, decoder_max_length=L)
  enc = (tokens(2, 5, seed=3),) if arch == 'encoder_decoder' else ()
  dec = tokens(2, L)
  model, params = init_params(c, *enc, dec)
  t = 4
  changed = dec.at[:, t:].set(tokens(2, L - t, seed=9))
  apply = jit_apply(model)
  a = apply({'params': params}, *enc, dec)
  b = apply({'params': params}, *enc, changed)
  np.testing.assert_allclose(a[:, :t], b[:, :t], rtol=1e-5, atol=1e-5)
  assert not np.allclose(a[:, t:], b[:, t:])  # the future does change later outputs


def _decode_stepwise(model, params, enc, dec):
  """Feeds dec one token at a time through the cache; returns the stacked logits."""
  cache = jax.jit(lambda *a: model.init(jax.random.PRNGKey(1), *a, decode=True))(*enc, dec)['cache']
  if enc:
    encoded = jit_apply(model, method=model.encode)({'params': params}, enc[0])
    fn = lambda p, cache, tok: model.apply({'params': p, 'cache': cache}, encoded, enc[0], tok,
                                           decode=True, method=model.decode, mutable=['cache'])
  else:
    fn = lambda p, cache, tok: model.apply({'params': p, 'cache': cache}, tok, decode=True,
                                           mutable=['cache'])
  step = jax.jit(fn)
  out = []
  for i in range(dec.shape[1]):
    logits, mutated = step(params, cache, dec[:, i:i + 1])
    cache = mutated['cache']
    out.append(logits[:, 0])
  return jnp.stack(out, axis=1)


def assert_cached_decoding_equals_full_forward(c):
  enc = (tokens(2, 5, seed=3),) if c.architecture == 'encoder_decoder' else ()
  dec = tokens(2, L)
  model, params = init_params(c, *enc, dec)
  full = jit_apply(model)({'params': params}, *enc, dec)
  np.testing.assert_allclose(_decode_stepwise(model, params, enc, dec), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('arch,variant', CASES, ids=lambda v: _ids(v))
def test_cached_decoding_equals_full_forward(arch, variant):
  assert_cached_decoding_equals_full_forward(
      tiny(architecture=arch, self_attention=variant, decoder_max_length=L, placement='subln'))


def test_cached_decoding_with_the_papers_separate_w1():
  """synthesizer_hidden='w1': the dense synthesizers' own W_1 instead of the shared query."""
  assert_cached_decoding_equals_full_forward(tiny(
      architecture='decoder_only', self_attention=('dense', 'factorized_dense', 'dot_product'),
      synthesizer_hidden='w1', decoder_max_length=L))


@pytest.mark.parametrize('placement', ['post', 'deepnorm'])
def test_cached_decoding_other_placements_unrolled(placement):
  c = tiny(architecture='decoder_only', placement=placement, scan_layers=False, decoder_max_length=L)
  dec = tokens(2, L)
  model, params = init_params(c, dec)
  np.testing.assert_allclose(_decode_stepwise(model, params, (), dec),
                             jit_apply(model)({'params': params}, dec), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('variant', VARIANTS, ids=_ids)
def test_packed_segments_equal_separate_sequences(variant):
  """Two sequences packed in one row (segment ids, restarting positions) give the same logits
  as each run alone: masks and position-addressed synthesizers respect segments."""
  c = tiny(architecture='decoder_only', self_attention=variant, decoder_max_length=L)
  a, b = tokens(1, 5, seed=1), tokens(1, 3, seed=2)
  model, params = init_params(c, a)
  packed = jit_apply(model)({'params': params}, jnp.concatenate([a, b], 1),
                            jnp.asarray([[1] * 5 + [2] * 3]), jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2]]))
  apply = jit_apply(model)
  np.testing.assert_allclose(packed[:, :5], apply({'params': params}, a), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed[:, 5:], apply({'params': params}, b), rtol=1e-5, atol=1e-5)


def test_a_prefix_lm_sees_its_whole_prefix_and_no_later_target():
  """T5's prefix LM (Raffel et al. 2020, Fig. 3): query i sees key j when j <= i or both are in
  the prefix. A prefix token changes the outputs before it; a target token never does."""
  c = tiny(architecture='decoder_only', prefix_lm=True, decoder_max_length=L)
  dec = tokens(2, L)
  prefix = jnp.asarray([[1] * 4 + [0] * 4, [1] * 2 + [0] * 6])
  model, params = init_params(c, dec)
  apply = jit_apply(model)
  a = apply({'params': params}, dec, None, None, prefix)
  b = apply({'params': params}, dec.at[:, 1].set(7), None, None, prefix)
  assert not np.allclose(a[0, 0], b[0, 0]) and not np.allclose(a[1, 0], b[1, 0])
  c_ = apply({'params': params}, dec.at[:, 3].set(7), None, None, prefix)
  assert not np.allclose(a[0, :3], c_[0, :3])  # inside row 0's prefix: seen from before
  np.testing.assert_allclose(a[1, :3], c_[1, :3], rtol=1e-6, atol=1e-6)  # row 1's targets: not
  d = apply({'params': params}, dec.at[:, 5].set(7), None, None, prefix)
  np.testing.assert_allclose(a[:, :5], d[:, :5], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('bidirectional, buckets, ordered', [
    (True, None, True), (False, None, False), (True, False, False)])
def test_a_prefix_lm_tells_the_order_of_later_prefix_tokens_apart(bidirectional, buckets, ordered):
  """Mesh TensorFlow's relative buckets for a prefix LM (the T5 paper's code): bidirectional, so
  swapping two prefix tokens after a query changes its output. A causal LM of the same rows
  (T5's 'language model') never sees them; T5X's one-directional buckets see them unordered."""
  c = tiny(architecture='decoder_only', prefix_lm=True, decoder_max_length=L, num_decoder_layers=1,
           inputs_bidirectional_attention=bidirectional,  # one layer: only the bias orders keys
           relative_attention_bidirectional=buckets)
  dec = tokens(1, L)
  prefix = jnp.asarray([[1] * 4 + [0] * 4])
  model, params = init_params(c, dec)
  apply = jit_apply(model)
  a = apply({'params': params}, dec, None, None, prefix)
  swapped = dec.at[:, 2].set(dec[0, 3]).at[:, 3].set(dec[0, 2])
  b = apply({'params': params}, swapped, None, None, prefix)
  assert bool(dec[0, 2] != dec[0, 3])
  assert np.allclose(a[0, :2], b[0, :2], rtol=1e-6, atol=1e-6) != ordered


@pytest.mark.parametrize('scan_layers, kernel', [(True, 'xla'), (False, 'xla'), (True, 'cudnn')])
def test_a_shared_encoder_decoder_is_one_whose_encoder_holds_the_decoders_weights(
    scan_layers, kernel, monkeypatch):
  """T5's shared-parameter encoder-decoder (Table 2): its logits are those of the plain model whose
  encoder holds copies of the decoder's self-attention, FFN, norms, relative bias and final
  norm; its parameters are the plain model's less the encoder's. 'cudnn' (served by JAX's XLA
  implementation of the fused call) takes causality from the kernel's flag, not the mask."""
  monkeypatch.setattr(fused_attention, 'IMPLEMENTATIONS',
                      {**fused_attention.IMPLEMENTATIONS, 'cudnn': 'xla'})
  enc, dec = tokens(2, 6).at[1, 4:].set(0), tokens(2, 4, seed=1)
  kw = dict(scan_layers=scan_layers, attention_kernel=kernel)
  model, params = init_params(tiny(shared_encoder_decoder=True, **kw), enc, dec)
  plain_model, plain = init_params(tiny(**kw), enc, dec)
  assert count(params) == count(plain) - count(plain['encoder'])
  copied = unshared_params(params)
  shape = lambda t: jax.tree_util.tree_map(jnp.shape, t)
  assert shape(copied['encoder']) == shape(plain['encoder'])
  np.testing.assert_allclose(jit_apply(model)({'params': params}, enc, dec),
                             jit_apply(plain_model)({'params': copied}, enc, dec), rtol=1e-6, atol=1e-6)


def test_a_language_model_of_inputs_then_targets_reads_its_inputs_causally():
  """T5's 'language model' row (Table 2): the prefix LM's rows, fully causal. The prefix feature
  changes nothing (an input token never reaches the outputs before it) and the outputs are the
  plain causal LM's with the same parameters."""
  c = tiny(architecture='decoder_only', prefix_lm=True, inputs_bidirectional_attention=False,
           decoder_max_length=L)
  dec = tokens(2, L)
  prefix = jnp.asarray([[1] * 4 + [0] * 4, [1] * 2 + [0] * 6])
  model, params = init_params(c, dec)
  apply = jit_apply(model)
  a = apply({'params': params}, dec, None, None, prefix)
  b = apply({'params': params}, dec.at[:, 3].set(7), None, None, prefix)
  np.testing.assert_allclose(a[:, :3], b[:, :3], rtol=1e-6, atol=1e-6)
  assert not np.allclose(a[:, 3], b[:, 3])
  causal_lm = jit_apply(build_model(tiny(architecture='decoder_only', decoder_max_length=L)))
  np.testing.assert_allclose(a, causal_lm({'params': params}, dec), rtol=1e-6, atol=1e-6)


def test_packed_prefix_lm_rows_equal_separate_rows():
  """seqio's packed prefix LM rows: each segment's prefix is fully visible to itself only."""
  c = tiny(architecture='decoder_only', prefix_lm=True, decoder_max_length=L)
  a, b = tokens(1, 5, seed=1), tokens(1, 3, seed=2)
  pa, pb = jnp.asarray([[1, 1, 1, 0, 0]]), jnp.asarray([[1, 1, 0]])
  model, params = init_params(c, a)
  apply = jit_apply(model)
  packed = apply({'params': params}, jnp.concatenate([a, b], 1), jnp.asarray([[1] * 5 + [2] * 3]),
                 jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2]]), jnp.concatenate([pa, pb], 1))
  np.testing.assert_allclose(packed[:, :5], apply({'params': params}, a, None, None, pa), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed[:, 5:], apply({'params': params}, b, None, None, pb), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('side', ['encoder', 'decoder'])
def test_one_sides_segment_ids_alone_are_refused(side):
  """Packed encoder-decoder rows need both sides' segment ids: with the encoder's alone the
  decoder attended across the encoder's examples; with the decoder's alone it was a TypeError."""
  c = tiny()
  enc, dec = tokens(1, L), tokens(1, L, seed=1)
  model, params = init_params(c, enc, dec)
  segments = jnp.asarray([[1] * 5 + [2] * 3])
  given = {f'{side}_segment_ids': segments}
  with pytest.raises(ValueError, match=f'{side}_segment_ids without'):
    model.apply({'params': params}, enc, dec, **given)


def test_restarting_positions_without_segment_ids_do_not_open_the_future():
  """The causal mask follows token order, not position values."""
  c = tiny(architecture='decoder_only', decoder_max_length=L)
  dec = tokens(1, L)
  model, params = init_params(c, dec)
  positions = jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2]])
  apply = jit_apply(model)
  a = apply({'params': params}, dec, None, positions)
  b = apply({'params': params}, dec.at[:, 6].set(7), None, positions)
  np.testing.assert_allclose(a[:, :6], b[:, :6], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('variant', ['random', 'fixed_random', 'factorized_random'])
def test_batch_shared_synthesizer_logits_train_on_a_padded_encoder_batch(variant):
  """A random synthesizer's logits are one (1, heads, q, k) array for the batch; under the padding
  mask of an unpacked encoder batch their gradient is the batch's sum (it was refused: the
  softmax's custom VJP returned the mask's batch)."""
  enc = jnp.concatenate([tokens(2, 5, seed=3), jnp.zeros((2, 3), jnp.int32)], 1)
  dec = tokens(2, 6)
  model, params = init_params(tiny(self_attention=variant), enc, dec)
  grads = jax.jit(jax.grad(lambda p: jnp.mean(model.apply({'params': p}, enc, dec) ** 2)))(params)
  assert all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))


@pytest.mark.parametrize('arch', ['encoder_decoder', 'encoder_only'])
def test_encoder_padding_does_not_change_outputs(arch):
  enc, dec = tokens(2, 5, seed=3), tokens(2, 6)
  rest = (dec,) if arch == 'encoder_decoder' else ()
  model, params = init_params(tiny(architecture=arch), enc, *rest)
  padded = jnp.concatenate([enc, jnp.zeros((2, 4), jnp.int32)], 1)
  apply = jit_apply(model)
  a, b = apply({'params': params}, padded, *rest), apply({'params': params}, enc, *rest)
  if arch == 'encoder_only':
    a = a[:, :5]
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_decoding_with_a_padded_encoder_input_equals_full_forward():
  c = tiny(decoder_max_length=L)
  enc = tokens(2, 7, seed=3).at[1, 4:].set(0)
  dec = tokens(2, L)
  model, params = init_params(c, enc, dec)
  np.testing.assert_allclose(_decode_stepwise(model, params, (enc,), dec),
                             jit_apply(model)({'params': params}, enc, dec), rtol=1e-4, atol=1e-4)


def test_a_prefill_given_positions_of_each_row_fills_the_cache_as_without_them():
  """The relative position bias of a prefill is built from token indices, as the full forward
  pass builds it: positions with a batch axis raised in add_shared_bias (a bias of batch 2)."""
  c = tiny(architecture='decoder_only', decoder_max_length=L)
  dec = tokens(2, L)
  model, params = init_params(c, dec)
  cache = model.init(jax.random.PRNGKey(1), dec, decode=True)['cache']
  prompt, lengths = tokens(2, 4), jnp.array([4, 4])
  fill = lambda positions: model.apply({'params': params, 'cache': cache}, prompt, None, positions,
                                       decode=True, prefill_lengths=lengths, mutable=['cache'])
  (with_positions, filled), (without, _) = fill(jnp.tile(jnp.arange(4)[None], (2, 1))), fill(None)
  np.testing.assert_allclose(np.asarray(with_positions), np.asarray(without), rtol=1e-6, atol=1e-6)
  assert filled['cache']


def test_a_cached_decode_step_takes_one_token():
  c = tiny(architecture='decoder_only', decoder_max_length=L)
  dec = tokens(2, L)
  model, params = init_params(c, dec)
  cache = model.init(jax.random.PRNGKey(1), dec, decode=True)['cache']
  with pytest.raises(ValueError, match='one token per step, got 2'):
    model.apply({'params': params, 'cache': cache}, dec[:, :2], decode=True, mutable=['cache'])


def _unstack_layers(tree, n):
  out = {}
  for k, v in tree.items():
    if k == 'layers':
      out.update({f'layers_{i}': jax.tree_util.tree_map(lambda a: a[i], v) for i in range(n)})
    else:
      out[k] = _unstack_layers(v, n) if isinstance(v, dict) else v
  return out


@pytest.mark.parametrize('arch', ['encoder_decoder', 'decoder_only', 'encoder_only'])
def test_scan_and_unrolled_give_the_same_outputs(arch):
  kw = dict(architecture=arch, num_encoder_layers=3, num_decoder_layers=3, placement='deepnorm',
            self_attention=('dense', 'dot_product'))
  inputs = [tokens(2, 6, seed=s) for s in range(2 if arch == 'encoder_decoder' else 1)]
  scanned, params = init_params(tiny(**kw), *inputs)
  unrolled, own = init_params(tiny(scan_layers=False, **kw), *inputs)
  converted = _unstack_layers(params, 3)
  assert jax.tree_util.tree_structure(converted) == jax.tree_util.tree_structure(own)
  assert count(converted) == count(own)
  np.testing.assert_allclose(jit_apply(unrolled)({'params': converted}, *inputs),
                             jit_apply(scanned)({'params': params}, *inputs), rtol=1e-5, atol=1e-5)


def _loss_and_grads(config, params, inputs):
  model = build_model(config)
  loss = lambda p: jnp.mean(jax.nn.log_softmax(model.apply({'params': p}, *inputs))[..., 3])
  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize('scan', [True, False])
def test_remat_leaves_values_and_gradients_unchanged(scan):
  inputs = (tokens(2, 6, seed=1), tokens(2, 6, seed=2))
  _, params = init_params(tiny(scan_layers=scan), *inputs)
  ref_loss, ref_grads = _loss_and_grads(tiny(scan_layers=scan), params, inputs)
  for policy in REMAT:
    loss, grads = _loss_and_grads(tiny(scan_layers=scan, remat=policy), params, inputs)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                           grads, ref_grads)


@pytest.mark.parametrize('policy, saved', [
    ('save_qkv_attention', {'query_proj', 'key_proj', 'value_proj', 'attention_out'}),
    ('save_attention_mlp', {'query_proj', 'key_proj', 'value_proj', 'attention_out', 'out_proj',
                            'mlp_hidden'}),
    ('full', set())])
def test_named_remat_policies_keep_what_they_name(policy, saved, capsys):
  """The residuals the backward pass keeps, by their checkpoint names: exactly the policy's."""
  inputs = (tokens(2, 6, seed=1), tokens(2, 6, seed=2))
  config = tiny(scan_layers=False, remat=policy)
  _, params = init_params(config, *inputs)
  model = build_model(config)
  capsys.readouterr()
  jax.ad_checkpoint.print_saved_residuals(lambda p: jnp.mean(model.apply({'params': p}, *inputs)), params)
  named = set(re.findall(r"named '(\w+)'", capsys.readouterr().out))
  assert named == saved


def test_auto_remat_is_full_on_a_gpu_in_bfloat16_and_none_elsewhere(monkeypatch, capsys):
  """'auto' by platform and dtype, and the stack applies what it resolves to for the platform
  being traced: no named residual kept when the platform is said to be a GPU."""
  assert tiny(dtype='bfloat16').remat_policy('gpu') == 'full'
  assert [tiny(dtype='bfloat16').remat_policy(p) for p in ('cpu', 'tpu')] == ['none', 'none']
  assert tiny().remat_policy('gpu') == 'none'  # float32
  assert tiny(dtype='bfloat16', remat='minimal').remat_policy('gpu') == 'minimal'
  inputs = (tokens(2, 6, seed=1), tokens(2, 6, seed=2))
  config = tiny(scan_layers=False, dtype='bfloat16', attention_kernel='xla')
  _, params = init_params(config, *inputs)
  model = build_model(config)

  def kept():
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(lambda p: jnp.mean(model.apply({'params': p}, *inputs)), params)
    return set(re.findall(r"named '(\w+)'", capsys.readouterr().out))
  monkeypatch.setattr(fused_attention, 'platform', lambda: 'cpu')  # also when the suite runs on a GPU
  assert kept()  # the CPU: 'none' keeps named residuals (the key and value projections among them)
  monkeypatch.setattr(fused_attention, 'platform', lambda: 'gpu')
  assert kept() == set()


def test_dropout_is_active_only_when_enabled():
  c = tiny(dropout_rate=0.3)
  inputs = (tokens(2, 6, seed=1), tokens(2, 6, seed=2))
  model, params = init_params(c, *inputs)
  apply = jit_apply(model)
  det = apply({'params': params}, *inputs)
  np.testing.assert_array_equal(det, apply({'params': params}, *inputs))
  drop = jax.jit(lambda p, k: model.apply({'params': p}, *inputs, enable_dropout=True,
                                          rngs={'dropout': k}))
  a, b = drop(params, jax.random.PRNGKey(0)), drop(params, jax.random.PRNGKey(1))
  assert not np.allclose(a, det) and not np.allclose(a, b)


@pytest.mark.parametrize('rate', ['dropout_rate', 'attention_dropout_rate', 'activation_dropout_rate'])
def test_each_dropout_rate_acts_on_its_own(rate):
  """Residual, attention-probability and FFN-activation dropout are separate rates (fairseq's
  dropout / attention_dropout / activation_dropout); each alone changes the output."""
  c = tiny(**{'dropout_rate': 0.0, 'attention_dropout_rate': 0.0, 'activation_dropout_rate': 0.0, rate: 0.5})
  assert c.uses_dropout and not tiny(attention_dropout_rate=0.0, activation_dropout_rate=0.0).uses_dropout
  inputs = (tokens(2, 6, seed=1), tokens(2, 6, seed=2))
  model, params = init_params(c, *inputs)
  det = jit_apply(model)({'params': params}, *inputs)
  drop = model.apply({'params': params}, *inputs, enable_dropout=True, rngs={'dropout': jax.random.PRNGKey(0)})
  assert not np.allclose(drop, det)


@pytest.mark.parametrize('broadcast', [True, False])
@pytest.mark.parametrize('rates', [(0.3, 0.0), (0.0, 0.3)], ids=['residual', 'attention'])
def test_dropout_is_shared_by_positions_or_per_element(broadcast, rates):
  """T5X broadcasts residual and activation dropout masks over the sequence axis, and the
  attention probabilities' over the queries; PyTorch draws one per element. With identical
  tokens and no position information every position computes the same thing, so only a
  per-element mask can make positions differ."""
  c = tiny(architecture='encoder_only', position_embedding='none', dropout_rate=rates[0],
           attention_dropout_rate=rates[1], dropout_broadcast=broadcast)
  ids = jnp.full((2, 6), 5, jnp.int32)
  model, params = init_params(c, ids)
  out = model.apply({'params': params}, ids, enable_dropout=True, rngs={'dropout': jax.random.PRNGKey(0)})
  same = np.allclose(out, out[:, :1], atol=1e-6)
  assert same == broadcast


@pytest.mark.parametrize('broadcast', [True, False])
def test_attention_dropout_draws_a_mask_per_example_over_batch_shared_probabilities(broadcast):
  """A random synthesizer's probabilities are one row for the whole batch (unpacked decoder-only
  rows: a causal mask of batch 1): their dropout mask was one for every example."""
  c = tiny(architecture='decoder_only', self_attention='random', dropout_rate=0.0,
           attention_dropout_rate=0.5, dropout_broadcast=broadcast)
  ids = jnp.tile(tokens(1, 6), (2, 1))  # two identical rows
  model, params = init_params(c, ids)
  out = model.apply({'params': params}, ids, enable_dropout=True, rngs={'dropout': jax.random.PRNGKey(0)})
  assert not np.allclose(out[0], out[1], atol=1e-6)


def test_bfloat16_output_logits_and_synthesizer_logits_are_float32():
  """Under bfloat16 compute the vocabulary projection multiplies bfloat16 operands (as T5X and
  MaxText: tests/test_precision.py) and its logits come out float32, for the loss's softmax."""
  inputs = (tokens(2, 6, seed=1), tokens(2, 6, seed=2))
  model, params = init_params(tiny(dtype='bfloat16'), *inputs)
  x = jnp.asarray(np.random.RandomState(0).randn(2, 3, 32), jnp.float32)
  logits = model.apply({'params': params}, x, method=lambda m, h: m.logits(h))
  assert logits.dtype == jnp.float32
  as_bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
  exact = as_bf16(x) @ as_bf16(params['logits_dense']['kernel'])  # bfloat16 operands, exact product
  np.testing.assert_allclose(logits, exact, rtol=2**-8, atol=1e-2 * np.abs(exact).max())
  from t5x_variants.layers.synthesizer import FactorizedRandomSynthesizer, RandomSynthesizer
  pos = jnp.arange(3)[None]
  for m in (RandomSynthesizer(2, 4), FactorizedRandomSynthesizer(2, 4, 2)):
    out, _ = m.init_with_output(jax.random.PRNGKey(0), x.astype(jnp.bfloat16), pos, pos)
    assert out.dtype == jnp.float32


def test_bfloat16_compute_keeps_float32_params_and_logits():
  inputs = (tokens(2, 6, seed=1), tokens(2, 6, seed=2))
  model32, params = init_params(tiny(), *inputs)
  model16, params16 = init_params(tiny(dtype='bfloat16'), *inputs)
  assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params16))
  out16 = jit_apply(model16)({'params': params}, *inputs)
  out32 = jit_apply(model32)({'params': params}, *inputs)
  assert out16.dtype == jnp.float32
  np.testing.assert_allclose(out16, out32, atol=0.1 * float(np.abs(out32).max()))


@pytest.mark.parametrize('scaled', [True, False])
def test_tied_logits_are_x_times_embedding_transpose_over_sqrt_d_or_not(scaled):
  """T5: x E^T / sqrt(d); fairseq / torchscale (scale_tied_logits=False): x E^T."""
  inputs = (tokens(1, 4, seed=1), tokens(1, 4, seed=2))
  model, params = init_params(tiny(tie_embeddings=True, scale_tied_logits=scaled), *inputs)
  assert 'logits_dense' not in params
  x = np.random.RandomState(0).randn(1, 3, 32).astype(np.float32)
  want = x @ np.asarray(params['token_embedder']['embedding']).T / (np.sqrt(32) if scaled else 1.0)
  np.testing.assert_allclose(model.apply({'params': params}, x, method=lambda m, h: m.logits(h)),
                             want, rtol=1e-5, atol=1e-5)


def test_deep_scanned_deepnorm_model_runs_forward_and_backward():
  """200 + 200 layers: scan compiles one layer body per stack."""
  c = tiny(d_model=16, num_heads=2, head_dim=8, d_ff=32, vocab_size=32, num_encoder_layers=200,
           num_decoder_layers=200, placement='deepnorm', init_scheme='xavier', norm='layernorm')
  inputs = (tokens(2, 8, vocab=32, seed=1), tokens(2, 8, vocab=32, seed=2))
  _, params = init_params(c, *inputs)
  assert params['encoder']['layers']['mlp']['wi']['kernel'].shape == (200, 16, 32)
  loss, grads = _loss_and_grads(c, params, inputs)
  assert np.isfinite(float(loss))
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))
  assert float(np.abs(np.asarray(grads['encoder']['layers']['mlp']['wi']['kernel'][0])).sum()) > 0


def test_a_list_given_for_a_tuple_field_becomes_the_tuple():
  """gin gives ['random', 'dot_product'] as a list: the frozen config stayed unhashable (a static
  argument of jit, a field of a Flax module) and unequal to the same mixture given as a tuple."""
  given = tiny(self_attention=['random', 'dot_product'], ffn=['relu'])
  assert given == tiny(self_attention=('random', 'dot_product'), ffn=('relu',))
  assert hash(given) == hash(tiny(self_attention=('random', 'dot_product'), ffn=('relu',)))
