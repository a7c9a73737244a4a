"""t5xv-quickstart: pretrain a tiny T5 on the embedded corpus, evaluate its checkpoints and
decode two validation examples, in one command (a few minutes on 2 CPU cores, no download).

  t5xv-quickstart [--model_dir=/tmp/t5xv_quickstart] [--gin.KEY=VALUE ...]

It runs what a researcher runs by hand, in one process:
  t5xv-train --gin_file=gin/experiments/quickstart.gin --gin.MODEL_DIR="'DIR'"
  t5xv-eval  --gin_file=DIR/config.gin --gin_file=gin/runs/eval.gin \\
             --gin.CHECKPOINT_PATH="'DIR'" --gin.EVAL_ALL=True
  t5xv-infer --gin_file=DIR/config.gin --gin_file=gin/runs/infer.gin --gin.CHECKPOINT_PATH="'DIR'" \\
             --gin.INFER_OUTPUT="'DIR/predictions.jsonl'" --gin.infer.max_examples=2
Extra ``--gin.KEY=VALUE`` flags go to the training run. A second call resumes in the same
directory (delete it to start over).
"""
import argparse
import json
import re
import sys

import gin

from t5x_variants.cli import common
from t5x_variants.train import storage

DEFAULT_DIR = '/tmp/t5xv_quickstart'


def split_args(argv):
  """(the run directory, the flags for the training run): ``--model_dir=DIR`` or ``--model_dir DIR``
  taken out, the rest passed on."""
  p = common.ArgumentParser(prog='t5xv-quickstart', description=__doc__, allow_abbrev=False,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--model_dir', default=DEFAULT_DIR)
  args, rest = p.parse_known_args(argv)
  if any(re.match(r'(--gin\.|--gin_bindings=)?\s*(MODEL_DIR|train\.model_dir)\s*=', a) for a in rest):
    p.error('the run directory is --model_dir=DIR (training, eval and decoding all read it); '
            'leave out --gin.MODEL_DIR and --gin.train.model_dir')
  return args.model_dir, rest


def main(argv=None):
  model_dir, argv = split_args(sys.argv[1:] if argv is None else list(argv))
  from t5x_variants.cli import eval as eval_cli, infer, train  # pylint: disable=g-import-not-at-top
  predictions = storage.join(model_dir, 'predictions.jsonl')
  run_config = f'--gin_file={storage.join(model_dir, "config.gin")}'
  checkpoints = f"--gin.CHECKPOINT_PATH='{model_dir}'"
  steps = [
      (train.main, ['--gin_file=gin/experiments/quickstart.gin', f"--gin.MODEL_DIR='{model_dir}'",
                    *argv]),
      (eval_cli.main, [run_config, '--gin_file=gin/runs/eval.gin', checkpoints,
                       '--gin.EVAL_ALL=True']),
      (infer.main, [run_config, '--gin_file=gin/runs/infer.gin', checkpoints,
                    f"--gin.INFER_OUTPUT='{predictions}'", '--gin.infer.max_examples=2']),
  ]
  for command, args in steps:
    gin.clear_config()  # each command reads its own gin files, as in its own process
    with common.on_behalf_of('t5xv-quickstart', {'--gin.MODEL_DIR': '--model_dir',
                                                 'MODEL_DIR (train.model_dir) = ': '--model_dir='}):
      code = command(args)
    if code:
      return code
  with common.clear_errors('t5xv-quickstart'):
    for line in storage.path(predictions).read_text().splitlines():
      row = json.loads(line)
      print(f'inputs:     {row["inputs"][:160]}\ntargets:    {row["targets"]}\n'
            f'prediction: {row["prediction"]}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
