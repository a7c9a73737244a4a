"""t5x_variants: Transformer variants for T5-style research in JAX/Flax."""
import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))  # ships gin/: found from any directory


def path_keys(path) -> list:
  """A pytree key path as strings, a dict's keys bare: ['encoder', 'layers', 'mlp', 'wi',
  'kernel']; '/'.join gives the name parameter tables, rules and checkpoints use."""
  return [str(getattr(k, 'key', k)) for k in path]
