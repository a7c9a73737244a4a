"""BENCHMARKS.md's compile table: each row is one ``t5xv-compile`` of a recipe for a TPU slice
(libtpu's compile-only devices on this CPU host; extra ``tpu``), its JSON kept in ``--out_dir``.
A row whose JSON is there is not compiled again, so the script resumes where it stopped. Prints
the markdown table. Every figure is the compiler's (memory, cost-model estimate), not a run.

  python scripts/compile_table.py --out_dir=docs/compile > /tmp/table.md
"""
import argparse
import json
import os
import subprocess
import sys

PRETRAIN = 'gin/runs/pretrain.gin'
SIZES = {'T5-base': 'gin/models/t5_base.gin', 'T5-large': 'gin/models/t5_large.gin',
         'T5-3B': 'gin/models/t5_3b.gin'}
SLICES = ('v5e:4x4', 'v5p:2x2x2', 'v4:2x2x2')  # v5litepod-16, v5p-16 and v4-16: 16, 8, 8 chips
DEEPNET_1000 = ['gin/experiments/deepnet/span_corruption.gin', 'gin/variants/norm/deepnorm.gin',
                '--gin.TransformerConfig.num_encoder_layers=500',
                '--gin.TransformerConfig.num_decoder_layers=500']
ESTIMATE = ['--gin.TransformerConfig.scan_layers=False']  # the cost model needs unrolled layers

E = 'gin/experiments'
# Each full-scale recipe with a variant of its paper, on the slice its header names.
RECIPES = [
    ('glu_swiglu', 'GLU variants, SwiGLU', [f'{E}/glu_variants/swiglu.gin']),
    ('foundation_lm_subln', 'Magneto LM (decoder-only 12L, 512), Sub-LN',
     [f'{E}/foundation/lm.gin', 'gin/variants/norm/subln.gin']),
    ('foundation_mlm_subln', 'Magneto MLM (encoder-only 12L, 512), Sub-LN',
     [f'{E}/foundation/mlm.gin', 'gin/variants/norm/subln.gin']),
    ('foundation_span_subln', 'Magneto span corruption (12L-12L), Sub-LN',
     [f'{E}/foundation/span_corruption.gin', 'gin/variants/norm/subln.gin']),
    ('deepnet_span_deepnorm_100', 'DeepNet span corruption 100L-100L, DeepNorm',
     [f'{E}/deepnet/span_corruption.gin', 'gin/variants/norm/deepnorm.gin', f'{E}/deepnet/depth_100.gin']),
    ('deepnet_lm_deepnorm_100', 'DeepNet LM 100L, DeepNorm',
     [f'{E}/deepnet/lm.gin', 'gin/variants/norm/deepnorm.gin', f'{E}/deepnet/depth_100.gin']),
    ('deepnet_mlm_deepnorm_100', 'DeepNet MLM 100L, DeepNorm',
     [f'{E}/deepnet/mlm.gin', 'gin/variants/norm/deepnorm.gin', f'{E}/deepnet/depth_100.gin']),
    ('synthesizer_span_dense_plus_v', 'Synthesizer span corruption (T5-base), D+V',
     [f'{E}/synthesizer/span_corruption.gin', 'gin/variants/attention/synth_dense_plus_v.gin']),
    ('synthesizer_lm_random', 'Synthesizer LM (6L, 512), R',
     [f'{E}/synthesizer/lm.gin', 'gin/variants/attention/synth_random.gin']),
    ('vanilla_span_post_ln', 'Xiong et al. span corruption, Post-LN',
     [f'{E}/vanilla/span_corruption.gin', 'gin/variants/norm/post_ln.gin']),
    ('vanilla_mlm_post_ln', 'Xiong et al. MLM, Post-LN',
     [f'{E}/vanilla/mlm.gin', 'gin/variants/norm/post_ln.gin']),
]
RECIPE_SLICE = 'v5e:4x4'

# (name, what it is, t5xv-compile arguments, topology)
ROWS = ([(f'{size}_{s}', f'{size}, `runs/pretrain.gin`', [PRETRAIN, path], s)
         for size, path in SIZES.items() for s in SLICES]
        + [('deepnet_1000L_v5p:4x4x4', 'DeepNet 1000L (500L-500L, d 512), DeepNorm', DEEPNET_1000,
            'v5p:4x4x4'),
           ('T5-base_v5p:2x2x2_unrolled', 'T5-base, layers unrolled (for the cost model)',
            [PRETRAIN, SIZES['T5-base'], *ESTIMATE], 'v5p:2x2x2'),
           ('T5-base_v4:2x2x2_unrolled', 'T5-base, layers unrolled (for the cost model)',
            [PRETRAIN, SIZES['T5-base'], *ESTIMATE], 'v4:2x2x2')]
        + [(name, f'recipe: {what}', args, RECIPE_SLICE) for name, what, args in RECIPES])


def command(args, topology, output):
  gin = [a if a.startswith('--') else f'--gin_file={a}' for a in args]
  return ['t5xv-compile', *gin, f'--topology={topology}', '--max_compiles=6', f'--output={output}']


def gib(result, key='total_bytes'):
  return f'{result[key] / 2**30:.2f}' if result.get(key) is not None else '-'


def row(number, what, topology, result) -> str:
  s = result.get('suggestions') or []
  fitting = ('' if result['fits'] else
             f'{gib(s[0])} GiB with `{s[0]["flags"]}`' if s else 'none found in 6 compiles')
  estimate = (f'{result["estimated_step_seconds"] * 1e3:.1f} ms, MFU {result["estimated_mfu"]:.1%}'
              if 'estimated_step_seconds' in result else '-')
  verdict = 'fits' if result['fits'] else 'does not fit'
  needed = gib(result, 'total_bytes' if result.get('total_bytes') is not None else 'temp_bytes')
  return (f'| {number} | {what} | {topology} | {needed} of {gib(result, "memory_limit_bytes")} | '
          f'{verdict} | {result["compile_seconds"]:.0f} | {fitting} | {estimate} |')


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--out_dir', required=True)
  p.add_argument('--only', default='', help='comma-separated row names')
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  print('| # | recipe (bfloat16, batch 128, 512/114 unless said) | slice | GiB per chip (of) | '
        'data-parallel, no remat | compile s | cheapest fitting found by --suggest | '
        'cost-model estimate |')
  print('|---|---|---|---|---|---|---|---|')
  commands = []
  for name, what, gin_args, topology in ROWS:
    if args.only and name not in args.only.split(','):
      continue
    number = len(commands) + 1
    output = os.path.join(args.out_dir, f'{name.replace(":", "-")}.json')
    cmd = command(gin_args, topology, output)
    commands.append(f'{number}. `{" ".join(cmd)}`')
    if not os.path.exists(output):
      print(' '.join(cmd), file=sys.stderr, flush=True)
      subprocess.run(cmd, check=False, stdout=sys.stderr)
    if os.path.exists(output):
      with open(output) as f:
        print(row(number, what, topology, json.load(f)), flush=True)
    else:
      print(f'| {number} | {what} | {topology} | failed: see the command\'s output | | | | |', flush=True)
  print('\nThe command of each row (run from the repository root):\n')
  print('\n'.join(commands))


if __name__ == '__main__':
  main()
