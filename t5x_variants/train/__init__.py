"""Training: partitioning, optimizer, train step (and, later, the loop, checkpoints, evaluation,
decoding). Imports jax, flax, optax, orbax, numpy and gin only: no TensorFlow."""
