"""What every command-line tool does first: flags, joining other processes, gin, the model
config; and the one place that turns a known failure into one clear line and exit status 2."""
import argparse
import contextlib
import logging
import sys
from typing import Callable, Mapping, Optional, Sequence

from t5x_variants import gin_utils, multihost


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
  gin_utils.add_gin_flags(p)
  multihost.add_flags(p)
  return p


def setup(p: argparse.ArgumentParser, argv: Optional[Sequence[str]],
          configurables: Optional[Mapping[str, Callable]] = None):
  """(args, TransformerConfig): processes joined, gin applied. ``configurables``: the tool's own
  (named in error messages)."""
  args = gin_utils.parse_args(p, sys.argv[1:] if argv is None else argv)
  multihost.initialize(args)
  logging.basicConfig(level=logging.INFO, format='%(asctime)s %(levelname)s %(message)s')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], 'GPU')  # the input pipeline must not take the accelerators
  from t5x_variants.data import corpus, pipeline, tasks, vocab  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import checkpoints, optimizer, predictor, trainer  # pylint: disable=g-import-not-at-top
  known = {'train': trainer.train, 'Checkpointer': checkpoints.Checkpointer,
                   'adafactor': optimizer.adafactor,
                   'learning_rate_schedule': optimizer.learning_rate_schedule,
                   'DatasetConfig': pipeline.DatasetConfig, 'vocabulary': vocab.vocabulary,
                   'local_corpus_files': corpus.local_corpus_files,
                   'register_tasks': tasks.register_tasks,
                   'DecodeOptions': predictor.DecodeOptions, **(configurables or {})}
  return args, gin_utils.config_from_flags(args, known)


@contextlib.contextmanager
def clear_errors(prog: str, expected: Sequence[type] = ()):
  """Known failures (bad gin, missing data or checkpoints, ...) exit 2 with one message."""
  from t5x_variants.train import checkpoints, trainer  # pylint: disable=g-import-not-at-top
  from t5x_variants.data import tasks  # pylint: disable=g-import-not-at-top
  known = (gin_utils.GinConfigError, checkpoints.CheckpointError, trainer.NonFiniteLossError,
           tasks.DataNotFoundError, ValueError, *expected)
  try:
    yield
  except known as e:
    logging.debug('traceback', exc_info=True)
    print(f'{prog}: error: {e}', file=sys.stderr)
    raise SystemExit(2) from None


def use_run_vocabulary(checkpoint_path: str):
  """Tokenize with the vocabulary the run of ``checkpoint_path`` trained with (its
  ``vocab.model`` copy), if it has one: the embedded vocabulary depends on the Python release."""
  import gin  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import checkpoints  # pylint: disable=g-import-not-at-top
  vocab_file = checkpoints.checkpoint_path(checkpoint_path).parent / 'vocab.model'
  if vocab_file.exists():
    with gin.unlock_config():
      gin.bind_parameter('vocabulary.kind', 'file')
      gin.bind_parameter('vocabulary.path', str(vocab_file))
