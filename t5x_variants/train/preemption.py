"""SIGTERM / SIGINT during training: the run saves a checkpoint after the current step and
returns."""
import os
import signal

import jax

from t5x_variants.train import checkpoints


class Preemption:
  """Set by SIGTERM or SIGINT. With several processes, all of them must stop after the same step:
  jax's preemption sync point decides (asked through orbax's checkpoint manager). It hears of
  SIGTERM through the handler jax.distributed registers, so SIGTERM is left to that handler and
  SIGINT is passed on to it as a SIGTERM."""

  def __init__(self, ckpt: checkpoints.Checkpointer):
    self.signal = None
    self.ckpt = ckpt
    self.multiprocess = jax.process_count() > 1

  def __enter__(self):
    signals = (signal.SIGINT,) if self.multiprocess else (signal.SIGTERM, signal.SIGINT)
    self._previous = {s: signal.signal(s, self._handle) for s in signals}
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)

  def _handle(self, signum, frame):
    del frame
    self.signal = signal.Signals(signum).name
    if self.multiprocess:
      os.kill(os.getpid(), signal.SIGTERM)

  def reached(self, step: int) -> bool:
    """Whether the run stops after ``step`` (every process gets the same answer)."""
    if self.multiprocess:
      return self.ckpt.manager.reached_preemption(step)
    return self.signal is not None
