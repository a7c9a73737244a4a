"""Trainer runs in child processes for tests/test_trainer.py.

  python trainer_subprocess.py mesh MODEL_DIR STEPS      8 host devices, replica=2 x data=2 x model=2, fsdp
  python trainer_subprocess.py slow MODEL_DIR STEPS [AGAIN]
      0.1 s per batch, no periodic checkpoints; with AGAIN, a SIGTERM to itself as the final
      checkpoint's commit starts (a second signal after the one that stops the run)
  python trainer_subprocess.py process MODEL_DIR STEPS PORT INDEX [UNREADABLE]
      one of 2 processes joined by jax.distributed (2 CPU devices each, data=2 x model=2, fsdp),
      each feeding its half of every global batch, 0.1 s per batch, no periodic checkpoints; with
      UNREADABLE, this process cannot read the state of checkpoint_UNREADABLE (the others can)
  python trainer_subprocess.py fulldisk MODEL_DIR STEPS PORT INDEX
      as ``process`` with checkpoints every 2 steps, process 1's disk full when it writes its data
      position at step 4
  python trainer_subprocess.py shardfail MODEL_DIR STEPS PORT INDEX
      as ``fulldisk``, process 1's writes of its array shards failing at step 4 instead (in
      orbax's background save thread)
  python trainer_subprocess.py syncfail MODEL_DIR STEPS PORT INDEX FAILING
      as ``fulldisk``, keeping 1 checkpoint, process FAILING's save of checkpoint_4 raising in the
      trainer's thread as it starts (before any background write)
  python trainer_subprocess.py diverge MODEL_DIR STEPS PORT INDEX
      as ``process``, with an eval of the fault tests' two batches every 2 steps, of which
      process 1's copy has only the first

  python trainer_subprocess.py kill MODEL_DIR STEPS PHASE AT
      1 device, checkpoints every 2 steps, an eval of 2 batches every 2 steps; SIGKILLs itself at
      step AT in PHASE: 'step' (the step dispatched, not finished), 'save' (checkpoint_AT written
      to its temporary directory, not committed), 'committed' (just after its commit) or 'eval'
      (after the first eval batch and checkpoint_AT's commit), printing ``KILL PHASE AT`` first
  python trainer_subprocess.py plain MODEL_DIR STEPS
      as ``kill`` without the kill (a run through a failing proxy to a bucket)
  python trainer_subprocess.py evalfail MODEL_DIR STEPS
      as ``plain``, with evaluation data that raises when read and each checkpoint's commit held
      back 2 s (an error mid-run while a save is in flight)
  python trainer_subprocess.py churn MODEL_DIR STEPS
      1 device, 0.05 s per batch, a checkpoint every step, keep 2 (t5xv-eval beside a training run)

Prints the trainer's result as JSON on the last line.
"""
import argparse
import functools
import json
import os
import sys

mode, model_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
devices = {'mesh': 8, 'slow': 1, 'process': 2, 'fulldisk': 2, 'shardfail': 2, 'syncfail': 2,
           'diverge': 2, 'kill': 1, 'plain': 1,
           'evalfail': 1, 'churn': 1}[mode]
os.environ['XLA_FLAGS'] = (f'{os.environ.get("XLA_FLAGS", "")} '  # the suite's, then the devices
                           f'--xla_force_host_platform_device_count={devices}').strip()
if devices > 1:  # host devices: the CPU's, also on a GPU machine
  os.environ['JAX_PLATFORMS'] = 'cpu'
sys.path.insert(0, os.path.dirname(__file__))

import gin  # noqa: E402
import jax  # noqa: E402

from t5x_variants.cli import common  # noqa: E402
from t5x_variants.train.partitioning import MeshConfig  # noqa: E402
from train_helpers import (FullDisk, StepBatches, eval_batches, failing_eval_batches,  # noqa: E402
                           failing_save_start, failing_shard_writes, kill_at, run_train,
                           slow_commits, unreadable_state)

if mode == 'mesh':
  gin.bind_parameter('MeshConfig.replica', 2)  # as --gin.MeshConfig.replica=2 ... on a command line
  gin.bind_parameter('MeshConfig.data', 2)
  gin.bind_parameter('MeshConfig.model', 2)
  gin.bind_parameter('MeshConfig.fsdp', True)
  result = run_train(model_dir, steps)
elif mode == 'slow':
  if len(sys.argv) > 4:
    import signal  # pylint: disable=g-import-not-at-top
    from t5x_variants.train.checkpoints import Checkpointer  # pylint: disable=g-import-not-at-top
    commit = Checkpointer.close

    def signalled(self):
      os.kill(os.getpid(), signal.SIGTERM)
      commit(self)
    Checkpointer.close = signalled
  result = run_train(model_dir, steps, period=1000,
                     batches=functools.partial(StepBatches, delay=0.1))
elif mode in ('kill', 'plain'):
  if mode == 'kill':
    kill_at(sys.argv[4], int(sys.argv[5]), model_dir)
  result = run_train(model_dir, steps, eval_data=eval_batches, eval_period=2)
elif mode == 'evalfail':
  slow_commits(2.0)
  result = run_train(model_dir, steps, eval_data=failing_eval_batches, eval_period=2)
elif mode == 'churn':
  result = run_train(model_dir, steps, period=1, keep=2,
                     batches=functools.partial(StepBatches, delay=0.05))
else:
  port, index = sys.argv[4], int(sys.argv[5])
  common.initialize_processes(argparse.Namespace(
      multiprocess_gpu=True, multiprocess_tpu=False, coordinator_address=f'127.0.0.1:{port}',
      process_count=2, process_index=index))
  if mode == 'process' and len(sys.argv) > 6:
    unreadable_state([int(sys.argv[6])])
  assert jax.process_count() == 2 and len(jax.devices()) == 4
  evals, batches, period = {}, StepBatches, 1000
  if mode == 'diverge':
    evals = dict(eval_period=2, eval_data=lambda: {
        name: batches[:2 - index] for name, batches in eval_batches().items()})
  if mode in ('fulldisk', 'shardfail', 'syncfail'):
    batches, period = (FullDisk if mode == 'fulldisk' and index == 1 else StepBatches), 2
  if mode == 'shardfail' and index == 1:
    failing_shard_writes(4)
  if mode == 'syncfail':
    evals = dict(keep=1)  # keep-N must not count the save that never finished
    if index == int(sys.argv[6]):
      failing_save_start(4)
  result = run_train(model_dir, steps, period=period, mesh=MeshConfig(2, 2, fsdp=True),
                     batches=functools.partial(batches, host=index, hosts=2, delay=0.1), **evals)
print(json.dumps(result))
