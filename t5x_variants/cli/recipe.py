"""A run's recipe: gin files and bindings applied T5X's way (``--gin_file`` repeatable, later
files override earlier ones; ``--gin.KEY=VALUE``; ``--gin_search_paths``), every failure one line
that names the culprit and its valid choices, and the model configuration they bind. Gin files are
found relative to the working directory, the search paths, and the installed package, which ships
``gin/`` so that ``--gin_file=gin/models/t5_base.gin`` works from anywhere; a run's own
``config.gin`` may be read from a bucket."""
import argparse
import contextlib
import inspect
import logging
import os
import re
import typing
from typing import Callable, List, Mapping, Optional, Sequence, Union

import gin

from t5x_variants import PACKAGE_DIR
from t5x_variants.cli import common, ranges
from t5x_variants.models.config import TransformerConfig
from t5x_variants.train import storage


QUOTES = '\'"'  # a value's own quotes, one of them left off


class GinConfigError(ValueError):
  """A gin file or binding that cannot be applied, with what to do about it (one line).
  ``detail``: gin's whole message (e.g. with the configuration it read), shown at --verbosity=1."""

  def __init__(self, message: str, detail: Optional[str] = None):
    super().__init__(message)
    self.detail = detail


# The configurables a gin file may bind; listed in error messages.
CONFIGURABLES = {'TransformerConfig': TransformerConfig}


def _explain(message: str, configurables: Mapping[str, Callable]) -> str:
  """Adds the valid choices to gin's message about an unknown configurable or parameter; says
  how to set a macro that is used but unset or still ``%gin.REQUIRED``."""
  unset = re.match(r"No bindings specified for '(\w+)/gin\.macro'", message)
  if unset:
    name = unset.group(1)
    return (f'macro {name} is used but not set: give the run\'s own config.gin first '
            f'(--gin_file=RUN/config.gin: it sets the run\'s macros) or set --gin.{name}=VALUE '
            f'(--verbosity=1 shows the configuration read)')
  required = re.match(r'(\w+)/macro\.value set to `%gin\.REQUIRED`', message)
  if required:
    name = required.group(1)
    return (f'macro {name} is required: set --gin.{name}=VALUE (a string in quotes: '
            f'--gin.{name}="\'...\'")')
  unknown_param = re.search(r"Configurable '([\w.]+)' doesn't have a parameter", message)
  if unknown_param and unknown_param.group(1) in configurables:
    params = inspect.signature(configurables[unknown_param.group(1)]).parameters
    return f'{message} Valid parameters: {", ".join(params)}'
  if 'No configurable matching' in message:
    return f'{message} Valid configurables: {", ".join(configurables)}'
  return message


def _one_line(message: str) -> str:
  """gin's message on one line: what is wrong and where (its first three lines)."""
  return ' '.join([line.strip() for line in message.splitlines() if line.strip()][:3])


@contextlib.contextmanager
def _quiet_search():
  """gin logs an ERROR for every search path a file is not in; only the final failure matters."""
  root = logging.getLogger()
  level = root.level
  root.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    root.setLevel(level)


def _open_uri(path: str):
  return storage.path(path).open()


def _is_uri_file(path: str) -> bool:
  """A gin file on an object store (gs://bucket/run/config.gin), read through epath."""
  return bool(storage.scheme(path)) and storage.path(path).exists()


def _unparsable(bindings: Sequence[str]) -> Optional[str]:
  """The first binding whose value gin cannot parse (an unquoted string), or None."""
  for binding in bindings:
    try:
      list(gin.config_parser.ConfigParser(binding, gin.config.ParserDelegate(skip_unknown=True)))
    except Exception:  # pylint: disable=broad-except  (SyntaxError, tokenize.TokenError)
      return binding
  return None


def parse_gin(gin_files: List[str], bindings: List[str], search_paths: Sequence[str] = (),
              configurables: Mapping[str, Callable] = None, skip_unknown: bool = False):
  """Applies gin files then bindings; any failure becomes one GinConfigError naming the culprit.

  ``configurables`` adds the caller's own configurables to those named in error messages;
  ``skip_unknown``: bindings of configurables not imported are ignored (a run's config.gin read
  for its model only)."""
  for path in [os.getcwd(), *[p for p in search_paths if p], PACKAGE_DIR]:
    gin.add_config_file_search_path(path)
  gin.config.register_file_reader(_open_uri, _is_uri_file)  # idempotent
  try:
    with _quiet_search():
      gin.parse_config_files_and_bindings(gin_files, bindings, skip_unknown=skip_unknown)
  except (IOError, OSError) as e:
    raise GinConfigError(f'cannot read gin file: {str(e).rstrip(".")}. Paths are resolved '
                         f'against the working directory, --gin_search_paths and {PACKAGE_DIR}') from e
  except (ValueError, SyntaxError, NameError, TypeError, KeyError) as e:
    bad = _unparsable(bindings)
    if bad:
      key, _, value = bad.partition('=')
      key, value = key.strip(), value.strip()
      raise GinConfigError(f'--gin.{key}={value}: {value} is not a gin value (a number, a quoted '
                           f'string, @name, %MACRO, or a list, tuple or dict of them); a string '
                           f'needs quotes: --gin.{key}="\'{value.strip(QUOTES)}\'"',
                           detail=str(e)) from e
    known = {**CONFIGURABLES, **(configurables or {})}
    raise GinConfigError(f'invalid gin configuration: {_explain(_one_line(str(e)), known)}',
                         detail=str(e)) from e


def build_config() -> TransformerConfig:
  """The gin-bound TransformerConfig; invalid values fail with their valid choices."""
  try:
    return TransformerConfig()
  except ValueError as e:
    raise GinConfigError(f'invalid model configuration: {e}') from e


def gin_macro(name: str):
  """The value the parsed gin binds to macro ``name`` (a run file's ``BATCH_SIZE``), or None."""
  try:
    return gin.query_parameter(f'%{name}')
  except ValueError:
    return None


# The data layer's configurables: without it (no TensorFlow) their bindings are skipped
# (``DatasetConfig`` needs no TensorFlow and is always read).
DATA_CONFIGURABLES = ('vocabulary', 'local_corpus_files', 'register_tasks', 'span_corruption')
# Run-file macros that only the trainer reads: bound to a placeholder by the tools that need only
# the model and its step, so that run files and recipes parse without them.
RUN_MACROS = ('MODEL_DIR', 'INITIAL_CHECKPOINT_PATH')


def library_configurables(with_data: bool = True) -> Mapping[str, Callable]:
  """The training library's configurables (and the data layer's), for error messages. Importing
  the data layer imports TensorFlow, which must not take the accelerators from JAX."""
  from t5x_variants.data.config import DatasetConfig  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import checkpoints, optimizer, partitioning, predictor, trainer  # pylint: disable=g-import-not-at-top
  known = {'train': trainer.train, 'DatasetConfig': DatasetConfig, 'Checkpointer': checkpoints.Checkpointer,
           'MeshConfig': partitioning.MeshConfig, 'make_optimizer': optimizer.make_optimizer,
           'adafactor': optimizer.adafactor, 'adam': optimizer.adam, 'adamw': optimizer.adamw,
           'learning_rate_schedule': optimizer.learning_rate_schedule,
           'DecodeOptions': predictor.DecodeOptions}
  if with_data:
    common.import_data_layer()
    from t5x_variants.data import corpus, span_corruption, tasks, vocab  # pylint: disable=g-import-not-at-top
    known.update(zip(DATA_CONFIGURABLES, (vocab.vocabulary, corpus.local_corpus_files,
                                          tasks.register_tasks, span_corruption.span_corruption)))
  return known


def _bound_value(value):
  """A binding's value with macros followed (``%NAME``); a reference to anything else stays one."""
  while isinstance(value, gin.config.ConfigurableReference) and value.selector == 'gin.macro':
    value = gin.query_parameter('%' + value.scoped_selector.rsplit('/', 1)[0])
  return value


def check_switches(configurables: Mapping[str, Callable], scopes=('', 'train', 'train_eval')):
  """ValueError (one line) for a binding of a ``bool`` parameter that is not True or False: the
  string 'False' (quoted) is true, and was taken as True without a word."""
  for name, fn in configurables.items():
    try:
      hints = typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else inspect.unwrap(fn))
    except Exception:  # pylint: disable=broad-except  (annotations this module cannot resolve)
      continue
    switches = {p for p, kind in hints.items()
                if kind is bool or kind == Optional[bool]}
    for scope in scopes:
      selector = f'{scope}/{name}' if scope else name
      for param, value in gin.get_bindings(selector, resolve_references=False).items():
        value = _bound_value(value)
        if param in switches and not (isinstance(value, bool) or value is None and
                                      hints[param] == Optional[bool]):
          flag, binding = ranges.binding_name(f'{selector}.{param}')
          raise ValueError(f'{binding} = {value!r}: expected True or False, unquoted '
                           f'(--gin.{flag}=True)')


def parse_recipe(gin_files: List[str], bindings: List[str], search_paths: Sequence[str] = (),
                 with_data: bool = True, configurables: Optional[Mapping[str, Callable]] = None):
  """``parse_gin`` with the library's configurables (and the caller's) named in its errors.
  ``with_data=False``: the data layer is not imported and its bindings are skipped, so the files
  of a run parse where TensorFlow is absent; a binding of anything else unknown is still an error."""
  known = {**library_configurables(with_data), **(configurables or {})}
  parse_gin(gin_files, bindings, search_paths, known,
            skip_unknown=False if with_data else list(DATA_CONFIGURABLES))
  ranges.check_ranges('MeshConfig', gin.get_bindings('MeshConfig'))  # every command's mesh
  check_switches(known)


def setup(p: argparse.ArgumentParser, argv: Optional[Sequence[str]],
          configurables: Optional[Mapping[str, Callable]] = None,
          with_data: Union[bool, Callable[[argparse.Namespace], bool]] = True):
  """(args, TransformerConfig): processes joined, gin applied. ``configurables``: the tool's own
  (named in error messages). ``with_data=False`` (tools that need only the model and its step:
  t5xv-info, t5xv-bench): no data layer, no TensorFlow; the same files as t5xv-train still parse,
  the data layer's bindings skipped and ``RUN_MACROS`` bound to a placeholder. A function of the
  parsed flags decides it per call (t5xv-train reading pre-built batches: no data layer, and its
  run macros kept)."""
  args = common.parse_args(p, argv)
  common.initialize_processes(args)
  data = with_data(args) if callable(with_data) else with_data
  if with_data is False:  # after the flags, whose line numbers gin's messages keep
    args.gin_bindings += [f"{m} = 'unused by {p.prog}'" for m in RUN_MACROS]
  parse_recipe(args.gin_file, args.gin_bindings, args.gin_search_paths.split(','), data, configurables)
  return args, build_config()


def vocabulary_kind(config_gin: str) -> Optional[str]:
  """The ``vocabulary.kind`` a run's config.gin binds last (None: none), read by gin's parser
  without the data layer."""
  kind = None
  for statement in gin.config_parser.ConfigParser(config_gin,
                                                  gin.config.ParserDelegate(skip_unknown=True)):
    if (isinstance(statement, gin.config_parser.BindingStatement) and statement.arg_name == 'kind'
        and statement.selector.rsplit('.', 1)[-1] == 'vocabulary'):
      kind = statement.value
  return kind


def use_run_vocabulary(checkpoint_path: str):
  """Tokenize with the vocabulary the run of ``checkpoint_path`` trained with: its
  ``vocab.model`` copy (a SentencePiece model: the embedded one depends on the Python release),
  else the ``vocabulary.kind`` its config.gin binds (bytes, ByT5's), over what later files bind
  (gin/runs/finetune.gin's T5 vocabulary). Every process calls it together (it finds the
  checkpoint through process 0, then reads)."""
  from t5x_variants.train import checkpoints, multihost  # pylint: disable=g-import-not-at-top
  run = checkpoints.checkpoint_path(checkpoint_path).parent
  vocab_file, config = run / 'vocab.model', run / 'config.gin'
  if multihost.process0_says(f'looking for {vocab_file}', vocab_file.exists):  # one answer for all

    def bind():
      with gin.unlock_config():
        gin.bind_parameter('vocabulary.kind', 'file')
        gin.bind_parameter('vocabulary.path', storage.local_copy(vocab_file))
    multihost.agree(f'reading {vocab_file}', bind)
  elif multihost.process0_says(f'looking for {config}', config.exists):

    def bind_kind():
      kind = vocabulary_kind(config.read_text())
      if kind is not None:
        with gin.unlock_config():
          gin.bind_parameter('vocabulary.kind', kind)
    multihost.agree(f'reading {config}', bind_kind)
