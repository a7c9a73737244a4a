"""A fingerprint of each array of a checkpoint, saved beside it and checked when it is read back:
damaged bytes that still decode (a flipped bit in an array file) read as other values, silently,
unless something compares them with what was saved.

The fingerprint of an array x of n words w_i (its elements' bits as unsigned 32-bit words, i in
row-major order) is

    F(x) = sum_i w_i * (2 i + 1)  (mod 2^32),

an integer sum, so every mesh and every reduction order gives the same value; every odd weight
makes any one flipped bit change it (by 2^k times an odd number), and the weights tell where
a value is, so swapped values change it too. All arrays are reduced by one jitted call over the
global arrays to scalars that every process holds whole: the same answer on all.
"""
from typing import Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

ITEM = 'fingerprints'  # the checkpoint item: {array name: [dtype, F]} (JSON)


def _words(x):
  """``x``'s bits as uint32 words: one per element of 1, 2 or 4 bytes, two of 8 (a last axis)."""
  size = np.dtype(x.dtype).itemsize
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fingerprint(x):
  words = _words(x)
  index = jnp.zeros(words.shape, jnp.uint32)
  for axis, stride in enumerate(np.cumprod((words.shape + (1,))[:0:-1])[::-1]):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * np.uint32(
        stride % 2**32)
  return jnp.sum(words * (2 * index + 1), dtype=jnp.uint32)


@jax.jit
def _summaries(xs):
  """(whether each floating array is finite (True for the others), each array's F)."""
  finite = [jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
            for x in xs]
  return finite, [_fingerprint(x) for x in xs]


def _named(tree) -> List[Tuple[str, jax.Array]]:
  """('a/b/c', array) of ``tree``'s arrays, named as orbax saves them."""
  flat = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(tree, keep_empty_nodes=True))
  return [('/'.join(map(str, k)), x) for k, x in flat.items() if hasattr(x, 'dtype')]


def summarize(tree) -> Tuple[Dict[str, bool], Dict[str, list]]:
  """({name: finite}, {name: [dtype, F]}) of ``tree``'s arrays: those on devices in one call,
  those on the host (numpy: an import's) one at a time, so at most one of them is put on a
  device at once (a model imported on a GPU host may not fit its memory whole)."""
  named = _named(tree)
  on_device = [i for i, (_, x) in enumerate(named) if isinstance(x, jax.Array)]
  results = dict(zip(on_device, zip(*_summaries([named[i][1] for i in on_device]))))
  for i in set(range(len(named))) - set(on_device):
    finite, prints = _summaries([named[i][1]])
    results[i] = finite[0], prints[0]
  value = lambda scalar: scalar.addressable_data(0).item()
  return ({name: bool(value(results[i][0])) for i, (name, _) in enumerate(named)},
          {name: [str(x.dtype), int(value(results[i][1]))] for i, (name, x) in enumerate(named)})


def changed(saved: Dict[str, list], read: Dict[str, list]) -> List[str]:
  """The arrays read whose fingerprint differs from the one saved (arrays read with another dtype
  than saved, or saved before fingerprints were, are not compared)."""
  return [name for name, (dtype, value) in read.items()
          if name in saved and saved[name][0] == dtype and saved[name][1] != value]
