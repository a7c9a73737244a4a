"""T5 relative position bias (Raffel et al. 2020, Sec. 2.1): a learned scalar per head and
log-spaced distance bucket, added to the attention logits; one table shared by a stack's layers."""
import flax.linen as nn
import jax.numpy as jnp
import numpy as np


def relative_position_bucket(relative_position, bidirectional: bool, num_buckets: int,
                             max_distance: int):
  """Bucket of ``relative_position = key_pos - query_pos``: exact for small distances, then
  logarithmic up to ``max_distance``; causal (unidirectional) buckets fold the future onto 0."""
  n = -relative_position
  bucket = 0
  if bidirectional:
    num_buckets //= 2
    bucket = (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  log_ratio = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact) / np.log(max_distance / max_exact)
  large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(n < max_exact, n, large)


class RelativePositionBias(nn.Module):
  """Bias b[h, bucket(k - q)] of shape (batch, heads, q_len, k_len) from position arrays."""
  num_heads: int
  num_buckets: int = 32
  max_distance: int = 128
  bidirectional: bool = True

  @nn.compact
  def __call__(self, q_positions, k_positions):
    table = self.param(
        'rel_embedding',
        nn.with_logical_partitioning(nn.initializers.variance_scaling(1.0, 'fan_avg', 'uniform'),
                                     ('heads', 'relpos_buckets')),
        (self.num_heads, self.num_buckets), jnp.float32)
    buckets = relative_position_bucket(k_positions[:, None, :] - q_positions[:, :, None],
                                       self.bidirectional, self.num_buckets, self.max_distance)
    return jnp.transpose(table[:, buckets], (1, 0, 2, 3))
