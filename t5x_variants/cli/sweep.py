"""t5xv-sweep: train a grid of runs (base gin files x variants x seeds) into one sweep directory.

  t5xv-sweep --sweep_dir=/runs/glu_small --gin_file=gin/experiments/glu_variants/small.gin \\
    --variants='gin/variants/ffn/*.gin' --seeds=2 --paper=glu
  t5xv-sweep --sweep_dir=/runs/lr --gin_file=gin/experiments/foundation/lm_small.gin \\
    --variants=gin/variants/norm/pre_ln.gin --grid=learning_rate_schedule.base=1e-4,3e-4,1e-3

``--variants`` (repeatable: each is one axis of the grid) takes comma-separated gin files or
globs, looked up as ``t5xv-train`` looks up ``--gin_file``: from the working directory, then
``--gin_search_paths`` (passed on to every run), then the installed package.
``--grid=BINDING=V1,V2,...`` (repeatable: each is one more axis, after the variants) gives each
run ``--gin.BINDING=V`` for one of the values and names the run by the binding's last component
and the value (``pre_ln+base=3e-4-seed0``): learning-rate or depth sweeps need no gin file per
value. Runs go one after another here (``--parallel=N``: N at a time, e.g. several
small runs sharing one GPU); ``--print_commands`` prints one ``t5xv-train``
command per unfinished run instead (for a cluster or TPU scheduler) and records the grid in
sweep.json, so ``t5xv-report`` reads those runs as they finish. Running the same command again
skips finished runs and resumes interrupted ones. ``--gin.KEY=VALUE`` applies to every run.

An accelerator host without TensorFlow trains from pre-built batches: ``--batches_dir=ROOT
--write_batches`` on a host with the data layer writes the batches of every run (runs reading the
same data share them), then the same sweep command with ``--batches_dir=ROOT`` (copied over)
trains them there (``train/prebuilt.py``).
"""
import os
import sys

from t5x_variants.cli import common
from t5x_variants.sweeps import grid, papers, runner
from t5x_variants.train import prebuilt, storage


def write_batches(sweep: grid.Sweep, batches_dir: str, verbosity: int) -> int:
  """Writes every run's pre-built batches under ``batches_dir`` in this one process (runs that
  read the same data share them); sweep.json and the runs are left as they are."""
  if not batches_dir:
    raise common.UsageError('--write_batches needs --batches_dir=ROOT (where to write them)')
  import gin  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import train  # pylint: disable=g-import-not-at-top
  for i, run in enumerate(sweep.runs, 1):
    print(f'[{i}/{len(sweep.runs)}] {run.name}: ', end='', flush=True)
    gin.clear_config()
    train.main([*sweep.command(run, ()), f'--batches_dir={batches_dir}', '--write_batches',
                f'--verbosity={verbosity}'])
  return 0


def check_recipes(sweep: grid.Sweep):
  """Each distinct recipe of the grid (its gin files and bindings, the seed aside) parsed and its
  model configuration and learning-rate schedule built and the trainer's numbers range-checked
  here, before any run directory or trainer starts: a misspelled binding or a bad value is one
  line, not one failed run each. The data layer's bindings are
  left to the runs (as without TensorFlow)."""
  import gin  # pylint: disable=g-import-not-at-top
  from t5x_variants.cli import ranges, recipe  # pylint: disable=g-import-not-at-top
  from t5x_variants.train import optimizer  # pylint: disable=g-import-not-at-top
  placeholders = [f"{m} = 'checked by t5xv-sweep'" for m in recipe.RUN_MACROS]
  recipes = dict.fromkeys((tuple([*sweep.base, *run.variant_files]),
                           tuple([*grid.DEFAULT_BINDINGS, *run.bindings, *sweep.bindings]))
                          for run in sweep.runs)
  for files, bindings in recipes:
    gin.clear_config()
    recipe.parse_recipe(list(files), [*placeholders, *bindings], sweep.search_paths,
                        with_data=False)
    recipe.build_config()
    for configurable in ('train', 'Checkpointer'):  # the trainer's numbers, as t5xv-train checks
      ranges.check_ranges(configurable, gin.get_bindings(configurable))  # them at its start
    optimizer.learning_rate_schedule()
  gin.clear_config()


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
  p.add_argument('--parallel', type=int, default=1,
                 help='how many runs train at once on this host (default 1)')
  p.add_argument('--batches_dir', default=None, metavar='ROOT',
                 help='every run trains from pre-built batches under ROOT (no TensorFlow)')
  p.add_argument('--write_batches', action='store_true',
                 help='with --batches_dir: write the batches of every run of the grid and stop')
  with common.clear_errors('t5xv-sweep'):
    args = common.parse_args(p, argv)
    if storage.file_in_the_way(args.sweep_dir):
      raise common.UsageError(f'--sweep_dir={args.sweep_dir}: {storage.file_in_the_way(args.sweep_dir)} '
                              'is a file; give a directory (a new one for a new sweep)')
    if args.batches_dir:
      prebuilt.local_root(args.batches_dir)
    sweep = grid.Sweep.build(args.sweep_dir, args.gin_file, args.variants, args.seeds,
                             args.gin_bindings, args.paper, args.grid,
                             args.gin_search_paths.split(','))
    if args.parallel < 1:
      raise common.UsageError(f'--parallel must be at least 1, got {args.parallel}')
    check_recipes(sweep)
    if args.write_batches:
      return write_batches(sweep, args.batches_dir, args.verbosity)
    sweep.batches_dir = args.batches_dir and os.path.abspath(args.batches_dir)
    with runner.lock(sweep.sweep_dir) as held:  # before sweep.json is read or written
      sweep.merge_previous()
      sweep.update_from_run_dirs()
      sweep.save()
      if args.print_commands:
        for run in sweep.runs:
          if run.status not in grid.FINISHED:
            print(grid.shell_line(sweep.command(run)))
        return 0
      counts = runner.run_sweep(sweep, runner.trainer_executable(), parallel=args.parallel,
                                held=held)
  print(f'sweep {sweep.sweep_dir}: ' + ', '.join(f'{n} {s}' for s, n in sorted(counts.items())))
  return 0 if set(counts) <= set(grid.FINISHED) else 1  # a failed or interrupted run: not done


if __name__ == '__main__':
  sys.exit(main())
