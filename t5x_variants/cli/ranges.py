"""The numbers the commands read, checked before any work starts: one table (``RANGES``) of every
integer binding whose out-of-range value would otherwise fail late and obscurely (BATCH_SIZE = 0:
TensorFlow's op error; a zero period: a ZeroDivisionError after the model compiled; keep = 0:
every checkpoint deleted), and the one-line error that names the binding and the flag to set."""
from typing import Mapping, Tuple

import gin

# {configurable: {parameter: (minimum, None allowed, what it is)}}; ``LENGTHS``: a {feature:
# length} mapping of integers >= 1.
LENGTHS = 'lengths'
RANGES = {
    'train': {'total_steps': (1, False, 'the number of training steps'),
              'log_period': (1, False, 'the steps between logs'),
              'eval_period': (0, False, 'the steps between evals (0: none)'),
              'eval_batches': (1, True, 'the batches per eval (None: all)'),
              'diagnostics_period': (0, False, 'the steps between diagnostics (0: none)'),
              'num_microbatches': (1, False, 'the microbatches per step'),
              'infer_eval_examples': (1, True, 'the examples decoded per eval task (None: all)'),
              'seed': (0, True, 'the random seed'),
              'max_skipped_in_a_row': (1, False, 'the non-finite steps in a row that stop it')},
    'MeshConfig': {'data': (-1, False, 'the data axis (-1: the devices model and replica leave)'),
                   'model': (1, False, 'the model axis'),
                   'replica': (1, False, 'the replica axis (groups that each hold whole parameters)')},
    'Checkpointer': {'period': (1, False, 'the steps between checkpoints'),
                     'keep': (1, True, 'the checkpoints kept (None: all)')},
    'DatasetConfig': {'batch_size': (1, False, 'the global batch size'),
                      'task_feature_lengths': LENGTHS,
                      'num_epochs': (1, True, 'the passes over the data (None: no end)')},
    'evaluate_checkpoints': {'batch_size': (1, False, 'the eval batch size'),
                             'task_feature_lengths': LENGTHS,
                             'max_batches': (1, True, 'the batches per task (None: all)'),
                             'max_examples': (1, True, 'the examples decoded per task (None: all)'),
                             'prompt_length': (1, True, 'the prompt length (None: no prompt)')},
    'infer': {'batch_size': (1, False, 'the decoding batch size'),
              'task_feature_lengths': LENGTHS,
              'max_examples': (1, True, 'the examples decoded (None: all)'),
              'prompt_length': (1, True, 'the prompt length (None: no prompt)')},
}


def binding_name(selector: str) -> Tuple[str, str]:
  """(the flag that sets ``selector``, how to name it): ('BATCH_SIZE', 'BATCH_SIZE
  (train/DatasetConfig.batch_size)') when it is bound to a macro, else the selector twice."""
  candidates = [selector]
  if '/' in selector:  # a scoped binding may come from the unscoped one
    candidates.append(selector.rsplit('/', 1)[1])
  for candidate in candidates:
    try:
      value = gin.query_parameter(candidate)
    except ValueError:
      continue
    if isinstance(value, gin.config.ConfigurableReference) and value.selector == 'gin.macro':
      macro = value.scoped_selector.rsplit('/', 1)[0]
      return macro, f'{macro} ({selector})'
    break
  return selector, selector


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def check_ranges(configurable: str, values: Mapping[str, object], scope: str = ''):
  """ValueError, one line naming the binding (its macro if it has one), its value, its valid
  range and the flag to set, for the first of ``values`` ({parameter: value} of
  ``configurable``, e.g. the gin bindings of ``train``) out of ``RANGES``. ``scope``: the gin
  scope they were bound in."""
  for param, spec in RANGES[configurable].items():
    if param not in values:
      continue
    value, selector = values[param], f'{scope + "/" if scope else ""}{configurable}.{param}'
    flag, name = binding_name(selector)
    if spec == LENGTHS:
      if value is None:
        continue
      bad = ([k for k, v in value.items() if not _is_int(v) or v < 1]
             if isinstance(value, Mapping) else None)
      if bad is None or bad:
        which = f' (\'{bad[0]}\' is {value[bad[0]]!r})' if bad else ''
        raise ValueError(f'{name} = {value!r} is out of range{which}: every feature length must '
                         f'be an integer >= 1; set --gin.{flag} accordingly')
      continue
    minimum, optional, what = spec
    if (value is None and optional) or (_is_int(value) and value >= minimum):
      continue
    valid = f'an integer >= {minimum}' + (' or None' if optional else '')
    raise ValueError(f'{name} = {value!r} is out of range: {what} must be {valid}; set '
                     f'--gin.{flag} accordingly')


def check_flags(args, least: Mapping[str, int]):
  """The same for a command's integer flags: ValueError, one line, for the first flag given below
  its least value (``least``: flag name -> least value); an unset flag (None) keeps its default."""
  for flag, low in least.items():
    value = getattr(args, flag)
    if value is not None and value < low:
      raise ValueError(f'--{flag}={value} is out of range: it must be at least {low}')
