"""A fingerprint of each array of a checkpoint, saved beside it and checked when it is read back:
damaged bytes that still decode (a flipped bit in an array file) read as other values, silently,
unless something compares them with what was saved.

The fingerprint of an array x of n words w_i (its elements' bits as unsigned 32-bit words, i in
row-major order) is

    F(x) = sum_i fmix32(w_i XOR (i * 0x9E3779B9))  (mod 2^32),

fmix32 being MurmurHash3's 32-bit finalizer (xor-shifts and odd multiplications: a bijection of
32-bit words). Any change to one word changes its term and so F; changes to several words, or
values moved to other places (the position enters each term), leave F as it was with chance about
2^-32. An integer sum: every mesh and every reduction order gives the same F.
"""
from typing import Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

ITEM = 'fingerprints'  # the checkpoint item: {array name: [dtype, F]} (JSON)


def _words(x):
  """``x``'s bits as uint32 words: one per element of 1, 2 or 4 bytes, two of 8 (a last axis)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[np.dtype(x.dtype).itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fmix32(h):
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _fingerprint(x):
  words = _words(x)
  index = jnp.zeros(words.shape, jnp.uint32)
  for axis, stride in enumerate(np.cumprod((words.shape + (1,))[:0:-1])[::-1]):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * np.uint32(
        stride % 2**32)
  return jnp.sum(_fmix32(words ^ (index * np.uint32(0x9E3779B9))), dtype=jnp.uint32)


@jax.jit
def _summaries(xs):
  """Whether each floating array is finite (True for the others) and each array's F: scalars,
  which every device holds whole (an array of them might come out split over devices)."""
  finite = [jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
            for x in xs]
  return finite, [_fingerprint(x) for x in xs]


def _host(xs) -> np.ndarray:
  """(2, len(xs)): ``_summaries`` of ``xs`` on this host, fetched together."""
  finite, prints = _summaries(xs)
  return np.asarray(jax.device_get([s.addressable_data(0) for s in finite + prints]),
                    np.uint64).reshape(2, -1)


def named_arrays(tree) -> List[Tuple[str, jax.Array]]:
  """('a/b/c', array) of ``tree``'s arrays (or abstract arrays), named as orbax saves them (a
  list item by its index, an optimizer state's fields by name, empty nodes left out)."""
  flat = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(tree, keep_empty_nodes=True))
  return [('/'.join(map(str, k)), x) for k, x in flat.items() if hasattr(x, 'shape')]


def summarize(tree) -> Tuple[Dict[str, bool], Dict[str, list]]:
  """({name: finite}, {name: [dtype, F]}) of ``tree``'s arrays: those on devices in one jitted
  call over the global arrays (its scalars are whole on every process: the same answer on all),
  those on the host (numpy: an import's) one at a time, so at most one of them is put on a
  device at once (a model imported on a GPU host may not fit its memory whole)."""
  named = named_arrays(tree)
  on_device = [i for i, (_, x) in enumerate(named) if isinstance(x, jax.Array)]
  results = dict(zip(on_device, _host([named[i][1] for i in on_device]).T)) if on_device else {}
  for i in set(range(len(named))) - set(on_device):
    results[i] = _host([named[i][1]])[:, 0]
  return ({name: bool(results[i][0]) for i, (name, _) in enumerate(named)},
          {name: [str(x.dtype), int(results[i][1])] for i, (name, x) in enumerate(named)})


def changed(saved: Dict[str, list], read: Dict[str, list]) -> List[str]:
  """The arrays read whose fingerprint differs from the one saved (arrays read with another dtype
  than saved, or saved before fingerprints were, are not compared)."""
  return [name for name, (dtype, value) in read.items()
          if name in saved and saved[name][0] == dtype and saved[name][1] != value]


def parse(saved) -> Dict[str, list]:
  """A checkpoint's fingerprints as read (JSON), checked to be {name: [dtype, F]}; else
  ValueError."""
  if not (isinstance(saved, dict) and all(
      isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], int)
      for v in saved.values())):
    raise ValueError('not a mapping of array names to [dtype, fingerprint]')
  return saved
