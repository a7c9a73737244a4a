"""Building blocks: norms, residual placement, init, FFN, attention, synthesizers, positions.

Imports only jax, flax and numpy, so it runs on accelerator hosts without TensorFlow.
"""
