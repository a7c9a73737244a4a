"""Synthetic batches and a tiny training setup shared by the trainer tests (no TensorFlow)."""
import numpy as np

from t5x_variants.models import build_model, init_inputs
from t5x_variants.train import optimizer, partitioning, train_step
from conftest import tiny


def synthetic_batch(batch=8, length=8, vocab=50, seed=0):
  rng = np.random.RandomState(seed)
  targets = rng.randint(2, vocab, (batch, length)).astype(np.int32)
  return {'encoder_input_tokens': rng.randint(2, vocab, (batch, length)).astype(np.int32),
          'decoder_input_tokens': np.concatenate([np.zeros((batch, 1), np.int32), targets[:, :-1]], 1),
          'decoder_target_tokens': targets,
          'decoder_loss_weights': np.ones((batch, length), np.int32)}


def setup(mesh, config=None, lr=0.01, **step_kwargs):
  """(state, jitted step) of a tiny encoder-decoder on ``mesh`` with Adafactor at constant lr."""
  import jax
  config = config or tiny()
  model = build_model(config)
  schedule = optimizer.learning_rate_schedule('constant', base=lr)
  tx_fn = lambda params: optimizer.adafactor(params, learning_rate=schedule)
  state, shardings, tx = train_step.init_state(model, config, tx_fn, mesh,
                                               partitioning.logical_axis_rules(),
                                               jax.random.PRNGKey(0), init_inputs(config))
  step = train_step.make_train_step(shardings, mesh, model=model, config=config, tx=tx,
                                    schedule=schedule, **step_kwargs)
  return state, step
