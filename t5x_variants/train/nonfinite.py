"""Non-finite training steps (``train.on_nonfinite``): a step whose loss or gradients are not
finite applies no update (decided on the device, inside the step); ``NonFiniteGuard`` judges each
step read on the host: skipped and let pass until ``max_skipped_in_a_row`` of them in a row (that
one stops the run), or the run stopped (``NonFiniteStop``, which the trainer turns into
``NonFiniteLossError`` after closing the run's files).
"""
import logging
import re
from typing import Mapping, Optional

log = logging.getLogger(__name__)

NONFINITE = ('skip', 'stop')
# How NonFiniteLossError's message begins: the first step of the non-finite run of steps, which
# t5xv-sweep reads from a trainer's error line (``diverged_step``) whichever rule stopped it.
_DIVERGED = re.compile(r'\bnon-finite from step (\d+): ')


class NonFiniteLossError(RuntimeError):
  """Training stopped at a step whose loss or gradients were not finite."""


class NonFiniteStop(Exception):
  """The guard's verdict: the run stops at ``step``, the steps from ``first`` not finite; ``what``
  happened, ``remedy`` may help."""

  def __init__(self, step: int, first: int, what: str, remedy: str):
    super().__init__(what)
    self.step, self.first, self.what, self.remedy = step, first, what, remedy

  def message(self) -> str:
    """NonFiniteLossError's first words (``diverged_step`` reads them), then what happened."""
    return f'non-finite from step {self.first}: {self.what}'


def diverged_step(line: str) -> Optional[int]:
  """The step a trainer's error line (a NonFiniteLossError's) says the run diverged at; None if
  it is another error."""
  found = _DIVERGED.search(line)
  return int(found.group(1)) if found else None


class NonFiniteGuard:
  """``on_nonfinite`` applied to each step read: a step whose update was skipped (its loss or
  gradients were not finite) stops the run ('stop') or is let pass ('skip'), until the
  ``max_skipped_in_a_row``-th in a row, which stops it; a run that applied no update at all
  stops at its end. What it has counted is kept with each checkpoint (``state``, ``load``): a
  resumed run is judged as the uninterrupted one (a row of skipped steps goes on counting across
  the resume, and a run that applied updates before it is not one that applied none)."""

  def __init__(self, on_nonfinite: str, max_skipped_in_a_row: int):
    if on_nonfinite not in NONFINITE:
      raise ValueError(f'unknown on_nonfinite {on_nonfinite!r}; valid: {", ".join(NONFINITE)}')
    self.on_nonfinite, self.max_skipped_in_a_row = on_nonfinite, max_skipped_in_a_row
    self.skipped = 0  # the skipped steps since the last applied one
    self.first = None  # (step, loss) of the first of them
    self.applied = False  # whether any step of the run applied its update

  def state(self) -> dict:
    return {'skipped': self.skipped, 'applied': self.applied,
            'first': self.first and [self.first[0], str(self.first[1])]}

  @staticmethod
  def parse(state: Mapping) -> tuple:
    """``state()``'s dict as (skipped, applied, first); a KeyError or TypeError if it is not."""
    first = state['first'] and (int(state['first'][0]), str(state['first'][1]))
    return int(state['skipped']), bool(state['applied']), first

  def load(self, parsed: tuple):
    self.skipped, self.applied, self.first = parsed

  def check(self, step: int, metrics: Mapping[str, float]):
    """Counts ``step`` (metrics on the host); raises NonFiniteStop if the run stops there."""
    if not metrics['skipped']:
      self.skipped, self.first, self.applied = 0, None, True
      return
    if self.on_nonfinite == 'stop':
      raise NonFiniteStop(step, step, f'the loss or gradients are not finite (loss '
                          f'{metrics["loss"]})', "or set train.on_nonfinite='skip'")
    self.skipped += 1
    self.first = self.first or (step, metrics['loss'])
    if self.skipped >= self.max_skipped_in_a_row:
      raise NonFiniteStop(step, self.first[0], f'{self.skipped} steps in a row had a non-finite '
                          f"loss or gradients (the first's loss {self.first[1]})",
                          'or check the data against the model (e.g. its vocab_size); '
                          'train.max_skipped_in_a_row sets how many in a row stop the run')
    log.warning('step %d: non-finite loss or gradients, update skipped', step)

  def check_run(self, start: int, step: int):
    """Raises NonFiniteStop if the run, resumed at ``start`` and now at ``step``, applied none of
    its steps (in this session or before it)."""
    if step > start and not self.applied:
      first, loss = self.first
      raise NonFiniteStop(step, first, f'every step of this run ({first} to {step}) had a '
                          f'non-finite loss or gradients, the first with loss {loss}',
                          'or check the data')
