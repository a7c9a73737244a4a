"""t5x_variants: Transformer variants for T5-style research in JAX/Flax."""
import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))  # ships gin/: found from any directory
