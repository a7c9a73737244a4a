"""Parameter counts equal closed-form formulas, built abstractly (no weights materialised)."""
import dataclasses
import pytest

from conftest import count, tiny
from t5x_variants.models import TransformerConfig
from t5x_variants.models.summary import abstract_params


def t5_count(d, h, dh, f, v, n, m, n_ffn_in=1, tied=False, buckets=32):
  """T5 v1.1-style encoder-decoder, RMSNorm, no biases: the count written out by hand."""
  attn = 4 * d * h * dh
  ffn = (n_ffn_in + 1) * d * f
  enc = n * (attn + ffn + 2 * d) + h * buckets + d
  dec = m * (2 * attn + ffn + 3 * d) + h * buckets + d
  return v * d + enc + dec + (0 if tied else d * v)


def test_t5_base_matches_the_published_count():
  # The original T5-base (tied logits, ReLU, d_ff 3072) has 222,903,552 parameters.
  c = TransformerConfig(tie_embeddings=True)
  assert count(abstract_params(c)) == 222_903_552 == t5_count(768, 12, 64, 3072, 32128, 12, 12, tied=True)


# transformers' google/t5-v1_1-{size} parameter counts (tied input embedding, untied logits).
T5_1_1 = {'small': (512, 6, 1024, 8, 76_961_152), 'base': (768, 12, 2048, 12, 247_577_856),
          'large': (1024, 16, 2816, 24, 783_150_080), 'xl': (2048, 32, 5120, 24, 2_849_757_184),
          'xxl': (4096, 64, 10240, 24, 11_135_332_352)}


@pytest.mark.parametrize('size', T5_1_1)
def test_t5_1_1_size_files_have_the_published_counts(size):
  """gin/models/t5_1_1_*.gin build T5.1.1 (GEGLU, untied): the count of the published checkpoint,
  equal to the closed form with two FFN input matrices; swapping in a two-matrix FFN keeps it."""
  from t5x_variants.cli import recipe  # pylint: disable=g-import-not-at-top
  d, h, f, n, published = T5_1_1[size]
  recipe.parse_gin([f'gin/models/t5_1_1_{size}.gin'], [])
  config = recipe.build_config()
  assert count(abstract_params(config)) == t5_count(d, h, 64, f, 32128, n, n, n_ffn_in=2) == published
  assert count(abstract_params(dataclasses.replace(config, ffn='relu'))) == published


def test_t5_base_relu_3072_equals_geglu_2048():
  relu = count(abstract_params(TransformerConfig(ffn='relu', d_ff=3072)))
  geglu = count(abstract_params(TransformerConfig(ffn='geglu', d_ff=3072, d_ff_glu=2048)))
  assert relu == geglu == t5_count(768, 12, 64, 3072, 32128, 12, 12)
  assert count(abstract_params(TransformerConfig(ffn='swiglu', d_ff=3072))) == relu  # 2/3 default


@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_only'])
def test_single_stack_counts(arch):
  c = tiny(architecture=arch, num_encoder_layers=3, num_decoder_layers=3)
  d, f, v = c.d_model, c.d_ff, c.vocab_size
  layer = 4 * d * d + 2 * d * f + 2 * d
  expected = v * d + 3 * layer + c.num_heads * 32 + d + d * v
  if arch == 'encoder_only':
    expected += d * d + d  # MLM transform and its norm
  assert count(abstract_params(c)) == expected


def test_layernorm_biases_subln_norms_and_dense_biases():
  base = tiny(architecture='decoder_only', num_decoder_layers=1)
  d, f, hd = base.d_model, base.d_ff, base.num_heads * base.head_dim
  plain = count(abstract_params(base))
  assert count(abstract_params(tiny(architecture='decoder_only', num_decoder_layers=1,
                                    norm='layernorm'))) == plain + 3 * d
  # Sub-LN: one extra norm over the attention output (heads * head_dim) and one over d_ff.
  assert count(abstract_params(tiny(architecture='decoder_only', num_decoder_layers=1,
                                    placement='subln'))) == plain + hd + f
  # Post-LN / DeepNorm: no final stack norm.
  assert count(abstract_params(tiny(architecture='decoder_only', num_decoder_layers=1,
                                    placement='post'))) == plain - d
  # Biases on q, k, v (heads * head_dim each), out (d), wi (f), wo (d); logits stay bias-free.
  assert count(abstract_params(tiny(architecture='decoder_only', num_decoder_layers=1,
                                    use_bias=True))) == plain + 3 * hd + d + f + d


L, K = 12, 8


@pytest.mark.parametrize('variant,synth_params', [
    ('dot_product', lambda d, h: 2 * d * d),                   # W_Q, W_K
    ('dense', lambda d, h: d * d + d // h * L),                 # code: W_q d^2 + d_h l (W_2 shared)
    ('random', lambda d, h: h * L * L),                         # paper: l^2 per head
    ('fixed_random', lambda d, h: h * L * L),                   # stored, never trained
    ('factorized_dense', lambda d, h: d * d + d * (3 + 4)),     # paper: d^2 + d(a + b), a*b = l
    ('factorized_random', lambda d, h: h * 2 * L * K),          # paper: 2 l k per head
    (('random', 'dot_product'), lambda d, h: h * L * L + 2 * d * d + 2),  # R+V, 2 mixture weights
    (('dense', 'random', 'dot_product'), lambda d, h: d // h * L + h * L * L + 2 * d * d + 3),  # one W_q
])
def test_synthesizer_counts_follow_the_paper_table(variant, synth_params):
  c = tiny(architecture='encoder_only', num_encoder_layers=1, self_attention=variant,
           encoder_max_length=L, synthesizer_rank=K)
  params = abstract_params(c)
  d, h = c.d_model, c.num_heads
  # Every variant shares the value and output projections G(X) (2 d^2).
  assert count(params['encoder']['layers']['self_attention']) == synth_params(d, h) + 2 * d * d
  # The relative bias: plain dot-product attention only, unless synthesizer_relative_bias.
  assert ('relpos_bias' in params['encoder']) == (c.attention_components == ('dot_product',))
  with_bias = abstract_params(dataclasses.replace(c, synthesizer_relative_bias=True))
  assert 'relpos_bias' in with_bias['encoder']


@pytest.mark.parametrize('shared,rank,want', [(True, 16, lambda d, h: d * d + d // h * L + h * 2 * L * 16),
                                              (False, 8, lambda d, h: d * d + d * L + h * 2 * L * 8)])
def test_synthesizer_defaults_are_the_code_and_the_paper_reading_a_binding_away(shared, rank, want):
  """Defaults as the authors' Mesh TensorFlow code: the dense W_2 shared by the heads, k = 16;
  synthesizer_shared_projection=False gives the paper's d^2 + d l."""
  kw = {} if shared else dict(synthesizer_shared_projection=False, synthesizer_rank=8)
  c = tiny(architecture='encoder_only', num_encoder_layers=1, self_attention=('dense', 'factorized_random'),
           encoder_max_length=L, **kw)
  assert (c.synthesizer_shared_projection, c.synthesizer_rank) == (shared, rank)
  d, h = c.d_model, c.num_heads
  assert count(abstract_params(c)['encoder']['layers']['self_attention']) == want(d, h) + 2 * d * d + 2


@pytest.mark.parametrize('variant,query_saves', [('dense', 0), ('factorized_dense', 0),
                                                 (('dot_product', 'dense'), 1),
                                                 (('dense', 'factorized_dense', 'dot_product'), 2)])
def test_synthesizer_hidden_query_shares_the_query_and_w1_is_a_binding_away(variant, query_saves):
  """Default 'query' (the authors' code): the dense synthesizers' hidden layer is relu of the
  attention's query, W_q (d x h d_h), created once; 'w1' (the paper): a W_1 of the same shape per
  dense synthesizer. Alone the two readings count the same; with dot product, or two dense
  synthesizers, 'query' has one d h d_h matrix fewer per extra user of the query."""
  dh = 16  # h d_h = 64 != d_model = 32: counts d * h * d_h, not d^2
  c = tiny(architecture='encoder_only', num_encoder_layers=1, self_attention=variant, head_dim=dh,
           encoder_max_length=L, synthesizer_factor=3)
  assert c.synthesizer_hidden == 'query'
  d, h = c.d_model, c.num_heads
  comps = c.attention_components
  w2 = (dh * L if 'dense' in comps else 0) + (h * dh * (3 + 4) if 'factorized_dense' in comps else 0)
  key_and_mix = (d * h * dh + len(comps) if 'dot_product' in comps else 0)
  vo = 2 * d * h * dh
  layer = lambda config: abstract_params(config)['encoder']['layers']['self_attention']
  paper = dataclasses.replace(c, synthesizer_hidden='w1')
  query, w1 = count(layer(c)), count(layer(paper))
  assert query == d * h * dh + w2 + key_and_mix + vo
  assert w1 == (1 + query_saves) * d * h * dh + w2 + key_and_mix + vo
  if variant == 'dense':  # the layer's parameters, by name
    assert set(layer(c)) == {'query', 'value', 'out', 'dense'}
    assert set(layer(paper)) == {'dense_w1', 'value', 'out', 'dense'}


def test_invalid_synthesizer_hidden_names_the_field_and_its_values():
  with pytest.raises(ValueError, match="unknown synthesizer_hidden 'w2'; valid: query, w1"):
    tiny(self_attention='dense', synthesizer_hidden='w2')
