"""The report's PNG plots (matplotlib, headless): loss curves per variant with the seeds as a
band, final log-perplexity bars with error bars, loss against depth per placement with divergence
marked, and the per-layer diagnostics (update norm, gradient and activation norms per layer)."""
import os
import re
from typing import Dict, List, Tuple

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

DPI = 80
LAYER_KEY = re.compile(r'(grad_norm|activation_norm)/(\w+)/(\d+)$')


def _band(ax, curves: List[List[Tuple[int, float]]], label: str):
  """Mean over the seeds that reached each step, the band from their min to max."""
  curves = [dict(c) for c in curves if c]
  steps = sorted(set().union(*curves))
  if not steps:
    return
  values = np.array([[c.get(s, np.nan) for s in steps] for c in curves], float)
  line, = ax.plot(steps, np.nanmean(values, 0), label=label, lw=1.2)
  if len(curves) > 1:
    ax.fill_between(steps, np.nanmin(values, 0), np.nanmax(values, 0), color=line.get_color(),
                    alpha=0.2)


def _save(fig, out_dir: str, name: str) -> str:
  path = os.path.join(out_dir, name)
  fig.tight_layout()
  fig.savefig(path, dpi=DPI)
  plt.close(fig)
  return path


def curves(group, out_dir: str) -> str:
  fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(9, 3.6))
  for v in group.variants():
    trials = group.of(v)
    _band(train_ax, [[(r['step'], r['loss']) for r in t.record.train if r.get('loss') is not None]
                     for t in trials], v)
    _band(eval_ax, [t.record.eval_curve() for t in trials], v)
  train_ax.set(title='training loss', xlabel='step')
  eval_ax.set(title='held-out log-perplexity', xlabel='step')
  eval_ax.legend(fontsize=7)
  return _save(fig, out_dir, f'{group.name}_curves.png')


def final_bars(group, out_dir: str, final_values) -> str:
  names, means, stds = [], [], []
  for v in group.variants():
    values = final_values(group.of(v))
    if values:
      names.append(v)
      means.append(np.mean(values))
      stds.append(np.std(values, ddof=1) if len(values) > 1 else 0.0)
  fig, ax = plt.subplots(figsize=(max(4, 0.6 * len(names) + 1.5), 3.6))
  ax.bar(range(len(names)), means, yerr=stds, capsize=3, color='tab:blue')
  ax.set_xticks(range(len(names)), names, rotation=45, ha='right', fontsize=8)
  if means:
    low, high = min(means) - max(stds + [0]), max(means) + max(stds + [0])
    ax.set_ylim(low - 0.1 * (high - low + 1e-3), high + 0.1 * (high - low + 1e-3))
  ax.set(title='final held-out log-perplexity (mean ± std over seeds)')
  return _save(fig, out_dir, f'{group.name}_final.png')


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


def depth_plot(group, out_dir: str, final_values, diverged_step) -> str:
  fig, ax = plt.subplots(figsize=(5, 3.6))
  lines: Dict[str, list] = {}
  for v in group.variants():
    placement, depth = depth_axis(v)
    trials = group.of(v)
    values = final_values(trials)
    lines.setdefault(placement, []).append(
        (depth, np.mean(values) if values else None,
         any(diverged_step(t) is not None for t in trials)))
  for placement, points in lines.items():
    points.sort()
    ok = [(d, m) for d, m, _ in points if m is not None]
    line, = ax.plot([d for d, _ in ok], [m for _, m in ok], 'o-', label=placement)
    bad = [d for d, _, div in points if div]  # at the top of the axes, whatever its values
    ax.plot(bad, [0.95] * len(bad), 'x', color=line.get_color(), ms=9, mew=2,
            transform=ax.get_xaxis_transform())
  depths = sorted({d for points in lines.values() for d, _, _ in points})
  ax.set(title='final log-perplexity by depth (x: diverged)', xlabel='layers per stack',
         xscale='log')
  ax.set_xticks(depths, [str(d) for d in depths])
  ax.minorticks_off()
  ax.legend(fontsize=7)
  return _save(fig, out_dir, f'{group.name}_depth.png')


def diagnostics_plot(group, out_dir: str) -> str:
  """Update norm over steps, and gradient and activation norms per layer at the last record
  (of each variant's first run that has diagnostics)."""
  fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
  for v in group.variants():
    records = next((t.record.diagnostics for t in group.of(v) if t.record.diagnostics), [])
    if not records:
      continue
    axes[0].plot([r['step'] for r in records], [r.get('update_norm') for r in records], label=v)
    for ax, kind in zip(axes[1:], ('grad_norm', 'activation_norm')):
      per_stack: Dict[str, Dict[int, float]] = {}
      for key, value in records[-1].items():
        found = LAYER_KEY.match(key)
        if found and found.group(1) == kind and value is not None:
          per_stack.setdefault(found.group(2), {})[int(found.group(3))] = value
      for stack, layers in sorted(per_stack.items()):
        ax.plot(sorted(layers), [layers[i] for i in sorted(layers)], '.-',
                label=f'{v} {stack}' if len(per_stack) > 1 else v)
  axes[0].set(title='model update ||F(x;θt) - F(x;θ0)||', xlabel='step')
  axes[1].set(title='gradient norm per layer (last record)', xlabel='layer', yscale='log')
  axes[2].set(title='residual activation norm per layer', xlabel='layer')
  for ax in axes:
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=6)
  return _save(fig, out_dir, f'{group.name}_diagnostics.png')


def group_plots(group, out_dir: str, final_values, diverged_step) -> List[Tuple[str, str]]:
  """(title, path) of every plot that has data in this group."""
  out = [('loss curves', curves(group, out_dir))]
  if any(final_values(group.of(v)) for v in group.variants()):
    out.append(('final log-perplexity', final_bars(group, out_dir, final_values)))
  if len(group.variants()) > 1 and all(depth_axis(v) for v in group.variants()):
    out.append(('log-perplexity by depth', depth_plot(group, out_dir, final_values, diverged_step)))
  if any(t.record.diagnostics for t in group.trials):
    out.append(('per-layer diagnostics', diagnostics_plot(group, out_dir)))
  return out
