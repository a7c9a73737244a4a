"""Every gin file parses and builds; t5xv-info reports the model; bad gin input fails clearly."""
import dataclasses
import glob
import os

import gin
import pytest

from conftest import count, needs_data_layer, parse_recipe
from t5x_variants import PACKAGE_DIR
from t5x_variants.cli import common, info, recipe
from t5x_variants.models.summary import abstract_params, model_info, param_rows

GIN_DIR = os.path.join(PACKAGE_DIR, 'gin')
ALL_GIN = sorted(os.path.relpath(p, os.path.dirname(GIN_DIR))
                 for p in glob.glob(os.path.join(GIN_DIR, '**', '*.gin'), recursive=True))
# The paper recipes are built by tests/test_experiments.py.
ALL_GIN = [p for p in ALL_GIN if not p.startswith('gin/experiments/') or p.endswith('quickstart.gin')]


def test_the_repo_gin_folder_is_the_package_one():
  repo_gin = os.path.join(os.path.dirname(__file__), '..', 'gin')
  if os.path.exists(repo_gin):
    assert os.path.samefile(repo_gin, GIN_DIR)
  assert len(ALL_GIN) >= 30


def _files(path):
  """Size files build as they are (abstractly); variant and run files on top of the tiny size;
  eval and infer files after a run's config (here the quickstart's)."""
  if path.startswith('gin/models/'):
    return [path]
  if path in ('gin/runs/eval.gin', 'gin/runs/infer.gin'):
    return ['gin/experiments/quickstart.gin', path]
  return ['gin/models/t5_tiny.gin', path]


@needs_data_layer
@pytest.mark.parametrize('path', ALL_GIN)
def test_every_gin_file_parses_and_builds(path):
  # The run files bind the trainer's, the data's and the tools' configurables.
  from t5x_variants.cli import eval as eval_lib, infer  # pylint: disable=unused-import
  from t5x_variants.data import pipeline  # pylint: disable=unused-import
  from t5x_variants.train import trainer  # pylint: disable=unused-import
  required = [f"{m} = '/tmp/x'" for m in ('MODEL_DIR', 'INITIAL_CHECKPOINT_PATH',
                                           'CHECKPOINT_PATH', 'INFER_OUTPUT')]
  recipe.parse_gin(_files(path), required if path.startswith('gin/runs/') else [])
  config = recipe.build_config()
  assert count(abstract_params(config)) > 0
  if path.startswith(('gin/runs/', 'gin/experiments/')):
    with gin.config_scope('train'):
      assert pipeline.DatasetConfig().task_feature_lengths['inputs'] > 0


@pytest.mark.parametrize('arch', ['encoder_decoder', 'decoder_only', 'encoder_only'])
def test_variant_files_compose(arch):
  recipe.parse_gin(['gin/models/t5_tiny.gin', f'gin/architectures/{arch}.gin',
                    'gin/variants/norm/subln.gin', 'gin/variants/norm/layernorm.gin',
                    'gin/variants/ffn/swiglu.gin', 'gin/variants/attention/synth_random_plus_v.gin'],
                   ['TransformerConfig.encoder_max_length = 64', 'TransformerConfig.decoder_max_length = 64'])
  c = recipe.build_config()
  assert (c.architecture, c.placement, c.norm, c.init_scheme, c.activations, c.attention_components) == (
      arch, 'subln', 'layernorm', 't5', ('swish', 'linear'), ('random', 'dot_product'))
  assert c.ffn_hidden_dim == 128  # t5_tiny's d_ff_glu


def test_the_prefix_lm_file_makes_a_decoder_only_model_read_inputs_then_targets():
  recipe.parse_gin(['gin/models/t5_tiny.gin', 'gin/architectures/prefix_lm.gin'], [])
  c = recipe.build_config()
  assert (c.architecture, c.prefix_lm, c.data_architecture, c.task_features) == (
      'decoder_only', True, 'prefix_lm', ('inputs', 'targets'))
  assert c.stack_length('decoder', {'inputs': 512, 'targets': 114}) == 626
  plain = dataclasses.replace(c, prefix_lm=False)
  assert (plain.data_architecture, plain.task_features) == ('decoder_only', ('targets',))
  assert c.visible_prefix


def test_the_language_model_file_reads_the_prefix_lms_rows_causally():
  recipe.parse_gin(['gin/models/t5_tiny.gin', 'gin/architectures/language_model.gin'], [])
  c = recipe.build_config()
  assert (c.architecture, c.data_architecture, c.task_features, c.visible_prefix) == (
      'decoder_only', 'prefix_lm', ('inputs', 'targets'), False)
  assert c.stack_length('decoder', {'inputs': 512, 'targets': 114}) == 626
  assert 'architecture: decoder_only (inputs then targets, causal)' in model_info(c)


def test_the_shared_encoder_decoder_file_runs_the_encoder_on_the_decoders_stack():
  recipe.parse_gin(['gin/models/t5_tiny.gin', 'gin/architectures/encoder_decoder_shared.gin'], [])
  c = recipe.build_config()
  assert (c.architecture, c.shared_encoder_decoder, c.stacks) == (
      'encoder_decoder', True, ('encoder', 'decoder'))
  assert "architecture: encoder_decoder (the encoder on the decoder's parameters)" in model_info(c)


@pytest.mark.parametrize('first, last', [('language_model', 'prefix_lm'), ('prefix_lm', 'decoder_only'),
                                         ('language_model', 'decoder_only'),
                                         ('encoder_decoder_shared', 'encoder_decoder'),
                                         ('prefix_lm', 'encoder_only')])
def test_a_later_architecture_file_makes_the_model_it_makes_alone(first, last):
  """(helper-75: the files set only the flags they turn on, so an earlier file's survived: the
  language model's causal inputs under prefix_lm.gin, the prefix LM's rows under decoder_only.gin,
  the shared stack under encoder_decoder.gin)"""
  fields = ('architecture', 'prefix_lm', 'inputs_bidirectional_attention', 'shared_encoder_decoder')
  def config(*files):
    gin.clear_config()
    recipe.parse_gin(['gin/models/t5_tiny.gin', *(f'gin/architectures/{f}.gin' for f in files)], [])
    return recipe.build_config()
  alone = config(last)
  assert [getattr(config(first, last), f) for f in fields] == [getattr(alone, f) for f in fields]


@pytest.mark.parametrize('run_file, continues', [('finetune.gin', True),
                                                  ('finetune_classification.gin', False)])
def test_text_to_text_fine_tuning_goes_on_with_the_optimizer_state_bert_starts_afresh(
    run_file, continues):
  parse_recipe(['gin/models/t5_tiny.gin', f'gin/runs/{run_file}'],
               ['INITIAL_CHECKPOINT_PATH = "/tmp/x"', 'MODEL_DIR = "/tmp/y"'])
  assert gin.query_parameter('train.init_optimizer') is continues
  if continues:  # T5X's: every checkpoint kept, for evaluating them all and taking the best
    assert gin.query_parameter('Checkpointer.keep') is None


def test_bert_fine_tuning_binds_its_schedule_and_clip_whatever_the_pretraining_run_set():
  """The pretraining run's bindings come first (its config.gin): a run without warmup and with
  clip 2.0 (the no-warmup arm of foundation/mlm.gin) must not leave fine-tuning without BERT's
  warmup or with its clip (before: both inherited); no frozen paths either."""
  parse_recipe(['gin/experiments/foundation/mlm.gin', 'gin/experiments/vanilla/no_warmup.gin',
                'gin/runs/finetune_classification.gin'],
               ['INITIAL_CHECKPOINT_PATH = "/tmp/x"', 'MODEL_DIR = "/tmp/y"'])
  assert gin.query_parameter('learning_rate_schedule.warmup_ramp') is True
  assert gin.query_parameter('make_optimizer.global_norm_clip') == 1.0
  assert gin.query_parameter('make_optimizer.frozen') == []


def test_base_geglu_uses_d_ff_2048_and_relu_3072():
  for ffn, width in (('relu', 3072), ('geglu', 2048)):
    gin.clear_config()
    recipe.parse_gin(['gin/models/t5_base.gin', f'gin/variants/ffn/{ffn}.gin'], [])
    assert recipe.build_config().ffn_hidden_dim == width


def test_t5xv_info_prints_table_constants_and_total(capsys):
  code = info.main(['--gin_file=gin/models/t5_tiny.gin', '--gin_file=gin/variants/norm/deepnorm.gin',
                    '--gin.TransformerConfig.decoder_gain=0.5'])
  out = capsys.readouterr().out
  assert code == 0
  gin.clear_config()
  recipe.parse_gin(['gin/models/t5_tiny.gin', 'gin/variants/norm/deepnorm.gin'],
                   ['TransformerConfig.decoder_gain = 0.5'])
  config = recipe.build_config()
  rows = param_rows(abstract_params(config))
  # N = M = 2: encoder alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16); decoder alpha =
  # (3M)^(1/4) with its gain overridden by the binding.
  assert 'encoder: alpha=1.0059 beta=0.700563' in out
  assert 'decoder: alpha=1.56508 beta=0.5' in out
  assert f'Total number of parameters: {sum(r[3] for r in rows):,}' in out
  assert "encoder/layers/mlp/wi/kernel" in out and "('layers', 'embed', 'mlp')" in out
  assert all(axes for _, _, axes, _ in rows)  # every parameter has logical axis names


@pytest.mark.parametrize('argv,message', [
    (['--gin.TransformerConfig.d_modl=8'], "doesn't have a parameter named 'd_modl'"),
    (['--gin.TransformerConfig.d_modl=8'], 'Valid parameters: architecture'),
    (['--gin.Transformer.d_model=8'], "No configurable matching 'Transformer'"),
    (["--gin.TransformerConfig.placement='prenorm'"], "unknown placement 'prenorm'; valid: post, pre, deepnorm, subln"),
    (["--gin.TransformerConfig.self_attention='synth'"], 'invalid self_attention'),
    (["--gin.TransformerConfig.norm='batchnorm'"], 'valid: rmsnorm, layernorm'),
    (['--gin_file=gin/variants/ffn/nope.gin'], 'cannot read gin file'),
    (['--gin.TransformerConfig.num_heads=0'], 'TransformerConfig.num_heads must be a positive integer, not 0'),
    (['--gin.TransformerConfig.num_encoder_layers=2.5'], 'num_encoder_layers must be a non-negative integer'),
    (['--gin.TransformerConfig.prefix_lm=True'], "prefix_lm is a decoder-only model's mask; architecture "
                                                 "is 'encoder_decoder' (gin/architectures/prefix_lm.gin sets both)"),
    (['--gin.TransformerConfig.shared_encoder_decoder=True',
      '--gin.TransformerConfig.num_decoder_layers=3'],
     'it needs architecture encoder_decoder and num_encoder_layers == num_decoder_layers'),
    (['--gin.TransformerConfig.shared_encoder_decoder=True',
      "--gin.TransformerConfig.placement='deepnorm'"],
     "one set of weights cannot take the encoder's and the decoder's residual constants "
     "(placement 'deepnorm')"),
    (['--gin.TransformerConfig.inputs_bidirectional_attention=False'],
     'inputs_bidirectional_attention=False is for a model reading inputs then targets '
     '(prefix_lm=True; gin/architectures/language_model.gin sets both)'),
    (['--gin.TransformerConfig.norm=rms'],  # unquoted: was 'Unable to parse value. (line 1)'
     "--gin.TransformerConfig.norm=rms: rms is not a gin value (a number, a quoted string, @name, "
     "%MACRO, or a list, tuple or dict of them); a string needs quotes: "
     "--gin.TransformerConfig.norm=\"'rms'\""),
    (['--gin.TransformerConfig.d_model=[8,'], '--gin.TransformerConfig.d_model=[8,: [8, is not a gin value'),
    (["--gin.TransformerConfig.norm='rmsnorm"],  # its closing quote left off: was told "''rmsnorm'"
     "a string needs quotes: --gin.TransformerConfig.norm=\"'rmsnorm'\""),
    (['--gin.TransformerConfig.encoder_alpha=2.0'], 'encoder_alpha scales the residual only under DeepNorm'),
    (['--gin.TransformerConfig.subln_cross_attention=True'],  # (ignored: helper-75)
     "subln_cross_attention gives Sub-LN's inner LN to cross-attention: it needs placement 'subln'"),
    # A value of another type (a flag given 'no' tied the embeddings; a rate 'x' failed in JAX).
    (["--gin.TransformerConfig.tie_embeddings='no'"], "TransformerConfig.tie_embeddings must be True or "
                                                      "False, not 'no'"),
    (["--gin.TransformerConfig.dropout_rate='x'"], "TransformerConfig.dropout_rate must be a number, not 'x'"),
    (['--gin.TransformerConfig.ffn=3'], 'TransformerConfig.ffn must be a string or a tuple of strings, not 3'),
    (["--gin.TransformerConfig.decoder_gain='a'"], "decoder_gain must be a number or None, not 'a'"),
    # With a run file: the trainer's configurables are checked; only the data layer's are skipped.
    (['--gin_file=gin/runs/pretrain.gin', '--gin.train.z_los=1'], "doesn't have a parameter named 'z_los'"),
    (['--gin_file=gin/runs/pretrain.gin', '--gin.Transformer.d_model=8'], "No configurable matching 'Transformer'"),
    # A switch of the library's given a string or a number ('False' quoted was taken as True).
    (['--gin_file=gin/runs/pretrain.gin', "--gin.Checkpointer.async_save='False'"],
     "Checkpointer.async_save = 'False': expected True or False, unquoted "
     '(--gin.Checkpointer.async_save=True)'),
    (['--gin_file=gin/runs/pretrain.gin', "--gin.train/DatasetConfig.pack='no'"],
     "train/DatasetConfig.pack = 'no': expected True or False"),
    (['--gin_file=gin/runs/pretrain.gin', '--gin.SWITCH=1',
      '--gin.learning_rate_schedule.warmup_ramp=%SWITCH'],
     'SWITCH (learning_rate_schedule.warmup_ramp) = 1: expected True or False, unquoted '
     '(--gin.SWITCH=True)'),
])
def test_bad_gin_input_fails_with_one_clear_message(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    info.main(['--gin_file=gin/models/t5_tiny.gin', *argv])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert message in err and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err


@needs_data_layer
def test_a_verbosity_in_the_environment_that_is_no_integer_is_named(monkeypatch, capsys):
  """Was: "invalid literal for int() with base 10: 'abc'", naming neither the variable nor the fix."""
  from t5x_variants.cli import info  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv('T5XV_VERBOSITY', 'abc')
  with pytest.raises(SystemExit) as e:
    info.main(['--gin_file=gin/models/t5_tiny.gin'])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err == ("t5xv-info: error: T5XV_VERBOSITY='abc' is not an integer: 0 "
                                       '(the default) or 1 (see --help)\n'), err


@pytest.mark.parametrize('command,argv,message,detail', [
    # t5xv-eval without the run's config.gin, which sets TASK_FEATURE_LENGTHS and the other macros
    ('t5xv-eval', ['--gin_file=gin/runs/eval.gin', "--gin.CHECKPOINT_PATH='/tmp/run'"],
     "invalid gin configuration: macro TASK_FEATURE_LENGTHS is used but not set: give the run's "
     "own config.gin first (--gin_file=RUN/config.gin: it sets the run's macros) or set "
     '--gin.TASK_FEATURE_LENGTHS=VALUE (--verbosity=1 shows the configuration read)',
     'evaluate_checkpoints.batch_size = %EVAL_BATCH_SIZE'),  # gin's operative configuration
    ('t5xv-train', ['--gin_file=gin/runs/pretrain.gin', '--gin_file=gin/models/t5_tiny.gin'],
     'invalid gin configuration: macro MODEL_DIR is required: set --gin.MODEL_DIR=VALUE (a string '
     'in quotes: --gin.MODEL_DIR="\'...\'")',
     'MODEL_DIR/macro.value set to `%gin.REQUIRED` but not subsequently overridden'),
])
def test_a_missing_gin_macro_is_one_line_and_the_rest_at_verbosity_1(command, argv, message,
                                                                      detail, capsys):
  from t5x_variants.cli import eval as eval_cli, train  # pylint: disable=g-import-not-at-top
  main = {'t5xv-eval': eval_cli.main, 't5xv-train': train.main}[command]
  with pytest.raises(SystemExit) as e:
    main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2 and err == f'{command}: error: {message}\n', err
  gin.clear_config()
  try:
    with pytest.raises(SystemExit) as e:
      main([*argv, '--verbosity=1'])
  finally:
    common.set_verbosity(0)
  err = capsys.readouterr().err
  assert e.value.code == 2 and f'{command}: error: {message}\n' in err and detail in err, err


@needs_data_layer
def test_t5xv_train_without_a_gin_file_says_what_to_give(capsys):
  """Was 'unknown task or mixture None; registered: ...'."""
  from t5x_variants.cli import train  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as e:
    train.main([])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith('t5xv-train: error: no --gin_file: give a run file '
                                              'and a model (--gin_file=gin/runs/pretrain.gin'), err


@pytest.mark.parametrize('files,summary', [
    (['gin/experiments/glu_variants/relu.gin'], ['architecture: encoder_decoder', 'ffn: relu']),
    (['gin/experiments/foundation/lm.gin', 'gin/variants/norm/subln.gin'],
     ['architecture: decoder_only', 'norm placement: subln']),
])
def test_t5xv_info_takes_recipes_as_t5xv_train_does(files, summary):
  # In a fresh process, where the data layer's configurables are unknown, as to t5xv-info, which
  # must not import TensorFlow to parse their bindings.
  import subprocess
  import sys
  code = (f'import sys; from t5x_variants.cli import info; info.main({[f"--gin_file={f}" for f in files]}); '
          "assert 'tensorflow' not in sys.modules")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
  gin.clear_config()  # as t5xv-train parses them: with the data layer, MODEL_DIR set
  parse_recipe(files, ["MODEL_DIR = '/tmp/x'"])
  total = count(abstract_params(recipe.build_config()))
  if files == ['gin/experiments/glu_variants/relu.gin']:
    assert total == 222_903_552  # T5 v1.0 base (tests/test_param_counts.py's closed form)
  assert f'Total number of parameters: {total:,}' in out and all(line in out for line in summary), out


def test_gin_files_resolve_from_any_working_directory(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  assert info.main(['--gin_file=gin/models/t5_tiny.gin']) == 0
  assert 'Total number of parameters' in capsys.readouterr().out


def test_variant_counts_script_all_ffns_match_at_tiny_and_base():
  import importlib.util
  path = os.path.join(os.path.dirname(__file__), '..', 'scripts', 'variant_counts.py')
  spec = importlib.util.spec_from_file_location('variant_counts', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for size in ('t5_tiny', 't5_base'):
    rows = module.variant_counts([f'gin/models/{size}.gin'])
    ffn_counts = {total for axis, _, total in rows if axis == 'ffn'}
    assert len(ffn_counts) == 1 and len(rows) == 14


def test_console_entry_point_runs():
  import subprocess
  import sys
  script = os.path.join(os.path.dirname(sys.executable), 't5xv-info')  # installed by pip
  out = subprocess.run([script, '--gin_file=gin/models/t5_tiny.gin'],
                       capture_output=True, text=True, check=True).stdout
  assert 'Total number of parameters: 4,310,016' in out  # t5_tiny, by the closed form below
  from test_param_counts import t5_count
  assert t5_count(64, 4, 16, 192, 32128, 2, 2) == 4_310_016
