"""The mesh side of context parallelism: how many devices share T, and the shard_map around
a per-shard attention.

Activations arrive as [B, T, ...] arrays with T sharded over the mesh axis "context" and the
batch over ("data", "fsdp") where the mesh has them (experiments/sharding.py's rules). Inside
`run_sharded` every device sees its own [B_local, T / N, ...] block; `shard_index` is its place
along T and `ring_shift` hands a pytree to the next device along "context".
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

AXIS = "context"
BATCH_AXES = ("data", "fsdp")


def _abstract_mesh():
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or getattr(mesh, "empty", False) else mesh


def context_size() -> int:
  """Devices along "context" in the current abstract mesh (jax.set_mesh); 1 without one."""
  mesh = _abstract_mesh()
  if mesh is None or AXIS not in mesh.axis_names:
    return 1
  return dict(zip(mesh.axis_names, mesh.axis_sizes))[AXIS]


def batch_axes() -> tuple[str, ...]:
  """The mesh axes the batch is split over (those of BATCH_AXES the mesh has)."""
  mesh = _abstract_mesh()
  return tuple(a for a in BATCH_AXES if mesh is not None and a in mesh.axis_names)


def token_axes(B: int, T: int) -> tuple[str, ...]:
  """The axes of the current mesh that split tokens [B, T] as the trainer's batches are split
  (B over the batch axes, T over "context"), those of size one left out; () without a mesh
  or where B or T does not divide."""
  mesh = _abstract_mesh()
  if mesh is None:
    return ()
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  batch = tuple(a for a in batch_axes() if sizes[a] > 1)
  n_batch = 1
  for a in batch:
    n_batch *= sizes[a]
  n_ctx = sizes.get(AXIS, 1)
  if B % n_batch or T % n_ctx:
    return ()
  return batch + ((AXIS,) if n_ctx > 1 else ())


def run_sharded(fn: Callable, sequence_args, other_args=(), *, out_time_axes=None):
  """fn(*local_sequence_args, *other_args) once per device, under jax.shard_map.

  sequence_args: arrays [B, T, ...] (or None), sharded B over `batch_axes()` and T over
  "context"; other_args: arrays every device holds whole (e.g. per-head constants).
  fn returns a pytree of [B, T_local, ...] arrays, put back together along T.
  """
  _check_divisible(sequence_args)
  bt = P(batch_axes() or None, AXIS)
  present = [i for i, a in enumerate(sequence_args) if a is not None]
  n_seq = len(sequence_args)
  in_specs = (bt,) * len(present) + (P(),) * len(other_args)
  axes = frozenset(batch_axes() + (AXIS,))

  def body(*args):
    seq = [None] * n_seq
    for i, a in zip(present, args[:len(present)]):
      seq[i] = a
    return fn(*seq, *args[len(present):])

  mapped = jax.shard_map(body, in_specs=in_specs, out_specs=bt, axis_names=axes,
                         check_vma=False)
  return mapped(*(sequence_args[i] for i in present), *other_args)


def _check_divisible(sequence_args) -> None:
  mesh_ = _abstract_mesh()
  sizes = dict(zip(mesh_.axis_names, mesh_.axis_sizes))
  n, nb = sizes[AXIS], 1
  for a in batch_axes():
    nb *= sizes[a]
  B, T = next(a for a in sequence_args if a is not None).shape[:2]
  if T % n:
    raise ValueError(f"context-parallel attention: T={T} does not split over mesh axis "
                     f"'context'={n}; make the sequence length a multiple of mesh.context")
  if B % nb:
    raise ValueError(f"context-parallel attention: batch {B} does not split over mesh axes "
                     f"{batch_axes()} ({nb} devices); make the batch a multiple of it")


def shard_index():
  """This device's place along "context" (inside run_sharded)."""
  return jax.lax.axis_index(AXIS)


def ring_shift(tree, n: int, *, step: int = 1):
  """Each device's `tree` goes to the device `step` further along "context" (cyclically)."""
  perm = [(d, (d + step) % n) for d in range(n)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, perm), tree)


def exchange(tree, perm):
  """A ppermute of `tree` along "context" by explicit (source, destination) pairs."""
  return jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, perm), tree)
