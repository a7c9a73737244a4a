"""The fused attention path (layers/fused_attention.py) computes what the reference path does.

On a CPU the cuDNN path runs through jax.nn.dot_product_attention's own XLA implementation
(``IMPLEMENTATIONS`` patched), which checks everything but the kernel: the masks as sequence
lengths and a causal flag, the bias, the scale, cached decoding, the fallbacks. In bfloat16 the
call and the model are held to their distance from float32: cuDNN itself on a GPU, the XLA
implementation on a CPU. The TPU Pallas kernels themselves run on a CPU in Pallas' TPU interpret
mode (a simulation of the TPU program, slow: tiny shapes), alone and per device under shard_map
on a mesh; compiled for a v5p slice its HLO holds the kernel.
"""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from conftest import HOST_DEVICES, ON_GPU, TINY, init_params, tiny, tokens, tpu_interpreter
from t5x_variants.layers import fused_attention, row_attention
from t5x_variants.models import build_model
from t5x_variants.train.decoding import decode


@pytest.fixture
def jax_xla_kernel(monkeypatch):
  """'cudnn' served by jax.nn.dot_product_attention's XLA implementation (runs on a CPU)."""
  monkeypatch.setattr(fused_attention, 'IMPLEMENTATIONS', {**fused_attention.IMPLEMENTATIONS, 'cudnn': 'xla'})
  monkeypatch.setattr(fused_attention, '_warned', set())


@pytest.fixture
def tpu_interpret(monkeypatch):
  """'pallas' as on a TPU: the platform said to be a TPU, the kernel run by the TPU interpreter
  (on the CPU only: conftest's ``tpu_interpreter``)."""
  if ON_GPU:
    pytest.skip(tpu_interpreter.kwargs['reason'])
  monkeypatch.setattr(fused_attention, 'platform', lambda: 'tpu')
  monkeypatch.setattr(fused_attention, '_warned', set())
  with pltpu.force_tpu_interpret_mode():
    yield


def padded_batch(arch):
  """Inputs with padding at the end of two rows (never a whole row), all target positions
  weighted."""
  enc = np.array(tokens(3, 12))
  enc[0, 7:] = 0
  enc[1, 3:] = 0
  dec = np.array(tokens(3, 8, seed=1))
  dec[:, 0] = 0  # the decoder's start token
  inputs = {'encoder_decoder': (enc, dec), 'decoder_only': (dec,), 'encoder_only': (enc,)}[arch]
  valid = (enc > 0) if arch == 'encoder_only' else np.ones(dec.shape, bool)
  return inputs, valid


def logits_and_gradients(inputs, valid, runs, **config):
  """For each (kernel, dtype) of ``runs``: logits at valid positions (others zeroed) and the
  gradient of a loss over them (their sum against a fixed random cotangent), all for the same
  parameters (initialized by the reference path: an init through the kernel would run the
  kernel too, minutes in TPU interpret mode)."""
  _, params = init_params(tiny(attention_kernel='xla', **config), *inputs)
  w = jnp.asarray(valid, jnp.float32)[..., None]
  cotangent = jnp.asarray(np.random.RandomState(0).normal(size=valid.shape + (TINY['vocab_size'],)),
                          jnp.float32)

  def run(kernel, dtype):
    model = build_model(tiny(**{**config, 'attention_kernel': kernel, 'dtype': dtype}))
    f = lambda p: model.apply({'params': p}, *inputs) * w
    loss = lambda p: jnp.sum(f(p).astype(jnp.float32) * cotangent)
    return jax.jit(lambda p: (f(p), jax.grad(loss)(p)))(params)
  return [run(*r) for r in runs]


def reference_and_kernel(kernel, inputs, valid, **config):
  return logits_and_gradients(inputs, valid, [('xla', 'float32'), (kernel, 'float32')], **config)


def assert_close(ref, got, rtol, atol):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree_util.tree_leaves(got)):
    np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=rtol,
                               atol=atol, err_msg=jax.tree_util.keystr(path))


def relative_error(x, exact):
  exact = np.asarray(exact, np.float32)
  return np.linalg.norm(np.asarray(x, np.float32) - exact) / max(np.linalg.norm(exact), 1e-30)


def assert_as_accurate_in_bfloat16(kernel, inputs, valid, **config):
  """The model through the kernel in bfloat16 is about as far from the float32 reference path as
  the reference path in bfloat16 is: per leaf (logits, every gradient), the relative error
  ||x - exact|| / ||exact|| at most 3 times the reference's, or 2%. A tiny model's bfloat16
  gradients are 1-6% from float32 in this norm on either path (on a CPU the two paths' errors
  are within 2.4x of each other), and single elements of a gradient differ by tens of percent
  between two bfloat16 computations that are both right (seen on an H200): element-wise
  tolerances do not fit. The kernel's own accuracy is the next test's."""
  exact, ref, got = logits_and_gradients(
      inputs, valid, [('xla', 'float32'), ('xla', 'bfloat16'), (kernel, 'bfloat16')], **config)
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree_util.tree_leaves(got))
  for (path, e), r, g in zip(jax.tree_util.tree_leaves_with_path(exact), jax.tree_util.tree_leaves(ref),
                             jax.tree_util.tree_leaves(got)):
    err_g, err_r = relative_error(g, e), relative_error(r, e)
    assert err_g <= max(3 * err_r, 2e-2), f'{jax.tree_util.keystr(path)}: {kernel} {err_g:.2e}, reference {err_r:.2e}'


@pytest.mark.parametrize('arch', ['encoder_decoder', 'decoder_only', 'encoder_only'])
def test_fused_path_equals_the_reference_path(arch, jax_xla_kernel):
  """Encoder self-attention with padding as lengths, causal decoder self-attention, and
  cross-attention over padded keys, with T5's relative position bias and its gradient: logits
  and every parameter's gradient (the bias table's included) agree."""
  inputs, valid = padded_batch(arch)
  ref, got = reference_and_kernel('cudnn', inputs, valid, architecture=arch)
  assert_close(ref, got, rtol=1e-4, atol=1e-5)


def test_fused_path_is_taken_and_the_reference_mask_is_not_computed(jax_xla_kernel):
  """The fused path's HLO has no (batch, heads, q, k) boolean mask select with -1e10 in float32
  logits from the reference path's masked softmax."""
  inputs, valid = padded_batch('encoder_decoder')
  texts = {}
  for kernel in ('xla', 'cudnn'):
    model, params = init_params(tiny(attention_kernel=kernel), *inputs)
    texts[kernel] = jax.jit(lambda p: model.apply({'params': p}, *inputs)).lower(params).as_text()
  assert '-1.000000e+10' in texts['xla'] and '-1.000000e+10' not in texts['cudnn']


def test_packed_rows_and_synthesizers_take_the_reference_path_with_a_reason(jax_xla_kernel):
  enc, dec = tokens(2, 12), tokens(2, 8, seed=1)
  seg_e = jnp.asarray([[1] * 6 + [2] * 6] * 2)
  seg_d = jnp.asarray([[1] * 4 + [2] * 4] * 2)
  packed = (enc, dec, seg_e, seg_d)
  ref_model, params = init_params(tiny(attention_kernel='xla'), *packed)
  with pytest.warns(UserWarning, match='decoder/layers/encoder_decoder_attention: packed segments'):
    model, _ = init_params(tiny(attention_kernel='cudnn'), *packed)
  np.testing.assert_array_equal(model.apply({'params': params}, *packed),
                                ref_model.apply({'params': params}, *packed))
  with pytest.warns(UserWarning, match='synthesizer logits'):
    init_params(tiny(attention_kernel='cudnn', self_attention=('dense', 'dot_product')), enc, dec)


@pytest.fixture(params=['rows', 'flash'])
def tpu_kernel(request, monkeypatch, tpu_interpret):
  """Each TPU kernel: the whole-row kernel (layers/row_attention.py, what T5's lengths get) and
  JAX's flash attention (what rows too long for it get; here by a row budget of 0)."""
  if request.param == 'flash':
    monkeypatch.setattr(row_attention, 'MAX_ROW_ELEMENTS', 0)
  return request.param


def test_pallas_kernels_equal_the_reference_path(tpu_kernel):
  """The TPU kernels themselves (interpreted): encoder self-attention with padding as lengths,
  causal decoder self-attention, cross-attention over padded keys, lengths 12 and 8 padded to
  the 128-tile; logits and every gradient, the relative bias table's included (summed over the
  batch inside the row kernel; broadcast over it for JAX's kernel and summed back)."""
  inputs, valid = padded_batch('encoder_decoder')
  ref, got = reference_and_kernel('pallas', inputs, valid)
  assert_close(ref, got, rtol=1e-4, atol=1e-5)


def packed_batch(arch):
  """Two examples packed per row with padding after them (segment ids 1, 2, then 0), positions
  restarting at each example, every target position of an example weighted."""
  enc_seg = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 8 + [2] * 4, [1] * 3 + [2] * 3 + [0] * 6])
  dec_seg = np.array([[1] * 4 + [2] * 3 + [0], [1] * 5 + [2] * 3, [1] * 2 + [2] * 2 + [0] * 4])
  enc = np.where(enc_seg > 0, np.array(tokens(3, 12)), 0)
  dec = np.where(dec_seg > 0, np.array(tokens(3, 8, seed=1)), 0)
  positions = lambda seg: np.stack([np.concatenate([np.arange(np.sum(r == s)) for s in (1, 2, 0)])
                                    for r in seg])
  dec[positions(dec_seg) == 0] = 0  # each example's decoder starts with the start token
  inputs = {'encoder_decoder': (enc, dec, enc_seg, dec_seg, positions(enc_seg), positions(dec_seg)),
            'decoder_only': (dec, dec_seg, positions(dec_seg)),
            'encoder_only': (enc, enc_seg, positions(enc_seg))}[arch]
  return tuple(jnp.asarray(x, jnp.int32) for x in inputs), (enc_seg if arch == 'encoder_only' else dec_seg) > 0


@pytest.mark.filterwarnings('error:attention_kernel')  # a fallback to the reference path fails it
@pytest.mark.parametrize('arch', ['encoder_decoder', 'decoder_only', 'encoder_only'])
def test_packed_rows_through_the_tpu_kernels_equal_the_reference_path(arch, tpu_kernel):
  """Packed rows reach each TPU kernel as segment ids (a query sees its own example's keys,
  causally in the decoder; cross-attention the encoder tokens of its example), T5's relative bias
  by index (equal to by position wherever a query sees a key): logits at every example token
  and every gradient agree with the reference path's segment mask (interpreted)."""
  inputs, valid = packed_batch(arch)
  ref, got = reference_and_kernel('pallas', inputs, valid, architecture=arch)
  assert_close(ref, got, rtol=1e-4, atol=1e-5)


def test_a_packed_example_without_inputs_gets_zeros_from_the_tpu_kernels(tpu_kernel):
  """Packed cross-attention where a decoder segment has no encoder tokens (an example with empty
  inputs): its queries come out as zeros, as an unpacked example's with no valid key (they got
  softmax over the row's padded tile: its keys' mean times 12/128); the other queries as the
  reference's."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, n, 2, 8)), jnp.float32) for n in (6, 12, 12))
  q_segments = np.asarray([[1, 1, 2, 2, 3, 3]])
  segments = fused_attention.cross_segments(jnp.asarray(q_segments),
                                            jnp.asarray([[1] * 5 + [3] * 4 + [0] * 3]))  # no 2
  out = np.asarray(fused_attention.attend(q, k, v, lengths=segments, implementation='pallas'))
  assert not out[0, 2:4].any()
  mask = q_segments[0, :, None] == np.asarray(segments.k)[0, None, :]
  logits = np.where(mask[None], np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(8), -1e30)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  want = np.einsum('bhqk,bkhd->bqhd', p / p.sum(-1, keepdims=True), v)
  keep = [0, 1, 4, 5]
  np.testing.assert_allclose(out[:, keep], want[:, keep], rtol=1e-5, atol=1e-6)


def test_the_cross_attention_of_a_packed_example_without_inputs_gets_segment_0(monkeypatch):
  """The encoder-decoder hands the TPU kernels cross-attention ``Segments`` in which a decoder
  example with no encoder tokens has segment 0 (its queries then come out as zeros, the test
  above), and self-attention the segment ids as they are."""
  monkeypatch.setattr(fused_attention, 'platform', lambda: 'tpu')
  calls = []
  monkeypatch.setattr(fused_attention, 'attend', lambda q, k, v, bias, lengths, *a: (
      calls.append(lengths), jnp.zeros_like(q))[1])
  enc_seg = np.array([[1] * 6 + [3] * 4 + [0] * 2])  # example 2 has no inputs
  dec_seg = np.array([[1] * 3 + [2] * 3 + [3] * 2])
  enc, dec = (np.where(seg > 0, np.array(tokens(1, seg.shape[1])), 0) for seg in (enc_seg, dec_seg))
  packed = tuple(jnp.asarray(x) for x in (enc, dec, enc_seg, dec_seg))
  _, params = init_params(tiny(attention_kernel='xla', scan_layers=False), *packed)
  build_model(tiny(attention_kernel='pallas', scan_layers=False)).apply({'params': params}, *packed)
  assert len(calls) == 3 * 2  # per layer: the encoder's self, the decoder's self and cross
  crosses = [s for s in calls if s.k.shape != s.q.shape]
  assert len(crosses) == 2
  for segments in crosses:
    np.testing.assert_array_equal(segments.q, [[1] * 3 + [0] * 3 + [3] * 2])
  for segments in calls:
    if segments.k.shape == segments.q.shape:
      assert (np.asarray(segments.q) > 0).sum() in (8, 10)


PALLAS_ON_A_MESH = """
import os, sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash
from jax.sharding import NamedSharding, PartitionSpec as P
from conftest import init_params, tiny, tokens
from t5x_variants.layers import fused_attention, row_attention
from t5x_variants.models import build_model
from t5x_variants.train import partitioning
fused_attention.platform = lambda: 'tpu'
calls = []
def counted(module, name):
  kernel = getattr(module, name)
  setattr(module, name, lambda q, *a, **k: calls.append((name, q.shape)) or kernel(q, *a, **k))
counted(tpu_flash, 'flash_attention')
counted(row_attention, 'attention')
enc, dec = np.array(tokens(4, 12)), np.array(tokens(4, 8, seed=1))
enc[1, 5:] = 0
_, params = init_params(tiny(attention_kernel='xla'), enc, dec)
def grads(kernel, mesh):
  model = build_model(tiny(attention_kernel=kernel))
  calls.clear()
  f = lambda p, e, d: jnp.sum(jnp.sin(model.apply({'params': p}, e, d)))
  rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))
  return partitioning.jit(jax.value_and_grad(f), mesh, in_shardings=(rep, rows, rows))(params, enc, dec)
ref = grads('xla', partitioning.make_mesh(devices=jax.devices()[:1]))
seen = []
for row_budget in (row_attention.MAX_ROW_ELEMENTS, 0):  # the row kernel, then JAX's flash kernel
  row_attention.MAX_ROW_ELEMENTS = row_budget
  with pltpu.force_tpu_interpret_mode():
    got = grads('pallas', partitioning.make_mesh(data=2, model=2, devices=jax.devices()[:4]))
  for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
  seen += sorted(set(calls))
print(seen)
"""


@pytest.mark.slow
def test_pallas_kernel_per_device_on_a_mesh_equals_one_device():
  """On a data=2 x model=2 mesh (partitioning.jit) each TPU kernel (the row kernel, then JAX's
  flash kernel) runs under shard_map on each device's 2 rows and 2 of the 4 heads, and the loss
  and every gradient equal the reference path on one device: the bias gradient is summed over
  the devices that split the batch."""
  env = {**os.environ, **HOST_DEVICES}
  out = subprocess.run([sys.executable, '-c', PALLAS_ON_A_MESH, os.path.dirname(__file__)],
                       capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  # (rows per device, heads per device, length padded to the tile, head_dim)
  assert out.stdout.split('\n')[-2] == (
      "[('attention', (2, 2, 128, 8)), ('flash_attention', (2, 2, 128, 8))]")


def test_kernel_choice_and_limits(monkeypatch):
  why = dict(components=('dot_product',), dtype=jnp.bfloat16, head_dim=64, lengths=(None, None),
             dropout=False)
  assert fused_attention.choose('xla', 'here', 512, 512, True, **why) is None
  assert fused_attention.choose('auto', 'here', 1, 512, True, **why) is None  # a decode step: reference
  if ON_GPU:
    assert fused_attention.choose('auto', 'here', 512, 512, True, **why) == 'cudnn'
  else:
    assert fused_attention.choose('auto', 'here', 512, 512, True, **why) is None  # silently the reference
    with pytest.raises(ValueError, match="'cudnn' needs a GPU; the step is compiled for cpu"):
      fused_attention.choose('cudnn', 'here', 512, 512, True, **why)
    with pytest.raises(ValueError, match="'pallas' needs a TPU"):
      fused_attention.choose('pallas', 'here', 512, 512, True, **why)
  monkeypatch.setattr(fused_attention, 'platform', lambda: 'tpu')
  monkeypatch.setattr(fused_attention, '_warned', set())
  assert fused_attention.choose('auto', 'here', 512, 512, True, **why) == 'pallas'
  assert fused_attention.choose('auto', 'here', 1, 512, True, **why) is None
  with pytest.warns(UserWarning, match='here: a single query'):
    assert fused_attention.choose('pallas', 'here', 1, 512, True, **why) is None
  plain = dict(components=('dot_product',), lengths=(None, None), dropout=False, implementation='cudnn')
  assert fused_attention.unsupported(**plain) is None
  assert 'dropout' in fused_attention.unsupported(**{**plain, 'dropout': True})
  packed = {**plain, 'lengths': fused_attention.Segments(jnp.ones((2, 8)), jnp.ones((2, 8)))}
  assert 'packed segments' in fused_attention.unsupported(**packed)
  assert fused_attention.unsupported(**{**packed, 'implementation': 'pallas'}) is None
  assert fused_attention.cudnn_unsupported(jnp.bfloat16, 64, 512, 512, True) is None
  # JAX's flash kernel (rows past the row kernel's budget) takes head_dim <= 128 or k * 128: 192
  # failed to compile under 'auto' instead of taking the reference path
  assert 'head_dim 192' in fused_attention.pallas_unsupported(jnp.bfloat16, 192, 1024, 1024, True)
  assert fused_attention.pallas_unsupported(jnp.bfloat16, 192, 512, 512, True) is None  # row kernel
  assert fused_attention.pallas_unsupported(jnp.bfloat16, 256, 1024, 1024, True) is None
  q = jnp.ones((2, 4, 1, 8))
  with pytest.raises(ValueError, match=r'bias of shape \(2, 1, 4, 4\): one \(1, heads, q, k\)'):
    fused_attention.attend(q, q, q, bias=jnp.ones((2, 1, 4, 4)), implementation='pallas')
  assert '16-bit' in fused_attention.cudnn_unsupported(jnp.float32, 64, 512, 512, True)
  assert 'head_dim 12' in fused_attention.cudnn_unsupported(jnp.bfloat16, 12, 512, 512, True)
  # cuDNN's training kernel refuses an odd length (jax's check_is_flash_attention), with a bias
  # and without one (jax then passes a placeholder bias, which its check counts as one: a
  # cross-attention of 127 targets x 128 inputs failed on a GPU); a decode step is forward only.
  assert 'even lengths' in fused_attention.cudnn_unsupported(jnp.bfloat16, 64, 113, 512, True)
  assert 'even lengths' in fused_attention.cudnn_unsupported(jnp.bfloat16, 64, 512, 113, True)
  assert 'even lengths' in fused_attention.cudnn_unsupported(jnp.bfloat16, 64, 127, 128, False)
  assert fused_attention.cudnn_unsupported(jnp.bfloat16, 64, 114, 512, False) is None
  assert fused_attention.cudnn_unsupported(jnp.bfloat16, 64, 1, 113, True) is None
  monkeypatch.setattr(fused_attention, 'platform', lambda: 'gpu')
  assert fused_attention.choose('auto', 'here', 114, 512, True, **why) == 'cudnn'
  assert fused_attention.choose('auto', 'here', 113, 512, True, **why) is None
  with pytest.raises(ValueError, match="unknown attention_kernel 'flash'"):
    tiny(attention_kernel='flash')


@pytest.mark.parametrize('arch', ['encoder_decoder', 'decoder_only'])
def test_cached_decoding_through_the_fused_path(arch, jax_xla_kernel):
  """Greedy decoding with a cache (one query against the cache's keys as key lengths, and
  cross-attention over padded encoder keys) gives the reference path's tokens and scores."""
  enc = np.array(tokens(2, 12))
  enc[1, 5:] = 0
  prompt = np.array(tokens(2, 3, seed=2))
  inputs = (enc, tokens(2, 8)) if arch == 'encoder_decoder' else (tokens(2, 8),)
  kw = dict(encoder_input_tokens=enc) if arch == 'encoder_decoder' else dict(prompt_tokens=prompt)
  out = {}
  for kernel in ('xla', 'cudnn'):
    config = tiny(architecture=arch, attention_kernel=kernel)
    model, params = init_params(config, *inputs)
    out[kernel] = decode(model, config, params, max_decode_length=8, **kw)
  np.testing.assert_array_equal(out['cudnn'][0], out['xla'][0])
  np.testing.assert_allclose(out['cudnn'][1], out['xla'][1], rtol=1e-5)


@pytest.fixture
def bfloat16_kernel(request):
  """'cudnn' as it runs: cuDNN itself on a GPU; on a CPU JAX's XLA implementation of the same
  call (the masks, bias and scale as passed to cuDNN, held to the same accuracy)."""
  if not ON_GPU:
    request.getfixturevalue('jax_xla_kernel')
  return 'cudnn'


@pytest.mark.parametrize('arch', ['encoder_decoder', 'decoder_only', 'encoder_only'])
def test_cudnn_in_bfloat16_is_as_accurate_as_the_reference_path(arch, bfloat16_kernel):
  """bfloat16 compute (the bias enters the kernel in bfloat16, the reference adds it in
  float32), both measured against the float32 reference path."""
  inputs, valid = padded_batch(arch)
  assert_as_accurate_in_bfloat16(bfloat16_kernel, inputs, valid, architecture=arch, head_dim=16,
                                 num_heads=2)


@pytest.mark.parametrize('causal,keys', [(False, 128), (True, 128), (False, 96)])
def test_the_cudnn_call_in_bfloat16_is_float32_attention_rounded(causal, keys, bfloat16_kernel):
  """fused_attention.attend itself at T5's head size (64), with a (1, heads, q, k) bias, padding
  as lengths (one row of length 0) and a causal mask: the outputs and the gradients of q, k, v
  and the bias within 1% (relative norm) of the same call in float32 on the same bfloat16
  inputs, so that only the kernel's arithmetic differs (bfloat16 keeps 8 bits: 0.4%)."""
  rng = np.random.default_rng(0)
  b, n, h, d = 4, 128, 4, 64
  bf16 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, k, v, bias = bf16(b, n, h, d), bf16(b, keys, h, d), bf16(b, keys, h, d), bf16(1, h, n, keys)
  cotangent = jnp.asarray(rng.normal(size=(b, n, h, d)), jnp.float32)
  q_lengths = jnp.array([n, 100, 7, 0])
  lengths = (q_lengths, q_lengths if causal else jnp.array([keys, 90, 7, 0]))

  def outputs_and_gradients(implementation, dtype):
    f = lambda *x: fused_attention.attend(*(y.astype(dtype) for y in x), lengths=lengths,
                                          causal=causal, implementation=implementation)
    loss = lambda *x: jnp.sum(f(*x).astype(jnp.float32) * cotangent)
    return jax.jit(lambda *x: (f(*x), *jax.grad(loss, (0, 1, 2, 3))(*x)))(q, k, v, bias)

  exact = outputs_and_gradients('xla', jnp.float32)
  got = outputs_and_gradients(fused_attention.IMPLEMENTATIONS[bfloat16_kernel], jnp.bfloat16)
  for name, g, e in zip(('out', 'dq', 'dk', 'dv', 'dbias'), got, exact):
    assert np.isfinite(np.asarray(g, np.float32)).all(), name
    assert relative_error(g, e) <= 1e-2, f'{name}: {relative_error(g, e):.2e}'


def test_queries_with_no_valid_key_come_out_as_zeros(bfloat16_kernel):
  """Cross-attention of an example whose inputs are all padding (key length 0, query length 8):
  zero outputs and nothing of its gradient in q, k, v or the shared bias (the other example's
  bias gradient alone, to bfloat16 rounding), where softmax over no keys is otherwise left to
  the kernel."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, n, 2, 64)), jnp.bfloat16) for n in (8, 16, 16))
  bias = jnp.asarray(rng.normal(size=(1, 2, 8, 16)), jnp.bfloat16)
  cotangent = jnp.asarray(rng.normal(size=(2, 8, 2, 64)), jnp.float32)

  implementation = fused_attention.IMPLEMENTATIONS[bfloat16_kernel]

  def outputs_and_gradients(*x, k_lengths):
    f = lambda *x: fused_attention.attend(*x, lengths=(None, k_lengths), implementation=implementation)
    loss = lambda *x: jnp.sum(f(*x).astype(jnp.float32) * cotangent[:len(x[0])])
    return jax.jit(lambda *x: (f(*x), *jax.grad(loss, (0, 1, 2, 3))(*x)))(*x)

  out, dq, dk, dv, dbias = outputs_and_gradients(q, k, v, bias, k_lengths=jnp.array([16, 0]))
  for name, x in (('out', out), ('dq', dq), ('dk', dk), ('dv', dv)):
    assert not np.asarray(x[1], np.float32).any(), name
  alone = outputs_and_gradients(q[:1], k[:1], v[:1], bias, k_lengths=jnp.array([16]))
  assert relative_error(dbias, alone[-1]) <= 1e-2  # a kernel may sum the batch in another order


def test_cudnn_with_an_all_padding_row_stays_finite(bfloat16_kernel):
  """A row with no valid input (zero query and key lengths), as in a padded eval batch: finite
  logits and gradients, and the other rows as accurate as the reference path's."""
  enc, dec = np.array(tokens(2, 12)), np.array(tokens(2, 8, seed=1))
  enc[1] = 0
  valid = np.array([[True] * 8, [False] * 8])
  assert_as_accurate_in_bfloat16(bfloat16_kernel, (enc, dec), valid, head_dim=16, num_heads=2)


# A decoder-only model's prompts of 5 tokens (one row 2), decoded to 9: its prefill is 6 queries
# (token 0, then the prompt) against a cache of 14 keys (even lengths, as cuDNN's kernel takes),
# causal, with key lengths.
PROMPTS = np.array([[5, 6, 7, 8, 11], [9, 10, 0, 0, 0]])


def cached_decoding(arch, kernel):
  """(tokens, scores) of greedy cached decoding of a bfloat16 model of ``arch``."""
  config = tiny(architecture=arch, attention_kernel=kernel, dtype='bfloat16', head_dim=16,
                num_heads=2)
  if arch == 'decoder_only':
    model, params = init_params(config, tokens(2, 8))
    return decode(model, config, params, max_decode_length=9, prompt_tokens=PROMPTS)
  enc = np.array(tokens(2, 12))
  enc[1, 5:] = 0
  model, params = init_params(config, enc, tokens(2, 8))
  return decode(model, config, params, max_decode_length=8, encoder_input_tokens=enc)


@pytest.mark.parametrize('kernel, fused', [('auto', {(6, 14)}), ('cudnn', {(6, 14), (1, 14)})])
def test_a_decoder_only_prefill_goes_through_cudnn_on_a_gpu(kernel, fused, monkeypatch,
                                                            jax_xla_kernel):
  """So that the GPU test below covers it: on a GPU the prompts' prefill (several queries against
  the cache's keys) is sent to cuDNN, under 'auto' and 'cudnn'; each decode step (one query)
  under 'cudnn' (under 'auto' the reference path takes it)."""
  if ON_GPU:
    pytest.skip('the routing as on a GPU, checked on the CPU')
  monkeypatch.setattr(fused_attention, 'platform', lambda: 'gpu')
  chosen, real = [], fused_attention.choose
  monkeypatch.setattr(fused_attention, 'choose', lambda kernel, where, queries, keys, *a, **k: (
      chosen.append((queries, keys, real(kernel, where, queries, keys, *a, **k))) or chosen[-1][2]))
  cached_decoding('decoder_only', kernel)
  assert fused <= {(q, k) for q, k, implementation in chosen if implementation}, set(chosen)


@pytest.mark.skipif(not ON_GPU, reason='cuDNN attention needs an NVIDIA GPU')
@pytest.mark.parametrize('arch', ['encoder_decoder', 'decoder_only'])
def test_cudnn_cached_decoding_on_a_gpu(arch):
  """cuDNN's causal mask with fewer queries than keys (the prefill) aligned as the reference
  path's, top-left; one query per step with key lengths; cross-attention over padded inputs."""
  out = {kernel: cached_decoding(arch, kernel) for kernel in ('xla', 'cudnn')}
  np.testing.assert_allclose(out['cudnn'][1], out['xla'][1], rtol=2e-2, atol=2e-2)
