"""Prints a markdown table of parameter counts for every FFN and self-attention variant of one
model size (abstract build, nothing materialised).

  python scripts/variant_counts.py --gin_file=gin/models/t5_base.gin
"""

import gin

from t5x_variants.cli import common, recipe
from t5x_variants.layers.attention import ATTENTION_COMPONENTS
from t5x_variants.layers.ffn import FFN_VARIANTS
from t5x_variants.models.summary import abstract_params, param_rows


def variant_counts(gin_files, bindings=(), search_paths=()):
  """[(axis, variant, total parameters)] for each FFN and each single self-attention variant."""
  rows = []
  for axis, field, names in (('ffn', 'ffn', FFN_VARIANTS), ('self-attention', 'self_attention',
                                                             ATTENTION_COMPONENTS)):
    for name in names:
      gin.clear_config()
      recipe.parse_gin(gin_files, [*bindings, f"TransformerConfig.{field} = '{name}'"],
                       search_paths)
      total = sum(r[3] for r in param_rows(abstract_params(recipe.build_config())))
      rows.append((axis, name, total))
  return rows


def main(argv=None):
  parser = common.parser('variant_counts.py', __doc__, processes=False)
  args = common.parse_args(parser, argv)
  print('| axis | variant | parameters |\n|---|---|---:|')
  for axis, name, total in variant_counts(args.gin_file, args.gin_bindings,
                                          args.gin_search_paths.split(',')):
    print(f'| {axis} | {name} | {total:,} |')


if __name__ == '__main__':
  main()
