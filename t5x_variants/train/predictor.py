"""A checkpoint's parameters on a mesh: cached decoding of token batches, teacher-forced scoring.

Shared by ``t5xv-infer`` and ``t5xv-eval`` (inference metrics). Every process passes the same
full batch; each feeds the rows of its own devices and all get every decoded row back.
"""
import dataclasses
import re
from typing import Iterator, List

import gin
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from t5x_variants.features import EOS_ID, PAD_ID
from t5x_variants.models import build_model, init_inputs
from t5x_variants.models.config import TransformerConfig
from t5x_variants.train import checkpoints, decoding, evaluation, partitioning


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """How to decode: 'greedy', 'sample' (temperature, top_k, top_p) or 'beam' (num_beams,
  length_penalty alpha of ((5 + length) / 6) ** alpha)."""
  method: str = 'greedy'
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  num_beams: int = 4
  length_penalty: float = 0.6
  seed: int = 0


class Predictor:
  """``config``'s model on the mesh (default: the gin-bound ``MeshConfig``); ``load`` puts a
  checkpoint's parameters on it."""

  def __init__(self, config: TransformerConfig, mesh: partitioning.MeshConfig = None,
               options: DecodeOptions = None, z_loss: float = 0.0):
    self.config, self.options = config, options or DecodeOptions()
    self.model = build_model(config)
    mesh = mesh or partitioning.MeshConfig()
    self.mesh = mesh.mesh()
    _, self.abstract_params = partitioning.sharded_abstract_params(
        self.model, init_inputs(config), self.mesh, mesh.rules())
    self.eval_step = evaluation.make_eval_step(  # teacher-forced sums, compiled once
        self.model, config, jax.tree_util.tree_map(lambda p: p.sharding, self.abstract_params),
        self.mesh, z_loss)
    self.params, self.step, self._decode = None, None, {}

  def load(self, checkpoint_path: str):
    """A ``checkpoint_<step>`` directory, or a run directory (its newest checkpoint)."""
    path = checkpoints.checkpoint_path(checkpoint_path)
    self.params = checkpoints.restore_params(str(path), self.abstract_params)
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
            num_beams=o.num_beams, length_penalty=o.length_penalty, eos_id=EOS_ID)
      replicated = NamedSharding(self.mesh, PartitionSpec())
      self._decode[max_decode_length] = jax.jit(run, out_shardings=(replicated, replicated))
    return self._decode[max_decode_length]

  def predict(self, tokens: np.ndarray, max_decode_length: int, batch_index: int = 0):
    """(decoded tokens (n, max_decode_length), scores (n,)) for input rows ``tokens`` (n, L):
    encoder inputs, or prompts of a decoder-only model (right-padded with 0)."""
    if self.config.architecture == 'encoder_only':
      raise ValueError('an encoder-only (MLM) model does not decode; evaluate it teacher-forced')
    n = len(tokens)
    batch = partitioning.global_batch(partitioning.host_rows({'t': tokens}, self.mesh), self.mesh)['t']
    rng = jax.random.fold_in(jax.random.PRNGKey(self.options.seed), batch_index)
    out, scores = self._jitted(max_decode_length)(self.params, batch, rng)
    out, scores = partitioning.to_host((out, scores))
    return out[:n], scores[:n]


def until_eos(tokens) -> list:
  """The ids before the first EOS (and without padding)."""
  ids = [int(t) for t in tokens]
  ids = ids[:ids.index(EOS_ID)] if EOS_ID in ids else ids
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


def decode_examples(predictor: Predictor, vocab, examples: List[dict], input_length: int,
                    max_decode_length: int, batch_size: int) -> List[dict]:
  """Adds 'prediction' (text by ``vocab.decode``), 'prediction_ids' and 'score' to each example
  (which has 'inputs' token ids; a decoder-only model continues them as a prompt, without their
  EOS)."""
  prompt = predictor.config.architecture == 'decoder_only'
  out = []
  for i, chunk in enumerate(_chunks(examples, batch_size)):
    rows = [np.asarray(ex['inputs'])[:-1] if prompt and ex['inputs'][-1] == EOS_ID
            else np.asarray(ex['inputs']) for ex in chunk]
    tokens, scores = predictor.predict(pad_tokens(rows, input_length, batch_size),
                                       max_decode_length, i)
    for ex, t, s in zip(chunk, tokens, scores):
      ids = until_eos(t)
      out.append(dict(ex, prediction=vocab.decode(ids), prediction_ids=ids, score=float(s)))
  return out
