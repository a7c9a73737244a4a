"""The train metrics between two logs and their summary: the means of the steps' metrics (the
token accuracy over their tokens), the latest learning rate and parameter norm, throughput and
step time."""
import time
from typing import Mapping, Tuple

import jax
import numpy as np

from t5x_variants.train.metrics import MetricsLogger

TOKEN_FEATURES = ('encoder_input_tokens', 'decoder_target_tokens')  # what tokens/s counts


def host_tokens(batch) -> Tuple[int, int]:
  """(tokens, sequences) of a host batch: input plus target positions, padding included."""
  tokens = sum(int(np.prod(batch[k].shape)) for k in TOKEN_FEATURES if k in batch)
  return tokens or int(np.prod(next(iter(batch.values())).shape)), len(next(iter(batch.values())))


class TrainMeter:
  """The steps read since the last log; ``log`` writes their summary (a ``train`` record of the
  ``MetricsLogger``) every ``log_period`` steps and at ``total_steps``, ``flush`` at any step.

  A step's time is the wall time since the previous step was read or a pause ended (``resume``:
  a checkpoint, eval or diagnostics left out of the step times)."""

  def __init__(self, logger: MetricsLogger, start: int, log_period: int, total_steps: int):
    self.logger, self.start = logger, start
    self.log_period, self.total_steps = log_period, total_steps
    self.window = []  # (metrics, tokens, sequences, seconds) of each step since the last log
    self.last = {}  # the last summary logged
    self.started = self.clock = time.time()  # clock: when the last step was read or a pause ended

  def add(self, metrics: Mapping[str, float], tokens: int, sequences: int):
    """A step just read: its metrics on the host and its batch's ``host_tokens``."""
    now = time.time()
    self.window.append((metrics, tokens, sequences, now - self.clock))
    self.clock = now

  def resume(self):
    """Ends a pause: the time since the last step was read is not the next step's."""
    self.clock = time.time()

  def log(self, step: int):
    """Logs the steps since the last log if ``step`` is a log step."""
    if step % self.log_period == 0 or step == self.total_steps:
      self.flush(step)

  def flush(self, step: int):
    """Logs the steps since the last log, if any, as ``step``'s record."""
    if self.window:
      self.last = _summarize(self.window)
      self.logger.train(step, self.last, self.start, self.started)
      self.window = []


def _summarize(window) -> dict:
  """The steps since the last log, skipped (non-finite) ones left out unless all were: losses
  and gradient norm as means over the steps (T5X's ``loss``), the token accuracy over their
  tokens (T5X's ``accuracy``); learning rate and parameter norm: the latest."""
  seconds = sum(w[3] for w in window)
  applied = [w[0] for w in window if not w[0]['skipped']] or [w[0] for w in window]
  mean = lambda k: float(np.mean([m[k] for m in applied]))
  tokens = sum(float(m['num_tokens']) for m in applied)
  correct = sum(float(m['token_accuracy']) * float(m['num_tokens']) for m in applied)
  accuracy = correct / max(tokens, 1.0)
  latest = window[-1][0]
  return {'loss': mean('loss'), 'z_loss': mean('z_loss'), 'token_accuracy': accuracy,
          'learning_rate': latest['learning_rate'], 'grad_norm': mean('grad_norm'),
          'param_norm': latest['param_norm'], 'skipped': sum(w[0]['skipped'] for w in window),
          'tokens_per_second': sum(w[1] for w in window) * jax.process_count() / seconds,
          'sequences_per_second': sum(w[2] for w in window) * jax.process_count() / seconds,
          'step_time': seconds / len(window), 'num_tokens': mean('num_tokens')}
