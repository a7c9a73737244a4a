"""The report of one or more sweeps (or run directories): per variant the final and best held-out
log-perplexity (mean ± std over seeds), steps, parameters, tokens/s and divergence; the paper's
numbers beside them with the ranking agreement (Spearman's rho and the pairs that flip); and the
plots of ``plots``. Partial sweeps give partial tables, their runs marked as running or pending."""
import collections
import dataclasses
import itertools
import os
import re
from typing import List, Optional, Sequence

import numpy as np

from t5x_variants.sweeps import grid, papers, plots
from t5x_variants.sweeps.runs import BLOW_UP_NATS, RunRecord, read_run


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
  """Run directories named ``<variant>-seed<N>`` (others: the whole name is the variant, seed 0)."""
  trials = []
  for d in run_dirs:
    base = os.path.basename(os.path.normpath(d))
    found = re.fullmatch(r'(.+)-seed(\d+)', base)
    record = read_run(d)
    trials.append(Trial(found.group(1) if found else base, int(found.group(2)) if found else 0,
                        'done' if record.finished() else 'incomplete', record))
  return Group(name, trials, papers.TABLES.get(paper) if paper else None)


def diverged_step(trial: Trial) -> Optional[int]:
  return trial.nonfinite_step if trial.nonfinite_step is not None else trial.record.diverged_at()


def mean_std(values: Sequence[float]) -> str:
  if not values:
    return '—'
  if len(values) == 1:
    return f'{values[0]:.3f}'
  return f'{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}'


def final_values(trials: Sequence[Trial], best: bool = False) -> List[float]:
  """Final (or best) held-out log-perplexity of the finished trials that did not diverge."""
  values = [t.record.best_eval() if best else t.record.final_eval() for t in trials
            if t.status == 'done' and diverged_step(t) is None]
  return [v for v in values if v is not None]


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


def ranking(group: Group):
  """(rho, flipped pairs, number of variants) of our mean final log-perplexity against the
  paper's rank column, over the variants both have; None if fewer than 3."""
  table = group.paper
  ours, theirs, names = [], [], []
  if not table.rows:
    return None
  for v in group.variants():
    values = final_values(group.of(v))
    published = table.rows.get(v, (None,) * len(table.columns))[table.rank_column]
    if values and published is not None:
      names.append(v)
      ours.append(float(np.mean(values)))
      theirs.append(published if table.lower_is_better else -published)
  if len(names) < 3:
    return None
  flips = [(a, b) for (i, a), (j, b) in itertools.combinations(enumerate(names), 2)
           if (ours[i] - ours[j]) * (theirs[i] - theirs[j]) < 0]
  return spearman(ours, theirs), flips, len(names)


def _status(trials: Sequence[Trial]) -> str:
  return ', '.join(f'{n} {s}' for s, n in collections.Counter(t.status for t in trials).items())


def table(group: Group) -> List[str]:
  paper = group.paper
  head = ['variant', 'runs', 'steps', 'parameters', 'tokens/s', 'final log-ppl', 'best log-ppl',
          'diverged']
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
    row = [v, _status(trials), f'{steps}' + (f'/{total}' if total else ''),
           f'{params:,}' if params else '—', f'{np.mean(speeds):,.0f}' if speeds else '—',
           mean_std(final_values(trials)), mean_std(final_values(trials, best=True)),
           f'{len(diverged)}/{len(trials)} (step {", ".join(map(str, diverged))})' if diverged else 'no']
    if paper:
      row += ['—' if x is None else f'{x:.3f}' for x in paper.rows.get(v, (None,) * len(paper.columns))]
    lines.append('| ' + ' | '.join(row) + ' |')
  return lines


def group_markdown(group: Group, out_dir: str) -> List[str]:
  lines = [f'## {group.name}', '']
  if group.paper:
    lines += [f'Paper: {group.paper.title} ({group.paper.source}).'
              + (f' What it found: {group.paper.findings}' if group.paper.findings else ''), '']
  lines += table(group) + ['']
  task = next((t.record.task for t in group.trials if t.record.task), None)
  lines.append(f'Log-perplexity: teacher-forced cross-entropy per target token on the held-out '
               f'split of `{task}` at the last evaluation (final) and the lowest of all (best), '
               f'mean ± sample std over the finished seeds that did not diverge. '
               f'Diverged: a non-finite loss or skipped update, or a logged training loss more '
               f'than {BLOW_UP_NATS:g} nat above the lowest before it that had not come back '
               'by the last log (the step where it first was).' if task else
               'No evaluation yet.')
  lines.append('')
  if group.paper and group.paper.rows:
    found = ranking(group)
    if found:
      rho, flips, n = found
      lines.append(f'Ranking against the paper\'s "{group.paper.columns[group.paper.rank_column]}" '
                   f'column: Spearman rho = '
                   f'{"undefined (all our values are equal)" if np.isnan(rho) else f"{rho:.2f}"} over {n} '
                   'variants; pairs ordered differently from the paper: '
                   + (', '.join(f'{a}/{b}' for a, b in flips) if flips else 'none') + '.')
      lines.append('')
  for title, path in plots.group_plots(group, out_dir, final_values, diverged_step):
    lines += [f'![{title}]({os.path.basename(path)})', '']
  return lines


def write_report(groups: Sequence[Group], out_dir: str, title: str = 'Sweep report') -> str:
  """Writes ``out_dir/report.md`` and its PNG plots; returns the markdown."""
  os.makedirs(out_dir, exist_ok=True)
  lines = [f'# {title}', '']
  for group in groups:
    lines += group_markdown(group, out_dir)
  text = '\n'.join(lines)
  with open(os.path.join(out_dir, 'report.md'), 'w') as f:
    f.write(text)
  return text
