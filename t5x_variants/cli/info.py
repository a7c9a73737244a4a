"""t5xv-info: print a gin-configured model's variant summary and parameter table.

  t5xv-info --gin_file=gin/models/t5_base.gin --gin_file=gin/variants/ffn/geglu.gin
"""
import sys

from t5x_variants.cli import common
from t5x_variants.models.summary import model_info


def main(argv=None):
  with common.clear_errors('t5xv-info'):
    args = common.parse_args(common.parser('t5xv-info', __doc__, processes=False), argv)
    config = common.config_from_flags(args)
  print(model_info(config))
  return 0


if __name__ == '__main__':
  sys.exit(main())
