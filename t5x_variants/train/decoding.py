"""Cached autoregressive decoding: greedy, sampling (temperature, top-k, top-p) and beam search.

Every method runs the decoder one token per step through the KV cache. The encoder-decoder starts
from token 0. A decoder-only model reads token 0 and then its prompt (right-padded with 0), as its
training sequences are shifted right behind a 0, so a row with an n-token prompt emits its first
token at step n: the prompts first fill the cache in one pass (T5X's prefill; a prefix LM's
(``TransformerConfig.visible_prefix``) fully visible, as in training), and the steps start at the
shortest prompt's last token. Rows advance in lockstep (the cache has one position counter): a
longer prompt is fed on, forced, while its prefilled keys and values stay as they are, and each
row ignores the steps outside its own window.
``tokens`` are the generated tokens, EOS included and 0 after it; ``scores`` sum the log-softmax
of the raw logits over them (for beam search, length-normalised as below). With ``num_decodes``
= k each input gets its k best beams, or k independent samples, as k consecutive rows, best first
(T5X's ``num_decodes``).
"""
import jax
import jax.numpy as jnp

METHODS = ('greedy', 'sample', 'beam')
_KV_CACHES = ('cached_key', 'cached_value')


def max_decodes(method: str, num_beams: int) -> float:
  """The most decodes per input ``method`` gives (``num_decodes``): any number of samples, a beam
  search's beams, one greedy decode."""
  return float('inf') if method == 'sample' else num_beams if method == 'beam' else 1


def filter_logits(logits, top_k: int = 0, top_p=1.0):
  """-inf outside the k largest logits (k = 0: off) and outside the nucleus: the smallest set of
  most probable tokens with probability mass >= top_p (Holtzman et al. 2020); the top one stays."""
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  ranked = -jnp.sort(-logits, axis=-1)
  probs = jax.nn.softmax(ranked, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  cutoff = jnp.min(jnp.where(mass_before < top_p, ranked, jnp.inf), axis=-1, keepdims=True)
  return jnp.where((logits < cutoff) & (top_p < 1), -jnp.inf, logits)


def _sampler(method, rng, temperature, top_k, top_p):
  """(log_probs (batch, vocab), step) -> tokens; temperature 0 is greedy."""
  if method == 'greedy':
    return lambda log_probs, i: jnp.argmax(log_probs, axis=-1)
  t = jnp.asarray(temperature, jnp.float32)

  def choose(log_probs, i):
    logits = filter_logits(log_probs / jnp.where(t > 0, t, 1.0), top_k, top_p)
    sampled = jax.random.categorical(jax.random.fold_in(rng, i), logits)
    return jnp.where(t > 0, sampled, jnp.argmax(log_probs, axis=-1))
  return choose


def _next_input(prompt, lengths, i, generated):
  """Token fed at step i + 1: the prompt's while it lasts, else the one just generated."""
  forced = prompt[:, jnp.minimum(i + 1, prompt.shape[1] - 1)]
  return jnp.where(i + 1 < lengths, forced, generated)


def _generate(step, cache, prompt, lengths, start, max_len, choose, eos_id):
  """Greedy or sampled decoding from step ``start``; stops once every row has emitted EOS or
  max_len tokens."""
  batch = prompt.shape[0]

  def body(state):
    i, token, cache, out, score, done = state
    log_probs, cache = step(token, cache)
    new = choose(log_probs, i)
    j = i - (lengths - 1)  # index of the token each row generates now; < 0 inside the prompt
    live = (j >= 0) & ~done
    out = jnp.where(live[:, None] & (jnp.arange(max_len) == j[:, None]), new[:, None], out)
    score += jnp.where(live, jnp.take_along_axis(log_probs, new[:, None], axis=-1)[:, 0], 0.0)
    done |= live & ((new == eos_id) | (j == max_len - 1))
    return i + 1, _next_input(prompt, lengths, i, new), cache, out, score, done

  init = (start, prompt[:, start], cache, jnp.zeros((batch, max_len), jnp.int32),
          jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), bool))
  _, _, _, out, score, _ = jax.lax.while_loop(lambda s: ~jnp.all(s[-1]), body, init)
  return out, score


def _gather_beams(cache, index, scan_layers: bool):
  """Cache rows ``index`` (batch * beams,) of the KV caches, (batch, length, heads, head_dim)
  after a leading layers axis when scanned; the position counters have no batch axis."""
  axis = 1 if scan_layers else 0
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.take(x, index, axis=axis) if path[-1].key in _KV_CACHES else x, cache)


def _beam_search(step, cache, prompt, lengths, start, max_len, beams, alpha, eos_id, scan_layers,
                 num_decodes: int = 1):
  """Beam search as in GNMT / T5X (Wu et al. 2016): ``beams`` alive and ``beams`` finished
  hypotheses per row; a finished one scores log p / lp(length), lp(n) = ((5 + n) / 6) ** alpha,
  n counting EOS (the generated tokens: a decoder-only prompt is not counted). Of each step's
  2 * beams best candidates, the best ``beams`` not ending in EOS stay alive, and every one
  ending in EOS is offered to the finished set (as T5X; fairseq finishes only those within the
  top ``beams``). Rows with no finished hypothesis at the end return their best alive one and its
  log p, unpenalised (as T5X); with ``num_decodes`` = k their k best, finished (or, in a row with
  none finished, alive), as k rows each: a finished slot left empty scores -inf."""
  batch = prompt.shape[0]
  penalty = lambda n: ((5.0 + n) / 6.0)**alpha
  take = jax.vmap(lambda x, i: x[i])  # per row: x (hyps, ...)[i (k,)]
  flat_prompt, flat_lengths = jnp.repeat(prompt, beams, 0), jnp.repeat(lengths, beams)
  first = (lengths - 1)[:, None]  # each row's step of its first generated token

  def body(state):
    i, token, cache, seqs, logp, fin_seqs, fin = state
    log_probs, cache = step(token, cache)
    vocab = log_probs.shape[-1]
    j = i - first
    scores = (logp[..., None] + log_probs.reshape(batch, beams, vocab)).reshape(batch, -1)
    cand, flat = jax.lax.top_k(scores, 2 * beams)  # >= beams of them do not end in EOS
    parent, new = flat // vocab, flat % vocab
    cand_seqs = jnp.where(jnp.arange(max_len) == j[..., None], new[..., None], take(seqs, parent))
    eos = new == eos_id
    new_logp, keep = jax.lax.top_k(jnp.where(eos, -jnp.inf, cand), beams)
    new_fin, fin_keep = jax.lax.top_k(
        jnp.concatenate([fin, jnp.where(eos, cand / penalty(j + 1), -jnp.inf)], 1), beams)
    frozen = (j < 0) | (j >= max_len)  # inside the prompt or past max_len: keep the state
    hold = lambda old, update: jnp.where(frozen.reshape(-1, *[1] * (old.ndim - 1)), old, update)
    parent = hold(jnp.arange(beams)[None], take(parent, keep))
    cache = _gather_beams(cache, (jnp.arange(batch)[:, None] * beams + parent).reshape(-1),
                          scan_layers)
    token = _next_input(flat_prompt, flat_lengths, i, take(new, keep).reshape(-1))
    return (i + 1, token, cache, hold(seqs, take(cand_seqs, keep)), hold(logp, new_logp),
            hold(fin_seqs, take(jnp.concatenate([fin_seqs, cand_seqs], 1), fin_keep)),
            hold(fin, new_fin))

  def running(state):
    """Stop when no alive hypothesis can beat or tie a row's worst finished one (as T5X): log p
    only falls, so log p / max_n lp(n) bounds its score."""
    i, logp, fin = state[0], state[4], state[6]
    bound = jnp.max(logp, -1) / jnp.maximum(penalty(1), penalty(max_len))
    return ~jnp.all((i - first[:, 0] >= max_len) | (jnp.min(fin, -1) > bound))

  seqs = jnp.zeros((batch, beams, max_len), jnp.int32)
  logp = jnp.tile(jnp.where(jnp.arange(beams) == 0, 0.0, -jnp.inf), (batch, 1))
  init = (start, flat_prompt[:, start], cache, seqs, logp, seqs, jnp.full((batch, beams), -jnp.inf))
  _, _, _, seqs, logp, fin_seqs, fin = jax.lax.while_loop(running, body, init)
  has_fin = fin[:, :1] > -jnp.inf  # top_k keeps both sets sorted, best first
  k = num_decodes
  tokens = jnp.where(has_fin[..., None], fin_seqs[:, :k], seqs[:, :k])
  return tokens.reshape(batch * k, max_len), jnp.where(has_fin, fin[:, :k], logp[:, :k]).reshape(-1)


def decode(model, config, params, *, encoder_input_tokens=None, prompt_tokens=None,
           max_decode_length: int, method: str = 'greedy', rng=None, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, num_beams: int = 4, length_penalty: float = 0.6,
           eos_id: int = 1, num_decodes: int = 1):
  """(tokens (batch * num_decodes, max_decode_length) int32, scores (batch * num_decodes,)
  float32); see the module doc.

  Encoder-decoder models take ``encoder_input_tokens``, decoder-only ones ``prompt_tokens``
  (batch, P), right-padded with 0 (token 0 goes before them); an all-0 row starts from token 0
  alone. Jit with ``method``,
  ``max_decode_length``, ``top_k``, ``num_beams`` and ``num_decodes`` static.
  """
  if method not in METHODS:
    raise ValueError(f'unknown decoding method {method!r}; valid: {", ".join(METHODS)}')
  if method == 'sample' and rng is None:
    raise ValueError("method='sample' needs rng")
  if not 1 <= num_decodes <= max_decodes(method, num_beams):
    raise ValueError(f'num_decodes={num_decodes} needs sampling, or beam search of at least as '
                     f'many beams (method {method!r}, num_beams {num_beams})')
  if method == 'sample' and num_decodes > 1:  # k independent samples: each input k times
    tokens, scores = decode(model, config, params, max_decode_length=max_decode_length,
                            method=method, rng=rng, temperature=temperature, top_k=top_k,
                            top_p=top_p, eos_id=eos_id, **{
                                k: jnp.repeat(v, num_decodes, 0) for k, v in
                                (('encoder_input_tokens', encoder_input_tokens),
                                 ('prompt_tokens', prompt_tokens)) if v is not None})
    order = jnp.argsort(-scores.reshape(-1, num_decodes), axis=1)  # best first
    rows = (jnp.arange(len(order))[:, None] * num_decodes + order).reshape(-1)
    return tokens[rows], scores[rows]
  beams = num_beams if method == 'beam' else 1
  variables = {'params': params}
  if config.architecture == 'encoder_decoder':
    enc = jnp.repeat(encoder_input_tokens, beams, 0)
    # once per input: its beams' queries share its cross-attention keys and values (Attention)
    encoded = model.apply(variables, encoder_input_tokens, method=model.encode)
    prompt = jnp.zeros((encoder_input_tokens.shape[0], 1), jnp.int32)
    run = lambda v, tok, **kw: model.apply(v, encoded, enc, tok, method=model.decode, **kw)
  elif config.architecture == 'decoder_only':
    prompt = jnp.pad(jnp.asarray(prompt_tokens, jnp.int32), ((0, 0), (1, 0)))  # 0 first, as in training
    run = lambda v, tok, **kw: model.apply(v, tok, **kw)
  else:
    raise ValueError(f'decoding needs a decoder; architecture is {config.architecture!r}')
  batch, prompt_len = prompt.shape
  lengths = jnp.sum(prompt != 0, axis=1) + 1  # with the leading 0
  # The last generated token is never fed, so prompt_len + max_decode_length - 1 positions
  # suffice. Creating the cache runs the model on dummy inputs whose outputs are unused
  # (dropped by XLA under jit).
  dummy = jnp.zeros((batch * beams, prompt_len + max_decode_length - 1), jnp.int32)
  cache = run(variables, dummy, decode=True, mutable=['cache'])[1]['cache']
  start = 0
  if config.architecture == 'decoder_only':  # the prompts fill the cache in one pass
    rows = jnp.repeat(lengths, beams)
    visible = None
    if config.visible_prefix:  # the prompt fully visible, as in training
      visible = (jnp.arange(prompt_len)[None] < rows[:, None]).astype(jnp.int32)
    cache = run({**variables, 'cache': cache}, jnp.repeat(prompt, beams, 0), decode=True,
                decoder_causal_attention=visible, prefill_lengths=rows, mutable=['cache'])[1]['cache']
    start = jnp.min(lengths) - 1

  def step(token, cache):
    logits, new = run({**variables, 'cache': cache}, token[:, None], decode=True, mutable=['cache'])
    return jax.nn.log_softmax(logits[:, 0], axis=-1), new['cache']

  if method == 'beam':
    return _beam_search(step, cache, prompt, lengths, start, max_decode_length, beams,
                        length_penalty, eos_id, config.scan_layers, num_decodes)
  return _generate(step, cache, prompt, lengths, start, max_decode_length,
                   _sampler(method, rng, temperature, top_k, top_p), eos_id)
