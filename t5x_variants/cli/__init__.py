"""The command-line tools (T5X conventions): one module per command (train, eval, infer, info,
data, bench, compile, sweep, report, hf, quickstart), ``common`` for what they share, and the
helpers of some (``profile`` and ``bench_hf`` for bench, ``eval_results`` and ``eval_passes`` for
eval (the passes also for train's decoding evals), ``ranges`` for argument checks,
``launch`` for the huge-pages re-execution).

TensorFlow and XLA print C++ start-up messages (oneDNN notices, CUDA probing on CPU hosts) as
soon as they load, before any flag is read; importing this package turns them off
(TF_CPP_MIN_LOG_LEVEL=3) unless ``--verbosity`` or ``T5XV_VERBOSITY`` asks for more.
"""
import os
import sys

if os.environ.get('T5XV_VERBOSITY', '0') == '0' and not any(
    a.startswith('--verbosity') and a != '--verbosity=0' for a in sys.argv[1:]):
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
