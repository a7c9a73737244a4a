"""Every experiment gin file parses and builds, holds its paper's headline settings (the GLU
recipe's 222,903,552 parameters for every FFN, LayerNorm and Adam for DeepNet / Magneto / Xiong,
Adafactor for the T5-based papers), and each family's small recipe trains."""
import dataclasses
import glob
import os
import re

import flax.linen as nn
import gin
import jax
import numpy as np
import pytest

from conftest import needs_data_layer, parse_recipe

from t5x_variants import PACKAGE_DIR
from t5x_variants.cli import recipe
from t5x_variants.models import build_model, init_inputs
from jax.sharding import AbstractMesh
from t5x_variants.train import aot, optimizer, partitioning, targets

EXPERIMENTS = os.path.join(PACKAGE_DIR, 'gin', 'experiments')
FFNS = ['relu', 'gelu', 'swish', 'glu', 'bilinear', 'reglu', 'geglu', 'swiglu']
PLACEMENT_FAMILIES = ('deepnet', 'foundation', 'vanilla')
# Files that are added to a recipe rather than run alone.
OVERLAYS = {'small_scale.gin', 'steps_65k.gin', 'no_warmup.gin'}


def experiment_files():
  return sorted(os.path.relpath(p, PACKAGE_DIR)
                for p in glob.glob(os.path.join(EXPERIMENTS, '**', '*.gin'), recursive=True))


def load(*files, bindings=()):
  """The TransformerConfig of gin ``files`` (+ bindings), parsed as t5xv-train parses them."""
  gin.clear_config()
  parse_recipe(files, bindings)
  return recipe.build_config()


def query(name):
  """A bound value (macros resolved); for a reference (``@adam``) the configurable's name."""
  value = gin.query_parameter(name)
  if not isinstance(value, gin.config.ConfigurableReference):
    return value
  return value.scoped_configurable_fn() if value.selector == 'gin.macro' else value.selector


def num_params(config) -> int:
  model = build_model(config)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *init_inputs(config)))['params']
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nn.unbox(params)))


def test_every_file_is_covered():
  names = {os.path.relpath(p, 'gin/experiments') for p in experiment_files()}
  assert {f'glu_variants/{f}.gin' for f in FFNS} <= names
  for family in PLACEMENT_FAMILIES + ('synthesizer',):
    assert any(n.startswith(family) and n.endswith('_small.gin') for n in names), family


@needs_data_layer
@pytest.mark.parametrize('path', experiment_files())
def test_every_experiment_file_builds(path):
  """Alone (overlays after a recipe of their family), its model config validates and its
  optimizer and schedule build (finetune files: after a pretraining run's config)."""
  name = os.path.basename(path)
  family = os.path.dirname(path)
  files = [path]
  if name in OVERLAYS or name.startswith('depth_'):
    base = {'gin/experiments': 'gin/experiments/glu_variants/small.gin',
            'gin/experiments/glu_variants': 'gin/experiments/glu_variants/relu.gin'}.get(
                family, os.path.join(family, 'span_corruption.gin'))
    files = [base, path]
  if name == 'finetune.gin':
    files = [os.path.join(family, 'relu.gin' if 'glu' in family else 'span_corruption.gin'), path]
  load(*files, bindings=['MODEL_DIR = "/tmp/unused"'] +
       (['INITIAL_CHECKPOINT_PATH = "/tmp/unused"'] if name == 'finetune.gin' else []))
  schedule = optimizer.learning_rate_schedule()
  assert float(schedule(query('learning_rate_schedule.warmup_steps') or 0)) > 0
  import seqio  # pylint: disable=g-import-not-at-top
  from t5x_variants.data import pipeline, tasks  # pylint: disable=g-import-not-at-top
  with gin.config_scope('train'):
    data = pipeline.DatasetConfig()
  added = tasks.register_tasks()  # with this recipe's vocabulary (T5's for the full-scale ones)
  try:
    tasks.get_task_or_mixture(data.mixture_or_task_name)  # registered (the data need not be here)
  finally:  # a later test's tasks must get its own vocabulary, not this recipe's
    for name in sorted(added, key=lambda n: n not in seqio.MixtureRegistry.names()):
      (seqio.MixtureRegistry if name in seqio.MixtureRegistry.names() else seqio.TaskRegistry).remove(name)
  assert min(data.task_feature_lengths.values()) > 0
  params = {'decoder': {'layers': {'w': np.zeros((2, 3, 4), np.float32)}}}
  optimizer.make_optimizer(params, schedule).init(params)


@needs_data_layer
@pytest.mark.parametrize('ffn', FFNS)
def test_glu_recipe_is_t5_v1_0_base_with_222_903_552_parameters(ffn):
  c = load(f'gin/experiments/glu_variants/{ffn}.gin', bindings=['MODEL_DIR = "/tmp/unused"'])
  assert num_params(c) == 222_903_552
  assert c.activations == {'relu': ('relu',), 'gelu': ('gelu',), 'swish': ('swish',)}.get(ffn, c.activations)
  assert (c.tie_embeddings, c.dropout_rate, c.norm, c.placement, c.vocab_size) == (True, 0.0, 'rmsnorm', 'pre', 32128)
  assert query('make_optimizer.optimizer') == 'adafactor'
  assert query('vocabulary.kind') == 't5'
  assert query('train.total_steps') == 524_288
  lr = optimizer.learning_rate_schedule()
  assert float(lr(0)) == pytest.approx(0.01) and float(lr(40_000)) == pytest.approx(0.005)
  assert float(lr(524_288 - 26_214)) == pytest.approx(0.5 / np.sqrt(524_288 - 26_214), rel=1e-4)
  assert float(lr(524_288)) == 0


@needs_data_layer
@pytest.mark.parametrize('variant', sorted(os.path.basename(p)[:-4] for p in glob.glob(
    os.path.join(PACKAGE_DIR, 'gin', 'variants', 'attention', '*.gin'))))
def test_in_the_synthesizer_recipe_only_dot_product_attention_has_the_relative_bias(variant):
  """As the authors' Synthesizer layer (relative_attention_type None): a synthesizer, alone or in
  a mixture, gets no relative position bias unless synthesizer_relative_bias is set."""
  files = ('gin/experiments/synthesizer/span_corruption.gin', f'gin/variants/attention/{variant}.gin')
  for extra, expected in (((), variant == 'dot_product'),
                          (('TransformerConfig.synthesizer_relative_bias = True',), True)):
    c = load(*files, bindings=['MODEL_DIR = "/tmp/unused"', *extra])
    model = build_model(c)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *init_inputs(c)))['params']
    assert ('relpos_bias' in params['encoder'], 'relpos_bias' in params['decoder']) == (expected, expected)


@pytest.mark.parametrize('path', [p for p in experiment_files()
                                  if os.path.basename(os.path.dirname(p)) in PLACEMENT_FAMILIES
                                  and os.path.basename(p) not in OVERLAYS
                                  and not os.path.basename(p).startswith('depth_')])
@pytest.mark.parametrize('placement', ['pre_ln', 'post_ln', 'deepnorm', 'subln'])
def test_placement_recipes_use_layernorm_and_adam(path, placement):
  """DeepNet, Magneto and Xiong et al. trained with LayerNorm (not RMSNorm) and Adam."""
  c = load(path, f'gin/variants/norm/{placement}.gin', bindings=['MODEL_DIR = "/tmp/unused"'])
  assert c.norm == 'layernorm' and c.placement == {'pre_ln': 'pre', 'post_ln': 'post'}.get(placement, placement)
  assert query('make_optimizer.optimizer') in ('adam', 'adamw')
  assert c.init_scheme == 'xavier' and c.use_bias


@pytest.mark.parametrize('path', ['gin/experiments/foundation/lm.gin', 'gin/experiments/foundation/mlm.gin',
                                  'gin/experiments/foundation/span_corruption.gin',
                                  'gin/experiments/deepnet/span_corruption.gin'])
@pytest.mark.parametrize('placement', ['subln', 'deepnorm'])
def test_the_code_init_overlay_changes_the_init_alone(path, placement):
  """A recipe runs as the papers' pseudocode (xavier) or, adding gin/variants/init/torchscale.gin,
  as their released code: the two runs' configs differ in init_scheme only, and the optimizer,
  schedule and data bindings are the same."""
  files = (path, f'gin/variants/norm/{placement}.gin')
  paper = load(*files, bindings=['MODEL_DIR = "/tmp/unused"'])
  paper_gin = gin.config_str()
  code = load(*files, 'gin/variants/init/torchscale.gin', bindings=['MODEL_DIR = "/tmp/unused"'])
  code_gin = gin.config_str()
  assert (paper.init_scheme, code.init_scheme) == ('xavier', 'torchscale')
  assert dataclasses.replace(paper, init_scheme='torchscale') == code
  differ = set(paper_gin.splitlines()) ^ set(code_gin.splitlines())
  assert all('init_scheme' in line for line in differ), differ


def test_magneto_recipes_follow_the_torchscale_example_commands():
  """Flags of torchscale's GPT / BERT / MT example commands (examples/fairseq/README.md)."""
  lm = load('gin/experiments/foundation/lm.gin', bindings=['MODEL_DIR = "/tmp/unused"'])
  assert (lm.tie_embeddings, lm.scale_tied_logits, lm.activations, lm.position_embedding) == (
      True, False, ('gelu_exact',), 'sinusoidal')
  assert (lm.dropout_rate, lm.rate('attention'), lm.rate('activation'), lm.dropout_broadcast) == (0.1, 0.1, 0.0, False)
  assert (query('adamw.eps'), query('adamw.weight_decay'), query('learning_rate_schedule.warmup_steps')) == (1e-8, 0.01, 750)
  mlm = load('gin/experiments/foundation/mlm.gin', bindings=['MODEL_DIR = "/tmp/unused"'])
  assert (mlm.tie_embeddings, mlm.scale_embeddings, mlm.rate('attention')) == (True, False, 0.0)
  assert (query('adam.eps'), query('make_optimizer.global_norm_clip'), query('learning_rate_schedule.warmup_steps')) == (
      1e-6, 2.0, 10000)
  mt = load('gin/experiments/deepnet/span_corruption.gin', bindings=['MODEL_DIR = "/tmp/unused"'])
  assert (mt.activations, mt.dropout_rate, mt.d_model, mt.position_embedding) == (('relu',), 0.3, 512, 'sinusoidal')
  assert (query('adamw.weight_decay'), query('learning_rate_schedule.name')) == (1e-4, 'noam')
  assert 'label_smoothing' not in gin.config_str()  # no --criterion: fairseq's plain cross-entropy


def test_xiong_bert_recipe_has_berts_optimizer():
  """vanilla/mlm.gin: BERT's AdamW (weight decay 0.01, not on norms and biases) clipped at 1.0."""
  load('gin/experiments/vanilla/mlm.gin', 'gin/variants/norm/post_ln.gin',
       bindings=['MODEL_DIR = "/tmp/unused"'])
  assert query('make_optimizer.optimizer') == 'adamw'
  assert (query('adamw.b1'), query('adamw.b2'), query('adamw.eps'), query('adamw.weight_decay'),
          query('adamw.decay_norms_and_biases'), query('make_optimizer.global_norm_clip')) == (
      0.9, 0.999, 1e-6, 0.01, False, 1.0)
  assert float(optimizer.learning_rate_schedule()(10_000)) == pytest.approx(1e-4)


def test_no_warmup_arm_differs_from_its_twin_in_the_warmup_alone():
  """vanilla/no_warmup.gin: peak rate from step 0; from the end of the twin's warmup on, the same rate."""
  schedules = []
  for extra in ((), ('gin/experiments/vanilla/no_warmup.gin',)):
    load('gin/experiments/vanilla/span_corruption.gin', 'gin/variants/norm/pre_ln.gin', *extra,
         bindings=['MODEL_DIR = "/tmp/unused"'])
    schedules.append(optimizer.learning_rate_schedule())
  twin, flat = schedules
  assert float(flat(0)) == pytest.approx(5e-4) and float(twin(0)) == 0.0
  for step in (4000, 10_000, 99_999):
    assert float(flat(step)) == pytest.approx(float(twin(step)))


def test_depth_files_set_both_stacks_and_the_deepnorm_constants_follow():
  c = load('gin/experiments/deepnet/span_corruption.gin', 'gin/variants/norm/deepnorm.gin',
           'gin/experiments/deepnet/depth_50.gin', bindings=['MODEL_DIR = "/tmp/unused"'])
  assert (c.num_encoder_layers, c.num_decoder_layers) == (50, 50)
  assert c.residual_constants()['decoder'] == pytest.approx(((3 * 50)**0.25, (12 * 50)**-0.25))


SMALL_RUNS = [
    ('gin/experiments/glu_variants/small.gin', 'gin/variants/ffn/swiglu.gin'),
    ('gin/experiments/foundation/lm_small.gin', 'gin/variants/norm/subln.gin'),
    ('gin/experiments/foundation/mlm_small.gin', 'gin/variants/norm/pre_ln.gin'),
    ('gin/experiments/deepnet/span_corruption_small.gin', 'gin/variants/norm/deepnorm.gin'),
    ('gin/experiments/synthesizer/span_corruption_small.gin', 'gin/variants/attention/synth_random_plus_v.gin'),
    ('gin/experiments/synthesizer/lm_small.gin', 'gin/variants/attention/synth_fixed_random.gin'),
    ('gin/experiments/vanilla/span_corruption_small.gin', 'gin/variants/norm/post_ln.gin'),
    ('gin/experiments/t5/lm_objective_small.gin', 'gin/architectures/prefix_lm.gin'),
]


@needs_data_layer
@pytest.mark.slow
@pytest.mark.parametrize('recipe,variant', SMALL_RUNS, ids=lambda p: os.path.basename(p))
def test_small_recipes_train(recipe, variant, tmp_path):
  """A few steps of each family's small recipe through t5xv-train, on the embedded corpus."""
  from t5x_variants.cli import train
  gin.clear_config()
  assert train.main([f'--gin_file={recipe}', f'--gin_file={variant}', f'--gin.MODEL_DIR="{tmp_path}"',
                     '--gin.TRAIN_STEPS=3', '--gin.BATCH_SIZE=4', '--gin.train.log_period=1',
                     '--gin.train.eval_period=0', '--gin.learning_rate_schedule.warmup_steps=1']) == 0
  assert (tmp_path / 'checkpoint_3').exists()


@needs_data_layer
def test_the_language_model_on_the_lm_objective_learns_the_whole_row_and_is_scored_on_the_targets(tmp_path):
  """T5's language model on the LM objective (``train/DatasetConfig.loss_on_targets_only=False``,
  EXPERIMENTS §6): the training loss covers the inputs too, the held-out loss the targets alone,
  as for the models it is compared with; the eval scope's binding moves the held-out loss."""
  from t5x_variants.cli import train
  from t5x_variants.sweeps.runs import read_records

  def metrics(name, *bindings):
    gin.clear_config()
    assert train.main(['--gin_file=gin/experiments/t5/lm_objective_small.gin',
                       '--gin_file=gin/architectures/language_model.gin',
                       f'--gin.MODEL_DIR="{tmp_path / name}"', '--gin.TRAIN_STEPS=1',
                       '--gin.BATCH_SIZE=4', '--gin.train.log_period=1', '--gin.train.eval_period=1',
                       '--gin.train.eval_batches=1', *bindings]) == 0
    rows = read_records(str(tmp_path / name))
    return [next(r['num_tokens'] for r in rows if r['kind'] == kind) for kind in ('train', 'eval')]

  targets_train, targets_eval = metrics('targets')
  whole_train, whole_eval = metrics('whole', '--gin.train/DatasetConfig.loss_on_targets_only=False')
  assert whole_eval == targets_eval
  assert whole_train == 4 * 129 > targets_train  # every row: a 127-token chunk and two EOS
  _, scored_whole = metrics('scored_whole', '--gin.train_eval/DatasetConfig.loss_on_targets_only=False')
  assert scored_whole == 4 * 129  # the eval scope's own binding


# Full-scale recipes: run alone (after a pretraining recipe for fine-tuning files).
FULL_SCALE = [p for p in experiment_files()
              if not p.endswith('_small.gin') and os.path.basename(p) not in OVERLAYS | {
                  'small.gin', 'base.gin', 'quickstart.gin'}
              and not os.path.basename(p).startswith('depth_')]
TARGET = re.compile(r'^# Target: (\S+)', re.M)


def target_of(path):
  """The slice a recipe's header names (``# Target: v5e:4x4 ...``), in it or the files it
  includes, the recipe's own first."""
  with open(os.path.join(PACKAGE_DIR, path)) as f:
    text = f.read()
  m = TARGET.search(text)
  if m:
    return m.group(1)
  for included in re.findall(r"^include '([^']+)'", text, re.M):
    found = target_of(included)
    if found:
      return found
  return None


@needs_data_layer
@pytest.mark.parametrize('path', FULL_SCALE)
def test_full_scale_recipes_name_a_slice_their_mesh_fits_in_bfloat16(path):
  """The slice is a valid topology and the recipe's mesh and batch split over its chips evenly
  (the checks every command makes before compiling; the memory is BENCHMARKS.md's compile table,
  made by scripts/compile_table.py); the small counterparts stay float32 (next test)."""
  topology = target_of(path)
  assert topology, f'{path} names no target slice (a "# Target: <topology>" header line)'
  _, chips = targets.parse_topology(topology)
  family = os.path.dirname(path)
  files = [path]
  if os.path.basename(path) == 'finetune.gin':
    files = [os.path.join(family, 'relu.gin' if 'glu' in family else 'span_corruption.gin'), path]
  config = load(*files, bindings=['MODEL_DIR = "/tmp/unused"', 'INITIAL_CHECKPOINT_PATH = "/tmp/unused"'])
  assert config.dtype == 'bfloat16'
  mesh_config = partitioning.MeshConfig()
  n = int(np.prod(chips))
  data = n // mesh_config.model if mesh_config.data == -1 else mesh_config.data
  mesh = AbstractMesh((1, data, mesh_config.model), partitioning.MESH_AXES)
  assert mesh.size == n
  model = build_model(config)
  boxed = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *init_inputs(config))['params'])
  partitioning.check_mesh(boxed, mesh, mesh_config.rules())
  from t5x_variants.data import pipeline  # pylint: disable=g-import-not-at-top
  with gin.config_scope('train'):
    batch = pipeline.DatasetConfig().batch_size
  partitioning.check_batch(batch, mesh, aot.train_options()['num_microbatches'])


@pytest.mark.parametrize('path', [p for p in experiment_files() if p.endswith('small.gin')])
def test_small_recipes_run_in_float32_without_remat(path):
  config = load(path, 'gin/variants/ffn/relu.gin', bindings=['MODEL_DIR = "/tmp/unused"'])
  assert (config.dtype, config.remat_policy('gpu'), config.remat_policy('tpu')) == ('float32', 'none', 'none')


def test_the_warmup_tables_are_those_of_the_committed_runs(capsys):
  """EXPERIMENTS.md section 7's tables are what ``scripts/warmup_pairs.py`` computes from the
  committed run files, row for row."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(PACKAGE_DIR)
  spec = importlib.util.spec_from_file_location('warmup_pairs', os.path.join(repo, 'scripts', 'warmup_pairs.py'))
  warmup_pairs = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(warmup_pairs)
  with open(os.path.join(repo, 'EXPERIMENTS.md')) as f:
    text = f.read()
  for name in ('xiong_warmup', 'xiong_warmup_6', 'xiong_warmup_6_lr1e-3'):
    capsys.readouterr()
    warmup_pairs.main(os.path.join(repo, 'docs', 'experiments', 'runs', name))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith('| ')]
    assert len(rows) == 11 and all(row in text for row in rows), name
