"""Multi-process flags (T5X conventions): on multi-GPU hosts every process is started with
``--multiprocess_gpu --coordinator_address=HOST:PORT --process_count=N --process_index=I`` and
joins through ``jax.distributed.initialize``. On Cloud TPU pods the same command runs on every
host and jax finds its peers itself (``jax.distributed.initialize()`` without arguments). CPU
processes (tests) exchange collectives through gloo."""
import argparse

import jax


def add_flags(parser: argparse.ArgumentParser):
  parser.add_argument('--multiprocess_gpu', action='store_true',
                      help='join other processes through jax.distributed.initialize')
  parser.add_argument('--multiprocess_tpu', action='store_true',
                      help='jax.distributed.initialize() with the TPU pod\'s own discovery')
  parser.add_argument('--coordinator_address', default=None, help='HOST:PORT of process 0')
  parser.add_argument('--process_count', type=int, default=None)
  parser.add_argument('--process_index', type=int, default=None)


def initialize(args):
  """Joins the other processes, if the flags ask for it. Must run before any other jax call."""
  if args.multiprocess_tpu:
    jax.distributed.initialize()
  elif args.multiprocess_gpu:
    missing = [f for f in ('coordinator_address', 'process_count', 'process_index')
               if getattr(args, f) is None]
    if missing:
      raise SystemExit(f'--multiprocess_gpu needs --{", --".join(missing)}')
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(args.coordinator_address, args.process_count, args.process_index)
