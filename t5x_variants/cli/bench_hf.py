"""The reference for ``t5xv-bench --hf``: a Hugging Face PyTorch T5ForConditionalGeneration train
step (forward with labels, backward, transformers' Adafactor with T5's settings) on the same shape
and synthetic batch. Needs the ``bench`` extra (torch, transformers)."""
import statistics
import time

import numpy as np

from t5x_variants.train.train_step import synthetic_batch

# Our FFN names -> transformers' feed_forward_proj (its gelu is the same tanh approximation).
HF_FFN = {'relu': 'relu', 'gelu': 'gelu_new', 'geglu': 'gated-gelu', 'reglu': 'gated-relu',
          'swiglu': 'gated-silu'}


def hf_model(config):
  import transformers  # pylint: disable=g-import-not-at-top
  if config.architecture != 'encoder_decoder' or config.attention_components != ('dot_product',):
    raise ValueError('--hf compares encoder-decoder dot-product models only')
  if config.ffn not in HF_FFN:
    raise ValueError(f'--hf supports the FFNs {", ".join(HF_FFN)}, not {config.ffn!r}')
  hf = transformers.T5Config(
      vocab_size=config.vocab_size, d_model=config.d_model, d_kv=config.head_dim,
      d_ff=config.ffn_hidden_dim, num_layers=config.num_encoder_layers,
      num_decoder_layers=config.num_decoder_layers, num_heads=config.num_heads,
      relative_attention_num_buckets=config.relative_attention_num_buckets,
      relative_attention_max_distance=config.relative_attention_max_distance,
      dropout_rate=0.0, feed_forward_proj=HF_FFN[config.ffn],
      tie_word_embeddings=config.tie_embeddings, decoder_start_token_id=0, pad_token_id=0)
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
