"""One mesh description (``MeshConfig``) and one optimizer (``make_optimizer``), both from gin,
are what every entry point builds: train, eval/infer (the Predictor) and bench."""
import gin
import optax
import pytest

from conftest import tiny
from t5x_variants.cli import bench
from t5x_variants.train import partitioning, predictor
from train_helpers import records_of, run_train


def test_every_entry_point_takes_the_gin_bound_mesh(tmp_path):
  """On this 1-device process a bound data=2 mesh cannot be built: each entry point says so,
  which it can only do if it built its mesh from the binding."""
  gin.bind_parameter('MeshConfig.data', 2)
  message = 'mesh data=2 x model=1 needs 2 devices, found 1'
  with pytest.raises(ValueError, match=message):
    run_train(tmp_path, 1)
  with pytest.raises(ValueError, match=message):
    predictor.Predictor(tiny())
  with pytest.raises(ValueError, match=message):
    bench.bench(tiny(), 2, {'inputs': 8, 'targets': 8}, steps=1, warmup=0)
  assert partitioning.MeshConfig(fsdp=True).rules() == partitioning.logical_axis_rules(True)


def test_bench_times_the_step_that_training_runs():
  """The bench builds t5xv-train's step: a gin-bound ``train.num_microbatches`` that a batch of 2
  cannot split into is refused there as it is by the trainer."""
  gin.bind_parameter('train.num_microbatches', 3)
  with pytest.raises(ValueError, match='x 3 microbatches'):
    bench.bench(tiny(), 2, {'inputs': 8, 'targets': 8}, steps=1, warmup=0)
  assert bench.bench(tiny(), 3, {'inputs': 8, 'targets': 8}, steps=1, warmup=0)['batch'] == 3


@gin.configurable
def no_update(learning_rate):
  del learning_rate
  return optax.set_to_zero()


def test_the_trainer_takes_the_gin_bound_optimizer(tmp_path):
  """With ``make_optimizer.optimizer = @no_update`` the parameters never move (with the default
  Adafactor they do)."""
  gin.parse_config('make_optimizer.optimizer = @no_update')
  run_train(tmp_path / 'frozen', 3)
  norms = [r['param_norm'] for r in records_of(tmp_path / 'frozen')]
  assert len(norms) == 3 and len(set(norms)) == 1, norms
  gin.clear_config()
  run_train(tmp_path / 'adafactor', 3)
  assert len({r['param_norm'] for r in records_of(tmp_path / 'adafactor')}) == 3


def test_a_data_shard_spanning_processes_is_refused():
  """Two hosts of 2 devices: data=2 x model=2 with each host's devices one data row feeds whole
  rows per process; data=1 x model=4, or rows split across hosts, is one error (each process
  would feed other rows to one shard: replicas that disagree, predictions lost). With replica
  groups the batch shards are counted replica-major: one group per host passes, hosts that
  share the groups' rows do not."""
  import types  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  def mesh(data, model, owner, replica=1):  # owner(replica, data, model index) -> process
    devices = np.array([[[types.SimpleNamespace(process_index=owner(r, d, m)) for m in range(model)]
                         for d in range(data)] for r in range(replica)])
    return types.SimpleNamespace(devices=devices, axis_names=partitioning.MESH_AXES,
                                 shape={'replica': replica, 'data': data, 'model': model})
  partitioning.check_processes(mesh(2, 2, lambda r, d, m: d), process_count=2)
  partitioning.check_processes(mesh(4, 1, lambda r, d, m: d // 2), process_count=2)
  partitioning.check_processes(mesh(2, 1, lambda r, d, m: r, replica=2), process_count=2)
  for bad in (mesh(1, 4, lambda r, d, m: m // 2), mesh(2, 2, lambda r, d, m: m),
              mesh(2, 2, lambda r, d, m: 1 - d), mesh(2, 1, lambda r, d, m: d, replica=2)):
    with pytest.raises(ValueError, match="each process must hold whole shards of the batch's mesh axes"):
      partitioning.check_processes(bad, process_count=2)
  partitioning.check_processes(mesh(1, 4, lambda r, d, m: 0))  # one process: anything goes


@pytest.mark.parametrize('micro', [0, -1, 2.5, True])
def test_a_number_of_microbatches_that_is_no_whole_number_of_at_least_1_is_one_error(micro):
  """The trainer, bench and compile check the batch with it: 0 was a ZeroDivisionError, -1 an
  error of the step's tracing, 2.5 the hint 'use a multiple of 2.5'."""
  with pytest.raises(ValueError, match=f'train.num_microbatches must be a whole number of at least '
                     f'1, not {micro!r}'):
    partitioning.check_batch(8, partitioning.make_mesh(), micro)
