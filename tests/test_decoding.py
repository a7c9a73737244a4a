"""Cached decoding against full forward passes (no cache): greedy, sampling, beam search
(exhaustive on a tiny problem), EOS padding, scanned vs unrolled caches, and jit."""
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import init_params, jit_apply, tiny, tokens
from test_models import _unstack_layers
from t5x_variants.models import build_model
from t5x_variants.train import decoding
from t5x_variants.train.decoding import decode, filter_logits

# 'prefix_lm': the decoder-only model with its prompt fully visible (filled into the cache at once).
ARCHS = ['encoder_decoder', 'decoder_only', 'prefix_lm']
EOS, M = 1, 8
# Right-padded prompts of lengths 3, 1, 4 and 0, each fed after token 0; ids valid for vocab 5.
PROMPT = np.asarray([[2, 3, 4, 0], [4, 0, 0, 0], [3, 2, 4, 4], [0, 0, 0, 0]], np.int32)
STATIC = ('max_decode_length', 'method', 'top_k', 'num_beams', 'eos_id', 'num_decodes')
run = jax.jit(decode, static_argnums=(0, 1), static_argnames=STATIC)


class Setup:
  """A random-init tiny model whose EOS logit x.w_eos is scaled up, so EOS often wins: rows end
  at different steps."""

  def __init__(self, arch, scan_layers=True, vocab=50):
    self.prefix_lm = arch == 'prefix_lm'
    shared = arch == 'encoder_decoder_shared'  # T5's shared-parameter encoder-decoder
    self.config = tiny(architecture={'prefix_lm': 'decoder_only', 'encoder_decoder_shared':
                                     'encoder_decoder'}.get(arch, arch), scan_layers=scan_layers,
                       vocab_size=vocab, prefix_lm=self.prefix_lm, shared_encoder_decoder=shared)
    if self.config.architecture == 'encoder_decoder':
      enc = tokens(4, 6, vocab=vocab, seed=1).at[1, 4:].set(0)
      self.inputs = dict(encoder_input_tokens=enc)
      self.model, params = init_params(self.config, enc, tokens(4, 4, vocab=vocab))
    else:
      self.inputs = dict(prompt_tokens=jnp.asarray(PROMPT))
      self.model, params = init_params(self.config, tokens(4, 4, vocab=vocab))
    kernel = params['logits_dense']['kernel']
    self.params = {**params, 'logits_dense': {'kernel': kernel.at[:, EOS].multiply(3.0)}}
    self.forward = jit_apply(self.model)

  def decode(self, **kw):
    tokens_, scores = run(self.model, self.config, self.params, **self.inputs, **kw)
    return np.asarray(tokens_), np.asarray(scores)

  def teacher_forced(self, out, repeat=1):
    """Log-probs (rows * repeat, length, vocab) at each position of ``out`` from one full forward
    pass on the inputs (each row repeated) followed by ``out``."""
    out = np.asarray(out)
    length = out.shape[1]
    if 'encoder_input_tokens' in self.inputs:
      enc = np.repeat(self.inputs['encoder_input_tokens'], repeat, 0)
      logits = self.forward({'params': self.params}, enc, np.pad(out[:, :-1], ((0, 0), (1, 0))))
      return np.asarray(jax.nn.log_softmax(logits))
    prompt = np.pad(np.repeat(PROMPT, repeat, 0), ((0, 0), (1, 0)))  # fed after token 0
    n = (prompt != 0).sum(1) + 1
    seq = np.zeros((len(out), prompt.shape[1] + length - 1), np.int32)
    for b in range(len(out)):
      seq[b, :n[b]], seq[b, n[b]:n[b] + length - 1] = prompt[b, :n[b]], out[b, :-1]
    # A prefix LM's prompt (token 0 and the prompt's tokens) is fully visible, as in training.
    visible = np.arange(seq.shape[1]) < n[:, None] if self.prefix_lm else None
    logits = np.asarray(self.forward({'params': self.params}, seq, None, None, visible))
    return np.asarray(jax.nn.log_softmax(np.take_along_axis(
        logits, (n[:, None] - 1 + np.arange(length))[..., None], 1)))


@functools.lru_cache(maxsize=None)
def setup(arch, scan_layers=True, vocab=50):
  return Setup(arch, scan_layers, vocab)


def upto_eos(out):
  """True at the tokens before and at the first EOS of each row."""
  return np.cumsum(out == EOS, 1) - (out == EOS) == 0


def token_log_probs(log_probs, out):
  return np.take_along_axis(log_probs, out[..., None], -1)[..., 0]


@pytest.mark.parametrize('arch', ARCHS)
def test_greedy_is_the_argmax_of_a_full_forward_pass_on_its_own_output(arch):
  s = setup(arch)
  out, scores = s.decode(max_decode_length=M)
  log_probs, valid = s.teacher_forced(out), upto_eos(out)
  assert 0 < (~valid).sum() and valid.all(1).any()  # some rows stop early, some run to the end
  np.testing.assert_array_equal(out, np.where(valid, log_probs.argmax(-1), 0))
  np.testing.assert_allclose(scores, (token_log_probs(log_probs, out) * valid).sum(1), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize('scan_layers', [True, False])
def test_cross_attention_keys_and_values_are_projected_once_when_the_cache_is_made(scan_layers):
  """A decode step reads them from the cache (it projected the encoder's output again at every
  step: for T5-base's 512 inputs, ~1.2 GFLOP per layer and row per step, ~100x the step's other
  work): a step given another encoder output computes the same logits."""
  s = setup('encoder_decoder', scan_layers)
  enc = s.inputs['encoder_input_tokens']
  encoded = s.model.apply({'params': s.params}, enc, method=s.model.encode)
  step = lambda cache, h, token: s.model.apply({'params': s.params, 'cache': cache}, h, enc, token,
                                               method=s.model.decode, decode=True, mutable=['cache'])
  made = s.model.apply({'params': s.params}, encoded, enc, jnp.zeros((4, M), jnp.int32),
                       method=s.model.decode, decode=True, mutable=['cache'])[1]['cache']
  names = {k[-1].key for k, _ in jax.tree_util.tree_leaves_with_path(made)}
  assert {'encoded_key', 'encoded_value', 'cached_key', 'cached_value'} <= names
  first = jnp.ones((4, 1), jnp.int32)
  logits, _ = step(made, encoded, first)
  other, _ = step(made, jnp.zeros_like(encoded), first)
  np.testing.assert_array_equal(np.asarray(other), np.asarray(logits))
  # A cache made by init (other parameters) keeps none: its steps project them, and it goes
  # through a loop unchanged in structure (an empty placeholder filled at the first step did not).
  by_init = s.model.init(jax.random.PRNGKey(1), enc, jnp.zeros((4, M), jnp.int32), decode=True)['cache']
  assert not {'encoded_key', 'encoded_value'} & {
      k[-1].key for k, _ in jax.tree_util.tree_leaves_with_path(by_init)}
  scanned = jax.lax.scan(lambda c, tok: (step(c, encoded, tok)[1]['cache'], None), by_init,
                         jnp.ones((2, 4, 1), jnp.int32))[0]
  assert jax.tree_util.tree_structure(scanned) == jax.tree_util.tree_structure(by_init)
  np.testing.assert_allclose(np.asarray(step(by_init, encoded, first)[0]), np.asarray(logits),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('scan_layers', [True, False])
def test_an_inputs_beams_share_one_row_of_cross_attention_keys_and_values(scan_layers, monkeypatch):
  """Kept once per input (batch B), not per beam row (B * beams: 2.4 GB at T5-base, batch 32,
  4 beams): a step's logits equal those of a cache made from the encoder output repeated per
  beam."""
  s, beams = setup('encoder_decoder', scan_layers), 3
  enc = s.inputs['encoder_input_tokens']
  encoded = s.model.apply({'params': s.params}, enc, method=s.model.encode)
  rows, tokens_ = jnp.repeat(enc, beams, 0), jnp.zeros((4 * beams, M), jnp.int32)
  make = lambda h: s.model.apply({'params': s.params}, h, rows, tokens_, method=s.model.decode,
                                 decode=True, mutable=['cache'])[1]['cache']
  shared, repeated = make(encoded), make(jnp.repeat(encoded, beams, 0))
  batch_axis = 1 if scan_layers else 0
  for path, x in jax.tree_util.tree_leaves_with_path(shared):
    if path[-1].key.startswith('encoded_'):
      assert x.shape[batch_axis] == 4
  step = lambda cache, h, token: s.model.apply(
      {'params': s.params, 'cache': cache}, h, rows, token, method=s.model.decode, decode=True,
      mutable=['cache'])[0]
  token = jnp.asarray(np.random.RandomState(0).randint(2, 50, (4 * beams, 1)), jnp.int32)
  np.testing.assert_allclose(np.asarray(step(shared, encoded, token)),
                             np.asarray(step(repeated, jnp.repeat(encoded, beams, 0), token)),
                             rtol=1e-6, atol=1e-6)
  # and the cache decode() makes for its beam search holds them so
  seen, search = [], decoding._beam_search  # pylint: disable=protected-access

  def beam_search(step_fn, cache, *args):
    seen.extend(x.shape[batch_axis] for path, x in jax.tree_util.tree_leaves_with_path(cache)
                if path[-1].key.startswith('encoded_'))
    return search(step_fn, cache, *args)
  monkeypatch.setattr(decoding, '_beam_search', beam_search)
  decoding.decode(s.model, s.config, s.params, encoder_input_tokens=enc, max_decode_length=3,
                  method='beam', num_beams=beams)
  assert seen and set(seen) == {4}


@pytest.mark.parametrize('scan_layers', [True, False])
def test_a_shared_encoder_decoder_decodes_as_its_full_forward_pass(scan_layers):
  """Greedy decoding and beam search of T5's shared-parameter encoder-decoder (the encoder run on
  the decoder's stack, with no cache) score as one teacher-forced pass."""
  s = setup('encoder_decoder_shared', scan_layers)
  for method in ('greedy', 'beam'):
    out, scores = s.decode(max_decode_length=M, method=method, num_beams=2, length_penalty=0.0)
    log_probs, valid = s.teacher_forced(out), upto_eos(out)
    if method == 'greedy':
      np.testing.assert_array_equal(out, np.where(valid, log_probs.argmax(-1), 0))
    np.testing.assert_allclose(scores, (token_log_probs(log_probs, out) * valid).sum(1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('arch', ARCHS)
def test_beam_search_of_width_one_offers_every_eos_candidate_to_the_finished(arch):
  """As T5X: a step ranks 2 * beams candidates, the alive beam is the best not ending in EOS (at
  width 1: greedy's path), and every candidate ending in EOS is offered to the finished set, the
  second-ranked too. With length_penalty 0 the result is the best of greedy's own ending and the
  exits to a second-ranked EOS along greedy's path (greedy where neither exists)."""
  s = setup(arch)
  greedy, greedy_scores = s.decode(max_decode_length=M)
  beam, scores = s.decode(max_decode_length=M, method='beam', num_beams=1, length_penalty=0.0)
  log_probs = s.teacher_forced(greedy)
  token = token_log_probs(log_probs, greedy)
  before = np.cumsum(token, 1) - token  # log p of greedy's first t tokens
  alive = upto_eos(greedy) & (greedy != EOS)
  exits = np.where(alive & (np.argsort(-log_probs, -1)[..., 1] == EOS), before + log_probs[..., EOS],
                   -np.inf)
  ended = (greedy == EOS).any(1)
  best_exit = exits.argmax(1)
  take_exit = exits.max(1) > np.where(ended, greedy_scores, -np.inf)
  want = greedy.copy()
  for row in np.flatnonzero(take_exit):
    want[row, best_exit[row]:] = 0
    want[row, best_exit[row]] = EOS
  np.testing.assert_array_equal(beam, want)
  np.testing.assert_allclose(scores, np.where(take_exit, exits.max(1), greedy_scores), rtol=1e-5)
  assert take_exit.any()  # the case the rule decides


def test_a_beam_search_that_finishes_nothing_returns_its_best_alive_log_p_as_t5x():
  """No hypothesis ends (an EOS id the model never emits): width 1 follows greedy's path, and the
  score is its log p, not divided by a length penalty (as T5X returns an unfinished row)."""
  s = setup('decoder_only')
  never = s.config.vocab_size + 1
  greedy, greedy_scores = s.decode(max_decode_length=M, eos_id=never)
  beam, scores = s.decode(max_decode_length=M, method='beam', num_beams=1, length_penalty=0.6,
                          eos_id=never)
  np.testing.assert_array_equal(beam, greedy)
  np.testing.assert_allclose(scores, greedy_scores, rtol=1e-5)


@pytest.mark.parametrize('arch', ARCHS)
def test_beam_search_is_exact_on_a_tiny_problem(arch):
  """Vocab 5, 3 steps, 80 beams: a step has at most 5 * 4^2 = 80 candidates (extensions of the
  alive non-EOS prefixes), all ranked within the top 80, so every EOS-ended sequence of at most 3
  tokens can finish and the best beam is the best of them."""
  vocab, length, beams = 5, 3, 80
  s = setup(arch, vocab=vocab)
  seqs = np.asarray(list(itertools.product(range(vocab), repeat=length)), np.int32)
  rows, tiled = len(PROMPT), np.tile(seqs, (len(PROMPT), 1))
  cum = np.cumsum(token_log_probs(s.teacher_forced(tiled, repeat=len(seqs)), tiled), 1)
  cum = cum.reshape(rows, len(seqs), length)
  has_eos = (seqs == EOS).any(1)
  ends = np.argmax(seqs == EOS, 1)  # first EOS
  truncated = np.where(np.arange(length) <= ends[:, None], seqs, 0)
  greedy, _ = s.decode(max_decode_length=length)
  differs = 0
  for alpha in (0.0, 0.6, 2.0):
    out, scores = s.decode(max_decode_length=length, method='beam', num_beams=beams,
                           length_penalty=alpha)
    brute = np.where(has_eos, cum[:, np.arange(len(seqs)), ends] / ((6.0 + ends) / 6.0)**alpha,
                     -np.inf)
    np.testing.assert_array_equal(out, truncated[brute.argmax(1)])
    np.testing.assert_allclose(scores, brute.max(1), rtol=1e-5)
    differs += (out != greedy).any(1).sum()
  assert differs


@pytest.mark.parametrize('arch', ARCHS)
def test_num_decodes_beams_are_the_best_finished_sequences_best_first(arch):
  """The exact problem above with num_decodes = 5: each input's 5 rows are the 5 best EOS-ended
  sequences by the brute force's penalised score, in order; the first is num_decodes=1's."""
  vocab, length, beams, k = 5, 3, 80, 5
  s = setup(arch, vocab=vocab)
  seqs = np.asarray(list(itertools.product(range(vocab), repeat=length)), np.int32)
  rows, tiled = len(PROMPT), np.tile(seqs, (len(PROMPT), 1))
  cum = np.cumsum(token_log_probs(s.teacher_forced(tiled, repeat=len(seqs)), tiled), 1)
  cum = cum.reshape(rows, len(seqs), length)
  ends = np.argmax(seqs == EOS, 1)
  truncated = np.where(np.arange(length) <= ends[:, None], seqs, 0)
  brute = np.where((seqs == EOS).any(1), cum[:, np.arange(len(seqs)), ends] / ((6.0 + ends) / 6.0)**0.6,
                   -np.inf)
  unique = np.unique(truncated, axis=0, return_index=True)[1]  # one of each truncated sequence
  out, scores = s.decode(max_decode_length=length, method='beam', num_beams=beams, num_decodes=k)
  assert out.shape == (rows * k, length) and scores.shape == (rows * k,)
  for r in range(rows):
    best = unique[np.argsort(-brute[r, unique], kind='stable')[:k]]
    np.testing.assert_allclose(scores[r * k:(r + 1) * k], brute[r, best], rtol=1e-5)
    np.testing.assert_array_equal(out[r * k:(r + 1) * k], truncated[best])
  one, _ = s.decode(max_decode_length=length, method='beam', num_beams=beams)
  np.testing.assert_array_equal(out[::k], one)


def test_num_decodes_samples_are_independent_and_sorted_by_their_log_probability():
  """k samples per input: k consecutive rows, best first, each scored by its own log p (a full
  forward pass on the repeated inputs), not all the same sample; a bad count is one error."""
  s, k = setup('decoder_only'), 4
  out, scores = s.decode(max_decode_length=M, method='sample', rng=jax.random.PRNGKey(0),
                         num_decodes=k)
  assert out.shape == (len(PROMPT) * k, M)
  lp = (token_log_probs(s.teacher_forced(out, repeat=k), out) * upto_eos(out)).sum(1)
  np.testing.assert_allclose(scores, lp, rtol=1e-4, atol=1e-4)
  assert (np.diff(scores.reshape(-1, k), axis=1) <= 1e-6).all()
  assert any(len({tuple(r) for r in out[i * k:(i + 1) * k]}) > 1 for i in range(len(PROMPT)))
  for kw in (dict(method='greedy'), dict(method='beam', num_beams=2)):
    with pytest.raises(ValueError, match='num_decodes=4 needs sampling, or beam search of at least'):
      s.decode(max_decode_length=M, num_decodes=k, **kw)


# The sampler is the same for both architectures: the sampling tests use the decoder-only one.
def test_sampling_top_k_one_or_temperature_zero_is_greedy():
  s = setup('decoder_only')
  greedy, scores = s.decode(max_decode_length=M)
  rng = jax.random.PRNGKey(3)
  for kw in (dict(top_k=1), dict(temperature=0.0)):
    out, sample_scores = s.decode(max_decode_length=M, method='sample', rng=rng, **kw)
    np.testing.assert_array_equal(out, greedy)
    np.testing.assert_allclose(sample_scores, scores, rtol=1e-5)


def test_top_k_samples_are_among_the_k_largest_logits():
  s = setup('decoder_only')
  for seed in range(3):
    out, _ = s.decode(max_decode_length=M, method='sample', rng=jax.random.PRNGKey(seed), top_k=3)
    top3 = np.argsort(s.teacher_forced(out), -1)[..., -3:]
    valid = upto_eos(out)
    assert ((top3 == out[..., None]).any(-1) | ~valid).all()
    assert (out != top3[..., -1])[valid].any()  # not merely greedy


def test_same_rng_same_sample_and_different_rng_different_sample():
  s = setup('decoder_only')
  sample = lambda seed, t=1.0: s.decode(max_decode_length=M, method='sample',
                                        rng=jax.random.PRNGKey(seed), temperature=t)
  a, b, c = sample(0), sample(0), sample(1)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
  assert (a[0] != c[0]).any()
  # Near-uniform at a high temperature: one noise draw reused at every step would repeat a token.
  hot, _ = sample(0, t=100.0)
  assert all(len(set(row)) > 1 for row in hot[:, :3].tolist())


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
  logits = jnp.log(jnp.asarray([[0.15, 0.5, 0.05, 0.3]]))
  keep = lambda **kw: np.isfinite(np.asarray(filter_logits(logits, **kw)))[0].tolist()
  assert keep(top_p=0.4) == [False, True, False, False]
  assert keep(top_p=0.75) == [False, True, False, True]
  assert keep(top_p=0.85) == [True, True, False, True]
  assert keep(top_p=0.01) == [False, True, False, False]  # the top token always stays
  assert keep(top_p=1.0) == [True] * 4
  assert keep(top_k=2) == [False, True, False, True]
  assert keep(top_k=3, top_p=0.75) == [False, True, False, True]
  np.testing.assert_array_equal(filter_logits(logits, top_k=2, top_p=0.9)[0, 1], logits[0, 1])


@pytest.mark.parametrize('arch', ARCHS)
def test_every_method_pads_with_zeros_after_eos(arch):
  s = setup(arch)
  for kw in (dict(), dict(method='sample', rng=jax.random.PRNGKey(0)),
             dict(method='beam', num_beams=3)):
    out, _ = s.decode(max_decode_length=M, **kw)
    after = ~upto_eos(out)
    assert after.any(), kw
    assert (out[after] == 0).all(), kw


@pytest.mark.parametrize('arch', ARCHS)
def test_scanned_and_unrolled_layers_decode_the_same(arch):
  """Beam search reorders the KV caches along their batch axis: 1 under a scanned ``layers``
  axis, 0 unrolled."""
  scanned, unrolled = setup(arch), setup(arch, scan_layers=False)
  params = _unstack_layers(scanned.params, 2)
  a, a_scores = scanned.decode(max_decode_length=M, method='beam', num_beams=3)
  b, b_scores = run(unrolled.model, unrolled.config, params, **unrolled.inputs,
                    max_decode_length=M, method='beam', num_beams=3)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(a_scores, b_scores, rtol=1e-5)


@pytest.mark.parametrize('arch', ['decoder_only', 'prefix_lm'])
@pytest.mark.parametrize('method', ['greedy', 'beam'])
def test_the_steps_start_at_the_shortest_prompts_last_token(arch, method):
  """The prompts fill the cache in one pass and the steps start at the shortest prompt's last
  token: rows without the empty prompt (so starting past step 0) decode as they do beside it."""
  s = setup(arch)
  kw = dict(max_decode_length=M, method=method, num_beams=3)
  want, want_scores = s.decode(**kw)
  got, scores = run(s.model, s.config, s.params, prompt_tokens=jnp.asarray(PROMPT[:3]), **kw)
  np.testing.assert_array_equal(got, want[:3])
  np.testing.assert_allclose(scores, want_scores[:3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('method', ['greedy', 'beam'])
def test_a_language_model_of_inputs_then_targets_decodes_as_the_causal_lm(method):
  """T5's 'language model' (the prefix LM's rows, read causally) fills its cache causally: it
  decodes as the plain causal LM with the same parameters, where the prefix LM does not."""
  s = setup('decoder_only')
  kw = dict(max_decode_length=M, method=method, num_beams=3)
  want, want_scores = s.decode(**kw)
  for bidirectional in (False, True):
    c = dataclasses.replace(s.config, prefix_lm=True, inputs_bidirectional_attention=bidirectional)
    got, scores = run(build_model(c), c, s.params, **s.inputs, **kw)
    if bidirectional:  # the prompt seen whole: other log-probabilities
      assert not np.allclose(scores, want_scores, rtol=1e-3)
    else:
      np.testing.assert_array_equal(got, want)
      np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('prefix_lm', [False, True])
@pytest.mark.parametrize('placement, position', [('pre', 'relative'), ('subln', 'learned')])
def test_prefilled_synthesizer_mixtures_and_absolute_positions_decode_as_a_full_forward(
    prefix_lm, placement, position):
  """The prefill with position-addressed synthesizers (random, dense) mixed with dot-product, and
  with learned absolute positions: greedy decoding is the argmax of one full forward pass."""
  prompt = np.asarray([[5, 6, 7], [8, 9, 0]], np.int32)
  c = tiny(architecture='decoder_only', prefix_lm=prefix_lm, vocab_size=50, decoder_max_length=16,
           self_attention=('random', 'dense', 'dot_product'), placement=placement,
           position_embedding=position)
  model, params = init_params(c, tokens(2, 16, vocab=50))
  out, _ = run(model, c, params, prompt_tokens=jnp.asarray(prompt), max_decode_length=6)
  out = np.asarray(out)
  n = (prompt != 0).sum(1) + 1  # with the leading 0
  seq = np.zeros((2, 16), np.int32)
  for b in range(2):
    seq[b, 1:n[b]], seq[b, n[b]:n[b] + 5] = prompt[b, :n[b] - 1], out[b, :-1]
  visible = (np.arange(16) < n[:, None]).astype(np.int32) if prefix_lm else None
  logits = np.asarray(jit_apply(model)({'params': params}, seq, None, None, visible))
  want = np.take_along_axis(logits, (n[:, None] - 1 + np.arange(6))[..., None], 1).argmax(-1)
  valid = upto_eos(out)
  np.testing.assert_array_equal(out, np.where(valid, want, 0))


def test_jitted_decoding_equals_eager_decoding():
  """``run`` (used throughout) jits decode with the sizes and method static; the rest traced."""
  s = setup('decoder_only')
  out, scores = decode(s.model, s.config, s.params, **s.inputs, max_decode_length=M,
                       method='beam', num_beams=3)
  want, want_scores = s.decode(max_decode_length=M, method='beam', num_beams=3)
  np.testing.assert_array_equal(out, want)
  np.testing.assert_allclose(scores, want_scores, rtol=1e-5)


def test_bad_arguments_raise():
  s = setup('decoder_only')
  with pytest.raises(ValueError, match='valid: greedy, sample, beam'):
    decode(s.model, s.config, s.params, **s.inputs, max_decode_length=M, method='topk')
  with pytest.raises(ValueError, match='needs rng'):
    decode(s.model, s.config, s.params, **s.inputs, max_decode_length=M, method='sample')
  with pytest.raises(ValueError, match='needs a decoder'):
    decode(s.model, tiny(architecture='encoder_only'), s.params, max_decode_length=M)
