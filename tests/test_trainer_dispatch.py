"""The training loop keeps the device queue full: it dispatches step N+1 before it reads step N's
metrics to the host, except where step N's state is needed at once (a checkpoint or eval step)."""
from t5x_variants.train import partitioning, trainer, train_step
from train_helpers import run_train


def test_step_n_plus_1_is_dispatched_before_step_n_is_read(tmp_path, monkeypatch):
  events = []
  make_step = train_step.make_train_step

  def recording_make_step(*args, **kwargs):
    step = make_step(*args, **kwargs)

    def dispatch(state, batch, rng):
      events.append(f'D{sum(e.startswith("D") for e in events) + 1}')
      return step(state, batch, rng)
    return dispatch

  to_host = partitioning.to_host

  def recording_to_host(tree):
    events.append(f'R{sum(e.startswith("R") for e in events) + 1}')
    return to_host(tree)

  monkeypatch.setattr(trainer.train_step, 'make_train_step', recording_make_step)
  monkeypatch.setattr(trainer.partitioning, 'to_host', recording_to_host)
  result = run_train(tmp_path, 6, period=3)  # checkpoint at step 3: read before step 4 is sent
  assert result['step'] == 6
  assert ' '.join(events) == 'D1 D2 R1 D3 R2 R3 D4 D5 R4 D6 R5 R6', events
