"""gin flags shared by the command-line tools (T5X conventions).

``--gin_file=PATH`` (repeatable, later files override earlier ones), ``--gin.KEY=VALUE`` and
``--gin_bindings=KEY=VALUE`` (repeatable), ``--gin_search_paths=DIR[,DIR]``. Gin files are found
relative to the working directory, the search paths, and the installed package, which ships
``gin/`` so that ``--gin_file=gin/models/t5_base.gin`` works from anywhere.
"""
import argparse
import contextlib
import inspect
import logging
import os
import re
from typing import Callable, List, Mapping, Sequence

import gin

from t5x_variants.models.config import TransformerConfig

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


# The configurables a gin file may bind; listed in error messages.
CONFIGURABLES = {'TransformerConfig': TransformerConfig}


class GinConfigError(ValueError):
  """A gin file or binding that cannot be applied, with what to do about it."""


def _explain(message: str, configurables: Mapping[str, Callable]) -> str:
  """Adds the valid choices to gin's message about an unknown configurable or parameter."""
  unknown_param = re.search(r"Configurable '([\w.]+)' doesn't have a parameter", message)
  if unknown_param and unknown_param.group(1) in configurables:
    params = inspect.signature(configurables[unknown_param.group(1)]).parameters
    return f'{message}\nValid parameters: {", ".join(params)}'
  if 'No configurable matching' in message:
    return f'{message}\nValid configurables: {", ".join(configurables)}'
  return message


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


def add_gin_flags(parser: argparse.ArgumentParser):
  parser.add_argument('--gin_file', action='append', default=[], help='gin file (repeatable)')
  parser.add_argument('--gin_bindings', action='append', default=[], help='KEY=VALUE (repeatable)')
  parser.add_argument('--gin_search_paths', default='', help='comma-separated gin search dirs')


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]):
  """Parses argv, turning every ``--gin.KEY=VALUE`` into a binding ``KEY = VALUE``."""
  gin_dotted, rest = [], []
  for arg in argv:
    (gin_dotted if arg.startswith('--gin.') else rest).append(arg)
  args = parser.parse_args(rest)
  for arg in gin_dotted:
    key, sep, value = arg[len('--gin.'):].partition('=')
    if not sep:
      parser.error(f'{arg}: expected --gin.KEY=VALUE')
    args.gin_bindings.append(f'{key} = {value}')
  return args


def parse_gin(gin_files: List[str], bindings: List[str], search_paths: Sequence[str] = (),
              configurables: Mapping[str, Callable] = None):
  """Applies gin files then bindings; any failure becomes one GinConfigError naming the culprit.

  ``configurables`` adds the caller's own configurables to those named in error messages."""
  for path in [os.getcwd(), *[p for p in search_paths if p], PACKAGE_DIR]:
    gin.add_config_file_search_path(path)
  try:
    with _quiet_search():
      gin.parse_config_files_and_bindings(gin_files, bindings)
  except (IOError, OSError) as e:
    raise GinConfigError(f'cannot read gin file: {e}. Paths are resolved against the working '
                         f'directory, --gin_search_paths and {PACKAGE_DIR}') from e
  except (ValueError, SyntaxError, NameError, TypeError, KeyError) as e:
    known = {**CONFIGURABLES, **(configurables or {})}
    raise GinConfigError(f'invalid gin configuration: {_explain(str(e), known)}') from e


def config_from_flags(args, configurables: Mapping[str, Callable] = None):
  """The TransformerConfig of parsed gin flags (``add_gin_flags``); GinConfigError if invalid."""
  parse_gin(args.gin_file, args.gin_bindings, args.gin_search_paths.split(','), configurables)
  return build_config()


def build_config():
  """The gin-bound TransformerConfig; invalid values fail with their valid choices."""
  try:
    return TransformerConfig()
  except ValueError as e:
    raise GinConfigError(f'invalid model configuration: {e}') from e
