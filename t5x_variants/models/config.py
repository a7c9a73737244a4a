"""The model configuration: one frozen dataclass, bound from gin files (``TransformerConfig.x``).

Every variant axis is a field; each is validated here, so a wrong value fails at construction
with its valid choices rather than deep inside a traced function.
"""
import dataclasses
import numbers
import typing
from typing import Dict, Optional, Tuple, Union

import gin
import jax.numpy as jnp
import numpy as np

from t5x_variants.features import ARCHITECTURES, STACKS
from t5x_variants.layers import attention, ffn, fused_attention, init, norms, placement, position

REMAT = ('auto', 'none', 'minimal', 'full', 'dots_and_probs', 'save_qkv_attention', 'save_attention_mlp')
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
HEADS = ('lm', 'classification')


def _check(name, value, valid):
  if value not in valid:
    raise ValueError(f'unknown {name} {value!r}; valid: {", ".join(valid)}')


def _is(value, kind) -> bool:
  """Whether ``value`` is of the declared field type ``kind`` (numpy's scalars too; a bool is no
  number; a list stands for a tuple, as gin may give one)."""
  if kind is bool:
    return isinstance(value, (bool, np.bool_))
  if kind in (int, float):
    number = numbers.Integral if kind is int else numbers.Real
    return isinstance(value, number) and not isinstance(value, (bool, np.bool_))
  if kind is type(None):
    return value is None
  args = typing.get_args(kind)
  if typing.get_origin(kind) is Union:
    return any(_is(value, a) for a in args)
  if typing.get_origin(kind) is tuple:
    return isinstance(value, (tuple, list)) and all(_is(v, args[0]) for v in value)
  return isinstance(value, kind)


def _described(kind) -> str:
  names = {bool: 'True or False', int: 'an integer', float: 'a number', str: 'a string',
           type(None): 'None'}
  if typing.get_origin(kind) is Union:
    return ' or '.join(_described(a) for a in typing.get_args(kind))
  return names.get(kind, 'a tuple of strings')


# The integer sizes: positive (the layer counts: non-negative; each stack's at least 1).
SIZES = ('vocab_size', 'd_model', 'num_heads', 'head_dim', 'd_ff', 'd_ff_glu', 'num_encoder_layers',
         'num_decoder_layers', 'relative_attention_num_buckets', 'relative_attention_max_distance',
         'encoder_max_length', 'decoder_max_length', 'synthesizer_rank')


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Defaults are T5-base v1.1 style (RMSNorm, Pre-LN, no biases, untied logits) with ReLU FFN.

  Attributes (non-obvious ones):
    d_ff: hidden width of the two-matrix FFNs (relu, gelu, swish, ...).
    d_ff_glu: hidden width of the gated three-matrix FFNs (glu, reglu, geglu, swiglu, bilinear);
      None means round(2/3 * d_ff), which keeps the parameter count of the two-matrix FFN.
    ffn: a variant name from layers/ffn.FFN_VARIANTS or a tuple of activation names.
    self_attention: 'dot_product', a synthesizer name, or a tuple of them (learned mixture).
    encoder_max_length / decoder_max_length: each stack's longest sequence: the synthesizer
      length l, and the table size of learned absolute position embeddings.
    position_embedding: 'relative' (T5's bias on dot-product logits, after mixing in a mixture),
      'sinusoidal' (Vaswani et al. 2017) or 'learned' added to the stack's input, or 'none'.
    embedding_init_std / scale_embeddings: the token embedding is initialised N(0, std^2) (T5: 1)
      and, with scale_embeddings, multiplied by sqrt(d_model) on the way in (Vaswani et al. 2017,
      Sec. 3.4, with std d_model^-0.5 as in fairseq).
    subln_cross_attention: give cross-attention Sub-LN's inner LN and gain gamma too; off by
      default, as in Magneto's code (DeepNorm's beta always applies to cross-attention).
    encoder_alpha, encoder_gain, decoder_alpha, decoder_gain: override the placement's residual
      scale alpha (DeepNorm only) and init gain (DeepNorm beta / Sub-LN gamma) of a stack the
      model has; None uses the papers' formulas.
    synthesizer_factor: a in a x b = l for factorized dense; None picks a near sqrt(l).
    synthesizer_rank: k of the factorized random synthesizer (16: the authors' code).
    synthesizer_shared_projection: the dense synthesizer's W_2 (d_h x l) shared by all heads, as
      the authors' code; False: one per head (the paper's parameter count).
    synthesizer_hidden: the dense synthesizers' hidden layer h in B = W_2 h (Tay et al. 2021,
      Sec. 3). 'query' (default, as the authors' Mesh TensorFlow code): relu of the attention's
      own query projection, scaled as for the dot product, relu(x W_q / sqrt(d_h)); mixed with
      dot-product attention the two share that query (d_model * heads * head_dim fewer
      parameters). 'w1': relu(x W_1 + b_1) with a separate W_1 (the paper's reading).
    synthesizer_relative_bias: add the relative position bias to a self-attention that has a
      synthesizer component (as the authors' code with relative_attention_type set); off by
      default, as there. Plain dot-product attention always gets it.
    init_scheme: 't5', 'xavier' (the DeepNet / Magneto pseudocode) or 'torchscale' (their
      released code as it runs: layers/init.py); its own choice, never set by a placement file.
    tie_embeddings / scale_tied_logits: logits from the token embedding, x E^T / sqrt(d) (T5)
      or, with scale_tied_logits False, x E^T (fairseq / torchscale).
    dropout_rate: residual dropout, on each sublayer's output before the residual add (and on the
      embeddings and the final norm's output), T5X's ``dropout_rate`` and fairseq's ``dropout``.
    attention_dropout_rate: on the attention probabilities (fairseq's ``attention_dropout``).
    activation_dropout_rate: in the FFN after the activation, before Sub-LN's inner LN and the
      output projection (fairseq's ``activation_dropout``). None for either: ``dropout_rate``, as
      T5X's single rate.
    dropout_broadcast: one mask per example shared by every position (T5X's broadcast over the
      sequence axis; on the attention probabilities, one (head, key) mask shared by every query,
      as T5X's) or, False, an independent mask per element (PyTorch / fairseq).
    remat: what the backward pass keeps of each layer (models/stack.py REMAT_POLICIES); the
      rest is recomputed. 'none' keeps everything, 'full' nothing; 'auto' is chosen per platform
      (``remat_policy``).
    attention_kernel: 'auto' (cuDNN fused attention on a GPU with a 16-bit compute dtype; on a
      TPU the row kernel up to 512 x 512, Pallas flash attention beyond; else XLA), 'xla' (the
      reference path), 'cudnn' or 'pallas' (layers/fused_attention.py).
    head: 'lm' (the architecture's logits over the vocabulary) or 'classification' (encoder-only:
      BERT's pooler and classifier on the first token, logits (batch, 1, num_labels)).
    num_labels: the classification head's outputs; 1 is regression (STS-B).
    prefix_lm: a decoder-only model as T5's "prefix LM" (Raffel et al. 2020, Sec. 3.2.1, Fig. 3):
      a row is the inputs then the targets, the mask fully visible over the inputs (and the
      position that reads their last token) and causal after them, the loss on the targets only
      (seqio's PrefixLMFeatureConverter); it trains and is prompted on tasks with inputs. Its
      relative position buckets are bidirectional (``relative_attention_bidirectional``).
    inputs_bidirectional_attention: with ``prefix_lm``, whether the inputs are fully visible (the
      prefix LM) or read causally like the targets: T5's "language model" on the inputs then the
      targets (Table 2), the same rows and loss (T5X's DecoderOnlyModel argument of this name).
    shared_encoder_decoder: T5's "encoder-decoder, shared" (Raffel et al. 2020, Table 2): the
      encoder runs on the decoder's parameters (its self-attention, FFN, norms, relative bias and
      final norm; the cross-attention is the decoder's alone), as the paper's code names the
      encoder's variables as the decoder's (Mesh TF ``bi_v1_shared``): the decoder's parameters
      alone, the same cost. Needs as many encoder as decoder layers, and Pre-LN or Post-LN
      without per-stack residual constants.
    relative_attention_bidirectional: None (default) for Mesh TensorFlow's rule, the T5 paper's
      code: bidirectional buckets unless the stack is causal throughout (its Unitransformer's
      ``fully_autoregressive``), so a prefix LM's; False keeps them one-directional in a
      causal stack, as T5X's decoder-only network (every key after its query in a prefix then
      falls in the bucket of distance 0; this project's prefix LM before eaee1f9).
  """
  architecture: str = 'encoder_decoder'
  vocab_size: int = 32128
  d_model: int = 768
  num_heads: int = 12
  head_dim: int = 64
  d_ff: int = 3072
  d_ff_glu: Optional[int] = None
  num_encoder_layers: int = 12
  num_decoder_layers: int = 12
  ffn: Union[str, Tuple[str, ...]] = 'relu'
  self_attention: Union[str, Tuple[str, ...]] = 'dot_product'
  norm: str = 'rmsnorm'
  norm_epsilon: float = 1e-6
  placement: str = 'pre'
  init_scheme: str = 't5'
  encoder_alpha: Optional[float] = None
  encoder_gain: Optional[float] = None
  decoder_alpha: Optional[float] = None
  decoder_gain: Optional[float] = None
  use_bias: bool = False
  tie_embeddings: bool = False
  scale_tied_logits: bool = True
  head: str = 'lm'
  num_labels: int = 2
  embedding_init_std: float = 1.0
  scale_embeddings: bool = False
  position_embedding: str = 'relative'
  subln_cross_attention: bool = False
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  encoder_max_length: int = 512
  decoder_max_length: int = 114
  synthesizer_factor: Optional[int] = None
  synthesizer_rank: int = 16
  synthesizer_shared_projection: bool = True
  synthesizer_hidden: str = 'query'
  synthesizer_relative_bias: bool = False
  dropout_rate: float = 0.0
  attention_dropout_rate: Optional[float] = None
  activation_dropout_rate: Optional[float] = None
  dropout_broadcast: bool = True
  scan_layers: bool = True
  remat: str = 'auto'
  attention_kernel: str = 'auto'
  dtype: str = 'float32'
  prefix_lm: bool = False
  inputs_bidirectional_attention: bool = True
  relative_attention_bidirectional: Optional[bool] = None
  shared_encoder_decoder: bool = False

  def remat_policy(self, platform: str) -> str:
    """The remat that runs on ``platform`` ('cpu', 'gpu', 'tpu'). 'auto': 'full' on a GPU with
    bfloat16 compute (measured: T5-base at batch 128 on an H200 ran 7% faster than with 'none'
    in a sixth of the memory), else 'none' (on v5p-16 the compiler's cost model puts 'full' 10%
    slower for T5-base, fsdp; on the CPU recomputation costs its time). BENCHMARKS.md has both."""
    if self.remat != 'auto':
      return self.remat
    return 'full' if platform == 'gpu' and self.dtype == 'bfloat16' else 'none'

  def __post_init__(self):
    for field in dataclasses.fields(self):  # 'no' for a flag was True; a rate 'x' failed in JAX
      value = getattr(self, field.name)
      if field.name not in SIZES and not _is(value, field.type):
        raise ValueError(f'TransformerConfig.{field.name} must be {_described(field.type)}, '
                         f'not {value!r}')
      if isinstance(value, list):  # gin's [...] for a tuple: kept hashable, as frozen promises
        object.__setattr__(self, field.name, tuple(value))
    _check('architecture', self.architecture, ARCHITECTURES)
    _check('norm', self.norm, norms.NORMS)
    _check('placement', self.placement, placement.PLACEMENTS)
    _check('init_scheme', self.init_scheme, init.INITS)
    _check('position_embedding', self.position_embedding, position.POSITION_EMBEDDINGS)
    _check('remat', self.remat, REMAT)
    _check('attention_kernel', self.attention_kernel, fused_attention.KERNELS)
    _check('dtype', self.dtype, tuple(DTYPES))
    _check('head', self.head, HEADS)
    _check('synthesizer_hidden', self.synthesizer_hidden, attention.synth.HIDDEN)
    if self.head == 'classification' and self.architecture != 'encoder_only':
      raise ValueError(f"head 'classification' needs architecture 'encoder_only', not {self.architecture!r}")
    if self.prefix_lm and self.architecture != 'decoder_only':
      raise ValueError(f"prefix_lm is a decoder-only model's mask; architecture is {self.architecture!r}"
                       " (gin/architectures/prefix_lm.gin sets both)")
    if self.shared_encoder_decoder and (self.architecture != 'encoder_decoder' or
                                        self.num_encoder_layers != self.num_decoder_layers):
      raise ValueError('shared_encoder_decoder runs the encoder on the decoder\'s layers: it needs '
                       'architecture encoder_decoder and num_encoder_layers == num_decoder_layers, '
                       f'not {self.architecture} with {self.num_encoder_layers} and '
                       f'{self.num_decoder_layers}')
    per_stack = [n for n in ('encoder_alpha', 'encoder_gain', 'decoder_alpha', 'decoder_gain')
                 if getattr(self, n) is not None]
    if self.shared_encoder_decoder and (self.placement in ('deepnorm', 'subln') or per_stack):
      raise ValueError('shared_encoder_decoder: one set of weights cannot take the encoder\'s and '
                       'the decoder\'s residual constants (placement '
                       f'{self.placement!r}{", " + ", ".join(per_stack) if per_stack else ""}); '
                       'use placement pre or post without per-stack alpha / gain')
    for name in per_stack:
      stack, kind = name.split('_')
      if stack not in self.stacks:
        raise ValueError(f'{name} is set but a {self.architecture} model has no {stack}: set '
                         f'{" / ".join(f"{s}_{kind}" for s in self.stacks)}')
      if name.endswith('alpha') and self.placement != 'deepnorm':
        raise ValueError(f'{name} scales the residual only under DeepNorm (x + f(x) -> '
                         f'LN(alpha x + f(x))); placement {self.placement!r} has no alpha: unset '
                         'it or use placement deepnorm')
    if self.subln_cross_attention and (self.placement, self.architecture) != ('subln',
                                                                              'encoder_decoder'):
      raise ValueError("subln_cross_attention gives Sub-LN's inner LN to cross-attention: it needs "
                       f"placement 'subln' and an encoder-decoder (here {self.placement!r}, "
                       f'{self.architecture!r}); unset it')
    if (self.shared_encoder_decoder and self.sized_by_length
        and self.encoder_max_length != self.decoder_max_length):
      raise ValueError('shared_encoder_decoder with learned positions or a synthesizer (parameters '
                       'sized by the sequence length) needs encoder_max_length == decoder_max_length')
    if not self.inputs_bidirectional_attention and not self.prefix_lm:
      raise ValueError('inputs_bidirectional_attention=False is for a model reading inputs then '
                       'targets (prefix_lm=True; gin/architectures/language_model.gin sets both)')
    for name in ('dropout_rate', 'attention_dropout_rate', 'activation_dropout_rate'):
      rate = getattr(self, name)
      if rate is not None and not 0.0 <= rate < 1.0:
        raise ValueError(f'{name} must be in [0, 1), not {rate}')
    if self.num_labels < 1:
      raise ValueError(f'num_labels must be >= 1 (1: regression), not {self.num_labels}')
    for name in SIZES:  # a size of 0, -5 or 2.5 failed later inside JAX, in a traceback
      value, least = getattr(self, name), 0 if 'layers' in name else 1
      if value is None and name == 'd_ff_glu':
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f'TransformerConfig.{name} must be a {("positive", "non-negative")[least == 0]} '
                         f'integer, not {value!r}')
    buckets, distance = self.relative_attention_num_buckets, self.relative_attention_max_distance
    if self.position_embedding == 'relative' and not (buckets >= 4 and distance > buckets // 2):
      raise ValueError('relative position buckets (exact up to half the buckets, logarithmic up to '
                       'the max distance) need relative_attention_num_buckets >= 4 and '
                       'relative_attention_max_distance > num_buckets // 2, not '
                       f'{buckets} and {distance}')
    ffn.resolve_activations(self.ffn)
    attention.resolve_components(self.self_attention)
    for stack in self.stacks:
      if self.num_layers(stack) < 1:
        raise ValueError(f'{self.architecture} needs num_{stack}_layers >= 1')
    if 'factorized_dense' in self.attention_components:
      for stack in self.stacks:
        attention.synth.factor_pair(self.max_length(stack), self.synthesizer_factor)

  @property
  def activations(self) -> Tuple[str, ...]:
    return ffn.resolve_activations(self.ffn)

  @property
  def ffn_hidden_dim(self) -> int:
    if len(self.activations) == 1:
      return self.d_ff
    return self.d_ff_glu if self.d_ff_glu is not None else round(2 * self.d_ff / 3)

  @property
  def attention_components(self) -> Tuple[str, ...]:
    return attention.resolve_components(self.self_attention)

  @property
  def relative_bias(self) -> bool:
    """Whether self-attention gets T5's relative position bias."""
    return self.position_embedding == 'relative' and (
        self.attention_components == ('dot_product',) or self.synthesizer_relative_bias)

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def stacks(self) -> Tuple[str, ...]:
    return STACKS[self.architecture]

  @property
  def data_architecture(self) -> str:
    """The rows the data layer builds for this model (features.DATA_ARCHITECTURES)."""
    return 'prefix_lm' if self.prefix_lm else self.architecture

  @property
  def visible_prefix(self) -> bool:
    """Whether a decoder-only row's inputs are fully visible (T5's prefix LM)."""
    return self.prefix_lm and self.inputs_bidirectional_attention

  def bidirectional_buckets(self, causal: bool) -> bool:
    """Whether a stack's relative position buckets tell later keys apart (``causal``: the
    decoder's mask): ``relative_attention_bidirectional``, or by default unless the stack is
    causal throughout (Mesh TensorFlow's ``not fully_autoregressive``)."""
    if self.relative_attention_bidirectional is not None and causal:
      return self.relative_attention_bidirectional
    return not causal or self.visible_prefix

  def stack_features(self, stack: str) -> Tuple[str, ...]:
    """The task features one row of ``stack`` holds: the encoder's 'inputs', the decoder's
    'targets', a prefix LM's 'inputs' then 'targets'."""
    if stack == 'encoder':
      return ('inputs',)
    return ('inputs', 'targets') if self.prefix_lm else ('targets',)

  @property
  def task_features(self) -> Tuple[str, ...]:
    """The task features whose lengths make the model's rows."""
    return tuple(dict.fromkeys(f for s in self.stacks for f in self.stack_features(s)))

  def stack_length(self, stack: str, lengths: Dict[str, int]) -> int:
    """The length of ``stack``'s rows for task feature ``lengths``."""
    return sum(lengths[f] for f in self.stack_features(stack))

  def overlong_stack(self, lengths: Dict[str, int]) -> Optional[Tuple[str, int]]:
    """(stack, its row length) of the first stack whose rows for task feature ``lengths`` are
    longer than a model whose parameters are sized by its lengths (``sized_by_length``) reads;
    None where every row fits."""
    for stack in self.stacks if self.sized_by_length else ():
      if all(f in lengths for f in self.stack_features(stack)):
        n = self.stack_length(stack, lengths)
        if n > self.max_length(stack):
          return stack, n
    return None

  def num_layers(self, stack: str) -> int:
    return self.num_encoder_layers if stack == 'encoder' else self.num_decoder_layers

  def max_length(self, stack: str) -> int:
    return self.encoder_max_length if stack == 'encoder' else self.decoder_max_length

  @property
  def sized_by_length(self) -> bool:
    """Whether parameters are sized by each stack's ``max_length`` (learned positions, a
    synthesizer's), so that no row may be longer."""
    return self.position_embedding == 'learned' or self.attention_components != ('dot_product',)

  @property
  def uses_dropout(self) -> bool:
    return max(self.dropout_rate, self.rate('attention'), self.rate('activation')) > 0

  @property
  def dropout_broadcast_dims(self) -> Tuple[int, ...]:
    """nn.Dropout's broadcast_dims: the sequence axis of (batch, length, features) and the query
    axis of attention probabilities (batch, heads, queries, keys), or none."""
    return (-2,) if self.dropout_broadcast else ()

  def rate(self, name: str) -> float:
    """The 'attention' or 'activation' dropout rate, falling back to dropout_rate."""
    rate = getattr(self, f'{name}_dropout_rate')
    return self.dropout_rate if rate is None else rate

  def residual_constants(self) -> Dict[str, Tuple[float, float]]:
    """{stack: (alpha, gain)} from the papers' formulas (DeepNorm's beta as the released code has
    it under init_scheme 'torchscale'), with the gin overrides applied."""
    consts = placement.residual_constants(self.placement, self.architecture,
                                          self.num_encoder_layers, self.num_decoder_layers,
                                          code=self.init_scheme == 'torchscale')
    out = {}
    for stack, (alpha, gain) in consts.items():
      a, g = getattr(self, f'{stack}_alpha'), getattr(self, f'{stack}_gain')
      out[stack] = (alpha if a is None else a, gain if g is None else g)
    return out
