"""t5xv-compile: compile the real train step for a TPU slice or an N-device host, no data read.

  t5xv-compile --gin_file=gin/runs/pretrain.gin --gin_file=gin/models/t5_base.gin \\
    --topology=v5e:4x4 [--num_slices=2] [--suggest] [--estimate] [--traffic=25] [--output=compile.json]
  t5xv-compile ... --devices=8 [--device_memory_gib=80]

Takes the same gin as ``t5xv-train`` (run file, size, variants, recipe, ``--gin.`` bindings) and
prints one table: per-device arguments, temporaries and total against the device's memory, fits
or not with the margin, compile time, model FLOPs per step and, where the compiler's cost model
gives one, an estimated step time and MFU (estimates, never measurements). ``--suggest`` compiles
the usual memory knobs (remat, FSDP, model-axis sizes, microbatches) cheapest first and prints
the ones that fit as flags to paste. ``--traffic=N`` adds where the step's memory traffic goes
(our count from the compiled program: by kind of instruction and its N largest sources, the
model ops they came from). Exit status 2 when the configuration does not fit.
"""
import dataclasses
import json
import math
import sys

from t5x_variants.cli import common, launch, ranges, recipe
from t5x_variants.train import aot, hlo_traffic, partitioning, storage, targets


def _run_settings(args):
  """(global batch size, {'inputs': n, 'targets': m}, packed) of the run: the flags, else the
  gin-bound ``train/DatasetConfig`` that ``t5xv-train`` reads (with or without the data layer);
  whether its rows are packed, from ``DatasetConfig.pack``."""
  import gin  # pylint: disable=g-import-not-at-top
  from t5x_variants.data.config import DatasetConfig  # pylint: disable=g-import-not-at-top
  with gin.config_scope('train'):
    dataset = DatasetConfig()
  lengths = dict(dataset.task_feature_lengths or {})
  for feature in ('inputs', 'targets'):
    lengths[feature] = getattr(args, f'{feature}_length') or lengths.get(feature)
  return args.batch or dataset.batch_size, lengths, dataset.pack


def _table(result) -> str:
  gib = lambda key: f'{result[key] / targets.GIB:.2f} GiB' if result.get(key) is not None else 'n/a'
  mesh = {'replica': 1, **result['mesh_shape']}  # results written before the replica axis lack it
  rows = [
      ('target', f'{result["target"]} ({result["devices"]} x {result["device_kind"]})'),
      ('mesh', ('' if mesh['replica'] == 1 else f'replica {mesh["replica"]} x ')
               + f'data {mesh["data"]} x model {mesh["model"]}, fsdp {result["mesh"]["fsdp"]}'),
      ('step', f'batch {result["batch"]}, lengths {result["lengths"]}, {result["num_microbatches"]} '
               f'microbatch(es), dtype {result["dtype"]}, remat {result["remat"]}, '
               f'scan_layers {result["scan_layers"]}'
               + (', packed rows' if result.get('packed') else '')),
      ('parameters', f'{result["parameters"]:,}'),
      ('arguments per device', gib('argument_bytes')),
      ('temporaries per device', gib('temp_bytes')),
      ('total per device', gib('total_bytes')),
      ('device memory', f'{gib("memory_limit_bytes")} ({result["memory_limit_source"]})'),
      ('verdict', aot.fit_line(result)),
      ('compile time', f'{result["compile_seconds"]:.1f} s'),
      ('model FLOPs per step', f'{result["model_flops_per_step"] / 1e12:,.4g} TFLOP (models/flops.py)'),
  ]
  if 'estimated_step_seconds' in result:
    source = f' of {result["estimate_from"]}' if 'estimate_from' in result else ''
    rows.append(('estimated step time', f'{result["estimated_step_seconds"] * 1e3:.1f} ms '
                 f'(compiler cost model{source}: an estimate, not a measurement)'))
    rows.append(('estimated MFU', f'{result["estimated_mfu"]:.1%} of the published bf16 peak '
                 '(an estimate)'))
  elif not result.get('compiler_refused'):
    rows.append(('estimated step time', _no_estimate(result)))
  width = max(len(k) for k, _ in rows)
  return '\n'.join(f'{k:<{width}}  {v}' for k, v in rows)


def _no_estimate(result) -> str:
  if 'estimate_refused' in result:
    return f'n/a: the unrolled compile for it {result["estimate_refused"]}'
  seconds = result['cost_model']['optimal_seconds']
  if result['num_microbatches'] > 1:
    return ('n/a: the cost model counts the microbatch loop\'s body once (an estimate needs '
            'train.num_microbatches = 1)')
  if not result['cost_model']['counts_whole_step']:
    return 'n/a: the cost model counts a scanned layer once (--estimate compiles layers unrolled)'
  if seconds is None or seconds <= 0:
    return f'n/a: this platform\'s cost model gives none (optimal_seconds {seconds})'
  return 'n/a: no published peak for this device'


def main(argv=None):
  parser = common.parser('t5xv-compile', __doc__, processes=False)
  where = parser.add_mutually_exclusive_group(required=True)
  where.add_argument('--topology', help='a TPU slice: v4:2x2x2, v5e:4x4, v5e:16x16, v5p:2x2x4, v6e:8x8, ...')
  where.add_argument('--devices', type=int, help='an N-device mesh on this host (its GPUs, else N CPU devices)')
  parser.add_argument('--num_slices', type=int, default=1,
                      help='with --topology: that many slices joined by the data-center network '
                      '(multislice); \'data\' runs across them')
  parser.add_argument('--device_memory_gib', type=float, default=None,
                      help='memory per device to fit in (default on TPU: what its compiler allows a chip)')
  parser.add_argument('--batch', type=int, default=None, help='global batch (default: the run\'s)')
  parser.add_argument('--inputs_length', type=int, default=None)
  parser.add_argument('--targets_length', type=int, default=None)
  parser.add_argument('--suggest', action='store_true',
                      help='also list configurations that fit (always when this one does not)')
  parser.add_argument('--max_compiles', type=int, default=12, help='--suggest compiles at most this many')
  parser.add_argument('--estimate', action='store_true',
                      help='with scanned layers, compile once more unrolled for the cost-model estimate')
  parser.add_argument('--traffic', type=int, default=0, metavar='N',
                      help='print the compiled step\'s memory traffic by kind and its N largest sources')
  parser.add_argument('--output', default=None, help='write the results as JSON here')
  with common.clear_errors('t5xv-compile'):
    args = common.parse_args(parser, argv)
    ranges.check_flags(args, {'devices': 1, 'batch': 1, 'inputs_length': 1, 'targets_length': 1,
                              'max_compiles': 1, 'traffic': 0, 'num_slices': 1})
    if args.num_slices > 1 and not args.topology:
      raise common.UsageError('--num_slices is for TPU slices: give it with --topology')
    if args.output:
      common.check_json_output(args.output, 't5xv-compile', 'target')
    if args.device_memory_gib is not None and not 0 < args.device_memory_gib < math.inf:
      raise common.UsageError(f'--device_memory_gib={args.device_memory_gib} is out of range: it '
                              'must be more than 0 and finite')
    if args.topology:
      targets.deviceless_environment()
      import jax  # pylint: disable=g-import-not-at-top
      # An executable for compile-only devices is written to a persistent cache but cannot be read back.
      jax.config.update('jax_enable_compilation_cache', False)
    try:
      recipe.library_configurables(with_data=True)
      with_data = True
    except ImportError:  # a host without the data extra: the macros give batch and lengths
      with_data = False
    args.gin_bindings[:0] = [f"{m} = 'unused by t5xv-compile'" for m in recipe.RUN_MACROS]
    recipe.parse_recipe(args.gin_file, args.gin_bindings, args.gin_search_paths.split(','),
                        with_data)
    config = recipe.build_config()
    batch, lengths, packed = _run_settings(args)
    unread = [f for f in ('inputs', 'targets')
              if getattr(args, f'{f}_length') and f not in config.task_features]
    if unread:
      raise common.UsageError(f'--{unread[0]}_length: this model ({config.architecture}) reads '
                              f'{" and ".join(config.task_features)} only')
    lengths = {f: lengths[f] for f in config.task_features}
    missing = [f'--{k}_length' for k, v in lengths.items() if not v]
    if missing:
      raise common.UsageError(f'no sequence lengths: give {" and ".join(missing)} or a run file')
    target = (targets.tpu_target(args.topology, args.num_slices) if args.topology else
              targets.host_target(args.devices, accelerators=not launch.backend_is_cpu()))
    if args.suggest and not args.device_memory_gib and target.memory_bytes is None:
      raise common.UsageError(f'--suggest looks for what fits in a device\'s memory, and '
                              f'{target.name} has no known limit: give --device_memory_gib')
    if args.device_memory_gib:
      target.memory_bytes = int(args.device_memory_gib * targets.GIB)
      target.memory_source = 'given with --device_memory_gib'
    options = aot.train_options()
    plan = aot.Plan(config, partitioning.MeshConfig(), options['num_microbatches'],
                    packed and config.head != 'classification')
    result = aot.compile_plan(plan, target, batch, lengths, options, traffic=args.traffic)
    # (with microbatches there is no estimate to make: the loop's body is counted once either way)
    if (args.estimate and config.scan_layers and options['num_microbatches'] == 1
        and not result.get('compiler_refused')):
      unrolled = aot.compile_plan(dataclasses.replace(
          plan, config=dataclasses.replace(config, scan_layers=False)), target, batch, lengths, options,
          traffic=args.traffic)
      if unrolled.get('compiler_refused'):  # the scanned compile's figures and traffic stand
        result['estimate_refused'] = aot.fit_line(unrolled)
      else:
        for key in ('cost_model', 'estimated_step_seconds', 'estimated_mfu', 'traffic'):
          if key in unrolled:
            result[key] = unrolled[key]
        result['estimate_from'] = 'an unrolled compile (scan_layers=False)'
    print(_table(result))
    if 'traffic' in result:
      print(hlo_traffic.table(result['traffic']))
      if not result['cost_model']['counts_whole_step']:
        print('  (a loop\'s body is counted once: each scanned layer\'s, each microbatch\'s'
              + ('' if args.estimate else '; --estimate adds an unrolled compile that counts every '
                 'layer') + ')')
    if args.suggest or result['fits'] is False:
      print(f'searching for configurations that fit {target.name} '
            f'(at most {args.max_compiles} compiles):')
      result['suggestions'] = aot.suggest(plan, target, batch, lengths, options,
                                          max_compiles=args.max_compiles)
      print(f'configurations that fit {target.name}, cheapest first:')
      for found in result['suggestions']:
        print(f'  {aot.fit_line(found)}: {found["flags"]}')
      if not result['suggestions']:
        print('  none found: try a larger slice, a smaller batch or bfloat16 '
              '(--gin.TransformerConfig.dtype="\'bfloat16\'")')
    if args.output:
      storage.write_text(storage.path(args.output), json.dumps(result, indent=1, default=str))
  if result['fits'] is False:
    print(f't5xv-compile: error: {aot.fit_line(result)}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
