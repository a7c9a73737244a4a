"""Token-level cross-entropy with label smoothing and z-loss (T5X conventions).

loss_i = -sum_v q_iv log softmax(z_i)_v - H(q_i) + z_loss * (log sum_v exp z_iv)^2, where q_i is
the one-hot target smoothed to (1 - ls) on the target and ls / (V - 1) elsewhere (Szegedy et al.
2016); subtracting the entropy H(q_i) makes a perfect prediction cost 0. The z-loss term keeps the
softmax normaliser near 1 (Chowdhery et al. 2022, PaLM Sec. 5).
"""
from typing import Dict, Union

import jax
import jax.numpy as jnp

from t5x_variants import is_positive_number

NORMALIZERS = ('num_tokens', 'none', 'average_per_sequence')


def cross_entropy(logits, targets, weights=None, label_smoothing: float = 0.0,
                  z_loss: float = 0.0):
  """Per-token (loss, z_loss part), both (batch, length) float32, zero where weights are 0."""
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  log_z = jax.nn.logsumexp(logits, axis=-1)
  log_probs = logits - log_z[..., None]
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1)
  soft = jax.nn.one_hot(targets, vocab) * (confidence - low) + low
  entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
  loss = -jnp.sum(soft * log_probs, axis=-1) - entropy
  z = z_loss * jnp.square(log_z)
  w = jnp.ones_like(loss) if weights is None else weights.astype(jnp.float32)
  return (loss + z) * w, z * w


def per_sequence_weights(weights, segment_ids=None):
  """``weights`` divided by the total weight of the sequence each position belongs to (its row, or
  in packed rows its segment), so each sequence's weights sum to 1 and a summed loss is the sum of
  the sequences' mean token losses (T5X's AVERAGE_PER_SEQUENCE); 0 where the weight is 0."""
  w = weights.astype(jnp.float32)
  if segment_ids is None:
    total = jnp.sum(w, axis=-1, keepdims=True)
  else:
    n = segment_ids.shape[-1]  # segment ids run from 1 to at most n (0: padding)
    sums = jax.vmap(lambda x, s: jax.ops.segment_sum(x, s, num_segments=n + 1))(w, segment_ids)
    total = jnp.take_along_axis(sums, segment_ids, axis=-1)
  return jnp.where(w > 0, w / jnp.where(total > 0, total, 1.0), 0.0)


def classification_loss(logits, labels, weights=None, label_smoothing: float = 0.0,
                        z_loss: float = 0.0):
  """Per-example (loss, z_loss part) of a classification head's logits (..., num_labels), zero
  where weights are 0: with num_labels >= 2 ``cross_entropy`` against the class ids ``labels``
  (BERT: softmax cross-entropy); with one output (regression, STS-B) the squared error
  (logits[..., 0] - labels)^2, which takes no label smoothing or z-loss."""
  if logits.shape[-1] > 1:
    return cross_entropy(logits, labels.astype(jnp.int32), weights, label_smoothing, z_loss)
  error = jnp.square(logits[..., 0].astype(jnp.float32) - labels.astype(jnp.float32))
  w = jnp.ones_like(error) if weights is None else weights.astype(jnp.float32)
  return error * w, jnp.zeros_like(error)


def normalizing_factor(loss_normalizing_factor: Union[str, float], num_tokens):
  """'num_tokens': the number of weighted tokens (at least 1); 'none' or None (T5X's spelling, its
  T5.1.1 default): 1, the summed loss; 'average_per_sequence': 1, the loss having been summed
  over ``per_sequence_weights``; a number: itself (T5's constant normaliser makes the loss
  independent of the batch's padding)."""
  check_normalizing_factor(loss_normalizing_factor)
  if loss_normalizing_factor is None:
    return 1.0
  if isinstance(loss_normalizing_factor, str):
    return jnp.maximum(num_tokens, 1.0) if loss_normalizing_factor == 'num_tokens' else 1.0
  return loss_normalizing_factor


def check_normalizing_factor(loss_normalizing_factor):
  """ValueError unless one of NORMALIZERS, None or a finite number > 0 (0 made every step's loss
  infinite, a negative one trained by gradient ascent)."""
  if loss_normalizing_factor is None or loss_normalizing_factor in NORMALIZERS:
    return
  if not is_positive_number(loss_normalizing_factor):
    raise ValueError(f'loss_normalizing_factor must be {", ".join(map(repr, NORMALIZERS))}, None '
                     f'or a number > 0, not {loss_normalizing_factor!r}')


def loss_and_metrics(logits, targets, weights, label_smoothing: float = 0.0, z_loss: float = 0.0,
                     loss_normalizing_factor: Union[str, float] = 'num_tokens',
                     segment_ids=None) -> Dict[str, jnp.ndarray]:
  """The scalar training loss (summed, divided by ``normalizing_factor``; with
  'average_per_sequence' summed over ``per_sequence_weights`` of ``segment_ids``' sequences) and
  its metrics; ``correct`` is the number of weighted tokens predicted right, ``token_accuracy``
  its fraction."""
  loss_weights = (per_sequence_weights(weights, segment_ids)
                  if loss_normalizing_factor == 'average_per_sequence' else weights)
  per_token, z = cross_entropy(logits, targets, loss_weights, label_smoothing, z_loss)
  num_tokens = jnp.sum(weights.astype(jnp.float32))
  factor = normalizing_factor(loss_normalizing_factor, num_tokens)
  correct = jnp.sum((jnp.argmax(logits, -1) == targets) * weights)
  return {'loss': jnp.sum(per_token) / factor, 'z_loss': jnp.sum(z) / factor, 'correct': correct,
          'token_accuracy': correct / jnp.maximum(num_tokens, 1.0), 'num_tokens': num_tokens}
