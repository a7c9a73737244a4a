"""Learning-rate stability curves (Wortsman et al. 2023, "Small-scale proxies for large-scale
Transformer training instabilities"): the final held-out loss of each configuration
against ``learning_rate_schedule.base`` of a ``t5xv-sweep --grid=learning_rate_schedule.base=...``
sweep (the peak rate of the linear, cosine and plain noam schedules; of rsqrt it is
base / sqrt(warmup_steps)), and its LR sensitivity,

    S = mean over the swept rates eta of min(l(eta), l_0) - min over eta of l(eta),

where l(eta) is the final loss at rate eta (a diverged run counts as l_0) and l_0 the loss of the
initial parameters (``train.eval_at_start``). A curve is the sweep's variant without its rate
(``post_ln+xavier`` of ``post_ln+xavier+base=1e-3``). A run that stays finite but whose loss
fell by less than ``STALL_FRACTION`` of the largest fall of any run in the sweep is *stalled*:
finite, not converged."""
import dataclasses
import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

RATE_PART = re.compile(r'base=(.+)')  # how --grid=learning_rate_schedule.base=... names runs
STALL_FRACTION = 0.1


@dataclasses.dataclass
class Point:
  """One rate of a curve over its seeds. ``runs``: (seed, l_0, l(eta), converged) of each finished
  run with a step-0 eval, l(eta) its final loss or, if it diverged, its l_0; ``finals``: the final
  losses of the runs that did not diverge; ``missing``: runs unfinished (a running run whose loss
  blew up so far included) or without a step-0 eval; ``stalled``: how many of its converged runs
  stalled."""
  rate: float
  runs: List[Tuple[int, float, float, bool]]
  finals: List[float]
  diverged: int
  missing: int
  stalled: int = 0

  def all_stalled(self) -> bool:
    return 0 < self.stalled == sum(ok for _, _, _, ok in self.runs)

  def loss(self) -> Optional[float]:
    """l(eta): the mean over seeds; None while a run is missing."""
    return None if self.missing or not self.runs else float(np.mean([l for _, _, l, _ in self.runs]))

  def clipped(self) -> Optional[float]:
    """The mean over seeds of min(l(eta), l_0), each run with its own l_0."""
    if self.loss() is None:
      return None
    return float(np.mean([min(loss, initial) for _, initial, loss, _ in self.runs]))


@dataclasses.dataclass
class Curve:
  label: str
  points: List[Point]

  @property
  def initial(self) -> Optional[float]:
    initials = [i for p in self.points for _, i, _, _ in p.runs]
    return float(np.mean(initials)) if initials else None

  def best(self) -> Optional[Point]:
    done = [p for p in self.points if p.loss() is not None]
    return min(done, key=lambda p: p.loss()) if done else None

  def sensitivity(self) -> Optional[float]:
    """Wortsman et al.'s LR sensitivity of the seed-mean curve; None until every rate's runs
    finished."""
    if any(p.loss() is None for p in self.points):
      return None
    return lr_sensitivity([p.clipped() for p in self.points], [p.loss() for p in self.points])

  def seed_sensitivities(self) -> Dict[int, float]:
    """{seed: the LR sensitivity of that seed's runs alone}, for the seeds with a finished run at
    every rate of the curve (the paired comparison of two curves, ``report``)."""
    by_seed: Dict[int, List[Tuple[float, float]]] = {}
    for p in self.points:
      for seed, initial, loss, _ in p.runs:
        by_seed.setdefault(seed, []).append((min(loss, initial), loss))
    return {seed: lr_sensitivity(*zip(*runs))
            for seed, runs in sorted(by_seed.items()) if len(runs) == len(self.points)}


def lr_sensitivity(clipped: Sequence[float], losses: Sequence[float]) -> float:
  """S = mean over the rates of min(l(eta), l_0) (``clipped``) - min over the rates of l(eta)."""
  return float(np.mean(clipped) - min(losses))


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
  return next((v for s, v in trial.record.eval_curve() if s == 0 and math.isfinite(v)), None)


def _point(rate: float, trials, final_value, diverged_step) -> Point:
  point = Point(rate, [], [], 0, 0)
  for t in trials:
    if t.status not in ('done', 'diverged'):
      point.missing += 1
      continue
    initial, final = initial_loss(t), final_value(t)
    converged = diverged_step(t) is None and t.status != 'diverged'
    if not converged:
      point.diverged += 1
    elif final is not None and math.isfinite(final):
      point.finals.append(final)
    else:
      point.missing += 1
      continue
    if initial is None:
      point.missing += 1
    else:
      point.runs.append((t.seed, initial, final if converged else initial, converged))
  return point


def curves(group, final_value, diverged_step) -> List[Curve]:
  """The group's curves, rates ascending; a run is stalled if it fell from l_0 by less than
  ``STALL_FRACTION`` of the largest fall of any run of the group."""
  by_label: Dict[str, List[Point]] = {}
  for v in group.variants():
    label, rate = rate_of(v)
    by_label.setdefault(label, []).append(_point(rate, group.of(v), final_value, diverged_step))
  points = [p for ps in by_label.values() for p in ps]
  largest = max([i - l for p in points for _, i, l, ok in p.runs if ok], default=0.0)
  for p in points:
    fell = [i - l for _, i, l, ok in p.runs if ok]
    p.stalled = sum(f < STALL_FRACTION * largest for f in fell) if largest > 0 else 0
  return [Curve(label, sorted(ps, key=lambda p: p.rate)) for label, ps in by_label.items()]


def _cell(p: Point) -> str:
  if p.finals:
    stalled = ' stalled' if p.all_stalled() else f' ({p.stalled} stalled)' if p.stalled else ''
    text = f'{np.mean(p.finals):.3f}' + stalled
    return text + (f' ({p.diverged} diverged)' if p.diverged else '')
  if p.diverged:
    return 'diverged'
  return 'not finished' if p.missing else '—'


def table(curves_: Sequence[Curve]) -> List[str]:
  """Markdown: per curve the initial loss, the final loss at each rate, the best rate, its loss
  and the LR sensitivity (which is small both for a curve that trains well at every rate and for
  one that trains at none: read it beside the best loss)."""
  rates = sorted({p.rate for c in curves_ for p in c.points})
  head = ['curve', 'initial loss'] + [f'{r:g}' for r in rates] + ['best rate', 'best loss',
                                                                   'LR sensitivity']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for c in curves_:
    at = {p.rate: p for p in c.points}
    best, s = c.best(), c.sensitivity()
    row = [c.label, '—' if c.initial is None else f'{c.initial:.3f}']
    row += [_cell(at[r]) if r in at else '—' for r in rates]
    row += ['—', '—'] if best is None else [f'{best.rate:g}', f'{best.loss():.3f}']
    row += ['—' if s is None else f'{s:.3f}']
    lines.append('| ' + ' | '.join(row) + ' |')
  return lines


def markdown(curves_: Sequence[Curve]) -> List[str]:
  lines = ['Learning-rate stability: final held-out loss at each learning rate '
           '(`learning_rate_schedule.base`, the columns). LR sensitivity (Wortsman et al. 2023): '
           'the mean over the rates of min(final, initial loss), a diverged run counting as its '
           'initial loss, minus the curve\'s lowest final loss (best loss); lower is more '
           'stable, read beside the best loss: a curve that trains at no rate scores low too. Initial '
           'loss: the held-out loss of the initial parameters (step 0). Stalled: finite, but fell '
           f'from the initial loss by less than {STALL_FRACTION:g} of the largest fall of any run '
           'here.', '']
  if any(c.initial is None for c in curves_):
    lines += ['Some runs have no step-0 eval, so no LR sensitivity: run them with '
              '`--gin.train.eval_at_start=True`.', '']
  return lines + table(curves_) + ['']
