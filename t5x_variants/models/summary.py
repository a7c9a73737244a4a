"""Parameter table and variant summary of a model, built abstractly (``jax.eval_shape``: no
weights are materialised), in the spirit of T5X's model-info.txt."""
import math
import re
from typing import List, Tuple

import flax.linen as nn
import jax

from t5x_variants import path_keys
from t5x_variants.models import build_model, init_inputs
from t5x_variants.models.config import TransformerConfig


def abstract_params(config: TransformerConfig):
  """Boxed (LogicallyPartitioned) ShapeDtypeStructs of the model's parameters."""
  model = build_model(config)
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *init_inputs(config)))
  return variables['params']


def param_rows(params) -> List[Tuple[str, Tuple[int, ...], Tuple[str, ...], int]]:
  """(path, shape, logical axes, count) for every parameter, sorted by path."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  rows = []
  for path, leaf in flat:
    name = '/'.join(path_keys(path))
    axes = tuple(leaf.names) if isinstance(leaf, nn.Partitioned) else ()
    shape = tuple(nn.unbox(leaf).shape)
    rows.append((name, shape, axes, math.prod(shape)))
  return sorted(rows)


def variant_summary(config: TransformerConfig) -> List[str]:
  c = config
  gain_name = {'deepnorm': 'beta', 'subln': 'gamma'}.get(c.placement, 'gain')
  rows = (' (prefix LM: inputs fully visible)' if c.visible_prefix else
          ' (inputs then targets, causal)' if c.prefix_lm else
          ' (the encoder on the decoder\'s parameters)' if c.shared_encoder_decoder else '')
  lines = [f'architecture: {c.architecture}{rows}',
           f'layers: encoder={c.num_encoder_layers if "encoder" in c.stacks else 0} '
           f'decoder={c.num_decoder_layers if "decoder" in c.stacks else 0}',
           f'd_model={c.d_model} heads={c.num_heads} head_dim={c.head_dim} vocab={c.vocab_size}',
           f'norm placement: {c.placement} (norm: {c.norm}, epsilon: {c.norm_epsilon:g}, '
           f'init: {c.init_scheme})']
  for stack, (alpha, gain) in c.residual_constants().items():
    lines.append(f'  {stack}: alpha={alpha:.6g} {gain_name}={gain:.6g}')
  lines += [f'ffn: {c.ffn} activations={c.activations} d_ff={c.ffn_hidden_dim}',
            f'self-attention: {"+".join(c.attention_components)} '
            f'(cross-attention: {"dot_product" if c.architecture == "encoder_decoder" else "none"})',
            f'positions: {c.position_embedding}' + (
                f' buckets={c.relative_attention_num_buckets} '
                f'max_distance={c.relative_attention_max_distance} '
                f'bidirectional={c.relative_attention_bidirectional}'
                if c.position_embedding == 'relative' else ''),
            f'embeddings: tied={c.tie_embeddings} scaled={c.scale_embeddings} '
            f'scale_tied_logits={c.scale_tied_logits}',
            f'execution: scan_layers={c.scan_layers} remat={c.remat} attention_kernel={c.attention_kernel} '
            f'dtype={c.dtype} (params float32)']
  return lines


def model_info(config: TransformerConfig) -> str:
  """The text of model-info.txt: variant summary, then one row per parameter and the total."""
  rows = param_rows(abstract_params(config))
  width = max(len(r[0]) for r in rows)
  out = variant_summary(config) + ['', f'{"parameter":<{width}}  {"count":>12}  shape / logical axes']
  for name, shape, axes, count in rows:
    out.append(f'{name:<{width}}  {count:>12,}  {shape} {axes}')
  out.append(f'Total number of parameters: {sum(r[3] for r in rows):,}')
  return '\n'.join(out)


def model_fields(text: str):
  """{field: value} of a model-info.txt: the variant summary's fields ('ffn', 'ffn.d_ff',
  'norm placement.norm', ...; not the execution line, which a resumed run may change) and every
  parameter's shape. Read field by field, so that a field one version of the summary has and
  another lacks is no difference."""
  fields = {}
  for line in text.splitlines():
    row = re.match(r'(\S+/\S+)\s+[\d,]+\s+(\([\d, ]*\))', line)  # name, count, shape
    if row:
      fields[f'parameter {row.group(1)}'] = row.group(2)
      continue
    label, sep, rest = line.strip().partition(': ')
    if not sep or '=' in label:
      label, rest = '', line.strip()
    if label in ('execution', 'Total number of parameters'):
      continue
    words = rest.split()
    if label and words and '=' not in words[0]:
      fields[label] = words[0]
    for key, value in re.findall(r'([\w-]+)(?:=|: )(\([^)]*\)|[^\s,()]+)', rest):
      fields[f'{label}.{key}' if label else key] = value
  return fields


def differences(saved: str, wanted: str) -> str:
  """'' when two model-info.txt texts describe the same model (the fields present in both
  summaries, and every parameter's shape); else the first difference and their number."""
  saved, wanted = model_fields(saved), model_fields(wanted)
  params = lambda fields: {k for k in fields if k.startswith('parameter ')}
  differ = sorted(k for k in (saved.keys() & wanted.keys()) | (params(saved) ^ params(wanted))
                  if saved.get(k) != wanted.get(k))
  if not differ:
    return ''
  k = differ[0]
  return (f'{k}: saved {saved.get(k)}, this configuration {wanted.get(k)}; {len(differ)} '
          'difference(s)')
