"""Wall time of cached decoding (``train/decoding.py``): a small decoder-only model (16 prompts
of 128 tokens) and a small encoder-decoder (16 inputs of 512 tokens), 8 new tokens each (EOS
never ends a row), greedy and 4-beam search, jitted, best of 3 after a warm-up.
``python scripts/decode_probe.py [CHECKOUT]`` times the package of CHECKOUT (a worktree of
another commit) or of this repository.
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

SMALL = dict(vocab_size=4224, d_model=256, num_heads=4, head_dim=64, d_ff=1024,
             num_encoder_layers=4, num_decoder_layers=4)
run = jax.jit(decode, static_argnums=(0, 1),
              static_argnames=('max_decode_length', 'method', 'top_k', 'num_beams', 'eos_id'))
for arch, key, length in (('decoder_only', 'prompt_tokens', 128),
                          ('encoder_decoder', 'encoder_input_tokens', 512)):
  config = TransformerConfig(architecture=arch, decoder_max_length=512, **SMALL)
  model = build_model(config)
  dummy = (jnp.ones((1, 8), jnp.int32),) * (2 if arch == 'encoder_decoder' else 1)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), *dummy)['params']
  inputs = {key: jnp.asarray(np.random.RandomState(0).randint(2, 4224, (16, length)), jnp.int32)}
  for method in ('greedy', 'beam'):
    once = lambda: jax.block_until_ready(run(model, config, params, **inputs, max_decode_length=8,
                                             method=method, num_beams=4, eos_id=-1))
    once()
    times = []
    for _ in range(3):
      start = time.perf_counter()
      once()
      times.append(time.perf_counter() - start)
    print(f'{arch} {method}: {min(times):.3f} s (best of 3)')
