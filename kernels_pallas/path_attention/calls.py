"""pallas_call wrappers: grids, BlockSpecs and per-backend compiler parameters.

backend "gpu" lowers through Triton (`pl.pallas_call`), "tpu" through Mosaic; "interpret" runs
the generic interpreter and "tpu_interpret" the TPU interpreter (`pltpu.InterpretParams`), both
on CPU. The kernel bodies are the same for every backend (kernels.py); which form of each
runs (spans, Mosaic GPU launches, lanes) is routing.py's choice.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.path_attention import bwd_kernels
from kernels_pallas.path_attention import kernels
from kernels_pallas.path_attention import prepass
from kernels_pallas.path_attention import routing
from kernels_pallas.path_attention.block_sizes import BlockSizes
from kernels_pallas.path_attention.prepass import Operands


def _compiler_params(backend: str, bs: BlockSizes, num_axes: int, *, bwd: bool, head_dim: int,
                     kv_axis: bool = False, warps: int | None = None,
                     stages: int | None = None, sequential_axes: int = 1):
  if backend == "gpu":
    try:
      from jax.experimental.pallas import triton as pltriton
      cls = pltriton.CompilerParams
    except (ImportError, AttributeError):  # older spellings
      cls = getattr(pl, "GPUCompilerParams", None) or getattr(pl, "TritonCompilerParams")
    stages = stages or bs.num_stages or (2 if head_dim * bs.block_k <= 64 * 64 else 1)
    bwd_warps = bs.bwd_num_warps or (4 if head_dim <= 64 else 8)
    return cls(num_warps=warps or (bwd_warps if bwd else bs.num_warps), num_stages=stages)
  if backend in ("tpu", "tpu_interpret"):
    from jax.experimental.pallas import tpu as pltpu
    # the last `sequential_axes` axes carry VMEM scratch from step to step when kv_axis is set
    tail = sequential_axes if kv_axis else 0
    sem = ("parallel",) * (num_axes - tail) + ("arbitrary",) * tail
    return pltpu.CompilerParams(dimension_semantics=sem,
                                vmem_limit_bytes=100 * 2**20)
  return None


def flash_stages(bs: BlockSizes, dtype) -> int | None:
  """Pipeline stages of the span backward's flash-like kernels (boundary, far dq): 2 with 16-bit
  inputs at every head_dim, else _compiler_params' default (1 at head_dim 128: shared memory);
  BlockSizes.num_stages overrides. H200, 2026-11-25, 2 stages against 1 at head_dim 128: far
  dq 5.04 -> 4.40 ms at 8,4096,16,128 and 32.97 -> 28.07 at 4,16384,16,128, boundary 0.64 ->
  0.58 and 4.34 -> 3.81 (the forward kernel: 3.34 -> 3.35 and 25.54 -> 29.06, so it keeps
  1). Resource report at head_dim 128, bf16, 2 stages: far dq 160 KiB of shared memory,
  boundary 96 (with gate, segments and grouped heads too), of 227; float32 inputs 256, 192."""
  if bs.num_stages:
    return bs.num_stages
  return 2 if jnp.dtype(dtype).itemsize <= 2 else None


def prepass_compiler_params(backend: str, num_axes: int, num_warps: int = 4):
  """The pre-pass kernels (prepass_kernel.py): every grid axis independent, no pipelining."""
  return _compiler_params(backend, BlockSizes(num_stages=1, num_warps=num_warps), num_axes,
                          bwd=False, head_dim=0)


def float32_precision(backend: str):
  """Dot precision that keeps float32 accuracy on `backend`.

  On the GPU, Precision.HIGHEST lowers to Triton's IEEE (FMA, no tensor cores) form: float32
  models ran ~60x slower than bf16 and the pre-pass took minutes to compile. Three-pass TF32
  (TF32_TF32_F32_X3: hi*hi + hi*lo + lo*hi on tensor cores) keeps ~1e-6 relative error per
  product. The interpreters and the TPU take HIGHEST (exact float32 / multi-pass bf16).
  """
  if backend == "gpu":
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  return jax.lax.Precision.HIGHEST


def bf16x3_precision(backend: str):
  """Three bf16 tensor-core passes (BF16_BF16_F32_X3: hi*hi + hi*lo + lo*hi of a bf16 hi / lo
  split, ~16 mantissa bits) on the GPU, where a bf16 MMA has twice a TF32 MMA's throughput and
  half its operand registers; the interpreter's CPU dot ignores the preset (exact float32, which
  the tests' GPU emulation replaces by the split); the TPU takes HIGHEST."""
  if backend in ("gpu", "interpret"):
    return jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
  return jax.lax.Precision.HIGHEST


def _interpret(backend: str):
  if backend == "interpret":
    return True
  if backend == "tpu_interpret":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams()
  return False


def _call(kernel, grid, in_specs, out_specs, out_shape, backend, bs, *, bwd, scratch=(),
          warps=None, stages=None, sequential_axes=1, aliases=None):
  kwargs = {"input_output_aliases": aliases} if aliases else {}
  params = _compiler_params(backend, bs, len(grid), bwd=bwd, head_dim=in_specs[0].block_shape[-1],
                            kv_axis=bool(scratch), warps=warps, stages=stages,
                            sequential_axes=sequential_axes)
  if params is not None:
    kwargs["compiler_params"] = params
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=_interpret(backend), scratch_shapes=scratch,
                        **kwargs)


def chunk_grid(B, H, n, backend, *, reverse=False):
  """-> (grid, ids, chunk_axis) of a launch with one program per (batch, head, chunk); ids maps
  program ids to (b, h, chunk).

  On the GPU the chunk axis comes first: the Triton lowering launches grid axis 0 as CUDA's x,
  the fastest-varying index, so the chunks of one head run side by side and their repeated
  reads of that head's whole-sequence operands (k, v, E in the forward; q, dO, ... in dk/dv)
  hit L2. With the batch first, co-resident programs belonged to different heads and every
  program read its own copy from HBM (ncu, H200, 32,2048,32,64: 13.3 GB of DRAM reads for
  1.3 GB of operands in the forward kernel). `reverse` runs chunk n-1 first. TPU grids run the
  last axis innermost, so they keep (batch, head, chunk)."""
  if backend in ("gpu", "interpret"):
    return (n, H, B), lambda i, h, b: (b, h, n - 1 - i if reverse else i), 0
  return (B, H, n), lambda b, h, c: (b, h, c), 2


def _full(x, ids, head_of):
  """Whole-sequence block [n, ...] of one (batch, head): ids maps program ids to (b, h, c),
  head_of maps the program's head to the operand's head."""
  nd = x.ndim
  return pl.BlockSpec((None, None) + x.shape[2:],
                      lambda *p: (ids(*p)[0], head_of(ids(*p)[1])) + (0,) * (nd - 2))


def time_major_spec(x, ids, head_of, heads=None):
  """Whole-sequence block of a time-major array (v, dO, dv: chunked [B, n, C, X, D] or merged
  [B, Tp, X, D]) -> the kernel's ref [n, C, D] / [Tp, D] of one head (heads None), or of
  `heads` adjacent heads [n, C, heads, D] / [Tp, heads, D], block index head_of(h), which the
  kernels read through kernels.HeadsMinor; ids maps program ids to (b, head, ...). Rows are
  strided (X * D elements apart): the same tiles as the blocked layout's, without the
  transposes into and out of it (H200: fwd+bwd time the same, their strided reads in the hot
  loops cost what the transposes did; peak -0.5 GiB at 32,4096,32,64: RESULTS round 31)."""
  lead = x.shape[1:-2]
  return pl.BlockSpec((None,) + lead + (heads, x.shape[-1]),
                      lambda *p: (ids(*p)[0],) + (0,) * len(lead) + (head_of(ids(*p)[1]), 0))


def time_major_chunk(x, ids):
  """One chunk's [C, D] block of a chunked [B, n, C, X, D] array; ids maps program ids to
  (b, head, chunk)."""
  return pl.BlockSpec((None, None, x.shape[2], None, x.shape[4]),
                      lambda *p: (ids(*p)[0], ids(*p)[2], 0, ids(*p)[1], 0))


def _flags(ops: Operands):
  return dict(transport=ops.e is not None, gate=ops.fq is not None, segments=ops.sq is not None)


def _bounds(ops: Operands, backend: str) -> bool:
  """Segment-aware chunk skipping (prepass.chunk_bounds): on the GPU and in the interpreter.
  TPU kernels walk every chunk pair: a loop bound read from a VMEM block is a vector value
  there (it would need scalar prefetch into SMEM)."""
  return ops.lo is not None and backend in ("gpu", "interpret")


def forward(ops: Operands, *, scale: float, precision, backend: str, bs: BlockSizes,
            boundary=None):
  """-> o [B, n, C, H, D] (chunked: time-major, as the caller takes it; v's dtype), lse
  [B, H, n, C, 1] float32. With
  routing.forward_span(...) > 0 the kernel reads the keys moved to their span's end and the span
  operators, `boundary` (span_boundary's; computed here when None)."""
  if backend in ("tpu", "tpu_interpret"):
    o, lse = _forward_kv(ops, scale=scale, precision=precision, backend=backend, bs=bs)
    return prepass.time_major(o), lse
  if bs.fwd_kernel == "mosaic":
    from kernels_pallas.path_attention import fwd_mosaic
    why = fwd_mosaic.supported(ops, bs)
    if backend != "gpu" or why:
      raise ValueError(f"fwd_kernel='mosaic' needs the GPU backend and PaTH in bf16/f16 at "
                       f"block 64 (got backend {backend!r}{', ' + why if why else ''})")
    return fwd_mosaic.forward(ops, scale=scale)
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  f = _flags(ops)
  grid, ids, axis = chunk_grid(B, H, n, backend, reverse=True)

  def chunk(x):  # this program's query chunk
    return pl.BlockSpec((None, None, None) + x.shape[3:], lambda *p: ids(*p) + (0, 0))

  kv = lambda x: _full(x, ids, lambda h: h // G)
  args = [ops.q, ops.k, ops.v]
  specs = [chunk(ops.q), kv(ops.k), time_major_spec(ops.v, ids, lambda h: h // G)]
  if f["transport"]:
    args += [ops.e, ops.diag]
    specs += [kv(ops.e), chunk(ops.diag)]
  if f["gate"]:
    args += [ops.fq, ops.fk]
    specs += [chunk(ops.fq), _full(ops.fk, ids, lambda h: h)]
  if f["segments"]:
    args += [ops.sq, ops.sk]
    specs += [pl.BlockSpec((None, None, None, C, 1),
                           lambda *p: (ids(*p)[0], 0, ids(*p)[2], 0, 0)),
              _full(ops.sk, ids, lambda h: 0)]
  bounds = _bounds(ops, backend)
  if bounds:
    args.append(ops.lo)
    specs.append(_full(ops.lo, ids, lambda h: 0))
  span = routing.forward_span(ops, bs, backend)
  far = routing.far_launch(ops, bs, backend, span)
  fine = None
  if span:
    from kernels_pallas.path_attention import calls_span
    kb, pi = boundary if boundary is not None else span_boundary(
        ops, precision=precision, backend=backend, bs=bs)
    args += [kb, pi]
    specs += [kv(kb), kv(pi)]
    fine = calls_span.chain_precision(ops.q, precision=precision, backend=backend, bs=bs)
  # with the far keys in a launch of their own, the near part's o stays float32 for the merge
  # o time-major: the caller's [B, T, H, D] is a reshape of it (no transpose pass)
  out_shape = [jax.ShapeDtypeStruct((B, n, C, H, D), jnp.float32 if far else ops.v.dtype),
               jax.ShapeDtypeStruct((B, H, n, C, 1), jnp.float32)]
  out_specs = [time_major_chunk(out_shape[0], ids), chunk(out_shape[1])]
  if span:   # the query states at the span boundaries, packed (the far launch reads them)
    out_shape.append(jax.ShapeDtypeStruct(
        (B, H, kernels.boundary_array_rows(n=n, span=span, C=C), D), ops.q.dtype))
    out_specs.append(_full(out_shape[-1], ids, lambda h: h))
  kernel = functools.partial(kernels.fwd_kernel, scale=scale, precision=precision,
                             chunk_axis=axis, reverse=True, bounds=bounds, span=span, fine=fine,
                             far=not far, **f)
  outs = _call(kernel, grid, specs, out_specs, out_shape, backend, bs, bwd=False)(*args)
  if not far:
    return tuple(outs[:2])
  from kernels_pallas.path_attention import fwd_far_mosaic
  far_fn = fwd_far_mosaic.far_forward if backend == "gpu" else fwd_far_mosaic.far_reference
  o_far, lse_far = far_fn(ops, kb, outs[2], scale=scale, span=span)
  return fwd_far_mosaic.merge_far(outs[0], outs[1], o_far, lse_far, dtype=ops.v.dtype)


def _forward_kv(ops: Operands, *, scale: float, precision, backend: str, bs: BlockSizes):
  """TPU form: grid (B, H, n, n) with the key-chunk axis j last ("arbitrary"); step j reads key
  chunk max(c - j, 0), so skipped steps (j > c) keep the block index and fetch nothing."""
  ops = ops._replace(v=prepass.heads_major(ops.v))   # TPU blocks: [C, D] tiles of [.., n, C, D]
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  f = _flags(ops)
  blk = lambda x: (None, None, None) + x.shape[3:]
  qspec = lambda x: pl.BlockSpec(blk(x), lambda b, h, c, j: (b, h, c, 0, 0))
  kspec = lambda x, head: pl.BlockSpec(
      blk(x), lambda b, h, c, j: (b, head(h), jnp.maximum(c - j, 0), 0, 0))
  kv = lambda x: kspec(x, lambda h: h // G)
  args, specs = [ops.q, ops.k, ops.v], [qspec(ops.q), kv(ops.k), kv(ops.v)]
  if f["transport"]:
    args += [ops.e, ops.diag]
    specs += [kv(ops.e), qspec(ops.diag)]
  if f["gate"]:
    args += [ops.fq, ops.fk]
    specs += [qspec(ops.fq), kspec(ops.fk, lambda h: h)]
  if f["segments"]:
    args += [ops.sq, ops.sk]
    specs += [pl.BlockSpec(blk(ops.sq), lambda b, h, c, j: (b, 0, c, 0, 0)),
              kspec(ops.sk, lambda h: 0)]
  out_shape = [jax.ShapeDtypeStruct((B, H, n, C, D), ops.v.dtype),
               jax.ShapeDtypeStruct((B, H, n, C, 1), jnp.float32)]
  out_specs = [qspec(out_shape[0]), qspec(out_shape[1])]
  from jax.experimental.pallas import tpu as pltpu
  f32 = jnp.float32
  scratch = [pltpu.VMEM((C, D), f32), pltpu.VMEM((C, 1), f32), pltpu.VMEM((C, 1), f32),
             pltpu.VMEM((C, D), f32)]
  kernel = functools.partial(kernels.fwd_kv_kernel, scale=scale, precision=precision, **f)
  return _call(kernel, (B, H, n, n), specs, out_specs, out_shape, backend, bs, bwd=False,
               scratch=scratch)(*args)


def backward(ops: Operands, do, lse, delta, *, scale: float, precision, backend: str,
             bs: BlockSizes, boundary=None):
  """Gradients w.r.t. the operands: dict(q [B,H,..], k [B,K,..], v [B,n,C,K,D] (chunked, as
  ops.v), diag? in the kernel dtype; dp [B,K,n,D,D]? (dL/dP per chunk), fq?, fk? float32).
  do [B, n, C, H, D] (chunked); lse, delta [B, H, n, C, 1]. PaTH with a span boundary inside the
  sequence takes the span-parallel form (bwd_spans, calls_span.backward); otherwise two
  kernels: dq/dP sequential per (batch, kv head, lane), then dk/dv parallel over key chunks (it
  reads dq/dP's boundary states with dkv_span). The TPU takes bwd_tpu.backward (one chunk per
  block)."""
  kw = dict(scale=scale, precision=precision, backend=backend, bs=bs)
  if backend in ("tpu", "tpu_interpret"):
    from kernels_pallas.path_attention import bwd_tpu
    g = bwd_tpu.backward(ops._replace(v=prepass.heads_major(ops.v)), prepass.heads_major(do),
                         lse, delta, **kw)
    return {**g, "v": prepass.time_major(g["v"])}
  if routing.fused_dkv(ops, bs, backend):
    return backward_dq(ops, do, lse, delta, **kw)
  span, kw["bs"] = routing.span_backward(ops, bs, backend)
  if span:
    from kernels_pallas.path_attention import calls_span
    return calls_span.backward(ops, do, lse, delta, span=span, boundary=boundary, **kw)
  grads = backward_dq(ops, do, lse, delta, **kw)   # first: with dkv_span it gives qb to dk/dv
  return {**backward_dkv(ops, do, lse, delta, qb=grads.pop("qb", None), **kw), **grads}


def span_boundary(ops: Operands, *, precision, backend: str, bs: BlockSizes):
  """(kb, pi) of calls_span's boundary launch where the span forward reads it (forward_span),
  else None. The forward makes it once and the span backward reads it from the residuals;
  without the span forward the backward makes its own (a residual would hold one k-sized
  array per layer from the forward to the backward)."""
  span = routing.forward_span(ops, bs, backend)
  if not span:
    return None
  from kernels_pallas.path_attention import calls_span
  return calls_span._boundary(ops, span=span, nb=(ops.q.shape[2] - 1) // span,
                              precision=precision, backend=backend, bs=bs)


def _bwd_inputs(ops: Operands, do, lse, delta, grid_kv, *, bounds: bool):
  """Operands and BlockSpecs of both backward kernels; grid_kv maps program ids to (b, kv head).
  bounds: append the chunk bounds (lo, hi) last. v and do are time-major (chunked, or do merged
  [B, Tp, H, D]): one kv head's v, the group's G heads of do."""
  G = ops.q.shape[1] // ops.k.shape[1]
  f = _flags(ops)
  grp = lambda x: pl.BlockSpec((None, G) + x.shape[2:],
                               lambda *i: (grid_kv(*i)[0], grid_kv(*i)[1]) + (0,) * (x.ndim - 2))
  kvh = lambda x: pl.BlockSpec((None, None) + x.shape[2:],
                               lambda *i: grid_kv(*i) + (0,) * (x.ndim - 2))
  seg = lambda x: pl.BlockSpec((None, None) + x.shape[2:],
                               lambda *i: (grid_kv(*i)[0], 0) + (0,) * (x.ndim - 2))
  args, specs = [ops.q, ops.k, ops.v], [grp(ops.q), kvh(ops.k),
                                        time_major_spec(ops.v, grid_kv, lambda h: h)]
  if f["transport"]:
    args.append(ops.e)
    specs.append(kvh(ops.e))
  args += [do, lse, delta]
  specs += [time_major_spec(do, grid_kv, lambda h: h, heads=G), grp(lse), grp(delta)]
  if f["gate"]:
    args += [ops.fq, ops.fk]
    specs += [grp(ops.fq), grp(ops.fk)]
  if f["segments"]:
    args += [ops.sq, ops.sk]
    specs += [seg(ops.sq), seg(ops.sk)]
  if f["transport"]:
    args.append(ops.diag)
    specs.append(grp(ops.diag))
  if bounds:
    args += [ops.lo, ops.hi]
    specs += [seg(ops.lo), seg(ops.hi)]
  return args, specs, grp


def backward_dkv(ops: Operands, do, lse, delta, *, scale: float, precision, backend: str,
                 bs: BlockSizes, qb=None, far_out=False, far_in=None):
  """dk, dv (and dfk): grid (B, K, key chunk), every program independent. qb: the dq/dP
  kernel's boundary states [B, H, R, D] (packed: kernels.boundary_offset) when
  routing.dkv_span(ops, bs, backend) > 0. far_out
  (with qb): also "a" [B, K, n, C, D] float32, the far walk's scale sum dS^T qb per key chunk
  (calls_span.py). far_in (instead of qb): the far walk's a, dv [B, K, n, C, D] and dfk
  [B, H, n, 1, C] (or None) float32 from calls_span._far_dkv; the kernel adds them."""
  B, H, n, C, D = ops.q.shape
  K = ops.k.shape[1]
  G = H // K
  f = _flags(ops)
  f32 = jnp.float32
  grid, ids, axis = chunk_grid(B, K, n, backend)
  bounds = _bounds(ops, backend)
  km = bs.dkv_keys_major
  if km:   # query-side vectors as rows, key-side ones as columns (dkv_kernel's keys_major)
    ops = ops._replace(fq=as_rows(ops.fq), fk=as_cols(ops.fk), sq=as_rows(ops.sq),
                       sk=as_cols(ops.sk))
    lse, delta = as_rows(lse), as_rows(delta)
  vec = (C, 1) if km else (1, C)   # dfk's block: a column or a row of the key chunk
  args, specs, grp = _bwd_inputs(ops, do, lse, delta, lambda *p: ids(*p)[:2], bounds=bounds)
  span = routing.dkv_span(ops, bs, backend)
  chunk = lambda s: pl.BlockSpec((None, None, None) + s.shape[3:], lambda *p: ids(*p) + (0, 0))
  if span and far_in is not None:
    fa, fdv, fdfk = far_in
    args += [fa, fdv] + ([fdfk.reshape(B, H, n, *vec)] if f["gate"] else [])
    specs += [chunk(fa), chunk(fdv)]
    if f["gate"]:
      specs.append(pl.BlockSpec((None, G, None) + vec, lambda *p: ids(*p) + (0, 0)))
  elif span:
    if qb is None:
      raise ValueError("dkv_span: backward_dkv needs the boundary states qb of backward_dq")
    args.append(qb)
    specs.append(grp(qb))
  gdt = ops.q.dtype  # gradients leave in the kernel dtype (accumulated in float32 on chip)
  out_shape = [jax.ShapeDtypeStruct((B, K, n, C, D), gdt), jax.ShapeDtypeStruct(ops.v.shape, gdt)]
  out_specs = [chunk(out_shape[0]), time_major_chunk(out_shape[1], ids)]
  if f["gate"]:
    out_shape.append(jax.ShapeDtypeStruct((B, H, n) + vec, f32))
    out_specs.append(pl.BlockSpec((None, G, None) + vec, lambda *p: ids(*p) + (0, 0)))
  far_out = far_out and bool(span)
  if far_out:
    out_shape.append(jax.ShapeDtypeStruct((B, K, n, C, D), f32))
    out_specs.append(chunk(out_shape[-1]))
  kernel = functools.partial(bwd_kernels.dkv_kernel, scale=scale, precision=precision,
                             chunk_axis=axis, bounds=bounds, span=span, far_out=far_out,
                             far_in=bool(span) and far_in is not None,
                             gate_colsum=bs.gate_colsum, keys_major=km, **f)
  # Without grouped heads two stages fit in shared memory at head_dim 128 too, and pay (H200
  # dk/dv 14.1 -> 13.6 ms at 8,4096,16,128, 112.9 -> 100.0 ms at 4,16384,16,128); with G = 2
  # they ask for 273 of 227 KiB. Grouped float32 heads take one stage at every head_dim (G = 2,
  # D = 64: two stages asked for 258 KiB on the H100, 2026-11-23).
  stages = 2 if G == 1 else (1 if ops.q.dtype.itemsize == 4 else None)
  outs = _call(kernel, grid, specs, out_specs, out_shape, backend, bs, bwd=True,
               stages=bs.num_stages or stages)(*args)
  grads = dict(k=outs[0], v=outs[1])
  if f["gate"]:
    grads["fk"] = outs[2].reshape(B, H, n, 1, C)
  if far_out:
    grads["a"] = outs[-1]
  return grads


def as_rows(x):
  """[..., n, C, 1] -> [..., n, 1, C] (None stays None): a query-side vector as a row, for the
  key-major dk/dv kernels (the same memory: a bitcast)."""
  return None if x is None else x.reshape(x.shape[:-2] + (1, x.shape[-2]))


def as_cols(x):
  """[..., n, 1, C] -> [..., n, C, 1] (None stays None): a key-side vector as a column."""
  return None if x is None else x.reshape(x.shape[:-2] + (x.shape[-1], 1))


def _merged(x):
  """[B, H, n, C, ...] -> [B, H, n*C, ...]: chunks merged into time (contiguous: a bitcast)."""
  return None if x is None else x.reshape(x.shape[:2] + (x.shape[2] * x.shape[3],) + x.shape[4:])


def backward_dq(ops: Operands, do, lse, delta, *, scale: float, precision, backend: str,
                bs: BlockSizes):
  """dq, d diag, dfq and dL/dP: grid (B, K, lane), sequential inside. The query-side operands
  go in with their chunks merged into time (bwd_kernels.dq_kernel loads 2C-row pairs)."""
  B, H, n, C, D = ops.q.shape
  K = ops.k.shape[1]
  f = _flags(ops)
  pairs = bs.dq_pairs and f["transport"]
  G = H // K
  units = n // 2 if pairs else n  # per head: query-chunk pairs or chunks
  if bs.bwd_lanes == 0 and backend in ("gpu", "interpret"):
    L = routing.auto_lanes(B * K, units, routing.gpu_sm_count(backend))
  else:
    L = max(1, min(bs.bwd_lanes or 1, units))
  if L > 1 and backend not in ("gpu", "interpret"):
    raise ValueError(f"bwd_lanes={L} needs the GPU backend or the interpreter (TPU output "
                     "blocks are written whole)")
  f32 = jnp.float32
  gdt = ops.q.dtype
  merged = ops._replace(q=_merged(ops.q), diag=_merged(ops.diag), fq=_merged(ops.fq),
                        sq=_merged(ops.sq))
  bounds = _bounds(ops, backend)
  args, specs, grp = _bwd_inputs(merged, prepass.unchunked(do), _merged(lse), _merged(delta),
                                 lambda b, kh, l: (b, kh), bounds=bounds)
  lane = lambda s: pl.BlockSpec((None, None) + s.shape[2:],
                                lambda b, kh, l: (b, kh * L + l) + (0,) * (len(s.shape) - 2))
  names, out_shape = ["q"], [jax.ShapeDtypeStruct((B, H, n * C, D), gdt)]
  span = routing.dkv_span(ops, bs, backend)
  if f["transport"]:
    names += ["diag", "dp", "states"]
    out_shape += [jax.ShapeDtypeStruct((B, H, n * C, C), gdt),
                  jax.ShapeDtypeStruct((B, K * L, n, D, D), f32),
                  jax.ShapeDtypeStruct((B, K * L, n, C * (1 + pairs), D), ops.q.dtype)]
  if span:
    names.append("qb")
    out_shape.append(jax.ShapeDtypeStruct(
        (B, H, kernels.boundary_array_rows(n=n, span=span, C=C), D), ops.q.dtype))
  if f["gate"]:
    names.append("fq")
    out_shape.append(jax.ShapeDtypeStruct((B, H, n * C, 1), f32))
  kv = routing.fused_dkv(ops, bs, backend)
  if kv:  # this lane's share of the key-side gradients, float32 (summed over lanes below)
    names += ["k", "v"] + (["fk"] if f["gate"] else [])
    out_shape += [jax.ShapeDtypeStruct((B, K * L, n, C, D), f32)] * 2
    if f["gate"]:
      out_shape.append(jax.ShapeDtypeStruct((B, K * L, G, n, 1, C), f32))
  per_lane = ("dp", "states", "k", "v", "fk")
  out_specs = [lane(s) if n_ in per_lane else grp(s) for n_, s in zip(names, out_shape)]
  kernel = functools.partial(bwd_kernels.dq_kernel, scale=scale, precision=precision, lanes=L,
                             pairs=pairs, bounds=bounds, kv=kv, span=span, **f)
  outs = _call(kernel, (B, K, L), specs, out_specs, out_shape, backend, bs, bwd=True,
               warps=bs.dq_num_warps or (8 if pairs else None))(*args)
  more = dict(zip(names, outs))
  more.pop("states", None)
  for name in ("q", "diag", "fq"):  # back to [B, H, n, C, ...]
    if name in more:
      more[name] = more[name].reshape(B, H, n, C, *more[name].shape[3:])
  for name in ("dp", "k", "v", "fk") if L > 1 else ():  # lanes summed in a fixed order
    if name in more:
      x = more[name]
      more[name] = x.reshape(B, K, L, *x.shape[2:]).sum(2)
  if kv:  # as the dk/dv kernel leaves them: k, v (chunked) in the kernel dtype, fk [B, H, n, 1, C]
    more["k"], more["v"] = more["k"].astype(gdt), prepass.time_major(more["v"].astype(gdt))
    if "fk" in more:
      more["fk"] = more["fk"].reshape(B, H, n, 1, C)
  return more
