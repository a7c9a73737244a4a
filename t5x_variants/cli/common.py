"""What every command-line tool shares besides its recipe (``cli/recipe.py``): its flags (gin,
processes, verbosity), joining other processes, quiet start-up, and the one place that turns a
known failure into one line and exit status 2 (the console-script entry points are
``cli/launch.py``).

gin flags follow T5X: ``--gin_file=PATH`` (repeatable, later files override earlier ones),
``--gin.KEY=VALUE`` and ``--gin_bindings=KEY=VALUE`` (repeatable), ``--gin_search_paths=DIR[,DIR]``.

Multi-process flags: on multi-GPU hosts every process is started with ``--multiprocess_gpu
--coordinator_address=HOST:PORT --process_count=N --process_index=I`` (one process per GPU:
``--local_device_ids=G`` too) and joins through ``jax.distributed.initialize``; on Cloud TPU pods
the same command runs on every host with ``--multiprocess_tpu`` and jax finds its peers itself.
CPU processes (tests) use gloo collectives.
"""
import argparse
import contextlib
import errno
import json
import logging
import os
import re
import sys
from typing import List, Optional, Sequence

from t5x_variants.cli import launch

launch.skip_absent_tpu()  # before any command starts a JAX backend

LOGGER = 't5x_variants'  # the project's own log lines (resume, fallback, skipped steps)


class UsageError(ValueError):
  """A command-line flag that cannot be used as given."""


# --- flags -----------------------------------------------------------------------------------

def check_json_output(output: str, prog: str, key: str):
  """UsageError (one line) when ``--output`` names a file that is not an earlier ``prog`` result
  (a JSON object with ``key``): the run would replace it."""
  from t5x_variants.train import storage  # pylint: disable=g-import-not-at-top
  path = storage.path(output)
  if not path.is_file() or not path.stat().length:  # (an empty one loses nothing: mktemp's)
    return
  try:
    ours = key in dict(json.loads(path.read_text()))
  except (ValueError, TypeError):  # not JSON, not text (UnicodeDecodeError), not an object
    ours = False
  if not ours:
    raise UsageError(f'--output={output} exists and is not an earlier {prog} result, which it '
                     'would replace: give another path, or move that file away')


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose usage errors are one line (and exit status 2), like every other error."""

  def error(self, message):
    prog = f'{_on_behalf_of[0]} ({self.prog} step)' if _on_behalf_of else self.prog
    print(f'{prog}: error: {message} (see --help)', file=sys.stderr)
    raise SystemExit(2)


def _device_ids(text: str) -> List[int]:
  try:
    return [int(i) for i in text.split(',')]
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not a list of GPU ids such as 0,1') from None


def parser(prog: str, doc: str, processes: bool = True) -> ArgumentParser:
  """A command's parser with the gin, verbosity and (if ``processes``) multi-process flags."""
  p = ArgumentParser(prog=prog, description=doc.strip().splitlines()[0])
  p.add_argument('--gin_file', action='append', default=[], help='gin file (repeatable)')
  p.add_argument('--gin_bindings', action='append', default=[], help='KEY=VALUE (repeatable)')
  p.add_argument('--gin_search_paths', default='', help='comma-separated gin search dirs')
  p.add_argument('--verbosity', type=int, default=None,
                 help='0: the project\'s lines and warnings (default); 1: also the libraries\' '
                      'INFO logs and TensorFlow/XLA start-up messages (env T5XV_VERBOSITY)')
  if processes:
    p.add_argument('--multiprocess_gpu', action='store_true',
                   help='join other processes through jax.distributed.initialize')
    p.add_argument('--multiprocess_tpu', action='store_true',
                   help='jax.distributed.initialize() with the TPU pod\'s own discovery')
    p.add_argument('--coordinator_address', default=None, help='HOST:PORT of process 0')
    p.add_argument('--process_count', type=int, default=None)
    p.add_argument('--process_index', type=int, default=None)
    p.add_argument('--local_device_ids', default=None, type=_device_ids, metavar='ID[,ID]',
                   help='with --multiprocess_gpu: the GPUs of this process (one process per GPU); '
                        'default: every GPU of the host')
  return p


def parse_args(p: argparse.ArgumentParser, argv: Optional[Sequence[str]]):
  """Parses argv (default: sys.argv), turning every ``--gin.KEY=VALUE`` into a binding
  ``KEY = VALUE`` where it stands among the ``--gin_bindings`` (the later of two wins, as in
  T5X), and applies ``--verbosity``."""
  rewritten = []
  for arg in sys.argv[1:] if argv is None else argv:
    if arg.startswith('--gin.'):
      key, sep, value = arg[len('--gin.'):].partition('=')
      if not sep:
        p.error(f'{arg}: expected --gin.KEY=VALUE')
      arg = f'--gin_bindings={key} = {value}'
    rewritten.append(arg)
  args = p.parse_args(rewritten)
  if args.verbosity is None:
    env = os.environ.get('T5XV_VERBOSITY', '0')
    if not re.fullmatch(r'\s*-?\d+\s*', env):
      p.error(f'T5XV_VERBOSITY={env!r} is not an integer: 0 (the default) or 1')
    args.verbosity = int(env)
  set_verbosity(args.verbosity)
  return args


# --- quiet start-up ----------------------------------------------------------------------------

# Library warnings that say nothing to a user of these commands.
_NOISE = (
    'Using an uncached FunctionDataset',  # seqio: our tasks shuffle documents in memory
    'NaN or Inf found in input tensor',  # tensorboardX, per value; the trainer warns per step
    # A failed checkpoint save, with tracebacks (gcsfs, orbax's background commit thread); the
    # command's one line says what failed and what is intact (train/checkpoints.py).
    'out of retries on exception',
    'non-retriable exception',  # gcsfs's log of an error it raises at once (a 401, a 403)
    'in background save thread',
    'Save Finalize thread',
    'has no dataset_info.json',  # TFDS on an unprepared dataset, which the command's line names
    # seqio packing a GLUE/SuperGLUE task: its idx and label, which no model reads (README walk)
    'will be removed during packing',
)


class _DropNoise(logging.Filter):

  def filter(self, record):
    return not any(n in record.getMessage() for n in _NOISE)


_DROP_NOISE = _DropNoise()  # one instance: adding it to a handler twice is a no-op
_verbosity = 0


def set_verbosity(verbosity: int):
  """verbosity 0: the project's own lines (INFO and up) and every library's warnings but those in
  ``_NOISE`` (TensorFlow's C++ start-up messages are off already: see ``cli/__init__.py``);
  1 and up: everything at INFO."""
  global _verbosity
  _verbosity = verbosity
  logging.basicConfig(format='%(asctime)s %(levelname)s %(name)s: %(message)s')
  root = logging.getLogger()
  root.setLevel(logging.INFO if verbosity > 0 else logging.WARNING)
  logging.getLogger(LOGGER).setLevel(logging.INFO)
  handlers = list(root.handlers)
  try:  # absl (used by orbax, seqio, TFDS) logs through Python logging once its handler is set
    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
    absl_logging.set_verbosity('info' if verbosity > 0 else 'warning')
    handlers.append(absl_logging.get_absl_handler())
  except ImportError:
    pass
  for handler in handlers:
    (handler.addFilter if verbosity <= 0 else handler.removeFilter)(_DROP_NOISE)


# --- processes ---------------------------------------------------------------------------------


JOIN_WAIT_SECS = 300  # jax.distributed's own default


def initialize_processes(args):
  """Joins the other processes, if the flags ask for it. Must run before any other jax call."""
  import jax  # pylint: disable=g-import-not-at-top
  tpu, gpu = getattr(args, 'multiprocess_tpu', False), getattr(args, 'multiprocess_gpu', False)
  if tpu and gpu:
    raise UsageError('--multiprocess_tpu and --multiprocess_gpu exclude each other: give the one '
                     "of this host's accelerators")
  alone = [f for f in ('local_device_ids', 'coordinator_address', 'process_count', 'process_index')
           if getattr(args, f, None) is not None]
  if not gpu and alone:  # (ignored, N hosts would train N separate runs into one directory)
    what = 'names the GPUs of' if alone[0] == 'local_device_ids' else 'is for'
    raise UsageError(f'--{alone[0]} {what} one of several processes: give it with '
                     '--multiprocess_gpu and its coordinator flags, or leave it out')
  if tpu:
    try:
      jax.distributed.initialize()
    except ValueError as e:  # no TPU pod's environment to find the coordinator in
      raise UsageError(f'--multiprocess_tpu found no Cloud TPU pod to join ({e}): run the command '
                       'on every host of a TPU pod slice, or without the flag on one host') from e
  elif gpu:
    missing = [f for f in ('coordinator_address', 'process_count', 'process_index')
               if getattr(args, f) is None]
    if missing:
      raise UsageError(f'--multiprocess_gpu needs --{", --".join(missing)}')
    if not re.fullmatch(r'\S+:\d+', args.coordinator_address):
      raise UsageError(f'--coordinator_address={args.coordinator_address} needs a port: '
                       'HOST:PORT of process 0 (e.g. 10.0.0.1:1234)')
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    # said first: a process that never comes makes jax abort the others after its wait, in C++,
    # with no Python error to explain it
    print(f'process {args.process_index} of {args.process_count}: joining the others at '
          f'{args.coordinator_address} (jax waits {JOIN_WAIT_SECS} s for all of them to start, '
          'then aborts every process)', flush=True)
    jax.distributed.initialize(args.coordinator_address, args.process_count, args.process_index,
                               local_device_ids=getattr(args, 'local_device_ids', None),
                               initialization_timeout=JOIN_WAIT_SECS)


def import_data_layer():
  """Imports TensorFlow, kept off the accelerators (they are JAX's), and the data layer. At
  verbosity 0 the process's stderr is closed while TensorFlow loads: its CUDA probing writes there
  from C++ whatever TF_CPP_MIN_LOG_LEVEL says. Python errors still raise after it is restored."""
  saved = None
  if _verbosity <= 0 and 'tensorflow' not in sys.modules:
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.config.set_visible_devices([], 'GPU')
    import t5x_variants.data.tasks  # pylint: disable=g-import-not-at-top,unused-import
  finally:
    if saved is not None:
      os.dup2(saved, 2)
      os.close(saved)


# --- errors ------------------------------------------------------------------------------------


def _stdout_closed() -> bool:
  """Whether standard output's reader has gone (its unwritten lines cannot be flushed)."""
  try:
    sys.stdout.flush()
  except BrokenPipeError:
    return True
  return False


def _unproxied(e: BaseException) -> BaseException:
  """The exception that a gin configurable raised: gin re-raises it as a subclass instance of its
  own whose attributes (an OSError's errno) are unset, the original as its context."""
  inner = e.__context__
  while inner is not None and e.__suppress_context__ and type(e).__bases__ == (type(inner),):
    e, inner = inner, inner.__context__
  return e


_on_behalf_of = None  # (the command the user ran, {flag in messages: its own flag}) or None


@contextlib.contextmanager
def on_behalf_of(command: str, flags: dict):
  """Inside, a failure's line names ``command`` (which ran the tool as one of its steps) before
  the tool, and advises ``command``'s own flags for the tool's (``flags``)."""
  global _on_behalf_of
  _on_behalf_of = command, flags
  try:
    yield
  finally:
    _on_behalf_of = None


@contextlib.contextmanager
def clear_errors(prog: str):
  """Known failures (bad flags or gin, missing data or checkpoints, a file system's error,
  non-finite training, another process's failure) exit with status 2 and one line: the message's
  first line. At --verbosity=1 and up the whole message (and gin's, of a
  ``recipe.GinConfigError``) follows it; the traceback is logged at DEBUG. Ctrl-C outside the
  training steps (which stop at a checkpoint instead) is one line too, and status 130."""
  from t5x_variants.train import checkpoints, multihost, nonfinite  # pylint: disable=g-import-not-at-top
  try:
    yield
  except KeyboardInterrupt:
    logging.getLogger(LOGGER).debug('traceback', exc_info=True)
    print(f'{prog}: interrupted; rerun the same command (a training run resumes from its last '
          'checkpoint)', file=sys.stderr)
    raise SystemExit(130) from None
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(e, BrokenPipeError) and _stdout_closed():  # its reader left (``| head``)
      sys.stdout = open(os.devnull, 'w')  # pylint: disable=consider-using-with  (for the exit's flush)
      raise SystemExit(1) from None
    raised = _unproxied(e)
    if isinstance(raised, OSError) and raised.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk
      e = ValueError(f'{raised.strerror} writing {raised.filename or "the run directory"}: free '
                     'space and rerun the same command (a training run resumes from its last '
                     'checkpoint)')
    known = [ValueError, OSError, checkpoints.CheckpointError, nonfinite.NonFiniteLossError,
             multihost.ProcessError]
    tasks, tf = sys.modules.get('t5x_variants.data.tasks'), sys.modules.get('tensorflow')
    if tasks:  # only when the command used the data layer
      known.append(tasks.DataNotFoundError)
    if tf:
      known.append(tf.errors.OpError)
    if not isinstance(e, tuple(known)):
      raise
    logging.getLogger(LOGGER).debug('traceback', exc_info=True)
    message = getattr(e, 'message', None) or str(e)  # OpError: without the op trace
    message = message.split('\n  In call to configurable')[0]  # gin's note on where it was called
    lines = [line.strip() for line in message.splitlines() if line.strip()] or [type(e).__name__]
    if _on_behalf_of:
      command, flags = _on_behalf_of
      prog = f'{command} ({prog} step)'
      for flag, own in flags.items():
        lines[0] = lines[0].replace(flag, own)
    print(f'{prog}: error: {lines[0]}', file=sys.stderr)
    if _verbosity > 0:
      rest = getattr(e, 'detail', None) or '\n'.join(lines[1:])
      if rest:
        print(rest, file=sys.stderr)
    raise SystemExit(2) from None


def vocabulary_size(task_or_vocabulary) -> int:
  """The number of ids of a seqio task or mixture (all its features) or of one vocabulary."""
  from t5x_variants.data import vocab  # pylint: disable=g-import-not-at-top
  features = getattr(task_or_vocabulary, 'output_features', None)
  vocabularies = [f.vocabulary for f in features.values()] if features else [task_or_vocabulary]
  return max(map(vocab.size, vocabularies))


def check_vocabulary_size(config, task_or_vocabulary, source: str):
  """A model whose embedding has fewer rows than the data's vocabulary has ids is refused at
  start: out-of-range ids would read NaN embeddings, and every step would be skipped.
  ``task_or_vocabulary``: a seqio task or mixture (all its features), one vocabulary, or the
  number of ids (pre-built batches)."""
  data_size = (task_or_vocabulary if isinstance(task_or_vocabulary, int)
               else vocabulary_size(task_or_vocabulary))
  if data_size > config.vocab_size:
    raise ValueError(f'the model vocab_size {config.vocab_size} is smaller than the vocabulary of '
                     f'{source} ({data_size} ids); set TransformerConfig.vocab_size >= {data_size} '
                     f'(e.g. {-(-data_size // 128) * 128}, a multiple of 128)')

