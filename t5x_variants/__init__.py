"""t5x_variants: Transformer variants for T5-style research in JAX/Flax."""
import math
import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))  # ships gin/: found from any directory


def path_keys(path) -> list:
  """A pytree key path as strings, a dict's keys bare: ['encoder', 'layers', 'mlp', 'wi',
  'kernel']; '/'.join gives the name parameter tables, rules and checkpoints use."""
  return [str(getattr(k, 'key', k)) for k in path]


def path_within(keys, path: str) -> bool:
  """Whether ``path``'s parts ('encoder/layers_1') occur in ``keys`` whole and in a row (not
  'layers_1' in 'layers_10'): how a gin list of parameter paths names parameters."""
  parts = path.strip('/').split('/')
  return any(list(keys[i:i + len(parts)]) == parts for i in range(len(keys) - len(parts) + 1))


def is_positive_number(value) -> bool:
  """Whether ``value`` is a finite real number > 0 (a bool is not a number here): a rate, a clip
  or a normaliser whose 0, sign or inf would train silently wrong."""
  return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and value > 0)
