"""A checkpoint's parameters on a mesh: cached decoding of token batches, teacher-forced scoring.

Shared by ``t5xv-infer`` and ``t5xv-eval`` (inference metrics). Every process passes the same
full batch; each feeds the rows of its own devices and all get every decoded row back.

A decoder-only model on a language-modelling task (examples with 'targets' only) is prompted
with the first ``prompt_length`` target tokens and continues them; its reference continuation (the
rest of the targets) is scored as log p(continuation | prompt).
"""
import dataclasses
import re
from typing import Iterator, List, Optional

import gin
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from t5x_variants.features import EOS_ID, PAD_ID
from t5x_variants.models import build_model, init_inputs, losses, summary
from t5x_variants.models.config import TransformerConfig
from t5x_variants.train import (checkpoints, decoding, evaluation, multihost, partitioning,
                                pretrained, train_step)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """How to decode: 'greedy', 'sample' (temperature, top_k, top_p) or 'beam' (num_beams,
  length_penalty alpha of ((5 + length) / 6) ** alpha); ``num_decodes`` samples, or best beams,
  per input (metrics judge the best one)."""
  method: str = 'greedy'
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  num_beams: int = 4
  length_penalty: float = 0.6
  seed: int = 0
  num_decodes: int = 1

  def check(self, vocab_size: int):
    """ValueError, one line naming the first binding out of its range (before any checkpoint is
    read, where decoding would fail after it with an error of JAX's)."""
    valid = {'method': (self.method in decoding.METHODS, ' or '.join(map(repr, decoding.METHODS))),
             'num_beams': (self.num_beams >= 1, 'an integer >= 1'),
             'top_k': (0 <= self.top_k <= vocab_size, f'0 (none) to the vocabulary size, {vocab_size}'),
             'top_p': (0 < self.top_p <= 1, 'in (0, 1]'),
             'num_decodes': (1 <= self.num_decodes <= decoding.max_decodes(self.method, self.num_beams),
                             "1, or with method 'sample' any count, with 'beam' at most num_beams"),
             'temperature': (self.temperature >= 0, '>= 0 (0: greedy)')}
    for name, (ok, what) in valid.items():
      if not ok:
        raise ValueError(f'DecodeOptions.{name} = {getattr(self, name)!r} is out of range: it must '
                         f'be {what}; set --gin.DecodeOptions.{name} accordingly')


class Predictor:
  """``config``'s model on the mesh (default: the gin-bound ``MeshConfig``); ``load`` puts a
  checkpoint's parameters on it."""

  def __init__(self, config: TransformerConfig, mesh: partitioning.MeshConfig = None,
               options: DecodeOptions = None, z_loss: float = 0.0):
    self.config, self.options = config, options or DecodeOptions()
    self.options.check(config.vocab_size)
    self.model = build_model(config)
    mesh = mesh or partitioning.MeshConfig()
    self.mesh = mesh.mesh()
    _, self.abstract_params = partitioning.sharded_abstract_params(
        self.model, init_inputs(config), self.mesh, mesh.rules())
    self.eval_step = evaluation.make_eval_step(  # teacher-forced sums, compiled once
        self.model, config, jax.tree_util.tree_map(lambda p: p.sharding, self.abstract_params),
        self.mesh, z_loss)
    self.params, self.step, self._decode, self._info = None, None, {}, ''

    def log_likelihood(params, batch):  # (rows,): sum of log p(target) over weighted positions
      logits = self.model.apply({'params': params}, **train_step.model_inputs(config, batch))
      nll, _ = losses.cross_entropy(logits, batch['decoder_target_tokens'],
                                    batch['decoder_loss_weights'])
      return -nll.sum(-1)
    self._log_likelihood = partitioning.jit(
        log_likelihood, self.mesh,
        in_shardings=(jax.tree_util.tree_map(lambda p: p.sharding, self.abstract_params),
                      partitioning.batch_sharding(self.mesh)),
        out_shardings=NamedSharding(self.mesh, PartitionSpec()))

  def check_run(self, run_dir):
    """ValueError (one line) when the run's ``model-info.txt`` (if it has one) describes another
    model than ``config``: one whose checkpoints would be read into another function, or
    (t5xv-eval) whose earlier results would be reported for this configuration."""
    info = run_dir / 'model-info.txt'
    saved = multihost.process0_json(f'reading {info}',  # one text for every process
                                    lambda: info.read_text() if info.exists() else '')
    self._info = self._info or summary.model_info(self.config)
    differ = saved and summary.differences(saved, self._info)
    if differ:
      raise ValueError(f'{run_dir} holds a run of another model than this configuration ({differ}, '
                       f'see its model-info.txt); pass that run\'s own config.gin '
                       f'(--gin_file={run_dir / "config.gin"}), keeping only decoding, data and '
                       'execution bindings of your own')

  def load(self, checkpoint_path: str):
    """A ``checkpoint_<step>`` directory, or a run directory (its newest checkpoint), checked
    against its run's model-info.txt first."""
    path = checkpoints.checkpoint_path(checkpoint_path)
    self.check_run(path.parent)
    self.params = pretrained.restore_params(str(path), self.abstract_params)
    self.step = int(re.search(r'(\d+)$', path.name).group(1))
    return self

  def _jitted(self, max_decode_length: int):
    if max_decode_length not in self._decode:
      o = self.options
      key = 'encoder_input_tokens' if self.config.architecture == 'encoder_decoder' else 'prompt_tokens'

      def run(params, tokens, rng):
        return decoding.decode(
            self.model, self.config, params, **{key: tokens}, max_decode_length=max_decode_length,
            method=o.method, rng=rng, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p,
            num_beams=o.num_beams, length_penalty=o.length_penalty, eos_id=EOS_ID,
            num_decodes=o.num_decodes)
      replicated = NamedSharding(self.mesh, PartitionSpec())
      self._decode[max_decode_length] = partitioning.jit(
          run, self.mesh, out_shardings=(replicated, replicated))
    return self._decode[max_decode_length]

  def predict(self, tokens: np.ndarray, max_decode_length: int, batch_index: int = 0):
    """(decoded tokens (n * k, max_decode_length), scores (n * k,)) for input rows ``tokens`` (n, L):
    encoder inputs, or prompts of a decoder-only model (right-padded with 0); k =
    ``num_decodes``, each input's decodes consecutive, best first."""
    if self.config.architecture == 'encoder_only':
      raise ValueError('an encoder-only (MLM) model does not decode; evaluate it teacher-forced')
    n = len(tokens)
    batch = partitioning.global_batch(partitioning.host_rows({'t': tokens}, self.mesh), self.mesh)['t']
    rng = jax.random.fold_in(jax.random.PRNGKey(self.options.seed), batch_index)
    out, scores = self._jitted(max_decode_length)(self.params, batch, rng)
    out, scores = partitioning.to_host((out, scores))
    k = self.options.num_decodes
    return out[:n * k], scores[:n * k]

  def score(self, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """(n,) log p(target row | input row), summed over the target's tokens up to and with its
    EOS, teacher-forced. ``inputs``: encoder inputs, or a decoder-only model's prompts (the targets
    continue them); both (n, L) and right-padded with 0."""
    n = len(targets)
    if self.config.architecture == 'encoder_decoder':
      targets = pad_tokens([until_eos(t, keep_eos=True) for t in targets], targets.shape[1], n)
      batch = {'encoder_input_tokens': inputs, 'decoder_target_tokens': targets,
               'decoder_loss_weights': (targets != PAD_ID).astype(np.int32)}
    elif self.config.architecture == 'decoder_only':
      # A prefix LM's inputs keep their EOS and are fully visible up to the position reading it.
      prompts = [until_eos(p, keep_eos=not continues_text(self.config)) for p in inputs]
      rows = [np.asarray(p + until_eos(t, keep_eos=True), np.int32) for p, t in zip(prompts, targets)]
      sequences = pad_tokens(rows, inputs.shape[1] + targets.shape[1], n)
      positions = np.arange(sequences.shape[1])
      weights = np.stack([(len(p) <= positions) & (positions < len(r))
                          for p, r in zip(prompts, rows)])
      batch = {'decoder_target_tokens': sequences, 'decoder_loss_weights': weights.astype(np.int32)}
      if self.config.visible_prefix:
        batch['decoder_causal_attention'] = np.stack(
            [positions <= len(p) for p in prompts]).astype(np.int32)
    else:
      raise ValueError('an encoder-only (MLM) model does not score continuations; evaluate it teacher-forced')
    batch['decoder_input_tokens'] = np.pad(batch['decoder_target_tokens'], ((0, 0), (1, 0)))[:, :-1]
    batch = partitioning.global_batch(partitioning.host_rows(batch, self.mesh), self.mesh)
    return partitioning.to_host(self._log_likelihood(self.params, batch))[:n]


def continues_text(config: TransformerConfig) -> bool:
  """Whether the model continues its inputs as text (a decoder-only language model: prompted
  without their EOS) rather than reading them whole, EOS included, as trained (an encoder, a
  prefix LM)."""
  return config.architecture == 'decoder_only' and not config.prefix_lm


def until_eos(tokens, keep_eos: bool = False) -> list:
  """The ids before the first EOS (and with it, if ``keep_eos``), without padding."""
  ids = [int(t) for t in tokens]
  ids = ids[:ids.index(EOS_ID) + keep_eos] if EOS_ID in ids else ids
  return [t for t in ids if t != PAD_ID]


def pad_tokens(rows: List[np.ndarray], length: int, num_rows: int) -> np.ndarray:
  """(num_rows, length): each row cut or zero-padded to ``length``, zero rows after them (so every
  batch has one shape and decoding compiles once)."""
  out = np.full((num_rows, length), PAD_ID, np.int32)
  for i, r in enumerate(rows):
    out[i, :min(len(r), length)] = r[:length]
  return out


def _chunks(items: List, size: int) -> Iterator[List]:
  for i in range(0, len(items), size):
    yield items[i:i + size]


def prompted(examples: List[dict], prompt_length: Optional[int], task_name: str = 'the task'
             ) -> List[dict]:
  """Language-modelling examples (only 'targets') as prompt and continuation: 'inputs' the first
  ``prompt_length`` target tokens, 'targets' the rest up to the first EOS, with it (the end of
  the document the row starts in; a causal-LM row may hold none); examples with no token left
  to continue are dropped. Examples that have inputs are returned as they are."""
  if not prompt_length or prompt_length < 1:
    raise ValueError(f'{task_name} has no inputs length: a decoder-only model is prompted with '
                     'PROMPT_LENGTH tokens (of the targets, for a language-modelling task) and '
                     'continues them; set e.g. --gin.PROMPT_LENGTH=32')
  if not examples or 'inputs' in examples[0]:
    return examples
  out = []
  for ex in examples:
    ids = until_eos(ex['targets'], keep_eos=True)
    if ids and len(ids) > prompt_length + (ids[-1] == EOS_ID):
      out.append({'inputs': np.asarray(ids[:prompt_length], np.int32),
                  'targets': np.asarray(ids[prompt_length:], np.int32)})
  return out


def continuation_length(targets_length: int, prompt_length: int) -> int:
  """The longest continuation (with EOS) of a ``prompt_length`` prompt cut from targets of
  ``targets_length`` tokens."""
  if prompt_length >= targets_length:
    raise ValueError(f'PROMPT_LENGTH {prompt_length} leaves nothing to continue in targets of '
                     f'{targets_length} tokens; set it below {targets_length}')
  return targets_length - prompt_length


def score_examples(predictor: Predictor, examples: List[dict], input_length: int,
                   target_length: int, batch_size: int) -> List[dict]:
  """Adds 'log_likelihood' (``Predictor.score`` of its targets given its inputs) and
  'num_target_tokens' (with EOS) to each example."""
  out = []
  for chunk in _chunks(examples, batch_size):
    inputs = pad_tokens([np.asarray(ex['inputs']) for ex in chunk], input_length, batch_size)
    targets = pad_tokens([np.asarray(ex['targets']) for ex in chunk], target_length, batch_size)
    for ex, ll, t in zip(chunk, predictor.score(inputs, targets), targets):
      out.append(dict(ex, log_likelihood=float(ll), num_target_tokens=len(until_eos(t, keep_eos=True))))
  return out


def decode_examples(predictor: Predictor, vocab, examples: List[dict], input_length: int,
                    max_decode_length: int, batch_size: int) -> List[dict]:
  """Adds 'prediction' (text by ``vocab.decode``), 'prediction_ids' and 'score' to each example
  (which has 'inputs' token ids; a decoder-only language model continues them as a prompt,
  without their EOS; a prefix LM reads them with it, as in training): of its best decode; with
  ``DecodeOptions.num_decodes`` > 1 also 'predictions', every decode's text and score, best
  first (a beam left unfinished, score -inf, left out)."""
  strip = continues_text(predictor.config)
  out = []
  for i, chunk in enumerate(_chunks(examples, batch_size)):
    rows = [np.asarray(ex['inputs'])[:-1] if strip and ex['inputs'][-1] == EOS_ID
            else np.asarray(ex['inputs']) for ex in chunk]
    # A last batch's filler repeats a prompt: an empty one would start every row's steps at 0.
    rows += rows[:1] * (batch_size - len(rows))
    tokens, scores = predictor.predict(pad_tokens(rows, input_length, batch_size),
                                       max_decode_length, i)
    k = predictor.options.num_decodes
    for j, ex in enumerate(chunk):
      ids = until_eos(tokens[j * k])
      out.append(dict(ex, prediction=vocab.decode(ids), prediction_ids=ids, score=float(scores[j * k])))
      if k > 1:
        out[-1]['predictions'] = [{'prediction': vocab.decode(until_eos(t)), 'score': float(s)}
                                  for t, s in zip(tokens[j * k:(j + 1) * k], scores[j * k:(j + 1) * k])
                                  if not np.isneginf(s)]
  return out
