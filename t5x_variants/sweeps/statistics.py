"""The statistics of the reports, over seeds: a mean's 95% Student t interval, the verdict of a
paired difference, Spearman's rho and its paired bootstrap interval."""
import dataclasses
from typing import Optional, Sequence, Tuple

import numpy as np


# Student's t 0.975 quantile (a two-sided 95% interval) for 1 to 30 degrees of freedom.
T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157,
        2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922,
        2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831,
        2.048407, 2.045230, 2.042272)
Z975 = 1.959963984540054  # the normal's


def t975(dof: int) -> float:
  """Student's t 0.975 quantile with ``dof`` degrees of freedom: the table ``T975`` up to 30,
  beyond it the Cornish-Fisher expansion around the normal quantile to 1/dof^4 (Abramowitz &
  Stegun 26.7.5; within 1e-7 of the exact value there)."""
  if dof < 1:
    raise ValueError(f'a t interval needs at least 1 degree of freedom, got {dof}')
  if dof <= len(T975):
    return T975[dof - 1]
  z = Z975
  terms = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96,
           (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
           (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160)
  return z + sum(g / dof**(k + 1) for k, g in enumerate(terms))


@dataclasses.dataclass(frozen=True)
class Interval:
  """A mean over ``n`` seeds and its 95% confidence interval (None for n=1)."""
  mean: float
  n: int
  low: Optional[float] = None
  high: Optional[float] = None


def t_interval(values: Sequence[float]) -> Optional[Interval]:
  """The mean and its 95% Student t interval: mean ± t(0.975, n-1) * s / sqrt(n), s the sample
  std (n-1 dof); no interval for n=1; None for no values."""
  if not values:
    return None
  x = np.asarray(values, float)
  mean = float(x.mean())
  if len(x) == 1:
    return Interval(mean, 1)
  half = t975(len(x) - 1) * float(x.std(ddof=1)) / np.sqrt(len(x))
  return Interval(mean, len(x), mean - half, mean + half)


def format_interval(interval: Optional[Interval], digits: int = 3, mean: bool = True,
                    signed: bool = False) -> str:
  """``mean [low, high] (n=N)``, ``mean (n=1, no interval)`` or ``—``; without the mean if not
  ``mean``; ``signed``: every number with its sign (a difference: +0.0000 is above 0)."""
  if interval is None:
    return '—'
  f = f'{"+" if signed else ""}.{digits}f'
  head = f'{interval.mean:{f}} ' if mean else ''
  if interval.low is None:
    return f'{head}(n=1, no interval)' if mean else 'n=1, no interval'
  bounds = digits  # more digits where a bound not 0 would print as 0 (beside 'worse': +0.000)
  while bounds < digits + 4 and any(b and round(b, bounds) == 0
                                    for b in (interval.low, interval.high)):
    bounds += 1
  g = f'{"+" if signed else ""}.{bounds}f'
  return f'{head}[{interval.low:{g}}, {interval.high:{g}}]' + (f' (n={interval.n})' if mean else '')


def verdict(interval: Optional[Interval], below: str = 'better', above: str = 'worse') -> str:
  """``below`` ('better': lower log-perplexity) if the 95% interval of variant - baseline lies
  entirely below 0, ``above`` if entirely above, else ``not distinguishable at n=K seeds``. The
  same difference at every seed (to rounding) has no spread to test (a zero-width interval): no
  verdict."""
  if interval is None:
    return 'no seed finished in both'
  if interval.n > 1 and interval.high - interval.low <= 1e-9 * max(1.0, abs(interval.mean)):
    return f'no verdict: the same difference at all n={interval.n} seeds (no spread to test)'
  if interval.high is not None and interval.high < 0:
    return below
  if interval.low is not None and interval.low > 0:
    return above
  return f'not distinguishable at n={interval.n} seeds'


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
  """Spearman's rho: Pearson's correlation of the ranks (ties get their mean rank)."""
  def ranks(x):
    x = np.asarray(x, float)
    order = np.argsort(x, kind='stable')
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    for value in np.unique(x):
      r[x == value] = r[x == value].mean()
    return r
  ra, rb = ranks(a), ranks(b)
  return float(np.corrcoef(ra, rb)[0, 1])


def bootstrap_spearman(values: Sequence[Sequence[float]], reference: Sequence[float],
                       resamples: int = 1000, seed: int = 0) -> Optional[Tuple[float, float, int]]:
  """(2.5th, 97.5th percentile, undefined) of Spearman's rho between the per-variant means and
  ``reference`` when the seeds are resampled with replacement (``resamples`` times, RNG seed
  ``seed``), the same draw for every variant: ``values[variant][k]`` is seed k's value, the same
  seeds in the same order for every variant, whose runs share their data order (a paired
  bootstrap). ``undefined``: resamples whose means were all equal (no rho), left out. None with
  fewer than 2 seeds or no resample with a rho."""
  x = np.asarray(values, float)
  if x.ndim != 2 or x.shape[1] < 2:
    return None
  draws = np.random.default_rng(seed).integers(0, x.shape[1], (resamples, x.shape[1]))
  with np.errstate(invalid='ignore', divide='ignore'):  # all means equal: rho is NaN
    rhos = np.array([spearman(x[:, d].mean(axis=1), reference) for d in draws])
  finite = rhos[np.isfinite(rhos)]
  if not len(finite):
    return None
  low, high = np.percentile(finite, [2.5, 97.5])
  return float(low), float(high), int(len(rhos) - len(finite))
