"""t5xv-sweep: train a grid of runs (base gin files x variants x seeds) into one sweep directory.

  t5xv-sweep --sweep_dir=/runs/glu_small --gin_file=gin/experiments/glu_variants/small.gin \\
    --variants='gin/variants/ffn/*.gin' --seeds=2 --paper=glu
  t5xv-sweep --sweep_dir=/runs/lr --gin_file=gin/experiments/foundation/lm_small.gin \\
    --variants=gin/variants/norm/pre_ln.gin --grid=learning_rate_schedule.base=1e-4,3e-4,1e-3

``--variants`` (repeatable: each is one axis of the grid) takes comma-separated gin files or
globs. ``--grid=BINDING=V1,V2,...`` (repeatable: each is one more axis, after the variants)
gives each run ``--gin.BINDING=V`` for one of the values and names the run by the binding's last
component and the value (``pre_ln+base=3e-4-seed0``): learning-rate or depth sweeps need no gin
file per value. Runs go one after another here; ``--print_commands`` prints one ``t5xv-train``
command per unfinished run instead (for a cluster or TPU scheduler) and records the grid in
sweep.json, so ``t5xv-report`` reads those runs as they finish. Running the same command again
skips finished runs and resumes interrupted ones. ``--gin.KEY=VALUE`` applies to every run.
"""
import sys

from t5x_variants.cli import common
from t5x_variants.sweeps import grid, papers


def main(argv=None):
  p = common.parser('t5xv-sweep', __doc__, processes=False)
  p.add_argument('--sweep_dir', required=True, help='where sweep.json and the run directories go')
  p.add_argument('--variants', action='append', default=[],
                 help='comma-separated gin files or globs; repeatable (one axis each)')
  p.add_argument('--grid', action='append', default=[], metavar='BINDING=V1,V2,...',
                 help='one gin binding\'s values, one run each; repeatable (one axis each)')
  p.add_argument('--seeds', type=int, default=1, help='seeds 0..N-1 per variant')
  p.add_argument('--paper', choices=sorted(papers.TABLES), default=None,
                 help='the published table t5xv-report compares with')
  p.add_argument('--print_commands', action='store_true',
                 help='print the t5xv-train commands of unfinished runs instead of running them')
  with common.clear_errors('t5xv-sweep'):
    args = common.parse_args(p, argv)
    sweep = grid.Sweep.build(args.sweep_dir, args.gin_file, args.variants, args.seeds,
                             args.gin_bindings, args.paper, args.grid)
    sweep.merge_previous()
    sweep.update_from_run_dirs()
    sweep.save()
    if args.print_commands:
      for run in sweep.runs:
        if run.status not in grid.FINISHED:
          print(grid.shell_line(sweep.command(run)))
      return 0
    try:
      counts = grid.run_sweep(sweep, grid.trainer_executable())
    except KeyboardInterrupt:
      print('t5xv-sweep: interrupted; run the same command to resume', file=sys.stderr)
      return 130
  print(f'sweep {sweep.sweep_dir}: ' + ', '.join(f'{n} {s}' for s, n in sorted(counts.items())))
  return 0 if counts.get('failed', 0) == 0 else 1


if __name__ == '__main__':
  sys.exit(main())
