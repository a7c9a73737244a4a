"""t5x_variants: Transformer variants for T5-style research in JAX/Flax."""
