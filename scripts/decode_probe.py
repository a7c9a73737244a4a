"""Wall time of cached decoding (``train/decoding.py``) of a small decoder-only model: 16 prompts
of 128 tokens, 8 new tokens (EOS never ends a row), greedy and 4-beam search, jitted, best of 3
after a warm-up. ``python scripts/decode_probe.py [CHECKOUT]`` times the package of CHECKOUT (a
worktree of another commit) or of this repository.
"""
import os
import sys
import time

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from t5x_variants.models import build_model  # noqa: E402
from t5x_variants.models.config import TransformerConfig  # noqa: E402
from t5x_variants.train.decoding import decode  # noqa: E402

config = TransformerConfig(architecture='decoder_only', vocab_size=4224, d_model=256, num_heads=4,
                           head_dim=64, d_ff=1024, num_decoder_layers=4, decoder_max_length=512)
model = build_model(config)
params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))['params']
prompts = jnp.asarray(np.random.RandomState(0).randint(2, 4224, (16, 128)), jnp.int32)
run = jax.jit(decode, static_argnums=(0, 1),
              static_argnames=('max_decode_length', 'method', 'top_k', 'num_beams', 'eos_id'))
for method in ('greedy', 'beam'):
  once = lambda: jax.block_until_ready(run(model, config, params, prompt_tokens=prompts,
                                           max_decode_length=8, method=method, num_beams=4, eos_id=-1))
  once()
  times = []
  for _ in range(3):
    start = time.perf_counter()
    once()
    times.append(time.perf_counter() - start)
  print(f'{method}: {min(times):.3f} s (best of 3)')
