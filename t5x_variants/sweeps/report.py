"""The report of one or more sweeps (or run directories): per variant the final and best held-out
log-perplexity (mean ± std over seeds, and the final's 95% confidence interval), steps,
parameters, tokens/s and divergence; with a baseline variant, the paired differences of every
other variant against it (seed by seed) and a verdict; the paper's numbers beside them with the
ranking agreement (Spearman's rho, its bootstrap interval over seeds, and the pairs that flip); and
the plots of ``plots``; a learning-rate sweep's stability table (``stability``). The statistics
are ``statistics``'s. Partial sweeps give partial tables, their runs marked as running or
pending."""
import collections
import dataclasses
import itertools
import math
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from t5x_variants.sweeps import grid, papers, plots, stability
from t5x_variants.sweeps.statistics import (bootstrap_spearman, format_interval, spearman,
                                             t_interval, verdict)
from t5x_variants.sweeps.runs import BLOW_UP_NATS, RunRecord, read_run
from t5x_variants.train import storage


@dataclasses.dataclass
class Trial:
  """One run of a variant: its seed, status and record."""
  variant: str
  seed: int
  status: str
  record: RunRecord
  reason: Optional[str] = None
  nonfinite_step: Optional[int] = None  # where the trainer stopped a diverged run


@dataclasses.dataclass
class Group:
  """One table: the trials of one sweep (or of the given run directories)."""
  name: str
  trials: List[Trial]
  paper: Optional[papers.Table] = None

  def variants(self) -> List[str]:
    return list(dict.fromkeys(t.variant for t in self.trials))

  def of(self, variant: str) -> List[Trial]:
    return [t for t in self.trials if t.variant == variant]


def sweep_group(sweep_dir: str) -> Group:
  sweep = grid.Sweep.load(sweep_dir)
  sweep.update_from_run_dirs()
  trials = []
  for run in sweep.all_runs():
    record = read_run(sweep.model_dir(run))
    trials.append(Trial(run.variant, run.seed, run.status, record, run.reason, run.diverged_step))
  return Group(os.path.basename(os.path.normpath(sweep_dir)), trials,
               papers.TABLES.get(sweep.paper) if sweep.paper else None)


def run_dirs_group(run_dirs: Sequence[str], name: str = 'runs', paper: Optional[str] = None) -> Group:
  """Run directories named ``<variant>-seed<N>`` (others: the whole name is the variant, seed 0);
  two of the same variant and seed (from two sweeps) are refused, not merged. A run is done,
  diverged (stopped by a non-finite loss) or incomplete."""
  trials, seen = [], {}
  for d in run_dirs:
    path = storage.path(d)
    if not path.exists():
      raise FileNotFoundError(f'--run_dirs: {d} does not exist')
    if (path / grid.SWEEP_FILE).exists() or any(
        (child / f).exists() for child in path.iterdir() if child.is_dir()
        for f in ('config.gin', 'metrics.jsonl')):  # (one without either: a run not started yet)
      raise ValueError(f'--run_dirs: {d} holds runs and is none (a sweep\'s directory, or one of '
                       'run directories): give the run directories, or a sweep\'s as --sweep_dir')
    base = os.path.basename(os.path.normpath(d))
    found = re.fullmatch(r'(.+)-seed(\d+)', base)
    variant, seed = (found.group(1), int(found.group(2))) if found else (base, 0)
    if (variant, seed) in seen:
      raise ValueError(f'--run_dirs: {seen[variant, seed]} and {d} are both {variant} seed {seed} '
                       '(a directory\'s name says which): one table pairs runs by variant and '
                       'seed; report the two sweeps separately (--sweep_dir each)')
    seen[variant, seed] = d
    record = read_run(d)
    status = ('done' if record.finished() else
              'diverged' if record.stopped_non_finite() else 'incomplete')
    trials.append(Trial(variant, seed, status, record))
  return Group(name, trials, papers.TABLES.get(paper) if paper else None)


def diverged_step(trial: Trial) -> Optional[int]:
  """The step a finished trial diverged at, None if it did not or is not finished (a running
  run's blow-up may still recover): the tables and the depth plot alike."""
  if trial.status not in grid.FINISHED:
    return None
  return trial.nonfinite_step if trial.nonfinite_step is not None else trial.record.diverged_at()


def mean_std(values: Sequence[float]) -> str:
  if not values:
    return '—'
  if len(values) == 1:
    return f'{values[0]:.3f}'
  return f'{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}'


def final_value(trial: Trial, best: bool = False) -> Optional[float]:
  """Final (or best) held-out log-perplexity of a finished trial that did not diverge, else None
  (the best only where there is a final: both are of the same trials)."""
  if (trial.status != 'done' or diverged_step(trial) is not None
      or trial.record.final_eval() is None):
    return None
  return trial.record.best_eval() if best else trial.record.final_eval()


def final_values(trials: Sequence[Trial], best: bool = False) -> List[float]:
  """Final (or best) held-out log-perplexity of the finished trials that did not diverge."""
  values = [final_value(t, best) for t in trials]
  return [v for v in values if v is not None]


# --- statistics over seeds -------------------------------------------------------------------------

def paired_differences(trials: Sequence[Trial],
                       baseline: Sequence[Trial]) -> List[Tuple[int, float]]:
  """(seed, variant - baseline final held-out log-perplexity) for every seed where both runs
  finished without diverging, by seed (seed s of both saw the same data order); a seed missing or
  unfinished in either is dropped."""
  def by_seed(ts):
    return {t.seed: v for t in ts for v in [final_value(t)] if v is not None}
  ours, theirs = by_seed(trials), by_seed(baseline)
  return [(s, ours[s] - theirs[s]) for s in sorted(set(ours) & set(theirs))]


def _paired_lines(kind: str, difference: str,
                  pairs: Sequence[Tuple[str, List[Tuple[int, float]]]],
                  words: Tuple[str, str] = ('better', 'worse'),
                  notes: Optional[Dict[str, str]] = None) -> List[str]:
  """Markdown: per name its (seed, difference from the baseline) pairs: the seeds, n, the mean
  ``difference``, its 95% t interval over the pairs and the verdict (``words``: below 0, above),
  with the name's ``notes``, if any."""
  head = [kind, 'paired seeds', 'n', difference, '95% CI', 'verdict']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for name, named in pairs:
    interval = t_interval([d for _, d in named])
    row = [name, ', '.join(str(s) for s, _ in named) or '—', str(len(named)),
           '—' if interval is None else f'{interval.mean:+.4f}',
           format_interval(interval, 4, mean=False, signed=True),
           verdict(interval, *words) + (notes or {}).get(name, '')]
    lines.append('| ' + ' | '.join(row) + ' |')
  return lines


def _intervals(table: Sequence[str]) -> int:
  """How many rows of a ``_paired_lines`` table have an interval (two seeds or more)."""
  return sum(1 for row in table[2:] if row.split(' | ')[2] not in ('0', '1'))


def _uncorrected(k: int) -> str:
  """What ``k`` intervals side by side mean."""
  return (f' These are {k} intervals at 95% each, not corrected for multiple comparisons: by '
          'chance alone about one in twenty excludes 0.' if k > 1 else '')


def paired_table(group: Group, baseline: str) -> List[str]:
  """Every other variant's final held-out log-perplexity against ``baseline``'s, paired by seed;
  a verdict over the seeds where neither diverged names the seeds it leaves out for a divergence
  (a variant that diverged in one seed is no better for its other seeds)."""
  def diverged(name):
    return sorted(t.seed for t in group.of(name) if diverged_step(t) is not None)

  def left_out(name):
    arms = [(n, seeds) for n in (name, baseline) for seeds in [diverged(n)] if seeds]
    return '; ' + ', '.join(f'{n} diverged at seed{"s" * (len(s) > 1)} {", ".join(map(str, s))}'
                            for n, s in arms) + ' (left out)' if arms else ''

  others = [v for v in group.variants() if v != baseline]
  return _paired_lines('variant', f'mean difference (variant - {baseline})',
                       [(v, paired_differences(group.of(v), group.of(baseline))) for v in others],
                       notes={v: left_out(v) for v in others})


def sensitivity_table(curves: Sequence[stability.Curve], baseline: str) -> List[str]:
  """Every other curve's LR sensitivity against ``baseline``'s, paired by seed (each seed's
  sensitivity from its own runs at every rate)."""
  ours = {c.label: c.seed_sensitivities() for c in curves}
  theirs = ours[baseline]
  return _paired_lines('curve', f'mean difference of LR sensitivity (curve - {baseline})', [
      (label, [(s, v[s] - theirs[s]) for s in sorted(set(v) & set(theirs))])
      for label, v in ours.items() if label != baseline], ('less sensitive', 'more sensitive'))


def common_seeds(group: Group, names: Sequence[str]) -> List[List[float]]:
  """[variant][k]: the final log-perplexity of each of ``names`` at the k-th seed that finished
  without diverging in all of them."""
  by_seed = [{t.seed: final_value(t) for t in group.of(v) if final_value(t) is not None}
             for v in names]
  seeds = sorted(set.intersection(*(set(b) for b in by_seed))) if by_seed else []
  return [[b[s] for s in seeds] for b in by_seed]


def ranked(group: Group) -> Tuple[List[str], List[float]]:
  """(variants, the paper's rank column as lower-is-better) of the variants that both have (ours
  with a finished seed)."""
  table = group.paper
  names, theirs = [], []
  for v in group.variants() if table and table.rows else ():
    published = table.rows.get(v, (None,) * len(table.columns))[table.rank_column]
    if final_values(group.of(v)) and published is not None:
      names.append(v)
      theirs.append(published if table.lower_is_better else -published)
  return names, theirs


def ranking(group: Group):
  """(variants, their final log-perplexities at the seeds finished in every one, the paper's
  rank column, rho, flipped pairs): the ranking of our means over those seeds against the
  paper's, over the variants both have; None if fewer than 3, or no seed finished in all. A
  flipped pair: (a, b, the 95% t interval of a - b paired by seed), where our means order a and
  b otherwise than the paper."""
  names, theirs = ranked(group)
  paired = common_seeds(group, names)
  if len(names) < 3 or not paired[0]:
    return None
  ours = [float(np.mean(v)) for v in paired]
  flips = [(a, b, t_interval(list(np.subtract(paired[i], paired[j]))))
           for (i, a), (j, b) in itertools.combinations(enumerate(names), 2)
           if (ours[i] - ours[j]) * (theirs[i] - theirs[j]) < 0]
  return names, paired, theirs, spearman(ours, theirs), flips


def _status(trials: Sequence[Trial]) -> str:
  return ', '.join(f'{n} {s}' for s, n in collections.Counter(t.status for t in trials).items())


def table(group: Group) -> List[str]:
  paper = group.paper
  name = 'log-ppl' if plots.metric_name(group) == 'log-perplexity' else 'eval loss'
  head = ['variant', 'runs', 'steps', 'parameters', 'tokens/s', f'final {name}',
          'final: mean [95% CI]', f'best {name}', 'diverged']
  head += [f'paper: {c}' for c in paper.columns] if paper else []
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for v in group.variants():
    trials = group.of(v)
    records = [t.record for t in trials]
    steps = max(r.step for r in records)
    total = next((r.total_steps for r in records if r.total_steps), None)
    params = next((r.params for r in records if r.params), None)
    speeds = [s for s in (r.tokens_per_second() for r in records) if s]
    diverged = [diverged_step(t) for t in trials if diverged_step(t) is not None]
    totals = sorted({r.total_steps for r in records if r.total_steps})
    if len(totals) > 1:  # runs of other lengths in one row: say so, with every length
      total = ' or '.join(map(str, totals)) + ' (runs of other lengths)'
    row = [v, _status(trials), f'{steps}' + (f'/{total}' if total else ''),
           f'{params:,}' if params else '—', f'{np.mean(speeds):,.0f}' if speeds else '—',
           mean_std(final_values(trials)), format_interval(t_interval(final_values(trials))),
           mean_std(final_values(trials, best=True)),
           f'{len(diverged)}/{len(trials)} (step {", ".join(map(str, diverged))})' if diverged else 'no']
    if paper:
      row += ['—' if x is None else f'{x:.3f}' for x in paper.rows.get(v, (None,) * len(paper.columns))]
    lines.append('| ' + ' | '.join(row) + ' |')
  return lines


def ranking_lines(group: Group, resamples: int = 1000) -> List[str]:
  """The ranking agreement with the paper: Spearman's rho with its bootstrap interval over seeds,
  and the pairs ordered differently; none if fewer than 3 variants have the paper's numbers."""
  found = ranking(group)
  if not found:
    return []
  names, paired, theirs, rho, flips = found
  n, seeds = len(names), len(paired[0])
  shown = [f'{a}/{b} ({a} - {b}: {format_interval(i, 3, signed=True)})' for a, b, i in flips
           if verdict(i) in ('better', 'worse')]
  lines = [f'Ranking against the paper\'s "{group.paper.columns[group.paper.rank_column]}" '
           f'column, by our means over the {seeds} seeds finished in every variant: Spearman rho = '
           f'{"undefined (all our values are equal)" if np.isnan(rho) else f"{rho:.2f}"} over {n} '
           'variants; pairs ordered differently from the paper with a paired 95% interval '
           '(Student t over those seeds) excluding 0: ' + (', '.join(shown) or 'none')
           + f'; {len(flips) - len(shown)} other pair(s) ordered differently by the means '
           f'alone, not distinguishable.{_uncorrected(len(flips))}']
  interval = bootstrap_spearman(paired, theirs, resamples)
  if interval is None:
    lines.append(f'No bootstrap interval for rho (n = {seeds} seeds finished in every variant: '
                 'nothing to resample).')
  else:
    low, high, undefined = interval
    distinct = math.comb(2 * seeds - 1, seeds)  # multisets of the seeds
    lines.append(f'Bootstrap 95% interval of rho over seeds: [{low:.2f}, {high:.2f}] '
                 f'(n = {seeds} seeds finished in every variant, resampled with replacement '
                 f'{resamples} times, the same draw for every variant (a seed\'s runs share their '
                 'data order), RNG seed 0, 2.5th-97.5th percentiles'
                 + (f'; {undefined} resamples with all means equal left out' if undefined else '')
                 + ').' + (f' {seeds} seeds have only {distinct} distinct resamples: the '
                           'interval is coarse and may end at the point estimate.'
                           if distinct < resamples else ''))
  return [' '.join(lines), '']


def group_markdown(group: Group, out_dir: str, baseline: Optional[str] = None) -> List[str]:
  lines = [f'## {group.name}', '']
  if group.paper:
    lines += [f'Paper: {group.paper.title} ({group.paper.source}).'
              + (f' What it found: {group.paper.findings}' if group.paper.findings else ''), '']
  lines += table(group) + ['']
  task = next((t.record.task for t in group.trials if t.record.task), None)
  metric = plots.metric_name(group)
  what = ('Log-perplexity: teacher-forced cross-entropy per target token'
          if metric == 'log-perplexity' else
          'Eval loss: the head\'s loss (cross-entropy per example; a regression head\'s squared error)')
  lines.append(f'{what} on the held-out '
               f'split of `{task}` at the last evaluation (final) and the lowest of all (best), '
               f'mean ± sample std over the finished seeds that did not diverge, and the '
               f'final\'s mean with its 95% confidence interval over those seeds (Student t, '
               f'n-1 degrees of freedom: mean ± t(0.975, n-1) s/√n). Tokens/s: input and target '
               'positions trained per second, padding included, the mean over the logged windows '
               'but each training session\'s first (its compilation). '
               f'Diverged: a non-finite loss or skipped update or held-out value (even once), or '
               f'a logged training loss more than {BLOW_UP_NATS:g} nat above the lowest before it '
               'that had not come back by the last log (the step where it first was).' if task else
               'No evaluation yet.')
  lines.append('')
  rate_curves = (stability.curves(group, final_value, diverged_step)
                 if stability.is_rate_sweep(group) else None)
  if baseline and baseline in group.variants():
    paired = paired_table(group, baseline)
    lines += [f'Paired differences against `{baseline}`: final held-out {metric} of each '
              f'variant minus `{baseline}`\'s, seed by seed (seed s of both saw the same data '
              'order; only seeds where both finished and neither diverged: the verdict names the '
              'seeds a divergence left out), the mean over the '
              'pairs and its 95% Student t interval (n-1 degrees of freedom). Negative: lower '
              f'{metric} than the baseline. Verdict: better (or worse) if the interval lies '
              f'entirely below (above) 0.{_uncorrected(_intervals(paired))}', '']
    lines += paired + ['']
  elif baseline and baseline not in _curve_labels(group):
    lines += [f'No variant `{baseline}` here: no paired differences.', '']
  lines += ranking_lines(group)
  if rate_curves:
    lines += stability.markdown(rate_curves)
    if baseline in _curve_labels(group):
      paired = sensitivity_table(rate_curves, baseline)
      lines += [f'Paired differences against the curve `{baseline}`: each seed\'s LR sensitivity '
                '(from that seed\'s runs at every rate) minus the baseline\'s of the same seed, '
                'the mean over the seeds and its 95% Student t interval. Negative: less sensitive '
                'to the learning rate (which is not more stable: a run stuck at the unigram '
                'plateau is insensitive). Verdict: less (or more) sensitive if the interval lies '
                f'entirely below (above) 0.{_uncorrected(_intervals(paired))}', '']
      lines += paired + ['']
  for title, path in plots.group_plots(group, out_dir, final_values, diverged_step, rate_curves):
    lines += [f'![{title.replace("log-perplexity", metric)}]({os.path.basename(path)})', '',
              f'*{CAPTIONS[title].format(metric=metric)}*', '']
  return lines


CAPTIONS = {
    'loss curves': 'Training loss and held-out {metric} by step: the mean over the seeds '
                   'that reached the step; the band is its 95% Student t interval (none where '
                   'one seed).',
    'final log-perplexity': 'Final held-out {metric}: the mean over finished, '
                            'non-diverged seeds with its 95% Student t interval as the error bar '
                            '(n under each name); hollow diamonds: the paper\'s numbers, on a '
                            'secondary axis of the same scale.',
    'log-perplexity by depth': 'Final held-out {metric} against layers per stack, per '
                               'placement: mean and 95% t interval over seeds; x at the top: a '
                               'run diverged at that depth.',
    'per-layer diagnostics': 'DeepNet\'s model update ||F(x; θ_t) - F(x; θ_0)|| by step, and the '
                             'gradient and residual-activation norms per layer at the last record '
                             '(the first seed with diagnostics).',
    'loss against learning rate': 'Final held-out loss against the learning rate, one line per '
                                  'curve: the mean over seeds of min(final, initial loss); x: a '
                                  'run diverged (counted at its initial loss); hollow: stalled.',
}


def _curve_labels(group: Group) -> List[str]:
  """The learning-rate curves of a rate sweep (``stability.rate_of``), else none."""
  if not stability.is_rate_sweep(group):
    return []
  return list(dict.fromkeys(stability.rate_of(v)[0] for v in group.variants()))


def write_report(groups: Sequence[Group], out_dir: str, title: str = 'Sweep report',
                 baseline: Optional[str] = None) -> str:
  """Writes ``out_dir/report.md`` and its PNG plots; returns the markdown. ``baseline``: a variant
  name (as in the table) that the others are compared with, seed by seed."""
  names = [n for g in groups for n in g.variants() + _curve_labels(g)]
  if baseline and baseline not in names:
    raise ValueError(f'--baseline {baseline!r} is no variant (or learning-rate curve) here; they '
                     'are: ' + ', '.join(dict.fromkeys(names)))
  lines, used = [f'# {title}', ''], set()
  for group in groups:  # two sweep directories of one name: the second's plots are NAME_2_*.png
    name, n = group.name, 1
    while name in used:
      n += 1
      name = f'{group.name}_{n}'
    used.add(name)
    lines += group_markdown(dataclasses.replace(group, name=name), out_dir, baseline)
  text = '\n'.join(lines)
  storage.write_text(storage.join(out_dir, 'report.md'), text)
  return text
