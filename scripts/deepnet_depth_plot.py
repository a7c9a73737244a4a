"""EXPERIMENTS.md §2's depth figure: DeepNorm - Post-LN by layers per stack, from the section's
tables (their sweep directories were not kept, so the numbers are typed in from them).

Left: the final held-out log-perplexity, mean +- sample std over seeds, with the paper's init
(solid) and the code's (dashed), and the unigram plateau of the task. Middle: the paired
difference DeepNorm - Post-LN (seed by seed) with its 95% Student t interval, for the paper's
init and the authors' code's. Right: Pre-LN and Sub-LN against DeepNorm the same way, the
paper's init, and Pre-LN and Sub-LN with the code's init at 50+50.

  python scripts/deepnet_depth_plot.py docs/experiments/deepnet_depth_paired.png
"""
import sys

from matplotlib.figure import Figure

from t5x_variants.sweeps.plots import OKABE_ITO

PLATEAU = 5.8585  # scripts/unigram_baseline.py on the same held-out tokens
# layers per stack: (Post-LN mean, std), (DeepNorm mean, std) per init (§2's depth table).
MEANS = {'paper init': {2: ((5.260, 0.025), (5.269, 0.039)), 6: ((5.338, 0.037), (5.207, 0.031)),
                        18: ((6.062, 0.113), (5.162, 0.042)), 50: ((6.143, 0.160), (5.132, 0.028)),
                        100: ((5.989, 0.070), (5.120, 0.019))},
         'code init': {2: ((5.195, 0.022), (5.272, 0.064)), 6: ((5.125, 0.012), (5.227, 0.037)),
                       18: ((5.397, 0.260), (5.250, 0.066)), 50: ((5.949, 0.284), (5.203, 0.055)),
                       100: ((6.017, 0.248), (5.175, 0.039))}}
# DeepNorm - Post-LN, paired by seed: (mean, low, high), from §2's comparison tables.
PAIRED = {'paper init': {2: (0.009, -0.067, 0.084), 6: (-0.131, -0.247, -0.016),
                         18: (-0.900, -1.093, -0.708), 50: (-1.011, -1.372, -0.650),
                         100: (-0.870, -1.001, -0.738)},
          'code init': {2: (0.078, -0.049, 0.204), 6: (0.102, 0.029, 0.174),
                        18: (-0.147, -0.629, 0.336), 50: (-0.746, -1.559, 0.067),
                        100: (-0.843, -1.384, -0.301)}}

# Pre-LN / Sub-LN - DeepNorm of the same init, paired by seed: (mean, low, high).
OTHERS = {'Pre-LN, paper init': {6: (0.039, 0.018, 0.060), 18: (0.006, -0.101, 0.113),
                                 50: (0.011, -0.032, 0.054)},
          'Sub-LN, paper init': {6: (0.064, 0.033, 0.094), 18: (0.099, 0.030, 0.169),
                                 50: (0.110, 0.066, 0.154)},
          'Pre-LN, code init': {50: (-0.110, -0.249, 0.029)},
          'Sub-LN, code init': {50: (-0.038, -0.177, 0.101)}}


def _paired(ax, series, colours, ticks, ylabel, title):
  """One panel of paired differences: {label: {depth: (mean, low, high)}}, one colour each."""
  for i, ((label, rows), colour) in enumerate(zip(series.items(), colours)):
    shift = 1 + 0.06 * (i - (len(series) - 1) / 2)  # side by side around each depth
    ds = sorted(rows)
    ax.errorbar([d * shift for d in ds], [rows[d][0] for d in ds],
                [[rows[d][0] - rows[d][1] for d in ds], [rows[d][2] - rows[d][0] for d in ds]],
                marker='o', capsize=3, ls='none', color=colour, label=label)
  ax.axhline(0, color='grey', lw=0.8)
  ax.set(xscale='log', xticks=ticks, xticklabels=ticks, xlabel='layers per stack', ylabel=ylabel)
  ax.minorticks_off()
  ax.set_title(title, fontsize=8)
  ax.legend(fontsize=7)


def main(path: str) -> None:
  fig = Figure(figsize=(11, 3.2), dpi=100)
  left, middle, right = fig.subplots(1, 3)
  ticks = sorted(MEANS['paper init'])
  for (init, means), style, shift in zip(MEANS.items(), ('-', '--'), (0.97, 1.03)):
    depths = sorted(means)
    for i, (name, colour) in enumerate((('Post-LN', OKABE_ITO[4]), ('DeepNorm', OKABE_ITO[3]))):
      left.errorbar([d * shift for d in depths], [means[d][i][0] for d in depths],
                    [means[d][i][1] for d in depths], marker='o', capsize=3, color=colour, ls=style,
                    label=f'{name}, {init}')
  left.axhline(PLATEAU, color='grey', ls=':', label='unigram plateau')
  left.set(xscale='log', xticks=ticks, xticklabels=ticks, xlabel='layers per stack',
           ylabel='final held-out log-ppl')
  left.minorticks_off()
  left.set_title('mean +- std over 3 seeds', fontsize=8)
  left.legend(fontsize=7)
  _paired(middle, PAIRED, OKABE_ITO[3:1:-1], ticks, 'DeepNorm - Post-LN (nats)',
          'paired by seed, 95% t interval (n = 3)')
  _paired(right, OTHERS, OKABE_ITO[:2] + OKABE_ITO[5:7], sorted(set().union(*OTHERS.values())),
          'variant - DeepNorm, same init (nats)', 'paired by seed, 95% t interval (n = 3)')
  fig.tight_layout()
  fig.savefig(path)


if __name__ == '__main__':
  main(sys.argv[1])
