"""Device mesh, logical axis rules, and the one `shard` helper.

Parameters and activations are annotated with *logical* axis names ("batch", "embed",
"mlp", ...). One table of rules (config.mesh.rules) maps each logical name to mesh axes;
nothing else in the code knows the mesh layout. The mesh has three axes:

  data     pure data parallelism: the batch is split, parameters are replicated
  fsdp     the batch is split AND parameters are sharded along "embed" (ZeRO-3 style)
  context  one sequence is split: activations are sharded along T ("length"); attention
           runs as a ring over this axis (posenc_jax/context_parallel)

On one device every axis has size 1 and every annotation is a no-op, so the same jitted
step runs on 1 CPU, 8 fake CPU devices, one GPU or a pod slice.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "context")

# logical name -> mesh axis (or tuple of mesh axes, or None = replicated)
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("length", "context"),
    ("vocab", None),
    ("mlp", None),
    ("heads", None),
    ("kv_heads", None),
    ("head_dim", None),
)

Rules = Sequence[tuple[str, "str | tuple[str, ...] | None"]]


def mesh_shape(*, data: int, fsdp: int, context: int = 1, num_devices: int
               ) -> tuple[int, int, int]:
  """Resolves -1 (fill with the remaining devices) and checks the product."""
  sizes = {"data": data, "fsdp": fsdp, "context": context}
  for name, n in sizes.items():
    if n == 0 or n < -1:
      raise ValueError(f"config.mesh.{name}={n} must be a positive size or -1 (fill)")
  fills = [n for n, s in sizes.items() if s == -1]
  if len(fills) > 1:
    raise ValueError(f"config.mesh: only one of {MESH_AXES} may be -1, got {sizes}")
  known = math.prod(s for s in sizes.values() if s != -1)
  if fills:
    if num_devices % known:
      raise ValueError(f"config.mesh: {num_devices} devices do not divide into {sizes}")
    sizes[fills[0]] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(f"config.mesh: data={sizes['data']} x fsdp={sizes['fsdp']} x "
                     f"context={sizes['context']} must equal the {num_devices} available devices")
  return sizes["data"], sizes["fsdp"], sizes["context"]


def make_mesh(*, data: int = -1, fsdp: int = 1, context: int = 1,
              devices=None) -> jax.sharding.Mesh:
  """A ("data", "fsdp", "context") mesh over `devices` (default: all), axes in Auto mode.

  Auto axes let XLA propagate shardings from the annotated parameters and the few
  `shard` constraints; the model code stays free of per-op sharding arguments.
  """
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(data=data, fsdp=fsdp, context=context, num_devices=len(devices))
  auto = jax.sharding.AxisType.Auto
  return jax.make_mesh(shape, MESH_AXES, axis_types=(auto,) * len(MESH_AXES), devices=devices)


def logical_to_spec(names: Sequence[str | None] | None, *, rules: Rules, shape=None,
                    mesh=None) -> P:
  """PartitionSpec for logical `names` under `rules`.

  A dimension whose size the mesh axes do not divide, or whose mesh axes are already
  used by an earlier dimension, stays replicated: small models then still run on big
  meshes instead of failing to compile.
  """
  if names is None:
    return P()
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for i, name in enumerate(names):
    axes = table.get(name) if name is not None else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    if mesh is not None:
      axes = tuple(a for a in axes if a in mesh.shape and a not in used)
      size = math.prod(mesh.shape[a] for a in axes)
      if shape is not None and (size == 0 or shape[i] % size):
        axes = ()
    used.update(axes)
    spec.append(axes[0] if len(axes) == 1 else (axes or None))
  return P(*spec)


def shard(x: jax.Array, names: Sequence[str | None], *, rules: Rules = DEFAULT_RULES) -> jax.Array:
  """Constrains activation `x` to the sharding of its logical axis `names`.

  Uses the mesh set by `jax.set_mesh`; outside one (a notebook, a unit test) it does
  nothing, so the model also runs unsharded.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  spec = logical_to_spec(names, rules=rules, shape=x.shape, mesh=mesh)
  return jax.lax.with_sharding_constraint(x, spec)


def named_shardings(logical_tree, shapes_tree, mesh, *, rules: Rules):
  """NamedShardings for a tree of logical names (tuples or None) and matching shapes."""
  is_names = lambda n: n is None or (isinstance(n, tuple) and all(
      isinstance(a, (str, type(None))) for a in n))
  return jax.tree.map(
      lambda n, s: NamedSharding(mesh, logical_to_spec(n, rules=rules, shape=s.shape, mesh=mesh)),
      logical_tree, shapes_tree, is_leaf=is_names)


def batch_sharding(mesh, *, rules: Rules = DEFAULT_RULES) -> NamedSharding:
  """Sharding of a [B, T] batch array: B over the batch axes, T over "context"."""
  return NamedSharding(mesh, logical_to_spec(("batch", "length"), rules=rules, mesh=mesh))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_axis_size(mesh, *, rules: Rules = DEFAULT_RULES) -> int:
  """How many ways the batch dimension is split (the batch size must be a multiple)."""
  spec = logical_to_spec(("batch",), rules=rules, mesh=mesh)[0]
  axes = (spec,) if isinstance(spec, str) else tuple(spec or ())
  return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
