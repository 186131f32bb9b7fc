"""pallas_call wrappers: grids, BlockSpecs and per-backend compiler parameters.

backend "gpu" lowers through Triton (`pl.pallas_call`), "tpu" through Mosaic; "interpret" runs
the generic interpreter and "tpu_interpret" the TPU interpreter (`pltpu.InterpretParams`), both
on CPU. The kernel bodies are the same for every backend (kernels.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.path_attention import kernels
from kernels_pallas.path_attention.prepass import Operands


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes. The transport chunk, the query tile and the key tile are one size for now."""
  block_q: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int | None = None  # None: 2 for head_dim <= 64, else 1 (shared memory)
  bwd_num_warps: int = 4
  bwd_lanes: int | None = None   # programs per head in the backward; None: fill the GPU (TPU: 1)

  def validate(self, head_dim: int) -> None:
    if self.block_q != self.block_k:
      raise ValueError(f"block_q={self.block_q} must equal block_k={self.block_k} "
                       "(the query tile, key tile and transport chunk are one size)")
    if self.block_q < 16 or self.block_q & (self.block_q - 1):
      raise ValueError(f"block_q={self.block_q} must be a power of two >= 16")
    if head_dim < 16 or head_dim & (head_dim - 1):
      raise ValueError(f"head_dim={head_dim} must be a power of two >= 16")


def _compiler_params(backend: str, bs: BlockSizes, num_axes: int, *, bwd: bool, head_dim: int):
  if backend == "gpu":
    try:
      from jax.experimental.pallas import triton as pltriton
      cls = pltriton.CompilerParams
    except (ImportError, AttributeError):  # older spellings
      cls = getattr(pl, "GPUCompilerParams", None) or getattr(pl, "TritonCompilerParams")
    stages = bs.num_stages or (2 if head_dim * bs.block_k <= 64 * 64 else 1)
    return cls(num_warps=bs.bwd_num_warps if bwd else bs.num_warps, num_stages=stages)
  if backend in ("tpu", "tpu_interpret"):
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * num_axes,
                                vmem_limit_bytes=100 * 2**20)
  return None


def _interpret(backend: str):
  if backend == "interpret":
    return True
  if backend == "tpu_interpret":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams()
  return False


def _call(kernel, grid, in_specs, out_specs, out_shape, backend, bs, *, bwd):
  kwargs = {}
  params = _compiler_params(backend, bs, len(grid), bwd=bwd, head_dim=in_specs[0].block_shape[-1])
  if params is not None:
    kwargs["compiler_params"] = params
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=_interpret(backend), **kwargs)


def _full(x, head_of):
  """Whole-sequence block [n, ...] of one (batch, head): head_of maps program ids to the head."""
  nd = x.ndim
  return pl.BlockSpec((None, None) + x.shape[2:],
                      lambda *ids: (ids[0], head_of(*ids)) + (0,) * (nd - 2))


def _flags(ops: Operands):
  return dict(transport=ops.w is not None, gate=ops.fq is not None, segments=ops.sq is not None)


def forward(ops: Operands, *, scale: float, precision, backend: str, bs: BlockSizes):
  """-> o [B, H, n, C, D] (v's dtype), lse [B, H, n, C, 1] float32."""
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  f = _flags(ops)

  def chunk(x):  # this program's query chunk
    return pl.BlockSpec((None, None, None) + x.shape[3:], lambda b, h, c: (b, h, c, 0, 0))

  kv = lambda x: _full(x, lambda b, h, c: h // G)
  args, specs = [ops.q, ops.k, ops.v], [chunk(ops.q), kv(ops.k), kv(ops.v)]
  if f["transport"]:
    args += [ops.w, ops.u, ops.diag]
    specs += [kv(ops.w), kv(ops.u), chunk(ops.diag)]
  if f["gate"]:
    args += [ops.fq, ops.fk]
    specs += [chunk(ops.fq), _full(ops.fk, lambda b, h, c: h)]
  if f["segments"]:
    args += [ops.sq, ops.sk]
    specs += [pl.BlockSpec((None, None, None, C, 1), lambda b, h, c: (b, 0, c, 0, 0)),
              _full(ops.sk, lambda b, h, c: 0)]
  out_shape = [jax.ShapeDtypeStruct((B, H, n, C, D), ops.v.dtype),
               jax.ShapeDtypeStruct((B, H, n, C, 1), jnp.float32)]
  out_specs = [chunk(out_shape[0]), chunk(out_shape[1])]
  kernel = functools.partial(kernels.fwd_kernel, scale=scale, precision=precision, **f)
  return _call(kernel, (B, H, n), specs, out_specs, out_shape, backend, bs, bwd=False)(*args)


def backward(ops: Operands, do, lse, delta, *, scale: float, precision, backend: str,
             bs: BlockSizes):
  """Gradients w.r.t. the operands, per query head, float32:
  dict(q, k, v, w?, u?, diag?, fq?, fk?) with k, v, w, u still [B, H, ...] (sum over GQA groups)."""
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  f = _flags(ops)
  L = bs.bwd_lanes or (min(8, max(1, -(-264 // (B * H)))) if backend == "gpu" else 1)
  L = max(1, min(L, n))
  if L > 1 and backend != "gpu":
    raise ValueError(f"bwd_lanes={L} needs the GPU backend (TPU output blocks are written whole)")
  qh = lambda x: _full(x, lambda b, h, l: h)
  kv = lambda x: _full(x, lambda b, h, l: h // G)
  lane = lambda x: _full(x, lambda b, h, l: h * L + l)  # per-lane accumulators
  args, specs = [ops.q, ops.k, ops.v], [qh(ops.q), kv(ops.k), kv(ops.v)]
  if f["transport"]:
    args += [ops.w, ops.u]
    specs += [kv(ops.w), kv(ops.u)]
  args += [do, lse, delta]
  specs += [qh(do), qh(lse), qh(delta)]
  if f["gate"]:
    args += [ops.fq, ops.fk]
    specs += [qh(ops.fq), qh(ops.fk)]
  if f["segments"]:
    args += [ops.sq, ops.sk]
    specs += [_full(ops.sq, lambda b, h, l: 0), _full(ops.sk, lambda b, h, l: 0)]
  if f["transport"]:
    args.append(ops.diag)
    specs.append(qh(ops.diag))
  f32 = jnp.float32
  HL = H * L
  names = ["q", "k", "v"]
  shapes = [(B, H, n, C, D), (B, HL, n, C, D), (B, HL, n, C, D)]
  if f["transport"]:
    names += ["w", "u", "diag", "states"]
    shapes += [(B, HL, n, C, D)] * 2 + [(B, H, n, C, C), (B, HL, n, C, D)]
  if f["gate"]:
    names += ["fq", "fk"]
    shapes += [(B, H, n, C, 1), (B, HL, n, 1, C)]
  out_shape = [jax.ShapeDtypeStruct(s, f32) for s in shapes]
  out_specs = [lane(s) if s.shape[1] == HL and L > 1 else qh(s) for s in out_shape]
  kernel = functools.partial(kernels.bwd_kernel, scale=scale, precision=precision, lanes=L, **f)
  outs = _call(kernel, (B, H, L), specs, out_specs, out_shape, backend, bs, bwd=True)(*args)
  grads = dict(zip(names, outs))
  grads.pop("states", None)
  for name in ("k", "v", "w", "u", "fk"):  # lanes summed in a fixed order: deterministic
    if name in grads and L > 1:
      grads[name] = grads[name].reshape(B, H, L, *grads[name].shape[2:]).sum(2)
  return grads
