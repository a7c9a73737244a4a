"""t5xv-import / t5xv-export: Hugging Face ``transformers`` T5 checkpoints in and out.

  t5xv-import --hf_dir=/models/flan-t5-small --model_dir=/runs/flan_t5_small
  t5xv-export --checkpoint_path=/runs/t5_base_geglu --output_dir=/models/t5_base_geglu
  python -m t5x_variants.cli.hf import|export FLAGS    (the same two commands)

t5xv-import reads a local transformers T5 directory (config.json and model.safetensors, its
sharded index, or pytorch_model.bin; T5 v1.0, v1.1, Flan-T5 and mT5 layouts) and writes a run
directory: ``checkpoint_0`` (orbax, the parameters only, scanned unless ``--unrolled``),
``config.gin`` (the matching TransformerConfig and pretraining's data macros), ``model-info.txt``
and ``vocab.model`` (the checkpoint's ``spiece.model``, the run's vocabulary; a ByT5, whose
``config.json`` names ``ByT5Tokenizer`` and which has none, gets ``vocabulary.kind = 'byt5'`` in
its ``config.gin`` instead, and exports with that tokenizer class again). Fine-tune it with
``gin/runs/finetune.gin`` and ``INITIAL_CHECKPOINT_PATH``; t5xv-eval and t5xv-infer read it.

t5xv-export reads a run directory (its newest checkpoint) or one ``checkpoint_<step>``, written
by any number of devices, onto this host and writes config.json, model.safetensors and
spiece.model for ``T5ForConditionalGeneration.from_pretrained``. A variant transformers' T5
cannot express is refused with the axis that it lacks; ``--params_only`` then writes our
parameter tree as ``params.safetensors`` ('/'-joined names) with ``config.gin`` instead (of any
model, when given).
"""
import dataclasses
import json
import sys

import flax
import gin
import numpy as np

from t5x_variants.cli import common, recipe
from t5x_variants.features import EOS_ID, PAD_ID
from t5x_variants.layers.ffn import FFN_VARIANTS
from t5x_variants.models import hf_t5
from t5x_variants.models.encoder_decoder import unshared_params
from t5x_variants.models.config import TransformerConfig
from t5x_variants.models.summary import abstract_params, model_info, param_rows
from t5x_variants.train import checkpoint_reads, checkpoints, pretrained, storage

VOCAB = 'vocab.model'  # the run's vocabulary (recipe.use_run_vocabulary)
SPIECE = 'spiece.model'  # transformers' T5 tokenizer file
BYT5 = 'ByT5Tokenizer'  # a ByT5's tokenizer_class in transformers' config.json
BYT5_BINDING = "vocabulary.kind = 'byt5'"  # its config.gin's vocabulary
T5_LENGTHS = {'inputs': 512, 'targets': 114}  # T5's pretraining (gin/runs/pretrain.gin)
BYT5_LENGTHS, BYT5_MEAN_SPAN = {'inputs': 1024, 'targets': 189}, 20.0  # ByT5's
# T5WithLMHeadModel: the first's old name; mT5 is T5 v1.1 with another vocabulary.
LM_ARCHITECTURES = ('T5ForConditionalGeneration', 'T5WithLMHeadModel', 'MT5ForConditionalGeneration')


def _load_safetensors(data: bytes):
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  try:
    return st_numpy.load(data)
  except (TypeError, ValueError, KeyError):  # bfloat16 has no numpy dtype: through torch
    import torch  # pylint: disable=g-import-not-at-top
    from safetensors import torch as st_torch  # pylint: disable=g-import-not-at-top
    return {k: v.to(torch.float32).numpy() for k, v in st_torch.load(data).items()}


def read_hf_weights(hf_dir) -> dict:
  """{name: numpy array} of a transformers checkpoint directory."""
  d = storage.path(hf_dir)
  for index_name, single in (('model.safetensors.index.json', 'model.safetensors'),
                             ('pytorch_model.bin.index.json', 'pytorch_model.bin')):
    files = [d / single] if (d / single).exists() else []
    if (d / index_name).exists():
      files = [d / f for f in sorted(set(json.loads((d / index_name).read_text())['weight_map'].values()))]
    if files:
      weights = {}
      for f in files:
        try:
          weights.update(_load_safetensors(f.read_bytes()) if f.suffix == '.safetensors' else _load_torch(f))
        except (OSError, MemoryError, ImportError):  # the file system's, memory's: not the file's
          raise
        except Exception as e:  # safetensors' and torch's errors of a damaged file
          raise ValueError(f'{f} cannot be read ({checkpoint_reads.error_reason(e)}): is the file whole '
                           '(a finished download)?') from e
      return weights
  raise FileNotFoundError(f'{d} has no model.safetensors, pytorch_model.bin or a sharded index of '
                          'either: is it a transformers checkpoint directory?')


def _load_torch(path):
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ValueError(f'{path} is a PyTorch file: reading it needs torch (the hf extra)') from e
  with path.open('rb') as f:
    state = torch.load(f, map_location='cpu', weights_only=True)
  return {k: v.to(torch.float32).numpy() for k, v in state.items()}


def _read_config(path) -> dict:
  """A transformers config.json as a dict; ValueError naming the file if it is not one."""
  if not path.exists():
    raise FileNotFoundError(f'{path} does not exist: --hf_dir must be a directory that '
                            'save_pretrained (transformers) wrote, with config.json and the weights')
  try:
    hf = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f'{path} is not valid JSON ({e})') from e
  if not isinstance(hf, dict):
    raise ValueError(f'{path} holds a JSON {type(hf).__name__}, not a transformers config (an object)')
  return hf


def _gin_value(value):
  return repr(tuple(value)) if isinstance(value, (tuple, list)) else repr(value)


def _shape_mismatch(params, config: TransformerConfig, have: str, want: str):
  """'<name> is <shape> in the <have>, <shape> by the <want>' for the first parameter whose shape
  ``params`` and ``config``'s model disagree on (or that one of them lacks), else None."""
  wanted = {name: shape for name, shape, _, _ in param_rows(abstract_params(config))}
  got = {name: shape for name, shape, _, _ in param_rows(params)}
  bad = next((k for k in sorted(wanted.keys() | got.keys()) if wanted.get(k) != got.get(k)), None)
  return bad and (f'{bad} is {got.get(bad, "missing")} in the {have}, '
                  f'{wanted.get(bad, "not a parameter")} by the {want}')


def _refuse_filled(directory, remedy: str):
  """ValueError unless ``directory`` is new or empty: nothing there is overwritten or mixed with
  the files written now (another model's tokenizer beside these weights)."""
  if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
    raise ValueError(f'{directory} already exists and is {"not empty" if directory.is_dir() else "a file"}; '
                     f'{remedy}')


def import_checkpoint(hf_dir: str, model_dir: str, scan_layers: bool = True):
  """Writes the run directory of the module doc; returns its TransformerConfig."""
  hf = _read_config(storage.path(hf_dir) / 'config.json')
  kind = hf.get('architectures') or ['T5ForConditionalGeneration']
  other = None
  if hf.get('model_type', 't5') not in ('t5', 'mt5'):
    other = f'a {hf.get("model_type")!r} model'
  elif not hf.get('is_encoder_decoder', True):
    other = 'a model without a decoder (is_encoder_decoder false: T5EncoderModel?)'
  elif any(a not in LM_ARCHITECTURES for a in kind):
    other = f'a model of {", ".join(kind)}'
  if other:
    raise ValueError(f'{hf_dir} holds {other}, not T5ForConditionalGeneration (transformers T5 '
                     'or mT5 with its language-model head)')
  special = {'pad_token_id': PAD_ID, 'eos_token_id': EOS_ID, 'decoder_start_token_id': PAD_ID}
  odd = [f'{k} {hf[k]}' for k, want in special.items() if hf.get(k) not in (None, want, [want])]
  if odd:
    raise ValueError(f'{hf_dir}: its config.json has {", ".join(odd)}, where T5 (and this codebase, '
                     'which pads and starts decoding with id 0 and ends with EOS id 1) has 0, 1 and 0: '
                     'the imported model would read padding and decode otherwise than it was trained')
  run = storage.path(model_dir)
  _refuse_filled(run, 'import into a new directory')
  weights = read_hf_weights(hf_dir)
  bindings = hf_t5.config_bindings(hf, weights)
  named = {acts: name for name, acts in FFN_VARIANTS.items()}
  bindings['ffn'] = named.get(tuple(bindings['ffn']), bindings['ffn'])
  bindings['scan_layers'] = scan_layers
  config = TransformerConfig(**bindings)
  params = hf_t5.params_from_hf(weights, config, hf_t5.scales_decoder_outputs(hf))
  bad = _shape_mismatch(params, dataclasses.replace(config, scan_layers=False), 'weights', 'config')
  if bad:
    raise ValueError(f'{hf_dir}: its weights and its config.json disagree: {bad}')
  if scan_layers:
    params = hf_t5.stack_layers(params)
  ckpt = checkpoints.Checkpointer(str(run), async_save=False)
  ckpt.save(0, {'params': params}, force=True)
  ckpt.close()
  spiece = storage.path(hf_dir) / SPIECE
  byt5 = not spiece.exists() and hf.get('tokenizer_class') == BYT5
  lines = [f'# Imported from {hf_dir} by t5xv-import: transformers T5, feed_forward_proj '
           f'{hf.get("feed_forward_proj", "relu")!r}, tied embeddings {config.tie_embeddings}.',
           '# The data macros of gin/runs/pretrain.gin, which t5xv-eval and t5xv-infer read; '
           'override them there.',
           "MIXTURE_OR_TASK_NAME = 'c4_span_corruption'",
           f'TASK_FEATURE_LENGTHS = {BYT5_LENGTHS if byt5 else T5_LENGTHS}', 'Z_LOSS = 1e-4']
  if byt5:
    lines += ["# ByT5's pretraining: UTF-8 bytes, sentinels the final 100 byte ids (data/vocab.py), "
              'mean noise span 20 (Xue et al. 2022, Sec. 3.1).', BYT5_BINDING,
              f'span_corruption.mean_noise_span_length = {BYT5_MEAN_SPAN}']
  lines += [''] + [f'TransformerConfig.{k} = {_gin_value(v)}' for k, v in bindings.items()]
  storage.write_text(run / 'config.gin', '\n'.join(lines) + '\n')
  storage.write_text(run / 'model-info.txt', model_info(config) + '\n')
  if spiece.exists():
    storage.copy(spiece, run / VOCAB)
  elif not byt5:
    print(f't5xv-import: warning: {hf_dir} has no {SPIECE}; the run uses the vocabulary its gin '
          'files name', file=sys.stderr)
  return config


def export_checkpoint(checkpoint_path: str, output_dir: str, params_only: bool = False) -> str:
  """Writes the transformers directory (or with ``params_only`` the plain parameter file) of the
  module doc; returns what was written."""
  path = checkpoints.checkpoint_path(checkpoint_path)
  run = path.parent
  gin.clear_config()  # the run's config.gin alone says what the model is
  try:
    recipe.parse_gin([str(run / 'config.gin')], [], skip_unknown=True)
    config = recipe.build_config()
  finally:
    gin.clear_config()  # a caller's next configuration starts from nothing, not from this run's
  why = hf_t5.inexpressible(config)
  if why and not params_only:
    raise ValueError(f'transformers T5 cannot express this model: {why}. --params_only writes its '
                     'parameters as params.safetensors with config.gin instead')
  out = storage.path(output_dir)
  _refuse_filled(out, 'export into a new directory')
  params = pretrained.read_on_host(str(path))
  bad = _shape_mismatch(params, config, 'checkpoint', "run's config.gin")
  if bad:
    raise ValueError(f'{path} is not the model of {run / "config.gin"}: {bad}')
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  out.mkdir(parents=True, exist_ok=True)
  if params_only:
    flat = {k: np.ascontiguousarray(v) for k, v in flax.traverse_util.flatten_dict(params, sep='/').items()}
    storage.write_bytes(out / 'params.safetensors', st_numpy.save(flat))
    storage.copy(run / 'config.gin', out / 'config.gin')
    return f'params.safetensors and config.gin{f" (not a transformers model: {why})" if why else ""}'
  if config.shared_encoder_decoder:  # transformers' T5 holds the copies the model shares
    params = unshared_params(params)
    config = dataclasses.replace(config, shared_encoder_decoder=False)
  if config.scan_layers:
    params = hf_t5.unstack_layers(params)
  storage.write_bytes(out / 'model.safetensors',  # whole or not at all, as every file here
                      st_numpy.save(hf_t5.params_to_hf(params, config), metadata={'format': 'pt'}))
  hf = hf_t5.hf_config(config)
  byt5 = recipe.vocabulary_kind((run / 'config.gin').read_text()) == 'byt5'
  if byt5:
    hf['tokenizer_class'] = BYT5  # (transformers' ByT5 tokenizer needs no file)
  storage.write_text(out / 'config.json', json.dumps(hf, indent=2) + '\n')
  if (run / VOCAB).exists():
    storage.copy(run / VOCAB, out / SPIECE)
    return 'config.json, model.safetensors, spiece.model'
  if byt5:
    return f'config.json ({BYT5}), model.safetensors'
  print(f't5xv-export: warning: {run} has no {VOCAB}; {output_dir} has no {SPIECE}: give transformers '
        'the tokenizer the run was trained with', file=sys.stderr)
  return 'config.json, model.safetensors'


def import_main(argv=None):
  p = common.ArgumentParser(prog='t5xv-import', description=__doc__.strip().splitlines()[0])
  p.add_argument('--hf_dir', required=True, help='a local transformers T5 checkpoint directory')
  p.add_argument('--model_dir', required=True, help='the run directory to write')
  p.add_argument('--unrolled', action='store_true', help='unrolled layers (scan_layers=False)')
  args = p.parse_args(argv)
  with common.clear_errors('t5xv-import'):
    config = import_checkpoint(args.hf_dir, args.model_dir, scan_layers=not args.unrolled)
  print(f'imported {args.hf_dir} into {args.model_dir}: {config.num_encoder_layers}+'
        f'{config.num_decoder_layers} layers, d_model {config.d_model}, ffn {config.ffn}')
  return 0


def export_main(argv=None):
  p = common.ArgumentParser(prog='t5xv-export', description=__doc__.strip().splitlines()[0])
  p.add_argument('--checkpoint_path', required=True, help='a run directory or checkpoint_<step>')
  p.add_argument('--output_dir', required=True)
  p.add_argument('--params_only', action='store_true',
                 help='our parameters and config.gin instead of a transformers model (the only '
                 'export of a variant transformers cannot express)')
  args = p.parse_args(argv)
  with common.clear_errors('t5xv-export'):
    written = export_checkpoint(args.checkpoint_path, args.output_dir, args.params_only)
  print(f'wrote {written} to {args.output_dir}')
  return 0


def main(argv=None):
  """``python -m t5x_variants.cli.hf import|export FLAGS``: t5xv-import or t5xv-export."""
  argv = sys.argv[1:] if argv is None else argv
  p = common.ArgumentParser(prog='python -m t5x_variants.cli.hf',
                            description=__doc__.strip().splitlines()[0])
  p.add_argument('command', choices=('import', 'export'))
  command = p.parse_args(argv[:1]).command
  return {'import': import_main, 'export': export_main}[command](argv[1:])


if __name__ == '__main__':
  sys.exit(main())
