"""t5xv-info: print a gin-configured model's variant summary and parameter table.

  t5xv-info --gin_file=gin/models/t5_base.gin --gin_file=gin/variants/ffn/geglu.gin
"""
import argparse
import sys

from t5x_variants import gin_utils
from t5x_variants.models.summary import model_info


def main(argv=None):
  parser = argparse.ArgumentParser(prog='t5xv-info', description=__doc__.splitlines()[0])
  gin_utils.add_gin_flags(parser)
  args = gin_utils.parse_args(parser, sys.argv[1:] if argv is None else argv)
  try:
    config = gin_utils.config_from_flags(args)
  except gin_utils.GinConfigError as e:
    print(f't5xv-info: error: {e}', file=sys.stderr)
    return 2
  print(model_info(config))
  return 0


if __name__ == '__main__':
  sys.exit(main())
