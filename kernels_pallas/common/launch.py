"""The bottom of the package: pallas_call with per-backend compiler parameters, the launch
grids, the BlockSpecs every form shares, and the dot precisions.

Backends: "gpu" lowers through Triton (`pl.pallas_call`), "tpu" through Mosaic; "interpret"
runs the generic interpreter and "tpu_interpret" the TPU interpreter (`pltpu.InterpretParams`),
both on a CPU. Nothing here chooses a form or a tile: the callers do (PaTH / FoX's plan,
path_attention/plan.py; each other kernel's api.py) and pass what they chose (warps, stages)
down.
"""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

BACKENDS = ("gpu", "tpu", "interpret", "tpu_interpret")

# pallas_call imports its GPU lowerings (Triton, Mosaic GPU) when it first lowers one. On a GPU
# that import adds a config state to JAX's tracing context, so a jitted function traced before
# it (a train step, whose own first lowering reaches the kernels) missed its trace cache at its
# next call and was compiled a second time. Importing them with the package keeps the context
# fixed from the first trace on.
_GPU_LOWERINGS = ("jax._src.pallas.triton.pallas_call_registration",
                  "jax._src.pallas.mosaic_gpu.pallas_call_registration")


def load_gpu_lowerings() -> None:
  for name in _GPU_LOWERINGS:
    try:
      importlib.import_module(name)
    except ImportError:  # a jaxlib without that backend: nothing of it can lower anyway
      pass


load_gpu_lowerings()


def resolve_backend(interpret: bool, backend: str | None) -> str:
  """`backend` when given (one of BACKENDS), else "interpret" with interpret=True, else the
  default device's platform ("gpu" or "tpu")."""
  if backend is not None:
    if backend not in BACKENDS:
      raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    return backend
  if interpret:
    return "interpret"
  platform = jax.default_backend()
  if platform not in ("gpu", "tpu"):
    raise ValueError(f"no Pallas backend for platform {platform!r}: pass interpret=True")
  return platform


def pow2(n: int, least: int = 1) -> int:
  """The smallest power of two >= n and >= least (Triton's blocks are powers of two, and its
  dots want sides of 16 or more)."""
  return max(least, 1 << max(int(n) - 1, 0).bit_length())


def tile(requested, default: int, T: int, what: str) -> int:
  """A tile along T: `requested` (a power of two >= 16; `what` names it in the error), else
  `default`, at most T rounded up to a power of two >= 16."""
  if requested is not None and (requested < 16 or requested & (requested - 1)):
    raise ValueError(f"{what}={requested} must be a power of two >= 16")
  return min(requested or default, pow2(T, 16))


def is_tpu(backend: str) -> bool:
  return backend in ("tpu", "tpu_interpret")


def compiler_params(backend: str, num_axes: int, *, warps: int, stages: int,
                    sequential_axes: int = 0):
  """Triton's warps and pipeline stages on the GPU; on the TPU the grid's dimension semantics
  (the last `sequential_axes` axes carry VMEM scratch from step to step: "arbitrary")."""
  if backend == "gpu":
    return pltriton.CompilerParams(num_warps=warps, num_stages=stages)
  if is_tpu(backend):
    sem = ("parallel",) * (num_axes - sequential_axes) + ("arbitrary",) * sequential_axes
    return pltpu.CompilerParams(dimension_semantics=sem, vmem_limit_bytes=100 * 2**20)
  return None


def interpret_params(backend: str):
  if backend == "interpret":
    return True
  if backend == "tpu_interpret":
    return pltpu.InterpretParams()
  return False


def pad_axis(x, axis: int, size: int, value=0):
  """x zero- (or `value`-) padded at the end of `axis` to `size`; None stays None."""
  if x is None or x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def with_nones(kernel, present):
  """`kernel` (a functools.partial) called with None in place of each absent operand:
  pallas_call passes only the arrays it was given; `present` flags each ref slot."""
  def run(*refs):
    refs = list(refs)
    kernel(*[refs.pop(0) if p else None for p in present])
  run.__name__ = kernel.func.__name__   # the launch's name in the lowered program
  return run


def call_present(kernel, grid, operands, outs, *, backend: str, warps: int, stages: int,
                 aliases=None):
  """call() with optional operands: operands and outs are (array / ShapeDtypeStruct or None,
  BlockSpec) pairs, None meaning absent; `kernel` (a functools.partial) sees None there.
  aliases index the present operands and outputs."""
  present = [x is not None for x, _ in operands] + [x is not None for x, _ in outs]
  return call(with_nones(kernel, present), grid, [s for x, s in operands if x is not None],
              [s for x, s in outs if x is not None], [x for x, _ in outs if x is not None],
              backend=backend, warps=warps, stages=stages, aliases=aliases)(
                  *[x for x, _ in operands if x is not None])


def call(kernel, grid, in_specs, out_specs, out_shape, *, backend: str, warps: int = 4,
         stages: int = 1, scratch=(), sequential_axes: int = 0, aliases=None):
  """pl.pallas_call of `kernel` on `backend`; warps and stages count on the GPU only."""
  kwargs = {"input_output_aliases": aliases} if aliases else {}
  params = compiler_params(backend, len(grid), warps=warps, stages=stages,
                           sequential_axes=sequential_axes)
  if params is not None:
    kwargs["compiler_params"] = params
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=interpret_params(backend),
                        scratch_shapes=scratch, **kwargs)


def float32_precision(backend: str):
  """Dot precision that keeps float32 accuracy on `backend`.

  On the GPU, Precision.HIGHEST lowers to Triton's IEEE form (FMA, no tensor cores): float32
  models ran ~60x slower than bf16. Three-pass TF32 (TF32_TF32_F32_X3: hi*hi + hi*lo + lo*hi on
  tensor cores) keeps ~1e-6 relative error per product. The interpreters and the TPU take
  HIGHEST (exact float32 / multi-pass bf16)."""
  if backend == "gpu":
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  return jax.lax.Precision.HIGHEST


def bf16x3_precision(backend: str):
  """Three bf16 tensor-core passes (BF16_BF16_F32_X3, ~16 mantissa bits) on the GPU, where a
  bf16 MMA has twice a TF32 MMA's throughput; the interpreter's CPU dot ignores the preset
  (exact float32, which the tests' GPU emulation replaces by the split); the TPU takes
  HIGHEST."""
  if backend in ("gpu", "interpret"):
    return jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
  return jax.lax.Precision.HIGHEST


def chunk_grid(B, H, n, backend, *, reverse=False):
  """-> (grid, ids, chunk_axis) of a launch with one program per (batch, head, chunk); ids maps
  program ids to (b, h, chunk).

  On the GPU the chunk axis comes first: Triton launches grid axis 0 as CUDA's x, the
  fastest-varying index, so the chunks of one head run side by side and their repeated reads of
  that head's whole-sequence operands hit L2 (with the batch first, co-resident programs read
  different heads' copies from HBM). `reverse` runs chunk n-1 first (the longest causal walks
  start first). TPU grids run the last axis innermost, so they keep (batch, head, chunk)."""
  if not is_tpu(backend):
    return (n, H, B), lambda i, h, b: (b, h, n - 1 - i if reverse else i), 0
  return (B, H, n), lambda b, h, c: (b, h, c), 2


def full(x, ids, head_of):
  """Whole-sequence block [n, ...] of one (batch, head): ids maps program ids to (b, h, ...),
  head_of maps the program's head to the operand's head."""
  nd = x.ndim
  return pl.BlockSpec((None, None) + x.shape[2:],
                      lambda *p: (ids(*p)[0], head_of(ids(*p)[1])) + (0,) * (nd - 2))


def query_major_documents(docs, bq: int, T: int) -> list:
  """(operand, spec) pairs of a documents operand (tiles.documents, or None) for a program of
  a (query tile, head, batch) grid: the tile's segment ids [bq], every key's [T], and the
  walk's first key tile (its row of lo [n, 1, 1]); Nones without documents."""
  seg, lo, _ = (None, None, None) if docs is None else docs
  return [(seg, pl.BlockSpec((None, bq), lambda i, h, b: (b, i))),
          (seg, pl.BlockSpec((None, T), lambda i, h, b: (b, 0))), (lo, _bounds_spec(lo))]


def key_major_documents(docs, bk: int, T: int) -> list:
  """As query_major_documents for a (key tile, kv head, batch) grid: every query's segment
  ids [T], the tile's [bk], and the walk's last query tile (its row of hi [n, 1, 1])."""
  seg, _, hi = (None, None, None) if docs is None else docs
  return [(seg, pl.BlockSpec((None, T), lambda j, h, b: (b, 0))),
          (seg, pl.BlockSpec((None, bk), lambda j, h, b: (b, j))), (hi, _bounds_spec(hi))]


def _bounds_spec(x):
  """The whole [n, 1, 1] row of a batch's tile bounds [B, n, 1, 1]; None for absent bounds."""
  return None if x is None else pl.BlockSpec((None,) + x.shape[1:], lambda i, h, b: (b, 0, 0, 0))


def time_major_spec(x, ids, head_of, heads=None):
  """Whole-sequence block of a time-major array (v, dO, dv: chunked [B, n, C, X, D] or merged
  [B, Tp, X, D]) -> the kernel's ref [n, C, D] / [Tp, D] of one head (heads None), or of
  `heads` adjacent heads [n, C, heads, D] / [Tp, heads, D] (read through
  path_attention/tiles.HeadsMinor),
  block index head_of(h); ids maps program ids to (b, head, ...). Rows are strided (X * D
  elements apart): the blocked layout's tiles without transposes into and out of it."""
  lead = x.shape[1:-2]
  return pl.BlockSpec((None,) + lead + (heads, x.shape[-1]),
                      lambda *p: (ids(*p)[0],) + (0,) * len(lead) + (head_of(ids(*p)[1]), 0))


def time_major_chunk(x, ids):
  """One chunk's [C, D] block of a chunked [B, n, C, X, D] array; ids maps program ids to
  (b, head, chunk)."""
  return pl.BlockSpec((None, None, x.shape[2], None, x.shape[4]),
                      lambda *p: (ids(*p)[0], ids(*p)[2], 0, ids(*p)[1], 0))


def merged(x):
  """[B, H, n, C, ...] -> [B, H, n*C, ...]: chunks merged into time (a bitcast); None stays."""
  return None if x is None else x.reshape(x.shape[:2] + (x.shape[2] * x.shape[3],) + x.shape[4:])


def as_rows(x):
  """[..., n, C, 1] -> [..., n, 1, C] (None stays None): a query-side vector as a row, for
  key-major tiles (the same memory: a bitcast)."""
  return None if x is None else x.reshape(x.shape[:-2] + (1, x.shape[-2]))


def as_cols(x):
  """[..., n, 1, C] -> [..., n, C, 1] (None stays None): a key-side vector as a column."""
  return None if x is None else x.reshape(x.shape[:-2] + (x.shape[-1], 1))


def check_self_attention(what: str, q, k, v) -> tuple[int, int, int, int, int]:
  """(B, T, H, K, D) of q [B, T, H, D], k [B, T, K, D], v [B, T, K, Dv] with H a multiple of K,
  or one ValueError that starts with `what` (the kernel's name) and names the operand."""
  B, T, H, D = q.shape
  if k.ndim != 4 or k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
    raise ValueError(f"{what}: k {k.shape} must be [B, T, K, D] with q {q.shape}'s B, T and D")
  K = k.shape[2]
  if v.ndim != 4 or v.shape[:3] != k.shape[:3]:
    raise ValueError(f"{what}: v {v.shape} must be [B, T, K, Dv] with k {k.shape}")
  if H % K:
    raise ValueError(f"{what}: query heads {H} must be a multiple of kv heads {K}")
  return B, T, H, K, D


def check_shapes(what: str, *operands) -> None:
  """For each (name, array or None, expected shape): one ValueError that starts with `what`
  and names the first present operand whose shape differs."""
  for name, x, shape in operands:
    if x is not None and tuple(x.shape) != tuple(shape):
      raise ValueError(f"{what}: {name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def f32_shape(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)
