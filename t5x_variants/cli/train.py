"""t5xv-train: pretrain or fine-tune a gin-configured model (T5X's train.py).

Also ``python -m t5x_variants.cli.train``. This module wires the data layer (TensorFlow) to the
TensorFlow-free ``t5x_variants.train`` library.

  t5xv-train --gin_file=gin/runs/pretrain.gin --gin_file=gin/models/t5_base.gin \\
    --gin_file=gin/variants/ffn/swiglu.gin --gin.MODEL_DIR="'/tmp/run'"
"""
import contextlib
import os
import sys

import gin
import jax

from t5x_variants.cli import common, ranges, recipe
from t5x_variants.cli import eval_passes
from t5x_variants.sweeps import runner
from t5x_variants.train import locks, multihost, storage


def vocabulary_files(name: str):
  """{'vocab.model': path} when the task's vocabulary is a SentencePiece file (local or gs://)."""
  from t5x_variants.data import tasks  # pylint: disable=g-import-not-at-top
  vocab = tasks.output_vocabulary(tasks.get_task_or_mixture(name))
  path = getattr(vocab, 'sentencepiece_model_file', None)
  return {'vocab.model': path} if path and storage.path(path).exists() else {}


def _init_checkpoint():
  """The gin-bound ``train.init_checkpoint`` (macros resolved), or None."""
  try:
    value = gin.query_parameter('train.init_checkpoint')
  except ValueError:
    return None
  return value.scoped_configurable_fn() if isinstance(value, gin.config.ConfigurableReference) else value


def _local_unwritable(model_dir: str):
  """Why the local directory ``model_dir`` cannot be written (or created), or None."""
  path = os.path.abspath(model_dir)
  if os.path.exists(path):
    if not os.path.isdir(path):
      return 'is a file, not a directory'
    if not os.access(path, os.W_OK | os.X_OK):
      return 'is not writable'
    return None
  missing = [path]  # created to see that they can be, then removed: nothing is left behind
  while not os.path.exists(os.path.dirname(missing[-1])):
    missing.append(os.path.dirname(missing[-1]))
  parent = os.path.dirname(missing[-1])
  if not os.path.isdir(parent):
    return f'cannot be created: {parent} is a file'
  try:
    os.makedirs(path, exist_ok=True)  # exist_ok: another process of this run may probe too
  except OSError as e:
    return f'cannot be created in {parent}: {e.strerror}'
  finally:
    for directory in missing:  # deepest first; only what this call created, now empty
      if os.path.isdir(directory):
        try:
          os.rmdir(directory)
        except OSError:
          break
  return None


def check_model_dir(model_dir, config):
  """ValueError (one line) when ``model_dir`` cannot hold this run: not a string, a file, not
  writable (local paths; on a bucket: one that is missing or these credentials may not use), or
  holding a run of another model, as its model-info.txt says (another
  summary field or parameter; the checkpoints' parameter shapes are checked again on resume)."""
  flag, name = ranges.binding_name('train.model_dir')
  if not isinstance(model_dir, str) or not model_dir.strip():
    raise ValueError(f'{name} = {model_dir!r}: expected the run directory, a path in quotes; set '
                     f'--gin.{flag}="\'/path/to/run\'"')
  if not storage.scheme(model_dir):
    why = _local_unwritable(model_dir)
    if why:
      raise ValueError(f'{name} = {model_dir!r} {why}; set --gin.{flag} to a writable directory '
                       '(a new one for a new run)')
  else:
    why = storage.store_unusable(model_dir)
    if why:
      raise ValueError(f'{name} = {model_dir!r}: {why}')
  info = storage.path(model_dir) / 'model-info.txt'
  if info.exists():
    from t5x_variants.models.summary import differences, model_info  # pylint: disable=g-import-not-at-top
    differ = differences(info.read_text(), model_info(config))
    if differ:
      raise ValueError(
          f'{name} = {model_dir!r} holds a run of another model ({differ}, see its '
          'model-info.txt); '
          f'resume it with its own config.gin (--gin_file={storage.join(model_dir, "config.gin")}) '
          f'or set --gin.{flag} to a new directory')


def _check_rows_fit(config, scope: str, cfg):
  """ValueError if ``cfg``'s rows are longer than a model whose parameters are sized by its
  stacks' lengths (learned positions, a synthesizer) can read: before the run directory is
  written (it failed at the first step)."""
  lengths = cfg.task_feature_lengths or {}
  found = config.overlong_stack(lengths) if cfg.mixture_or_task_name else None
  if found:
    stack, n = found
    most = config.max_length(stack)
    raise ValueError(f'{ranges.binding_name(f"{scope}/DatasetConfig.task_feature_lengths")[1]} = '
                     f'{dict(lengths)} makes {stack} rows of {n} tokens, more than this model '
                     f'reads ({stack}_max_length {most}: its learned positions or synthesizer '
                     f'are sized by it); set TransformerConfig.{stack}_max_length = {n}, or '
                     'shorter lengths')


def check_inputs(config, train_cfg, eval_cfg):
  """Every number and path the training run reads, checked before any data is built or anything
  compiles; the first bad one is a ValueError of one line naming its binding (its macro if it has
  one) and its valid range (``ranges.RANGES``)."""
  from t5x_variants.data.config import check_loss_on_targets_only  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import partitioning  # pylint: disable=g-import-not-at-top
  bindings = gin.get_bindings('train')
  ranges.check_ranges('train', bindings)
  ranges.check_ranges('Checkpointer', gin.get_bindings('Checkpointer'))
  ranges.check_ranges('DatasetConfig', vars(train_cfg), scope='train')
  if eval_cfg.mixture_or_task_name:
    ranges.check_ranges('DatasetConfig', vars(eval_cfg), scope='train_eval')
  for scope, cfg in (('train', train_cfg), ('train_eval', eval_cfg)):
    check_loss_on_targets_only(cfg.loss_on_targets_only, config.data_architecture,
                               f'{scope}/DatasetConfig.loss_on_targets_only')
    _check_rows_fit(config, scope, cfg)
  if config.visible_prefix and not train_cfg.loss_on_targets_only and jax.process_index() == 0:
    print('t5xv-train: warning: a prefix LM with train/DatasetConfig.loss_on_targets_only=False: '
          'the inputs are fully visible, so the position predicting each input token sees it and '
          'their loss can be met by copying (as in the T5 paper\'s code: EXPERIMENTS.md, section 6); '
          'TransformerConfig.inputs_bidirectional_attention=False reads them causally', file=sys.stderr)
  if train_cfg.num_epochs is not None and jax.process_count() > 1:
    # Each host's share of the data ends after its own number of batches: the first host out
    # would stop while the others step on, alone in the step's collectives.
    raise ValueError(f'{ranges.binding_name("train/DatasetConfig.num_epochs")[1]} = '
                     f'{train_cfg.num_epochs} with {jax.process_count()} processes: the hosts\' '
                     'shares of the data would end at different steps; bound the run by its steps '
                     '(train.total_steps) instead')
  if train_cfg.seed is None and jax.process_count() > 1:  # each host would shuffle its own way
    raise ValueError(f'{ranges.binding_name("train/DatasetConfig.seed")[1]} = None with '
                     f'{jax.process_count()} processes: the hosts would shuffle the data each their '
                     'own way, their shares overlapping; set a seed (an integer)')
  if bindings.get('infer_eval'):  # the decoding settings before any step, not at the first eval
    from t5x_variants.train.predictor import DecodeOptions  # pylint: disable=g-import-not-at-top
    DecodeOptions().check(config.vocab_size)
  mesh = (bindings.get('mesh') or partitioning.MeshConfig()).mesh()
  try:
    partitioning.check_batch(train_cfg.batch_size, mesh, bindings.get('num_microbatches', 1))
  except ValueError as e:
    raise ValueError(f'{ranges.binding_name("train/DatasetConfig.batch_size")[1]} = '
                     f'{train_cfg.batch_size}: {e}') from None
  if 'model_dir' in bindings:  # else gin names the missing binding when train is called
    check_model_dir(bindings['model_dir'], config)


@contextlib.contextmanager
def held_run_dir():
  """This host's lock on the gin-bound run directory while a run trains, taken by process 0
  (``train/locks.py``): a second t5xv-train on it (the same command twice, a sweep's trainer and
  one started by hand) is one error before it writes anything, instead of two runs saving the same
  checkpoints and appending to one metrics.jsonl."""
  model_dir = gin.get_bindings('train').get('model_dir')
  held = []

  def take():
    handle = locks.exclusive(locks.host_file('t5xv-run', model_dir) + '.lock')
    if handle is None:
      raise ValueError(f'another t5xv-train is training in {model_dir} on this host; wait for it '
                       'to end or stop it (it saves a checkpoint on SIGTERM), or use another '
                       'model_dir')
    held.append(handle)
  if isinstance(model_dir, str):  # else check_model_dir or gin has named what is wrong
    multihost.process0_does(f'locking {model_dir}', take)
  try:
    yield
  finally:
    for handle in held:
      handle.close()


def _data_description(config, train_cfg, eval_cfg):
  """What decides this run's batches (``train/prebuilt.py``)."""
  from t5x_variants.train import prebuilt  # pylint: disable=g-import-not-at-top
  bindings = gin.get_bindings('train')
  return prebuilt.description(train_cfg, eval_cfg, config.data_architecture,
                              bindings.get('total_steps'), bindings.get('eval_batches'),
                              _init_checkpoint())


def _train_prebuilt(args, config, desc):
  """Trains from the pre-built batches under ``args.batches_dir``: no data layer."""
  from t5x_variants.train import prebuilt, trainer  # pylint: disable=g-import-not-at-top
  if jax.process_count() > 1:
    raise common.UsageError('--batches_dir serves one process; a multi-host run reads its data '
                            'through the data layer (leave --batches_dir out)')
  data = prebuilt.Prebuilt(args.batches_dir, desc)
  if data.meta['vocabulary_size']:
    common.check_vocabulary_size(config, data.meta['vocabulary_size'], data.directory)
  return trainer.train(config, data.train, eval_data=data.evals if data.meta['eval_tasks'] else None,
                       files=data.files())


def _decoded_metrics(config, eval_cfg, subtasks):
  """(task name, step, parameters, max_examples) -> the task's metrics of decoded predictions and
  of scores, as t5xv-eval computes them (``eval_passes.pass_metrics``, which also writes the examples'
  predictions under RUN/inference_eval/train/), on the eval split at the eval lengths and batch size
  with the gin-bound mesh and ``DecodeOptions`` ({} for a task without such metrics):
  ``train.infer_eval``. The decoder compiles at its first use."""
  from t5x_variants.train.predictor import Predictor  # pylint: disable=g-import-not-at-top
  passes = {t.name: (t, eval_passes.inference_passes(t, config, True, None)) for t in subtasks}
  bindings = gin.get_bindings('train')
  if bindings.get('infer_eval'):  # a split without labels: metrics of nothing
    for task, todo in passes.values():
      if todo:
        eval_passes.check_labelled(task, eval_cfg.split, eval_cfg.task_feature_lengths)
  predictor = []

  def metrics(name, step, params, max_examples):
    task, todo = passes[name]
    if not todo:
      return {}
    if not predictor:
      predictor.append(Predictor(config, bindings.get('mesh')))
    predictor[0].params = params
    return eval_passes.pass_metrics(predictor[0], task, todo, eval_cfg.split,
                                 eval_cfg.task_feature_lengths, eval_cfg.batch_size, max_examples,
                                 predictions_dir=storage.join(bindings['model_dir'], 'inference_eval',
                                                              'train'), step=step)
  return metrics


def _data_layer(config, train_cfg, eval_cfg):
  """(train_data, eval_data, eval_metric_fns, decoded_metrics, files, vocabulary_size) of the run
  from the data layer's tasks, each task checked against the model first."""
  from t5x_variants.data import classification, pipeline, tasks  # pylint: disable=g-import-not-at-top
  vocabulary_size = None
  if train_cfg.mixture_or_task_name:  # a model that does not fit the data: one clear error
    train_task = tasks.get_task_or_mixture(train_cfg.mixture_or_task_name)
    classification.check_model(train_task, config)
    common.check_vocabulary_size(config, train_task, train_cfg.mixture_or_task_name)
    vocabulary_size = common.vocabulary_size(train_task)
  host = (jax.process_index(), jax.process_count())
  train_data = lambda: pipeline.config_batches(train_cfg, config.data_architecture, *host)
  eval_data = eval_metric_fns = decoded = None
  if eval_cfg.mixture_or_task_name:
    eval_task = tasks.get_task_or_mixture(eval_cfg.mixture_or_task_name)
    subtasks = getattr(eval_task, 'tasks', None) or [eval_task]
    names = [t.name for t in subtasks]
    if classification.check_model(eval_task, config):  # GLUE metrics at eval
      eval_metric_fns = classification.metric_fns(subtasks)
    eval_data = lambda: {n: pipeline.eval_batches(n, eval_cfg.task_feature_lengths,
                                                  config.data_architecture, eval_cfg.batch_size,
                                                  eval_cfg.split, eval_cfg.loss_on_targets_only)
                           for n in names}
    decoded = _decoded_metrics(config, eval_cfg, subtasks)
  files = vocabulary_files(train_cfg.mixture_or_task_name)
  return train_data, eval_data, eval_metric_fns, decoded, files, vocabulary_size


def _train_from_data_layer(args, config, train_cfg, eval_cfg):
  """Trains from the data layer's batches; with ``--write_batches`` writes them instead (and
  returns None)."""
  from t5x_variants.train import prebuilt, trainer  # pylint: disable=g-import-not-at-top
  if _init_checkpoint():  # fine-tuning tokenizes as the pretrained run did
    recipe.use_run_vocabulary(_init_checkpoint())
  train_data, eval_data, eval_metric_fns, decoded, files, vocabulary_size = multihost.agree(
      "finding the run's tasks", lambda: _data_layer(config, train_cfg, eval_cfg))
  if args.write_batches:
    if eval_metric_fns or jax.process_count() > 1:
      raise common.UsageError('--write_batches serves one-process pretraining runs (no '
                              'classification metrics, which need the data layer at eval)')
    directory = prebuilt.write(args.batches_dir, _data_description(config, train_cfg, eval_cfg),
                               train_data, eval_data or dict, files, vocabulary_size,
                               {name: gin.get_bindings(name) for name in recipe.DATA_CONFIGURABLES})
    print(f'batches: {directory}')
    return None
  return trainer.train(config, train_data, eval_data=eval_data, eval_metric_fns=eval_metric_fns,
                       files=files, decoded_metrics=decoded)


def main(argv=None):
  with common.clear_errors('t5xv-train'):
    p = common.parser('t5xv-train', __doc__)
    p.add_argument('--batches_dir', default=None, metavar='ROOT',
                   help='pre-built batches: train from those under ROOT, without TensorFlow')
    p.add_argument('--write_batches', action='store_true',
                   help='with --batches_dir: write the run\'s batches under ROOT and stop')
    args, config = recipe.setup(p, argv, with_data=lambda a: not a.batches_dir or a.write_batches)
    if not args.gin_file:
      raise common.UsageError('no --gin_file: give a run file and a model (--gin_file=gin/runs/'
                              'pretrain.gin --gin_file=gin/models/t5_base.gin), a recipe of '
                              'gin/experiments/, or a run\'s config.gin; t5xv-quickstart needs none')
    if args.write_batches and not args.batches_dir:
      raise common.UsageError('--write_batches needs --batches_dir=ROOT (where to write them)')
    if args.batches_dir:
      from t5x_variants.train import prebuilt  # pylint: disable=g-import-not-at-top
      prebuilt.local_root(args.batches_dir)
    from t5x_variants.data.config import DatasetConfig  # pylint: disable=g-import-not-at-top
    runner.stop_with_sweep()
    with gin.config_scope('train'):
      train_cfg = DatasetConfig()
    with gin.config_scope('train_eval'):
      eval_cfg = DatasetConfig()
    multihost.agree("checking the run's settings", lambda: check_inputs(config, train_cfg, eval_cfg))
    with contextlib.nullcontext() if args.write_batches else held_run_dir():
      if args.batches_dir and not args.write_batches:
        result = _train_prebuilt(args, config, _data_description(config, train_cfg, eval_cfg))
      else:
        result = _train_from_data_layer(args, config, train_cfg, eval_cfg)
    if result is None:
      return 0
  print(f'done: step {result["step"]}' + (f', loss {result["loss"]:.4f}' if 'loss' in result else ''))
  return 0


if __name__ == '__main__':
  sys.exit(main())
