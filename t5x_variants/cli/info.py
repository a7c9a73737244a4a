"""t5xv-info: print a gin-configured model's variant summary and parameter table.

  t5xv-info --gin_file=gin/models/t5_base.gin --gin_file=gin/variants/ffn/geglu.gin
  t5xv-info --gin_file=gin/experiments/foundation/lm.gin --gin_file=gin/variants/norm/subln.gin

Takes the same gin as ``t5xv-train`` (run file, size, variants, recipe, ``--gin.`` bindings);
the data layer's bindings are not checked (no TensorFlow).
"""
import sys

from t5x_variants.cli import common, recipe
from t5x_variants.models.summary import model_info


def main(argv=None):
  with common.clear_errors('t5xv-info'):
    _, config = recipe.setup(common.parser('t5xv-info', __doc__, processes=False), argv,
                             with_data=False)
  print(model_info(config))
  return 0


if __name__ == '__main__':
  sys.exit(main())
