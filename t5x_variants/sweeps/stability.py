"""Learning-rate stability curves (Wortsman et al. 2023, "Small-scale proxies for large-scale
Transformer training instabilities", Sec. 2): the final held-out loss of each configuration
against the peak learning rate of a ``t5xv-sweep --grid=learning_rate_schedule.base=...`` sweep,
and its LR sensitivity,

    S = mean over the swept rates eta of min(l(eta), l_0) - min over eta of l(eta),

where l(eta) is the final loss at rate eta (a diverged run counts as l_0) and l_0 the loss of the
initial parameters (``train.eval_at_start``). A curve is the sweep's variant without its rate
(``post_ln+xavier`` of ``post_ln+xavier+base=1e-3``). A run that stays finite but whose loss
fell by less than ``STALL_FRACTION`` of the largest fall of any run in the sweep is *stalled*:
finite, not converged."""
import dataclasses
import re
from typing import Dict, List, Optional, Sequence

import numpy as np

RATE_PART = re.compile(r'base=(.+)')  # a --grid over learning_rate_schedule.base names runs so
STALL_FRACTION = 0.1


@dataclasses.dataclass
class Point:
  """One rate of a curve, over its seeds: ``finals`` of the runs that finished without diverging,
  ``diverged`` of the runs that diverged, ``unfinished`` the rest."""
  rate: float
  initial: Optional[float]
  finals: List[float]
  diverged: int
  unfinished: int
  stalled: bool = False

  def clipped(self) -> Optional[float]:
    """The mean over seeds of min(final, l_0), a diverged run counting as l_0; None while a run is
    unfinished or without l_0."""
    if self.unfinished or self.initial is None or not (self.finals or self.diverged):
      return None
    values = [min(f, self.initial) for f in self.finals] + [self.initial] * self.diverged
    return float(np.mean(values))


@dataclasses.dataclass
class Curve:
  label: str
  points: List[Point]

  def best(self) -> Optional[Point]:
    done = [p for p in self.points if p.finals]
    return min(done, key=lambda p: np.mean(p.finals)) if done else None

  def sensitivity(self) -> Optional[float]:
    """Wortsman et al.'s LR sensitivity; None until every rate's runs finished."""
    clipped = [p.clipped() for p in self.points]
    best = self.best()
    if any(c is None for c in clipped) or best is None:
      return None
    return float(np.mean(clipped) - np.mean(best.finals))


def rate_of(variant: str):
  """(curve label, rate) of a variant named with a ``base=RATE`` part, else None."""
  parts = variant.split('+')
  rates = [p for p in parts if RATE_PART.fullmatch(p)]
  if len(rates) != 1:
    return None
  try:
    rate = float(RATE_PART.fullmatch(rates[0]).group(1))
  except ValueError:
    return None
  return '+'.join(p for p in parts if p != rates[0]) or 'base', rate


def is_rate_sweep(group) -> bool:
  """Every variant has a rate, and some curve has two or more."""
  found = [rate_of(v) for v in group.variants()]
  if not found or not all(found):
    return False
  rates: Dict[str, set] = {}
  for label, rate in found:
    rates.setdefault(label, set()).add(rate)
  return max(len(r) for r in rates.values()) > 1


def initial_loss(trial) -> Optional[float]:
  return next((v for s, v in trial.record.eval_curve() if s == 0), None)


def curves(group, final_value, diverged_step) -> List[Curve]:
  """The group's curves, rates ascending; stalled points marked against the sweep's largest fall
  from l_0."""
  by_label: Dict[str, List[Point]] = {}
  for v in group.variants():
    label, rate = rate_of(v)
    trials = group.of(v)
    finals = [final_value(t) for t in trials]
    diverged = sum(1 for t in trials if diverged_step(t) is not None)
    initials = [x for x in map(initial_loss, trials) if x is not None]
    by_label.setdefault(label, []).append(Point(
        rate, float(np.mean(initials)) if initials else None, [f for f in finals if f is not None],
        diverged, len(trials) - diverged - sum(f is not None for f in finals)))
  points = [p for ps in by_label.values() for p in ps]
  falls = [p.initial - f for p in points if p.initial is not None for f in p.finals]
  largest = max(falls, default=0.0)
  for p in points:
    p.stalled = bool(p.finals and p.initial is not None and largest > 0
                     and p.initial - np.mean(p.finals) < STALL_FRACTION * largest)
  return [Curve(label, sorted(ps, key=lambda p: p.rate)) for label, ps in by_label.items()]


def _cell(p: Point) -> str:
  if p.finals:
    text = f'{np.mean(p.finals):.3f}' + (' stalled' if p.stalled else '')
    return text + (f' ({p.diverged} diverged)' if p.diverged else '')
  if p.diverged:
    return 'diverged'
  return 'not run' if p.unfinished else '—'


def table(curves_: Sequence[Curve]) -> List[str]:
  """Markdown: per curve the initial loss, the final loss at each rate, the best rate and the LR
  sensitivity."""
  rates = sorted({p.rate for c in curves_ for p in c.points})
  head = ['curve', 'initial loss'] + [f'{r:g}' for r in rates] + ['best rate', 'LR sensitivity']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for c in curves_:
    at = {p.rate: p for p in c.points}
    initial = next((p.initial for p in c.points if p.initial is not None), None)
    best, s = c.best(), c.sensitivity()
    row = [c.label, '—' if initial is None else f'{initial:.3f}']
    row += [_cell(at[r]) if r in at else '—' for r in rates]
    row += ['—' if best is None else f'{best.rate:g}', '—' if s is None else f'{s:.3f}']
    lines.append('| ' + ' | '.join(row) + ' |')
  return lines


def markdown(group, final_value, diverged_step) -> List[str]:
  found = curves(group, final_value, diverged_step)
  return (['Learning-rate stability: final held-out loss at each peak learning rate (columns). '
           'LR sensitivity (Wortsman et al. 2023): the mean over the rates of min(final, initial '
           'loss), a diverged run counting as the initial loss, minus the best final loss of the '
           'curve; lower is more stable. Initial loss: the held-out loss of the initial '
           f'parameters. Stalled: finite, but fell by less than {STALL_FRACTION:g} of the largest '
           'fall from the initial loss of any run here.', '']
          + table(found) + [''])
