"""The reference for ``t5xv-bench --hf``: a Hugging Face PyTorch T5ForConditionalGeneration train
step (forward with labels, backward, transformers' Adafactor with T5's settings) on the same shape
and synthetic batch. Needs the ``hf`` extra (torch, transformers)."""
import statistics
import time

import numpy as np

from t5x_variants.models import hf_t5
from t5x_variants.train.train_step import synthetic_batch


def hf_model(config):
  import transformers  # pylint: disable=g-import-not-at-top
  why = hf_t5.inexpressible(config)
  if why:
    raise ValueError(f'--hf needs a model transformers T5 can express: {why}')
  hf = transformers.T5Config(**{**hf_t5.hf_config(config), 'dropout_rate': 0.0})
  return transformers.T5ForConditionalGeneration(hf)


def bench(config, batch: int, lengths, steps: int = 10, warmup: int = 2) -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  from transformers.optimization import Adafactor  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  model = hf_model(config).train()
  opt = Adafactor(model.parameters(), lr=0.01, relative_step=False, scale_parameter=True,
                  warmup_init=False, decay_rate=-0.8, clip_threshold=1.0, beta1=None)
  data = synthetic_batch(config, batch, lengths)
  inputs = torch.from_numpy(data['encoder_input_tokens']).long()
  labels = torch.from_numpy(data['decoder_target_tokens']).long()
  times = []
  for i in range(warmup + steps):
    start = time.perf_counter()
    loss = model(input_ids=inputs, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if i >= warmup:
      times.append(time.perf_counter() - start)
  median = statistics.median(times)
  tokens = batch * (lengths['inputs'] + lengths['targets'])
  return {'torch': torch.__version__, 'threads': torch.get_num_threads(),
          'parameters': int(sum(np.prod(p.shape) for p in model.parameters())),
          'median_step_seconds': median, 'step_seconds': times,
          'tokens_per_second': tokens / median, 'final_loss': float(loss)}
