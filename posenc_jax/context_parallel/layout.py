"""Which chunks of T each device holds: contiguous, or zig-zag for causal load balance.

Contiguous: device d holds block d of N. Under a causal mask the last device then attends to
N blocks and the first to one. Zig-zag: T is cut into 2N chunks and device d holds chunks d
and 2N-1-d, so every device sees the same number of visible (query, key) pairs.

Activations arrive contiguous (the mesh shards T in order); `to_zigzag` moves the halves of
each device's block to their zig-zag owners with two ppermutes, and `from_zigzag` moves them
back. Inside, a device's tokens are a list of `slots` (one per chunk it holds) with
`chunk_ids(d)` their global chunk numbers.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from posenc_jax.context_parallel import mesh


def _owner(c: int, n: int) -> int:
  """The device that holds chunk c of 2n under zig-zag."""
  return c if c < n else 2 * n - 1 - c


def use_zigzag(zigzag: bool | None, *, T: int, n: int) -> bool:
  """The layout a ring runs: zigzag None picks zig-zag where each device's T / n splits in
  two; True where it does not is an error."""
  if zigzag is None:
    return (T // n) % 2 == 0
  if zigzag and (T // n) % 2:
    raise ValueError(f"zigzag=True needs an even number of tokens per device; T={T} over "
                     f"context={n} gives {T // n}: use zigzag=False or pad T")
  return zigzag


def chunk_ids(d, n: int, *, zigzag: bool):
  """Global chunk numbers of device d's slots (d may be traced)."""
  return (d, 2 * n - 1 - d) if zigzag else (d,)


def chunk_table(n: int, *, zigzag: bool) -> np.ndarray:
  """[n, slots] global chunk number of each device's slots (static)."""
  return np.array([chunk_ids(d, n, zigzag=zigzag) for d in range(n)])


def to_zigzag(arrays, n: int, d):
  """Contiguous [B, T_local, ...] arrays (None passes through) -> (slot 0, slot 1) tuples.

  Device e's halves are chunks 2e (moved by one ppermute) and 2e+1 (by the other); a device
  receives one of each, and its own chunk d arrives by the first when d is even.
  """
  first = [(e, _owner(2 * e, n)) for e in range(n)]
  second = [(e, _owner(2 * e + 1, n)) for e in range(n)]
  even = d % 2 == 0
  slot0, slot1 = [], []
  for x in arrays:
    if x is None:
      slot0.append(None)
      slot1.append(None)
      continue
    h = x.shape[1] // 2
    a, b = mesh.exchange(x[:, :h], first), mesh.exchange(x[:, h:], second)
    slot0.append(jnp.where(even, a, b))
    slot1.append(jnp.where(even, b, a))
  return tuple(slot0), tuple(slot1)


def from_zigzag(slot0, slot1, n: int, d):
  """The inverse of to_zigzag for one array per slot -> contiguous [B, T_local, ...]."""
  even = d % 2 == 0
  a = jnp.where(even, slot0, slot1)      # what arrived by the first ppermute goes back by it
  b = jnp.where(even, slot1, slot0)
  first = [(_owner(2 * e, n), e) for e in range(n)]
  second = [(_owner(2 * e + 1, n), e) for e in range(n)]
  return jnp.concatenate([mesh.exchange(a, first), mesh.exchange(b, second)], axis=1)
