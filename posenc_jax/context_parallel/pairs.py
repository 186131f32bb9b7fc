"""The zig-zag ring both families share: every visible pair of chunks is one full block.

With T cut into 2N chunks and device d holding chunks lo = d and hi = 2N-1-d (layout.py), a
device's queries see, besides each chunk's own causal attention (the family's local form):
- its chunk lo's keys from its chunk hi (same device, before the ring);
- at ring step s, the chunks of device e = d - s (mod N), that is e and 2N-1-e:
  chunk e from hi (always earlier), and exactly one more pair: chunk e from lo when e < d,
  else chunk 2N-1-e from hi.
So every device attends to 2N - 1 chunk pairs plus its two diagonals (balanced), and each
pair is non-causal attention of one query chunk against one whole key chunk: no positions,
no tiles to skip, one call of `cross` (the Pallas block kernel on an accelerator).

What the families differ in is `between(a, b, k, k_bias)`: how chunk b's keys look from
chunk a's start (PaTH: carried through the Householder products of the chunks in between;
FoX / ALiBi: the gate totals in between added to the keys' tails; softmax: unchanged).
Keys travel round the ring as their owner made them; the receiver applies `between`.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from posenc_jax.context_parallel import mesh
from posenc_jax.context_parallel.merge import merge


def _attend(cross: Callable, between: Callable, qs, a, ks, b):
  q, q_bias, q_seg = qs
  k, v, k_bias, k_seg = ks
  k, k_bias = between(a, b, k, k_bias)
  return cross(q, k, v, q_bias=q_bias, k_bias=k_bias, q_seg=q_seg, k_seg=k_seg)


def run(parts, queries, keys, *, n: int, cross: Callable, between: Callable):
  """The cross-chunk attention of one device, merged into its chunks' local results.

  parts: [(o, lse)] x 2, each chunk's causal attention with itself (lo, hi);
  queries: [(q, q_bias, q_seg)] x 2 and keys: [(k, v, k_bias, k_seg)] x 2 of chunks (lo, hi),
  q already scaled, None for an absent bias or segment ids;
  cross(q, k, v, *, q_bias, k_bias, q_seg, k_seg) -> (o, lse): non-causal attention;
  between(a, b, k, k_bias) -> (k, k_bias) for traced chunk numbers b < a.
  Returns [(o, lse)] x 2, float32.
  """
  d = mesh.shard_index()
  lo, hi = d, 2 * n - 1 - d
  (o0, l0), (o1, l1) = parts
  o1, l1 = merge(o1, l1, *_attend(cross, between, queries[1], hi, keys[0], lo))

  def pick(cond, x, y):
    return jax.tree.map(lambda a, b: jnp.where(cond, a, b), x, y)

  def step(carry, s):
    o0, l0, o1, l1, held = carry
    held = mesh.ring_shift(held, n)                 # chunks e and 2N-1-e of device e = d - s
    e = (d - s) % n
    o1, l1 = merge(o1, l1, *_attend(cross, between, queries[1], hi, held[0], e))
    early = e < d                                   # chunk e is before lo: lo sees it
    part = _attend(cross, between, pick(early, queries[0], queries[1]),
                   jnp.where(early, lo, hi), pick(early, held[0], held[1]),
                   jnp.where(early, e, 2 * n - 1 - e))
    o0, l0 = pick(early, merge(o0, l0, *part), (o0, l0))
    o1, l1 = pick(early, (o1, l1), merge(o1, l1, *part))
    return (o0, l0, o1, l1, held), None

  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  init = (f32(o0), l0, f32(o1), l1, tuple(keys))
  (o0, l0, o1, l1, _), _ = jax.lax.scan(step, init, jnp.arange(1, n))
  return [(o0, l0), (o1, l1)]


def chunk_sums(x_B2H, n: int):
  """Each device's two chunk totals [B, 2, H] (lo, hi) -> every chunk's in T order
  [B, 2N, H] (an all-gather: tiny)."""
  return chunk_order(jax.lax.all_gather(x_B2H, mesh.AXIS, axis=1), n)


def chunk_order(x, n: int):
  """[B, N, 2, ...] gathered per device (lo, hi) -> [B, 2N, ...] in T order."""
  lo, hi = x[:, :, 0], x[:, :, 1]
  return jnp.concatenate([lo, hi[:, ::-1]], axis=1)  # chunk c < N: device c; c >= N: 2N-1-c


def strictly_between(a, b, count: int):
  """[count] float32 mask of the chunks c with b < c < a (a, b traced)."""
  c = jnp.arange(count)
  return ((c > b) & (c < a)).astype(jnp.float32)


def gate_between(totals_BCH, a, b):
  """The gate totals of the chunks strictly between b and a: [B, H]."""
  return jnp.einsum("bch,c->bh", totals_BCH, strictly_between(a, b, totals_BCH.shape[1]))
