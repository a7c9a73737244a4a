"""The report's PNG plots (matplotlib, headless, no pyplot state): loss curves per variant (the
mean over seeds with its 95% Student t interval as a band), the final log-perplexity per variant
(mean with a 95% t interval error bar, n under each name, the paper's numbers as reference marks on
a same-scale secondary axis where the paper has them), loss against depth per placement with
divergence marked, and the per-layer diagnostics (update norm, gradient and activation norms per
layer).

Every variant keeps one colour and one marker in all of a group's plots: the 8 colours of Okabe &
Ito's colour-blind-safe palette, with 9 markers cycled beside them (9 and 8 coprime: 72 variants
before a (colour, marker) pair repeats). Legends sit outside the axes. Each ``*_figure`` function
returns its ``matplotlib.figure.Figure`` (for tests); the functions without the suffix save it as
``<group>_<kind>.png`` and return the path."""
import io
import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from t5x_variants.sweeps.statistics import t_interval
from t5x_variants.train import storage

DPI = 100
LAYER_KEY = re.compile(r'(grad_norm|activation_norm)/(\w+)/(\d+)$')

# Okabe & Ito (2008), "Color Universal Design": orange, sky blue, bluish green, blue, vermillion,
# reddish purple, black, yellow (yellow last: the faintest on white).
OKABE_ITO = ('#E69F00', '#56B4E9', '#009E73', '#0072B2', '#D55E00', '#CC79A7', '#000000',
             '#F0E442')
MARKERS = ('o', 's', '^', 'v', 'P', 'X', '<', '>', 'h')  # no 'D': the paper's mark
PAPER_STYLE = dict(marker='D', markerfacecolor='none', markeredgecolor='#555555',
                   markeredgewidth=1.5, markersize=8, linestyle='none')
PAPER_OFFSET = 0.25  # the paper's mark this far right of ours, not on it
BAND_ALPHA = 0.2
STACK_LINESTYLES = ('-', '--', ':', '-.')


def style(index: int) -> Tuple[str, str]:
  """(colour, marker) of the ``index``-th variant of a group."""
  return OKABE_ITO[index % len(OKABE_ITO)], MARKERS[index % len(MARKERS)]


def seed_band(curves: Sequence[Sequence[Tuple[int, float]]]):
  """(steps, mean, low, high, n) arrays over the seeds' curves of (step, value): at each step the
  mean of the seeds that reached it (finite values only) and its 95% Student t interval
  (``statistics.t_interval``: mean ± t(0.975, n-1) s/√n); low and high NaN where one seed has it."""
  curves = [{s: v for s, v in c if v is not None and math.isfinite(v)} for c in curves]
  curves = [c for c in curves if c]
  steps = sorted(set().union(*curves)) if curves else []
  mean, low, high, n = [], [], [], []
  for step in steps:
    interval = t_interval([c[step] for c in curves if step in c])
    mean.append(interval.mean)
    low.append(np.nan if interval.low is None else interval.low)
    high.append(np.nan if interval.high is None else interval.high)
    n.append(interval.n)
  return (np.array(steps, float), np.array(mean, float), np.array(low, float),
          np.array(high, float), np.array(n, int))


def _every(points: int, index: int) -> Tuple[int, int]:
  """About 8 markers a line, staggered between the variants."""
  stride = max(1, points // 8)
  return index % stride, stride


def _band(ax, curves, label: str, index: int):
  """The mean over seeds as a line (the variant's colour and marker) and its 95% t interval as a
  band where at least two seeds reached the step; returns the line, or None without data."""
  steps, mean, low, high, _ = seed_band(curves)
  if not len(steps):
    return None
  colour, marker = style(index)
  line, = ax.plot(steps, mean, color=colour, marker=marker, markersize=4, lw=1.3, label=label,
                  markevery=_every(len(steps), index))
  both = np.isfinite(low)
  if both.any():
    ax.fill_between(steps, np.where(both, low, mean), np.where(both, high, mean), where=both,
                    color=colour, alpha=BAND_ALPHA, lw=0)
  return line


def _legend_right(fig, axes, title: Optional[str] = None, extra=()):
  """One legend for ``axes`` (labels deduplicated) outside them, at the figure's right."""
  by_label = {}
  for ax in axes:
    for handle, label in zip(*ax.get_legend_handles_labels()):
      by_label.setdefault(label, handle)
  for handle in extra:
    by_label.setdefault(handle.get_label(), handle)
  if by_label:
    fig.legend(list(by_label.values()), list(by_label), loc='outside right upper', fontsize=7,
               title=title, title_fontsize=7, ncols=1 + (len(by_label) - 1) // 24)


def _save(fig, out_dir: str, name: str) -> str:
  """``out_dir``/``name`` as a PNG, written whole (``out_dir`` may be a bucket)."""
  path = storage.join(out_dir, name)
  png = io.BytesIO()
  fig.savefig(png, dpi=DPI, format='png')
  storage.write_bytes(path, png.getvalue())
  return path


def metric_name(group) -> str:
  """'log-perplexity', or 'eval loss' where the task's evals record none (a classification or
  regression head's loss)."""
  metric = next((t.record.eval_metric() for t in group.trials if t.record.task), 'log_perplexity')
  return 'log-perplexity' if metric == 'log_perplexity' else 'eval loss'


def curves_figure(group) -> Figure:
  fig = Figure(figsize=(10, 3.8), layout='constrained')
  train_ax, eval_ax = fig.subplots(1, 2)
  for i, v in enumerate(group.variants()):
    trials = group.of(v)
    train = [[(r['step'], r['loss']) for r in t.record.train if r.get('loss') is not None]
             for t in trials]
    evals = [[(step, value) for step, value in t.record.eval_curve() if math.isfinite(value)]
             for t in trials]
    seeds = max(sum(1 for c in train if c), sum(1 for c in evals if c))
    _band(train_ax, train, f'{v} (n={seeds})', i)
    _band(eval_ax, evals, f'{v} (n={seeds})', i)
  train_ax.set(title='training loss', xlabel='step')
  eval_ax.set(title=f'held-out {metric_name(group)}', xlabel='step')
  fig.suptitle('mean over the seeds at each step; band: its 95% Student t interval '
               '(none where one seed)', fontsize=8)
  _legend_right(fig, [train_ax, eval_ax], 'variant (seeds)')
  return fig


def curves(group, out_dir: str) -> str:
  return _save(curves_figure(group), out_dir, f'{group.name}_curves.png')


def paper_label(paper) -> str:
  """``paper (<source up to its first ';'>, <rank column>)``, e.g. ``paper (Shazeer 2020,
  arXiv:2002.05202, Table 1, 65,536 steps)``."""
  return f'paper ({paper.source.split(";")[0].strip()}, {paper.columns[paper.rank_column]})'


def paper_values(group, variants: Sequence[str]) -> Dict[int, float]:
  """{position in ``variants``: the paper's rank-column value} where the paper has one."""
  paper = group.paper
  if not paper or not paper.rows:
    return {}
  return {x: paper.rows[v][paper.rank_column] for x, v in enumerate(variants)
          if v in paper.rows and paper.rows[v][paper.rank_column] is not None}


def final_figure(group, final_values) -> Figure:
  """Per variant, the mean final held-out log-perplexity over its seeds with its 95% t interval
  as the error bar (n under the name; n=1: the point alone); with the paper's numbers, those as
  hollow diamonds (just right of ours) on a right axis with the same nats per unit height
  (shifted to centre them)."""
  rows = []  # (style index, variant, interval)
  for i, v in enumerate(group.variants()):
    interval = t_interval(final_values(group.of(v)))
    if interval is not None:
      rows.append((i, v, interval))
  names = [v for _, v, _ in rows]
  published = paper_values(group, names)
  fig = Figure(figsize=(max(5.0, 0.5 * len(rows) + 3.0), 4.4), layout='constrained')
  ax = fig.subplots()
  for x, (i, _, interval) in enumerate(rows):
    colour, marker = style(i)
    yerr = None if interval.low is None else [[interval.mean - interval.low],
                                              [interval.high - interval.mean]]
    ax.errorbar([x], [interval.mean], yerr=yerr, color=colour, marker=marker, markersize=7,
                capsize=4, lw=1.5, linestyle='none')
  ax.set_xticks(range(len(rows)), [f'{v} (n={iv.n})' for _, v, iv in rows], rotation=45,
                ha='right', rotation_mode='anchor', fontsize=8)
  ax.set_xlim(-0.6, len(rows) - 0.4)
  ax.set_ylabel(f'ours: {metric_name(group)}', fontsize=8)
  ax.set_title(f'final held-out {metric_name(group)}', fontsize=9)
  ax.grid(axis='y', alpha=0.3)
  legend = [Line2D([], [], color='#555555', marker='o', linestyle='-',
                   label='ours: mean over n seeds, bar: 95% Student t interval (n=1: point only)')]
  if published:
    twin = ax.twinx()
    twin.plot([x + PAPER_OFFSET for x in published], list(published.values()), **PAPER_STYLE)
    twin.set_ylabel('paper: log-perplexity', fontsize=8)
    if rows and group.paper.lower_is_better:  # the same scale on both axes, each centred
      ours = [x for _, _, iv in rows for x in (iv.mean, iv.low, iv.high) if x is not None]
      theirs = list(published.values())
      span = 1.25 * max(max(ours) - min(ours), max(theirs) - min(theirs), 1e-3)
      for axis, values in ((ax, ours), (twin, theirs)):
        centre = (max(values) + min(values)) / 2
        axis.set_ylim(centre - span / 2, centre + span / 2)
    legend.append(Line2D([], [], **PAPER_STYLE,
                         label=paper_label(group.paper) + ', right axis'
                         + (' (same scale, shifted)' if group.paper.lower_is_better else '')))
  fig.legend(handles=legend, loc='outside lower center', fontsize=7)
  return fig


def final_bars(group, out_dir: str, final_values) -> str:
  return _save(final_figure(group, final_values), out_dir, f'{group.name}_final.png')


DEPTH_PART = re.compile(r'(?:depth_|num_layers=|num_decoder_layers=|num_encoder_layers=)(\d+)')


def depth_axis(variant: str):
  """(placement, depth) of a variant named like ``post_ln+depth_18`` (a depth gin file) or
  ``post_ln+num_decoder_layers=18`` (a ``t5xv-sweep --grid`` over the layer count), else None."""
  parts = variant.split('+')
  depth = [p for p in parts if DEPTH_PART.fullmatch(p)]
  if len(depth) != 1:
    return None
  return ('+'.join(p for p in parts if p != depth[0]) or 'base',
          int(DEPTH_PART.fullmatch(depth[0]).group(1)))


def depth_figure(group, final_values, diverged_step) -> Figure:
  fig = Figure(figsize=(6.5, 3.8), layout='constrained')
  ax = fig.subplots()
  lines: Dict[str, list] = {}
  for v in group.variants():
    placement, depth = depth_axis(v)
    trials = group.of(v)
    lines.setdefault(placement, []).append(
        (depth, t_interval(final_values(trials)),
         any(diverged_step(t) is not None for t in trials)))
  for i, (placement, points) in enumerate(lines.items()):
    points.sort(key=lambda p: p[0])
    colour, marker = style(i)
    ok = [(d, iv) for d, iv, _ in points if iv is not None]
    ax.plot([d for d, _ in ok], [iv.mean for _, iv in ok], color=colour, marker=marker,
            markersize=6, lw=1.3, label=placement)
    spread = [(d, iv) for d, iv in ok if iv.low is not None]
    if spread:
      ax.errorbar([d for d, _ in spread], [iv.mean for _, iv in spread],
                  yerr=[[iv.mean - iv.low for _, iv in spread],
                        [iv.high - iv.mean for _, iv in spread]],
                  color=colour, linestyle='none', capsize=3, lw=1.2)
    bad = [d for d, _, div in points if div]  # at the top of the axes, whatever its values
    ax.plot(bad, [0.95] * len(bad), 'x', color=colour, ms=9, mew=2,
            transform=ax.get_xaxis_transform())
  depths = sorted({d for points in lines.values() for d, _, _ in points})
  metric = metric_name(group)
  ax.set(xlabel='layers per stack', ylabel=f'final {metric}', xscale='log')
  ax.set_title(f'final {metric} by depth: mean, 95% t interval over seeds', fontsize=9)
  ax.set_xticks(depths, [str(d) for d in depths])
  ax.minorticks_off()
  _legend_right(fig, [ax], 'placement', extra=[
      Line2D([], [], color='#555555', marker='x', markersize=7, markeredgewidth=2,
             linestyle='none', label='diverged (top edge)')])
  return fig


def depth_plot(group, out_dir: str, final_values, diverged_step) -> str:
  return _save(depth_figure(group, final_values, diverged_step), out_dir,
               f'{group.name}_depth.png')


def diagnostics_figure(group) -> Figure:
  """Update norm over steps, and gradient and activation norms per layer at the last record
  (of each variant's first run that has diagnostics); one linestyle per stack."""
  fig = Figure(figsize=(12.5, 3.8), layout='constrained')
  axes = fig.subplots(1, 3)
  stacks = sorted({found.group(2) for t in group.trials for r in t.record.diagnostics[-1:]
                   for found in map(LAYER_KEY.match, r) if found})
  for i, v in enumerate(group.variants()):
    records = next((t.record.diagnostics for t in group.of(v) if t.record.diagnostics), [])
    if not records:
      continue
    colour, marker = style(i)
    updates = [(r['step'], r['update_norm']) for r in records if r.get('update_norm') is not None]
    axes[0].plot([s for s, _ in updates], [u for _, u in updates], color=colour, marker=marker,
                 markersize=4, lw=1.3, markevery=_every(len(updates), i), label=v)
    for ax, kind in zip(axes[1:], ('grad_norm', 'activation_norm')):
      per_stack: Dict[str, Dict[int, float]] = {}
      for key, value in records[-1].items():
        found = LAYER_KEY.match(key)
        if found and found.group(1) == kind and value is not None:
          per_stack.setdefault(found.group(2), {})[int(found.group(3))] = value
      for stack, layers in sorted(per_stack.items()):
        ax.plot(sorted(layers), [layers[k] for k in sorted(layers)], color=colour, marker=marker,
                markersize=4, lw=1.3, markevery=_every(len(layers), i),
                linestyle=STACK_LINESTYLES[stacks.index(stack) % len(STACK_LINESTYLES)],
                label=v if len(stacks) < 2 else f'{v} {stack}')
  axes[0].set(title='model update ||F(x;θt) - F(x;θ0)||', xlabel='step')
  axes[1].set(title='gradient norm per layer (last record)', xlabel='layer', yscale='log')
  axes[2].set(title='residual activation norm per layer', xlabel='layer')
  for ax in axes:
    ax.title.set_fontsize(9)
  _legend_right(fig, axes, 'variant' + (' stack' if len(stacks) > 1 else ''))
  return fig


def diagnostics_plot(group, out_dir: str) -> str:
  return _save(diagnostics_figure(group), out_dir, f'{group.name}_diagnostics.png')


def stability_figure(curves, title: str) -> Figure:
  """Final loss against learning rate (log), one line per curve (``stability.Curve``): the mean
  over seeds of min(l(eta), l_0), as in the LR sensitivity; an x where a run diverged (a point
  where all did sits at l_0, dotted), a hollow marker where every converged run stalled."""
  fig = Figure(figsize=(7, 3.8), layout='constrained')
  ax = fig.subplots()
  for i, curve in enumerate(curves):
    colour, marker = style(i)
    points = [(p, p.clipped()) for p in curve.points if p.clipped() is not None]
    s = curve.sensitivity()
    ax.plot([p.rate for p, _ in points], [y for _, y in points], color=colour, marker=marker,
            markersize=6, lw=1.3, label=curve.label + ('' if s is None else f' (S={s:.2f})'))
    for p, y in points:
      if p.diverged:
        ax.plot([p.rate], [y], 'x', color=colour, ms=10, mew=2)
      elif p.all_stalled():
        ax.plot([p.rate], [y], marker=marker, ms=9, mfc='white', mec=colour, mew=1.5)
    if curve.initial is not None and any(p.diverged for p in curve.points):
      ax.axhline(curve.initial, color=colour, lw=0.8, ls=':')
  ax.set(xscale='log', xlabel='learning_rate_schedule.base',
         ylabel='final held-out loss')
  ax.set_title(title, fontsize=9)
  _legend_right(fig, [ax], 'curve (LR sensitivity)', extra=[
      Line2D([], [], color='#555555', marker='x', markersize=7, markeredgewidth=2,
             linestyle='none', label='diverged'),
      Line2D([], [], color='#555555', marker='o', markerfacecolor='white', linestyle='none',
             label='stalled'),
      Line2D([], [], color='#555555', lw=0.8, ls=':', label='initial loss (if one diverged)')])
  return fig


def group_plots(group, out_dir: str, final_values, diverged_step,
                rate_curves=None) -> List[Tuple[str, str]]:
  """(title, path) of every plot that has data in this group; ``rate_curves``: the
  ``stability.curves`` of a learning-rate sweep."""
  out = [('loss curves', curves(group, out_dir))]
  if any(final_values(group.of(v)) for v in group.variants()):
    out.append(('final log-perplexity', final_bars(group, out_dir, final_values)))
  if len(group.variants()) > 1 and all(depth_axis(v) for v in group.variants()):
    out.append(('log-perplexity by depth', depth_plot(group, out_dir, final_values, diverged_step)))
  if any(t.record.diagnostics for t in group.trials):
    out.append(('per-layer diagnostics', diagnostics_plot(group, out_dir)))
  if rate_curves:
    fig = stability_figure(rate_curves, f'{group.name}: final held-out loss against learning rate')
    out.append(('loss against learning rate', _save(fig, out_dir, f'{group.name}_lr.png')))
  return out
