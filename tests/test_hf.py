"""transformers T5 <-> ours (t5xv-import / t5xv-export) on tiny random models: logits equal on the
same padded tokens, greedy decoding equal to ``generate``, export -> import the identity, and one
refusal per variant axis transformers' T5 lacks."""
import json
import os
import subprocess
import sys

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from conftest import jit_apply, needs_data_layer, tiny
from t5x_variants.cli import hf as hf_cli
from t5x_variants.layers.position import relative_position_bucket
from t5x_variants.models import build_model, hf_t5
from t5x_variants.models.config import TransformerConfig
from t5x_variants.train import checkpoints, pretrained
from t5x_variants.train.decoding import decode

D_KV = 16  # sqrt(16) = 4: the attention scale multiplies and divides exactly
# An epsilon far from the 1e-6 default, so that one dropped on import or export changes logits.
HF_TINY = dict(vocab_size=64, d_model=32, d_kv=D_KV, d_ff=48, num_layers=2, num_decoder_layers=3,
               num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
               dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
               layer_norm_epsilon=1e-2)
# Encoder inputs with padding (0) and decoder inputs (0 first: the start token).
INPUTS = np.array([[5, 9, 23, 7, 1, 0, 0], [11, 12, 13, 14, 15, 16, 1], [40, 1, 0, 0, 0, 0, 0]])
DECODER = np.array([[0, 8, 9, 10, 3], [0, 30, 31, 1, 0], [0, 2, 60, 61, 62]])
FFNS = ['relu', 'gelu', 'swish', 'glu', 'bilinear', 'reglu', 'geglu', 'swiglu']


@pytest.mark.parametrize('bidirectional', [True, False])
def test_relative_position_buckets_are_transformers(bidirectional):
  """Every relative position in [-4096, 4096] falls in transformers' bucket, for bucket counts and
  max distances around T5's (32, 128), at exact log boundaries too (128 buckets, max distance 100:
  80 / 64 = sqrt(100 / 64))."""
  rel = np.arange(-4096, 4097)
  for num_buckets in (8, 32, 128):
    for max_distance in (16, 100, 128, 200, 2048):
      if max_distance <= num_buckets // 2:
        continue
      theirs = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(  # pylint: disable=protected-access
          torch.tensor(rel), bidirectional=bidirectional, num_buckets=num_buckets,
          max_distance=max_distance).numpy()
      ours = jax.jit(lambda r, nb=num_buckets, md=max_distance: relative_position_bucket(
          r, bidirectional, nb, md))(jnp.asarray(rel))
      np.testing.assert_array_equal(np.asarray(ours), theirs, err_msg=f'{num_buckets}, {max_distance}')


def hf_model(tmp_path, ffn='relu', tied=True, seed=0, **kw):
  """A random transformers T5 saved to ``tmp_path``/hf (with a stand-in spiece.model)."""
  torch.manual_seed(seed)
  config = transformers.T5Config(**{**HF_TINY, **kw},
                                 feed_forward_proj=hf_t5.feed_forward_proj(
                                     TransformerConfig(ffn=ffn).activations),
                                 tie_word_embeddings=tied)
  model = transformers.T5ForConditionalGeneration(config).eval()
  if not tied:  # transformers 5 ties lm_head at construction; T5 v1.1 has its own
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.05)
  with torch.no_grad():  # random norms and relative biases, so that every weight is tested
    for name, p in model.named_parameters():
      if 'layer_norm' in name or 'relative_attention_bias' in name:
        p.copy_(torch.rand_like(p) + 0.5)
  path = tmp_path / 'hf'
  model.save_pretrained(path)
  (path / 'spiece.model').write_bytes(b'stand-in sentencepiece model')
  return model, path


def hf_logits(model, inputs=INPUTS, decoder=DECODER):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(inputs), attention_mask=torch.tensor(inputs != 0),
                decoder_input_ids=torch.tensor(decoder))
  return out.logits.numpy()


def our_logits(run_dir, inputs=INPUTS, decoder=DECODER):
  config = run_config(run_dir)
  params = pretrained.read_on_host(str(run_dir))
  return np.asarray(jit_apply(build_model(config))({'params': params}, jnp.asarray(inputs),
                                                   jnp.asarray(decoder))), config, params


def run_config(run_dir):
  from t5x_variants.cli import recipe  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  recipe.parse_gin([str(run_dir / 'config.gin')], [], skip_unknown=True)
  return recipe.build_config()


def assert_logits_close(ours, theirs):
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())


@pytest.mark.parametrize('ffn,tied', [('relu', True), ('geglu', False)] +
                         [(f, False) for f in FFNS if f not in ('relu', 'geglu')])
def test_import_then_export_give_transformers_logits(ffn, tied, tmp_path):
  """T5 v1.0 (ReLU, tied) and v1.1 (GEGLU, untied), and every other FFN: HF -> import -> our
  logits = transformers' on padded inputs; ours -> export -> transformers' logits = ours; and
  export -> import leaves every parameter as it was."""
  model, hf_dir = hf_model(tmp_path, ffn, tied)
  config = hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'run'))
  assert (config.ffn, config.tie_embeddings, config.scan_layers) == (ffn, tied, True)
  ours, config, params = our_logits(tmp_path / 'run')
  assert_logits_close(ours, hf_logits(model))
  assert (tmp_path / 'run' / 'vocab.model').read_bytes() == b'stand-in sentencepiece model'

  hf_cli.export_checkpoint(str(tmp_path / 'run'), str(tmp_path / 'out'))
  assert (tmp_path / 'out' / 'spiece.model').exists()
  exported = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / 'out').eval()
  assert_logits_close(hf_logits(exported), ours)
  written = json.loads((tmp_path / 'out' / 'config.json').read_text())  # what logits cannot show
  assert {k: written[k] for k in ('decoder_start_token_id', 'eos_token_id', 'pad_token_id',
                                  'dropout_rate', 'layer_norm_epsilon')} == {
      k: HF_TINY[k] for k in ('decoder_start_token_id', 'eos_token_id', 'pad_token_id',
                              'dropout_rate', 'layer_norm_epsilon')}
  hf_cli.import_checkpoint(str(tmp_path / 'out'), str(tmp_path / 'again'))
  again = pretrained.read_on_host(str(tmp_path / 'again'))
  jax.tree_util.tree_map(np.testing.assert_array_equal, again, params)
  assert {x.dtype for x in jax.tree_util.tree_leaves(again)} == {np.dtype(np.float32)}  # not float64
  if ffn == 'relu':  # --params_only is honoured for a model transformers can hold too
    assert hf_cli.export_checkpoint(str(tmp_path / 'run'), str(tmp_path / 'plain'),
                                    params_only=True) == 'params.safetensors and config.gin'
    assert sorted(p.name for p in (tmp_path / 'plain').iterdir()) == ['config.gin', 'params.safetensors']
  if ffn == 'relu':  # into a directory that is not empty: one error each, nothing there touched
    before = {p.name: p.read_bytes() for p in (tmp_path / 'out').iterdir()}
    with pytest.raises(ValueError, match='out already exists and is not empty; export into a new'):
      hf_cli.export_checkpoint(str(tmp_path / 'run'), str(tmp_path / 'out'))
    with pytest.raises(ValueError, match='out already exists and is not empty; import into a new'):
      hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'out'))
    assert {p.name: p.read_bytes() for p in (tmp_path / 'out').iterdir()} == before


def test_an_mt5_imports_as_the_t5_v1_1_it_is(tmp_path):
  """mT5 (transformers' MT5ForConditionalGeneration, model_type 'mt5') is T5 v1.1 with another
  vocabulary: imported, our logits are transformers'."""
  torch.manual_seed(0)
  model = transformers.MT5ForConditionalGeneration(transformers.MT5Config(
      **HF_TINY, feed_forward_proj='gated-gelu', tie_word_embeddings=False)).eval()
  model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.05)
  model.save_pretrained(tmp_path / 'hf')
  assert json.loads((tmp_path / 'hf' / 'config.json').read_text())['model_type'] == 'mt5'
  config = hf_cli.import_checkpoint(str(tmp_path / 'hf'), str(tmp_path / 'run'))
  assert (config.ffn, config.tie_embeddings) == ('geglu', False)
  assert_logits_close(our_logits(tmp_path / 'run')[0], hf_logits(model))


def test_an_import_whose_weights_and_config_disagree_is_one_error(tmp_path):
  """A config.json that does not describe its weights (here a vocabulary other than the
  embedding's rows, or attention widths other than the projections': a bare numpy reshape error
  before) is refused at import, naming the parameter, not at the first restore."""
  _, hf_dir = hf_model(tmp_path, 'relu', True)
  config = json.loads((hf_dir / 'config.json').read_text())
  (hf_dir / 'config.json').write_text(json.dumps({**config, 'vocab_size': config['vocab_size'] * 2}))
  with pytest.raises(ValueError, match=r'weights and its config.json disagree: '
                                       r'token_embedder/embedding is \(\d+, \d+\) in the weights'):
    hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'run'))
  (hf_dir / 'config.json').write_text(json.dumps({**config, 'd_kv': config['d_kv'] // 2}))
  with pytest.raises(ValueError, match=r'weights and its config.json disagree: encoder.block.0.layer.0.'
                                       r'SelfAttention.q.weight is \(\d+, \d+\) in the weights, '
                                       r'\(\d+, \d+\) by the config'):
    hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('ids', [dict(decoder_start_token_id=5), dict(eos_token_id=2),
                                 dict(pad_token_id=3, eos_token_id=[1, 4])])
def test_an_import_with_other_special_ids_than_t5s_is_one_error(tmp_path, ids):
  """Our T5 pads (and masks) id 0, starts decoding from 0 and stops at 1: another model's ids
  were dropped without a word, and it decoded otherwise than transformers' generate."""
  _, hf_dir = hf_model(tmp_path, 'relu', True)
  config = json.loads((hf_dir / 'config.json').read_text())
  (hf_dir / 'config.json').write_text(json.dumps({**config, **ids}))
  with pytest.raises(ValueError, match=f'its config.json has {next(iter(ids))} .* has 0, 1 and 0'):
    hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()
  (hf_dir / 'config.json').write_text(json.dumps({**config, 'decoder_start_token_id': None,
                                                  'eos_token_id': [1]}))  # T5's, as written
  hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'run'))


@pytest.mark.parametrize('ffn', [('tanh',), ('tanh', 'linear')])
def test_a_tanh_ffn_imports_and_exports_with_transformers_logits(ffn, tmp_path):
  """feed_forward_proj 'tanh' / 'gated-tanh' (transformers' ACT2FN has it, as ours): refused
  both ways before, saying neither side computes it."""
  model, hf_dir = hf_model(tmp_path, ffn, False)
  assert json.loads((hf_dir / 'config.json').read_text())['feed_forward_proj'] == (
      'gated-tanh' if len(ffn) == 2 else 'tanh')
  assert hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'run')).activations == ffn
  ours = our_logits(tmp_path / 'run')[0]
  assert_logits_close(ours, hf_logits(model))
  hf_cli.export_checkpoint(str(tmp_path / 'run'), str(tmp_path / 'out'))
  exported = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / 'out').eval()
  assert_logits_close(hf_logits(exported), ours)


def test_an_import_with_weights_left_over_or_of_another_head_is_one_error(tmp_path):
  """A config.json naming fewer layers than its weights hold imported a truncated model; a T5 of
  another head (T5ForQuestionAnswering: its own output layer) imported as a language model."""
  _, hf_dir = hf_model(tmp_path, 'relu', True)
  config = json.loads((hf_dir / 'config.json').read_text())
  (hf_dir / 'config.json').write_text(json.dumps({**config, 'num_layers': 1, 'num_decoder_layers': 1}))
  with pytest.raises(ValueError, match=r'holds \d+ weights this configuration does not use \(e.g. '
                                       r'decoder.block.1.'):
    hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'run'))
  (hf_dir / 'config.json').write_text(json.dumps({**config, 'architectures': ['T5ForQuestionAnswering']}))
  with pytest.raises(ValueError, match="of T5ForQuestionAnswering, not T5ForConditionalGeneration"):
    hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'run'))
  encoder_only = {k: v for k, v in config.items() if k != 'architectures'}
  (hf_dir / 'config.json').write_text(json.dumps({**encoder_only, 'is_encoder_decoder': False}))
  with pytest.raises(ValueError, match=r'holds a model without a decoder \(is_encoder_decoder false'):
    hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_damaged_input_files_of_an_import_are_one_error_naming_the_file(tmp_path):
  """A weights file cut short (an unfinished download), a config.json that is not JSON or not an
  object, a directory that is a file: one line each through the command, no traceback."""
  _, hf_dir = hf_model(tmp_path, 'relu', True)
  weights = hf_dir / 'model.safetensors'
  weights.write_bytes(weights.read_bytes()[:1000])
  with pytest.raises(ValueError, match=r'model.safetensors cannot be read \(\w+.*\): is the file whole'):
    hf_cli.read_hf_weights(str(hf_dir))
  config = hf_dir / 'config.json'
  for text, message in (('{"d_model": 32,', 'config.json is not valid JSON'),
                        ('[1, 2]', 'config.json holds a JSON list, not a transformers config')):
    config.write_text(text)
    with pytest.raises(ValueError, match=message):
      hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'run'))
  for not_a_dir in (config, tmp_path / 'nonexistent'):  # a file; nothing (was a bare [Errno 2])
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), 't5xv-import'),
                          f'--hf_dir={not_a_dir}', f'--model_dir={tmp_path / "run"}'],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count('\n') == 1, out.stderr
    assert out.stderr.startswith(f't5xv-import: error: {not_a_dir}/config.json does not exist: '
                                 '--hf_dir must be a directory that save_pretrained'), out.stderr
    assert not (tmp_path / 'run').exists()


def test_tied_is_judged_against_the_encoders_embedding_where_there_is_no_shared_weight():
  head = np.ones((4, 2), np.float32)
  for embedding, tied in ((head, True), (head * 2, False)):
    weights = {'lm_head.weight': head, 'encoder.embed_tokens.weight': embedding}
    assert hf_t5._tied({}, weights) is tied  # pylint: disable=protected-access


def test_pytorch_bin_unrolled_and_a_scaled_untied_output_layer(tmp_path):
  """pytorch_model.bin is read through torch; ``--unrolled`` writes layers_<i>; an output layer
  scaled by d_model^-0.5 but not tied to the embedding imports with the scale folded in."""
  model, _ = hf_model(tmp_path, 'swiglu', tied=False)
  model.config.scale_decoder_outputs = True
  path = tmp_path / 'bin'
  model.config.save_pretrained(path)
  torch.save(model.state_dict(), path / 'pytorch_model.bin')  # older transformers' format
  config = hf_cli.import_checkpoint(str(path), str(tmp_path / 'run'), scan_layers=False)
  assert not config.tie_embeddings and not config.scan_layers
  ours, _, params = our_logits(tmp_path / 'run')
  assert 'layers_2' in params['decoder']
  assert_logits_close(ours, hf_logits(model))


def test_a_bfloat16_checkpoint_imports_through_torch(tmp_path):
  model, _ = hf_model(tmp_path, 'relu', tied=True)
  model.to(torch.bfloat16).save_pretrained(tmp_path / 'bf16')
  hf_cli.import_checkpoint(str(tmp_path / 'bf16'), str(tmp_path / 'run'))
  ours, _, _ = our_logits(tmp_path / 'run')
  assert_logits_close(ours, hf_logits(model.to(torch.float32)))  # the same rounded weights


def test_greedy_decoding_of_an_import_equals_generate(tmp_path):
  # As many decoder as encoder layers: transformers' generate sizes its cache by num_layers.
  model, hf_dir = hf_model(tmp_path, 'geglu', tied=False, seed=1, num_decoder_layers=2)
  hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'run'))
  config, params = run_config(tmp_path / 'run'), pretrained.read_on_host(str(tmp_path / 'run'))
  ours, _ = jax.jit(lambda p, x: decode(build_model(config), config, p, encoder_input_tokens=x,
                                        max_decode_length=8))(params, jnp.asarray(INPUTS))
  with torch.no_grad():
    theirs = model.generate(input_ids=torch.tensor(INPUTS), attention_mask=torch.tensor(INPUTS != 0),
                            max_new_tokens=8, do_sample=False, num_beams=1, min_new_tokens=0)
  theirs = theirs.numpy()[:, 1:]  # without the start token
  theirs = np.pad(theirs, ((0, 0), (0, 8 - theirs.shape[1])))
  np.testing.assert_array_equal(np.asarray(ours), theirs)


REFUSED = {
    'placement': (dict(placement='deepnorm'), "norm placement 'deepnorm'"),
    'subln': (dict(placement='subln'), "norm placement 'subln'"),
    'post': (dict(placement='post'), "norm placement 'post'"),
    'synthesizer': (dict(self_attention='dense'), "self-attention 'dense'"),
    'mixture': (dict(self_attention=('dense', 'dot_product')), "self-attention ('dense', 'dot_product')"),
    'layernorm': (dict(norm='layernorm'), "norm 'layernorm'"),
    'decoder_only': (dict(architecture='decoder_only'), "architecture 'decoder_only'"),
    'encoder_only': (dict(architecture='encoder_only'), "architecture 'encoder_only'"),
    'gated_exact_gelu': (dict(ffn=('gelu_exact', 'linear')), "ffn ('gelu_exact', 'linear')"),
    'unscaled_tied': (dict(tie_embeddings=True, scale_tied_logits=False),
                      'tie_embeddings without scale_tied_logits'),
    'bidirectional_decoder_buckets': (dict(relative_attention_bidirectional=True),
                                      'relative_attention_bidirectional=True'),
}


@pytest.mark.parametrize('axis', sorted(REFUSED))
def test_each_inexpressible_variant_is_refused_by_name(axis):
  overrides, message = REFUSED[axis]
  why = hf_t5.inexpressible(tiny(**overrides))
  assert why and why.startswith(message), why
  assert hf_t5.inexpressible(tiny()) is None


def test_a_shared_encoder_decoder_exports_as_the_plain_t5_it_computes(tmp_path, capsys):
  """T5's shared-parameter encoder-decoder goes to transformers with the decoder's weights copied
  into the encoder: its logits there are ours. (A run without vocab.model: the export says it has
  no tokenizer.)"""
  from train_helpers import save_fresh_state  # pylint: disable=g-import-not-at-top
  config = tiny(shared_encoder_decoder=True, vocab_size=64)  # INPUTS' and DECODER's ids
  params = save_fresh_state(config, tmp_path / 'run', seed=0)
  (tmp_path / 'run' / 'config.gin').write_text(''.join(
      f'TransformerConfig.{k} = {v!r}\n' for k, v in config.__dict__.items()
      if k in ('vocab_size', 'd_model', 'num_heads', 'head_dim', 'd_ff', 'num_encoder_layers',
               'num_decoder_layers', 'encoder_max_length', 'decoder_max_length',
               'shared_encoder_decoder')))
  assert hf_cli.export_checkpoint(str(tmp_path / 'run'), str(tmp_path / 'out')) == (
      'config.json, model.safetensors')
  assert 'has no vocab.model' in capsys.readouterr().err
  exported = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / 'out').eval()
  ours = jit_apply(build_model(config))({'params': params}, jnp.asarray(INPUTS), jnp.asarray(DECODER))
  assert_logits_close(hf_logits(exported), np.asarray(ours))


def test_export_refuses_in_one_line_or_writes_our_parameters(tmp_path):
  from train_helpers import save_fresh_state  # pylint: disable=g-import-not-at-top
  params = save_fresh_state(tiny(placement='deepnorm'), tmp_path / 'run', seed=0)
  (tmp_path / 'run' / 'config.gin').write_text(
      "TransformerConfig.placement = 'deepnorm'\n" +
      ''.join(f'TransformerConfig.{k} = {v!r}\n' for k, v in tiny().__dict__.items()
              if k in ('vocab_size', 'd_model', 'num_heads', 'head_dim', 'd_ff', 'num_encoder_layers',
                       'num_decoder_layers', 'encoder_max_length', 'decoder_max_length')))
  out = subprocess.run([os.path.join(os.path.dirname(sys.executable), 't5xv-export'),
                        f'--checkpoint_path={tmp_path / "run"}', f'--output_dir={tmp_path / "out"}'],
                       capture_output=True, text=True)
  assert out.returncode == 2 and out.stderr.count('\n') == 1, out.stderr
  assert "t5xv-export: error: transformers T5 cannot express this model: norm placement " \
         "'deepnorm'" in out.stderr and '--params_only' in out.stderr
  written = hf_cli.export_checkpoint(str(tmp_path / 'run'), str(tmp_path / 'out'), params_only=True)
  with pytest.raises(ValueError):  # the run's config.gin is not left parsed for the caller
    gin.query_parameter('TransformerConfig.placement')
  assert written.startswith('params.safetensors and config.gin (not a transformers model')
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  flat = load_file(tmp_path / 'out' / 'params.safetensors')
  np.testing.assert_array_equal(flat['token_embedder/embedding'], params['token_embedder']['embedding'])
  assert len(flat) == len(jax.tree_util.tree_leaves(params))


def test_export_of_another_model_or_a_damaged_checkpoint_is_one_error(tmp_path):
  """A checkpoint that its run's config.gin does not describe, and one whose array data is cut
  short, are one error each (they gave transformers a model of random weights, or tracebacks)."""
  from train_helpers import save_fresh_state  # pylint: disable=g-import-not-at-top
  save_fresh_state(tiny(), tmp_path / 'run', seed=0)
  sizes = {k: v for k, v in tiny().__dict__.items() if k in (
      'vocab_size', 'd_model', 'num_heads', 'head_dim', 'num_encoder_layers', 'num_decoder_layers')}
  (tmp_path / 'run' / 'config.gin').write_text(''.join(
      f'TransformerConfig.{k} = {v!r}\n' for k, v in {**sizes, 'd_ff': 2 * tiny().d_ff}.items()))
  with pytest.raises(ValueError, match=r"is not the model of .*config.gin: .*mlp/wi/kernel is "
                                       r"\(2, \d+, \d+\) in the checkpoint"):
    hf_cli.export_checkpoint(str(tmp_path / 'run'), str(tmp_path / 'out'))
  for f in (tmp_path / 'run').glob('checkpoint_1/state/ocdbt.process_0/d/*'):
    f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 2])
  with pytest.raises(checkpoints.CheckpointError, match=r'cannot read params of .*checkpoint_1 \('):
    pretrained.read_on_host(str(tmp_path / 'run'))
  assert not (tmp_path / 'out').exists()


def test_a_checkpoint_whose_metadata_is_cut_short_is_called_damaged(tmp_path):
  """Its metadata cut short gave a bare JSONDecodeError, without the hint an array's damage gets."""
  from train_helpers import save_fresh_state  # pylint: disable=g-import-not-at-top
  save_fresh_state(tiny(), tmp_path / 'run', seed=0)
  meta = tmp_path / 'run' / 'checkpoint_1' / 'state' / '_METADATA'
  meta.write_bytes(meta.read_bytes()[:len(meta.read_bytes()) // 2])
  with pytest.raises(checkpoints.CheckpointError, match=r'cannot read params of .*checkpoint_1 \('
                                                        r'.*\): is it damaged\?'):
    pretrained.read_on_host(str(tmp_path / 'run'))


@pytest.mark.slow
def test_export_reads_a_checkpoint_written_by_eight_devices(tmp_path):
  """A replica=2 x data=2 x model=2 (fsdp) run in a subprocess; exported here on one device,
  transformers' logits equal ours from the same checkpoint."""
  script = os.path.join(os.path.dirname(__file__), 'trainer_subprocess.py')
  out = subprocess.run([sys.executable, script, 'mesh', str(tmp_path / 'run'), '2'],
                       capture_output=True, text=True)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  config = tiny(num_encoder_layers=1, num_decoder_layers=1)  # run_train's model
  (tmp_path / 'run' / 'config.gin').write_text(''.join(
      f'TransformerConfig.{k} = {getattr(config, k)!r}\n' for k in
      ('vocab_size', 'd_model', 'num_heads', 'head_dim', 'd_ff', 'num_encoder_layers',
       'num_decoder_layers', 'encoder_max_length', 'decoder_max_length')))
  hf_cli.export_checkpoint(str(tmp_path / 'run'), str(tmp_path / 'out'))
  assert json.loads((tmp_path / 'out' / 'config.json').read_text())['num_layers'] == 1
  exported = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / 'out').eval()
  inputs, decoder = INPUTS % 50, DECODER % 50
  ours, _, _ = our_logits(tmp_path / 'run', inputs, decoder)
  assert_logits_close(ours, hf_logits(exported, inputs, decoder))


def byt5_model(tmp_path):
  """A tiny random ByT5 (transformers' T5 with tokenizer_class ByT5Tokenizer and 384 ids, as
  google/byt5-*), saved to ``tmp_path``/hf with no tokenizer file, as the hub's."""
  torch.manual_seed(0)
  config = transformers.T5Config(**{**HF_TINY, 'vocab_size': 384}, feed_forward_proj='gated-gelu',
                                 tie_word_embeddings=False, tokenizer_class='ByT5Tokenizer')
  model = transformers.T5ForConditionalGeneration(config).eval()
  model.save_pretrained(tmp_path / 'hf')
  return model, tmp_path / 'hf'


@needs_data_layer
def test_a_byt5_imports_with_its_byte_vocabulary_and_exports_as_a_byt5(tmp_path, capsys):
  """A ByT5 has no spiece.model: its import binds ByT5's vocabulary (UTF-8 bytes + 3, 259 ids,
  the final 100 byte ids span corruption's sentinels) where it warned and left the run with the
  gin files' vocabulary (the embedded one's 4100 ids, which every command then refused for a
  model of 384), and ByT5's pretraining macros (1024 inputs, mean span 20, where they were T5's
  512 and 3); its export names ByT5Tokenizer again, whose ids are ours."""
  from t5x_variants.cli import common, recipe  # pylint: disable=g-import-not-at-top
  from t5x_variants.data import span_corruption, vocab  # pylint: disable=g-import-not-at-top
  model, hf_dir = byt5_model(tmp_path)
  hf_cli.import_checkpoint(str(hf_dir), str(tmp_path / 'run'))
  assert 'warning' not in capsys.readouterr().err
  gin.clear_config()
  recipe.parse_gin([str(tmp_path / 'run' / 'config.gin')], [])
  byt5, config = vocab.vocabulary(), recipe.build_config()
  lengths = gin.query_parameter('%TASK_FEATURE_LENGTHS')  # ByT5's pretraining, not T5's 512/114
  assert lengths == {'inputs': 1024, 'targets': span_corruption.bound_targets_length(1024)}
  assert gin.get_bindings(span_corruption.span_corruption) == {'mean_noise_span_length': 20.0}
  gin.clear_config()
  assert isinstance(byt5, vocab.ByT5Vocabulary) and (byt5.vocab_size, vocab.sentinels(byt5)) == (259, 100)
  common.check_vocabulary_size(config, byt5, 'the run')  # (384 rows)
  assert_logits_close(our_logits(tmp_path / 'run')[0], hf_logits(model))
  assert 'ByT5Tokenizer' in hf_cli.export_checkpoint(str(tmp_path / 'run'), str(tmp_path / 'out'))
  assert json.loads((tmp_path / 'out' / 'config.json').read_text())['tokenizer_class'] == 'ByT5Tokenizer'
  assert recipe.vocabulary_kind("vocabulary.kind = 'byt5'  # ByT5\n"  # the last binding counts
                                 "t5x_variants.data.vocab.vocabulary.kind = 'bytes'\n") == 'bytes'
  text = 'Größe 5 €'
  tokenizer = transformers.ByT5Tokenizer()
  assert tokenizer(text).input_ids == list(byt5.encode(text)) + [1]


@needs_data_layer
@pytest.mark.slow
@pytest.mark.parametrize('tokenizer', ['spiece', 'byt5'])
def test_an_import_fine_tunes_and_decodes_through_the_commands(tokenizer, tmp_path):
  """t5xv-import -> t5xv-train with gin/runs/finetune.gin from its checkpoint -> t5xv-infer, of a
  T5 with its spiece.model and of a ByT5 (which every command refused: the run's vocabulary was
  the embedded one, larger than its 384 ids)."""
  from t5x_variants.cli import infer, train  # pylint: disable=g-import-not-at-top
  from t5x_variants.data import vocab  # pylint: disable=g-import-not-at-top
  if tokenizer == 'byt5':
    _, hf_dir = byt5_model(tmp_path)
  else:
    _, hf_dir = hf_model(tmp_path, 'geglu', tied=False, vocab_size=4224)
    (hf_dir / 'spiece.model').write_bytes(open(vocab.embedded_spm_file(), 'rb').read())
  assert hf_cli.import_main([f'--hf_dir={hf_dir}', f'--model_dir={tmp_path / "run"}']) == 0
  run, ft = tmp_path / 'run', tmp_path / 'ft'
  gin.clear_config()
  assert train.main([f'--gin_file={run}/config.gin', '--gin_file=gin/runs/finetune.gin',
                     f"--gin.INITIAL_CHECKPOINT_PATH='{run}'", f"--gin.MODEL_DIR='{ft}'",
                     "--gin.MIXTURE_OR_TASK_NAME='embedded_span_corruption'", '--gin.TRAIN_STEPS=2',
                     "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", '--gin.BATCH_SIZE=4',
                     '--gin.train.eval_period=0', '--gin.Checkpointer.period=2']) == 0
  assert (ft / 'checkpoint_2').exists() and (ft / 'vocab.model').exists() == (tokenizer == 'spiece')
  texts = tmp_path / 'texts.txt'
  texts.write_text('Return the number of items.\n')
  gin.clear_config()
  assert infer.main([f'--gin_file={ft}/config.gin', '--gin_file=gin/runs/infer.gin',
                     f"--gin.CHECKPOINT_PATH='{ft}'", f"--gin.INPUT_FILE='{texts}'",
                     f"--gin.INFER_OUTPUT='{tmp_path / 'out.jsonl'}'"]) == 0
  (row,) = [json.loads(l) for l in (tmp_path / 'out.jsonl').read_text().splitlines()]
  assert row['inputs'] == 'Return the number of items.'


def test_the_package_imports_without_the_hf_extra():
  """With torch, transformers and safetensors made unimportable, every command module imports."""
  code = ('import sys\n'
          'class Absent:\n'
          '  def find_spec(self, name, *args):\n'
          "    if name.split('.')[0] in ('torch', 'transformers', 'safetensors'):\n"
          "      raise ImportError(name)\n"
          'sys.meta_path.insert(0, Absent())\n'
          'import t5x_variants.cli.hf, t5x_variants.cli.bench, t5x_variants.cli.train, '
          't5x_variants.cli.eval, t5x_variants.cli.infer, t5x_variants.train.trainer\n'
          "print('imported')")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
  assert out.stdout.strip() == 'imported', out.stderr[-2000:]
