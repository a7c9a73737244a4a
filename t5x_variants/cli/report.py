"""t5xv-report: tables and plots of sweeps or run directories, beside the papers' numbers.

  t5xv-report --sweep_dir=/runs/glu_small            # writes /runs/glu_small/report.md + PNGs
  t5xv-report --sweep_dir=/runs/a --sweep_dir=/runs/b --output_dir=docs/results
  t5xv-report --run_dirs=/runs/x-seed0,/runs/y-seed0 --output_dir=/tmp/report --paper=glu
  t5xv-report --sweep_dir=/runs/magneto --baseline=pre_ln+xavier   # + paired differences

Reads sweep.json and each run's metrics.jsonl, config.gin and model-info.txt; works while a
sweep is still running (its unfinished runs are marked as such). Per variant: the mean final
held-out log-perplexity with its 95% Student t interval over seeds; with ``--baseline``, every
other variant's difference from the baseline paired by seed, its 95% interval and a verdict
(better / worse / not distinguishable); against a paper's numbers, Spearman's rho with a bootstrap
interval over seeds. A learning-rate sweep (``--grid=learning_rate_schedule.base=...``) also gets
its stability table; there ``--baseline`` may name a curve (``pre_ln+xavier``, the variant without
its rate): every other curve's LR sensitivity against it, paired by seed.
"""
import sys

from t5x_variants.cli import common
from t5x_variants.sweeps import papers, report
from t5x_variants.train import storage


def main(argv=None):
  p = common.ArgumentParser(prog='t5xv-report', description=__doc__.strip().splitlines()[0])
  p.add_argument('--sweep_dir', action='append', default=[], help='a sweep directory (repeatable)')
  p.add_argument('--run_dirs', default='', help='comma-separated run directories (one table)')
  p.add_argument('--paper', choices=sorted(papers.TABLES), default=None,
                 help='published results for --run_dirs (a sweep keeps its own --paper)')
  p.add_argument('--output_dir', default=None,
                 help='where report.md and the plots go (default: the one --sweep_dir)')
  p.add_argument('--title', default='Sweep report')
  p.add_argument('--baseline', default=None, metavar='VARIANT',
                 help='a variant name as in the table (e.g. pre_ln+xavier), or a learning-rate '
                      'curve: a second table of the others\' differences from it, paired by '
                      'seed, with 95%% intervals')
  args = p.parse_args(argv)
  run_dirs = [d for d in args.run_dirs.split(',') if d]
  if not args.sweep_dir and not run_dirs:
    p.error('give --sweep_dir or --run_dirs')
  if args.output_dir is None and (run_dirs or len(args.sweep_dir) > 1):
    p.error('--output_dir is needed with --run_dirs or several --sweep_dir')
  with common.clear_errors('t5xv-report'):
    groups = [report.sweep_group(d) for d in args.sweep_dir]
    if run_dirs:
      groups.append(report.run_dirs_group(run_dirs, paper=args.paper))
    out_dir = args.output_dir or args.sweep_dir[0]
    if storage.file_in_the_way(out_dir):
      raise common.UsageError(f'--output_dir={out_dir}: {storage.file_in_the_way(out_dir)} is a '
                              'file; give a directory for report.md and its plots')
    report.write_report(groups, out_dir, args.title, args.baseline)
  print(f'wrote {out_dir}/report.md')
  return 0


if __name__ == '__main__':
  sys.exit(main())
