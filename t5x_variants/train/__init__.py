"""Training: partitioning, optimizer and train step; the training loop (``trainer.train``) with its
checkpoints, metrics, evaluation, diagnostics and preemption handling; ahead-of-time compilation;
decoding and prediction. Imports jax, flax, optax, orbax, etils, numpy, gin and tensorboardX: no
TensorFlow."""
