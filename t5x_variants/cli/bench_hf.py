"""The peer of ``t5xv-bench --hf``: a Hugging Face PyTorch T5ForConditionalGeneration train step
on the same shape and synthetic batch, as a user of it would run it: float32 parameters, bfloat16
autocast when the model computes in bfloat16 (else, on a GPU, float32 matmuls on TF32 tensor
cores, as JAX's default precision runs ours), dropout 0, transformers' Adafactor with T5's
settings (or ``adamw``: PyTorch's fused AdamW), optionally under ``torch.compile``.

It runs on the device JAX will use (CUDA when JAX is on a GPU), in a child process started
before the parent's JAX takes the accelerator (JAX reserves most of a GPU's memory when its
backend starts), so each side has the whole device. Needs the ``hf`` extra (torch, transformers).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from t5x_variants.cli import launch
from t5x_variants.models import hf_t5
from t5x_variants.train.train_step import synthetic_batch

OPTIMIZERS = ('adafactor', 'adamw')


def run(config, batch: int, lengths, steps: int = 10, warmup: int = 2, compile: bool = False,
        optimizer: str = 'adafactor') -> dict:
  """Times the peer in a child process (before this one starts JAX's backend); its results."""
  why = hf_t5.inexpressible(config)
  if why:
    raise ValueError(f'--hf needs a model transformers T5 can express: {why}')
  if optimizer not in OPTIMIZERS:
    raise ValueError(f'the HF peer has no optimizer {optimizer!r} (the run\'s own kind unless '
                     f'--hf_optimizer is given); valid: {", ".join(OPTIMIZERS)}')
  spec = {'hf_config': {**hf_t5.hf_config(config), 'dropout_rate': 0.0},
          'bf16': config.dtype == 'bfloat16', 'steps': steps, 'warmup': warmup,
          'compile': compile, 'optimizer': optimizer,
          'device': 'cpu' if launch.backend_is_cpu() else 'cuda',
          'tokens': batch * (lengths['inputs'] + lengths['targets'])}
  data = synthetic_batch(config, batch, lengths)
  with tempfile.TemporaryDirectory() as tmp:
    np.save(os.path.join(tmp, 'inputs.npy'), data['encoder_input_tokens'])
    np.save(os.path.join(tmp, 'labels.npy'), data['decoder_target_tokens'])
    with open(os.path.join(tmp, 'spec.json'), 'w') as f:
      json.dump(spec, f)
    done = subprocess.run([sys.executable, '-m', 't5x_variants.cli.bench_hf', tmp],
                          capture_output=True, text=True, check=False)
    if done.returncode:
      raise RuntimeError(f'the HF peer failed: {done.stderr.strip().splitlines()[-1:]}')
    with open(os.path.join(tmp, 'result.json')) as f:
      return json.load(f)


def bench(spec: dict, inputs, labels) -> dict:
  """The peer's timed steps (in the child): median step, tokens/s, peak device memory."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  device = torch.device(spec['device'])
  if device.type == 'cuda' and not spec['bf16']:
    torch.set_float32_matmul_precision('high')
  torch.manual_seed(0)
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(**spec['hf_config']))
  if not spec['hf_config']['tie_word_embeddings']:  # transformers 5 ties lm_head at construction
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
  model = model.to(device).train()
  if spec['optimizer'] == 'adafactor':
    opt = transformers.optimization.Adafactor(
        model.parameters(), lr=0.01, relative_step=False, scale_parameter=True, warmup_init=False,
        decay_rate=-0.8, clip_threshold=1.0, beta1=None)
  else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == 'cuda')
  forward = torch.compile(model) if spec['compile'] else model
  inputs = torch.from_numpy(inputs).long().to(device)
  labels = torch.from_numpy(labels).long().to(device)
  sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
  times = []
  start_all = time.perf_counter()
  for i in range(spec['warmup'] + spec['steps']):
    sync()
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec['bf16']):
      loss = forward(input_ids=inputs, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    if i >= spec['warmup']:
      times.append(time.perf_counter() - start)
    elif i == spec['warmup'] - 1:
      warmup_seconds = time.perf_counter() - start_all
  median = statistics.median(times)
  memory = torch.cuda.max_memory_allocated() if device.type == 'cuda' else None
  return {'torch': torch.__version__, 'transformers': transformers.__version__,
          'device': torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu',
          'threads': torch.get_num_threads(), 'compile': spec['compile'],
          'optimizer': spec['optimizer'], 'autocast_bf16': spec['bf16'],
          'float32_matmul_precision': torch.get_float32_matmul_precision(),
          'parameters': int(sum(np.prod(p.shape) for p in model.parameters())),
          'median_step_seconds': median, 'step_seconds': times,
          'tokens_per_second': spec['tokens'] / median, 'final_loss': float(loss),
          'peak_memory_bytes': memory, 'warmup_seconds': warmup_seconds if spec['warmup'] else 0.0}


def main(argv):
  tmp = argv[1]
  with open(os.path.join(tmp, 'spec.json')) as f:
    spec = json.load(f)
  result = bench(spec, np.load(os.path.join(tmp, 'inputs.npy')), np.load(os.path.join(tmp, 'labels.npy')))
  with open(os.path.join(tmp, 'result.json'), 'w') as f:
    json.dump(result, f)


if __name__ == '__main__':
  main(sys.argv)
