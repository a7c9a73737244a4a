"""EXPERIMENTS.md section 7's paired comparisons (Xiong et al. 2020): in a directory of runs named
``{post_ln,pre_ln}+warmup_ramp={True,False}-seed<s>`` (a t5xv-sweep directory, or the committed
run files), the final held-out log-perplexity of each run, then, seed by seed, the effect of
dropping the warmup for each placement, the placements against each other, and the difference
of the two warmup effects (Post-LN's minus Pre-LN's), each with its 95% Student t interval.

  python scripts/warmup_pairs.py /work/sweeps/xiong_warmup
"""
import json
import os
import sys

import numpy as np

from t5x_variants.sweeps.statistics import t_interval, verdict

ARMS = {'post_ln, warmup': 'post_ln+warmup_ramp=True', 'post_ln, none': 'post_ln+warmup_ramp=False',
        'pre_ln, warmup': 'pre_ln+warmup_ramp=True', 'pre_ln, none': 'pre_ln+warmup_ramp=False'}


def final_log_ppl(run_dir: str) -> float:
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    evals = [r for r in map(json.loads, f) if r['kind'] == 'eval']
  return max(evals, key=lambda r: r['step'])['log_perplexity']


def main(root: str):
  seeds = sorted({int(d.rsplit('-seed', 1)[1]) for d in os.listdir(root) if '-seed' in d})
  final = {arm: [final_log_ppl(os.path.join(root, f'{name}-seed{s}')) for s in seeds]
           for arm, name in ARMS.items()}
  print('| arm | final log-ppl by seed | mean ± std |\n|---|---|---|')
  for arm, values in final.items():
    print(f'| {arm} | {", ".join(f"{v:.3f}" for v in values)} | {np.mean(values):.3f} ± '
          f'{np.std(values, ddof=1):.3f} |')
  minus = lambda a, b: [x - y for x, y in zip(final[a], final[b])]
  pairs = {'Post-LN: no warmup - warmup': minus('post_ln, none', 'post_ln, warmup'),
           'Pre-LN: no warmup - warmup': minus('pre_ln, none', 'pre_ln, warmup'),
           'with warmup: Pre-LN - Post-LN': minus('pre_ln, warmup', 'post_ln, warmup'),
           'without warmup: Pre-LN - Post-LN': minus('pre_ln, none', 'post_ln, none')}
  pairs["Post-LN's warmup effect - Pre-LN's"] = [
      a - b for a, b in zip(pairs['Post-LN: no warmup - warmup'], pairs['Pre-LN: no warmup - warmup'])]
  print(f'\nseeds {", ".join(map(str, seeds))}\n\n| pair | per seed | mean [95% CI] | verdict |\n|---|---|---|---|')
  for name, d in pairs.items():
    i = t_interval(d)
    print(f'| {name} | {", ".join(f"{x:+.4f}" for x in d)} | {i.mean:+.4f} [{i.low:+.4f}, {i.high:+.4f}] '
          f'| {verdict(i, below="lower", above="higher")} |')


if __name__ == '__main__':
  main(sys.argv[1])
