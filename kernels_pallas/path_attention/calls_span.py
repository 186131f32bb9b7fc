"""pallas_call wrappers of the span-parallel PaTH backward (bwd_span.py; BlockSizes.bwd_spans).

GPU and interpreter only (the TPU takes bwd_tpu.py). Launch order: boundary (kb, Pi), far dq
(qb, A, far dfq), the key side (bwd_spans 2: calls.backward_dkv, dk, dv, dfk whole and the far
accumulator a; 1: far dk/dv, a and the far dv, dfk; 3: far dk/dv, then calls.backward_dkv
inside the spans adding them), Y_J in XLA, then the span kernel. Every
launch is parallel over chunks or spans; the outputs are those of calls.backward.

Known repetition: the boundary kernel's operator walk (key chunk m to its span's end) is the
one the dk/dv kernel repeats for its near queries in form 2. The dk/dv kernel needs qb, which
the far dq kernel makes from the boundary kernel's Pi, so the walk cannot move into it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.path_attention import bwd_span
from kernels_pallas.path_attention import calls
from kernels_pallas.path_attention import kernels
from kernels_pallas.path_attention import prepass
from kernels_pallas.path_attention import routing
from kernels_pallas.path_attention.prepass import Operands


def fine_precision(dtype, precision, backend: str, products: str = "bf16x3"):
  """The precision of the span backward's products of aggregated D x D operators (Pi, the V and
  N chains; float32 operands): three bf16 passes (~16 mantissa bits) for 16-bit inputs, the
  inputs' own float32 precision otherwise; products="tf32" (BlockSizes.chain_products): the
  kernels' own precision at every input dtype, one TF32 pass for 16-bit inputs on the GPU. An
  aggregate rounded to bf16 once carries that rounding into everything it moves. Measured
  effect, small: mean relative RMS of dw / dbeta over 8 seeds (interpret with the GPU's
  rounding, bf16, correlated w, T 64, chunk 16) 4.8e-3 / 4.4e-3 with bf16 operands, 4.7e-3 /
  4.5e-3 with these, 4.6e-3 / 4.3e-3 with the boundary kernel's walk in them too (not taken: ~3x
  its products), 4.5e-3 / 4.0e-3 for the sweep."""
  if products == "tf32" or jnp.dtype(dtype).itemsize > 2:
    return precision
  return calls.bf16x3_precision(backend)


def chain_precision(x, *, precision, backend: str, bs: calls.BlockSizes):
  """fine_precision for a launch whose operand x ([..., D]) sets the dtype and head_dim, with
  BlockSizes.chain_products resolved (routing.chain_products)."""
  return fine_precision(x.dtype, precision, backend,
                        routing.chain_products(bs, head_dim=x.shape[-1]))


def _boundary(ops: Operands, *, span, nb, precision, backend, bs):
  """-> kb [B, K, n, C, D] (kernel dtype), pi [B, K, nb, D, D] float32."""
  B, K, n, C, D = ops.k.shape
  grid, ids, axis = calls.chunk_grid(B, K, n, backend)
  full = lambda x: calls._full(x, ids, lambda h: h)
  kb = jax.ShapeDtypeStruct(ops.k.shape, ops.k.dtype)
  pi = jax.ShapeDtypeStruct((B, K, nb, D, D), jnp.float32)
  out_specs = [pl.BlockSpec((None, None, None, C, D), lambda *p: ids(*p) + (0, 0)),
               # the span's block; the last span's chunks write nothing and map to block nb-1
               pl.BlockSpec((None, None, None, D, D), lambda *p: (
                   ids(*p)[0], ids(*p)[1], jnp.minimum(ids(*p)[2] // span, nb - 1), 0, 0))]
  fine = chain_precision(ops.k, precision=precision, backend=backend, bs=bs)
  kernel = functools.partial(bwd_span.boundary_kernel, span=span, nb=nb, chunk_axis=axis,
                             precision=precision, fine=fine)
  return calls._call(kernel, grid, [full(ops.k), full(ops.e)], out_specs, [kb, pi], backend, bs,
                     bwd=True, stages=calls.flash_stages(bs, ops.k.dtype))(ops.k, ops.e)


def _optional_inputs(ops: Operands, bounds: bool, *, query, seg, hi: bool):
  """The operands that only some calls have, in the kernels' order, with their BlockSpecs: the
  gate sums (fq, fk; `query`'s spec), the segment ids (sq, sk) and chunk bounds (lo, and hi
  with `hi`; `seg`'s spec)."""
  args = []
  if ops.fq is not None:
    args += [(ops.fq, query), (ops.fk, query)]
  if ops.sq is not None:
    args += [(ops.sq, seg), (ops.sk, seg)]
  if bounds:
    args += [(ops.lo, seg)] + ([(ops.hi, seg)] if hi else [])
  return [x for x, _ in args], [spec(x) for x, spec in args]


def _query_tiles(ops: Operands, bs: calls.BlockSizes, backend: str):
  """The far dq launches' tiles (far_dq_kernel, far_states_kernel): query chunks two at a time
  with BlockSizes.far_dq_pairs. -> pairs, the grid, its ids and chunk axis, the BlockSpec
  makers of a query head's (`own`) and its kv head's (`kv`) arrays, and the warps: 2C-row tiles
  take 8 (resource report at head_dim 64, bf16: 648 B of spills a thread with 4, none with 8)."""
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  pairs = D > 64 if bs.far_dq_pairs is None else bs.far_dq_pairs
  grid, ids, axis = calls.chunk_grid(B, H, (n + 1) // 2 if pairs else n, backend, reverse=True)
  own = lambda x: calls._full(x, ids, lambda h: h)
  kv = lambda x: calls._full(x, ids, lambda h: h // G)
  warps = bs.far_dq_num_warps or bs.dq_num_warps or (8 if pairs else None)
  return pairs, grid, ids, axis, own, kv, warps


def _far_dq(ops: Operands, do, lse, delta, kb, pi, *, scale, span, nb, precision, backend, bs):
  """-> qb, A [B, H, R, D] (kernel dtype; packed, kernels.boundary_offset), (dfq [B, H, n, C, 1]
  float32 of far tiles).
  Query chunks two at a time with BlockSizes.far_dq_pairs (bwd_span.far_dq_kernel)."""
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  f = calls._flags(ops)
  bounds = calls._bounds(ops, backend)
  pairs, grid, ids, axis, own, kv, warps = _query_tiles(ops, bs, backend)
  seg = lambda x: calls._full(x, ids, lambda h: 0)
  m = calls._merged
  args = [m(ops.q), kb, ops.v, ops.e, pi, prepass.unchunked(do), m(lse), m(delta)]
  specs = [own(args[0]), kv(kb), calls.time_major_spec(ops.v, ids, lambda h: h // G), kv(ops.e),
           kv(pi), calls.time_major_spec(args[5], ids, lambda h: h), own(args[6]), own(args[7])]
  more, more_specs = _optional_inputs(ops._replace(fq=m(ops.fq), sq=m(ops.sq)), bounds,
                                     query=own, seg=seg, hi=False)
  args, specs = args + more, specs + more_specs
  states = jax.ShapeDtypeStruct((B, H, kernels.boundary_array_rows(n=n, span=span, C=C), D),
                                ops.q.dtype)
  out_shape = [states, states]
  if f["gate"]:
    out_shape.append(jax.ShapeDtypeStruct((B, H, n * C, 1), jnp.float32))
  out_specs = [own(x) for x in out_shape]
  fine = chain_precision(ops.q, precision=precision, backend=backend, bs=bs)
  kernel = functools.partial(bwd_span.far_dq_kernel, scale=scale, span=span, nb=nb,
                             bounds=bounds, precision=precision, chunk_axis=axis, fine=fine,
                             gate=f["gate"], segments=f["segments"], pairs=pairs)
  outs = calls._call(kernel, grid, specs, out_specs, out_shape, backend, bs, bwd=True,
                     stages=calls.flash_stages(bs, ops.q.dtype), warps=warps)(*args)
  return tuple(outs[:2]) + tuple(x.reshape(B, H, n, C, 1) for x in outs[2:])


def _far_states(ops: Operands, pi, *, span, precision, backend, bs):
  """-> qb [B, H, R, D] (kernel dtype; packed): bwd_span.far_states_kernel, the far dq launch's
  first half when the walk runs elsewhere (bwd_far_mosaic.far_dq). Tiles as _far_dq's."""
  B, H, n, C, D = ops.q.shape
  pairs, grid, _, axis, own, kv, warps = _query_tiles(ops, bs, backend)
  args = [calls._merged(ops.q), ops.e, pi]
  states = jax.ShapeDtypeStruct((B, H, kernels.boundary_array_rows(n=n, span=span, C=C), D),
                                ops.q.dtype)
  fine = chain_precision(ops.q, precision=precision, backend=backend, bs=bs)
  kernel = functools.partial(bwd_span.far_states_kernel, span=span, precision=precision,
                             fine=fine, chunk_axis=axis, pairs=pairs)
  return calls._call(kernel, grid, [own(args[0]), kv(ops.e), kv(pi)], [own(states)], [states],
                     backend, bs, bwd=True, stages=calls.flash_stages(bs, ops.q.dtype),
                     warps=warps)(*args)[0]


def _far_dkv(ops: Operands, do, lse, delta, kb, qb, *, scale, span, precision, backend, bs):
  """-> a, dv [B, K, n, C, D] float32 (far tiles), (dfk [B, H, n, 1, C] float32). Key chunks
  two at a time with BlockSizes.far_dkv_pairs (bwd_span.far_dkv_kernel), or the Mosaic GPU
  launch (BlockSizes.far_dkv, routing.mosaic_launch)."""
  if routing.mosaic_launch(ops, bs, backend, "far_dkv"):
    from kernels_pallas.path_attention import bwd_far_mosaic
    walk = bwd_far_mosaic.far_dkv if backend == "gpu" else bwd_far_mosaic.far_dkv_reference
    a, dv, dfk = walk(ops, do, lse, delta, kb, qb, scale=scale, span=span)
    return (a, dv) + ((dfk,) if dfk is not None else ())
  B, H, n, C, D = ops.q.shape
  K = ops.k.shape[1]
  G = H // K
  f = calls._flags(ops)
  bounds = calls._bounds(ops, backend)
  pairs = far_dkv_pairs(bs, dtype=ops.q.dtype, backend=backend)
  grid, ids, axis = calls.chunk_grid(B, K, (n + 1) // 2 if pairs else n, backend)
  grp = lambda x: pl.BlockSpec((None, G) + x.shape[2:],
                               lambda *p: (ids(*p)[0], ids(*p)[1]) + (0,) * (x.ndim - 2))
  kv = lambda x: calls._full(x, ids, lambda h: h)
  seg = lambda x: calls._full(x, ids, lambda h: 0)
  keys_major = bs.far_dkv_keys_major
  # Key-side vectors [.., n, 1, C] as one row of keys [.., 1, n*C], or (keys_major) a column
  # [.., n*C, 1]; keys_major takes the query-side [.., n, C, 1] as rows [.., n, 1, C]. Each is
  # the same memory (a bitcast).
  keys = lambda x: None if x is None else x.reshape(
      x.shape[:2] + ((n * C, 1) if keys_major else (1, n * C)))
  rows = calls.as_rows if keys_major else (lambda x: x)
  kbm, vm = calls._merged(kb), prepass.unchunked(ops.v)
  args = [qb, kbm, vm, do, rows(lse), rows(delta)]
  specs = [grp(qb), kv(kbm), calls.time_major_spec(vm, ids, lambda h: h),
           calls.time_major_spec(do, ids, lambda h: h, heads=G), grp(args[4]), grp(args[5])]
  more, more_specs = _optional_inputs(
      ops._replace(fq=rows(ops.fq), fk=keys(ops.fk), sq=rows(ops.sq), sk=keys(ops.sk)), bounds,
      query=grp, seg=seg, hi=True)
  args, specs = args + more, specs + more_specs
  out_shape = [jax.ShapeDtypeStruct((B, K, n * C, D), jnp.float32)] * 2
  if f["gate"]:
    out_shape.append(jax.ShapeDtypeStruct((B, H) + ((n * C, 1) if keys_major else (1, n * C)),
                                          jnp.float32))
  out_specs = [kv(out_shape[0]), kv(out_shape[1])] + [grp(x) for x in out_shape[2:]]
  kernel = functools.partial(bwd_span.far_dkv_kernel, scale=scale, span=span, bounds=bounds,
                             precision=precision, chunk_axis=axis, gate=f["gate"],
                             segments=f["segments"], pairs=pairs,
                             gate_colsum=bs.gate_colsum, keys_major=keys_major,
                             rows=bs.far_dkv_rows or (C // 2 if pairs and D > 64 and
                                                      not keys_major else C))
  # 2C-row key tiles take 8 warps (resource report, bf16, no gate: 1,144 B of spills a thread
  # with 4 at head_dim 64, 20 with 8; at 128 with 64-row query parts 244 with 8, 3,824 with 4)
  outs = calls._call(kernel, grid, specs, out_specs, out_shape, backend, bs, bwd=True,
                     stages=calls.flash_stages(bs, ops.q.dtype),
                     warps=bs.bwd_num_warps or (8 if pairs else None))(*args)
  a, dv = (x.reshape(B, K, n, C, D) for x in outs[:2])
  return (a, dv) + tuple(x.reshape(B, H, n, 1, C) for x in outs[2:])


def far_queries_y(qb, a, *, K: int, n: int, chunk: int, span: int, precision, backend: str,
                  bs: calls.BlockSizes):
  """Y_J = sum over the group's heads and the query chunks c >= b_J of qb_c^(b_J)T A_c^(a_J)
  -> [B, K, nb, D, D] float32 (zero for J = 0: no keys left of the first span). qb, A: packed
  [B, H, R, D] (kernels.boundary_offset) of n chunks of `chunk` rows.

  A launch (bwd_span.far_y_kernel) that reads each boundary's rows where they lie; XLA's einsums
  over slices of the packed arrays (far_queries_y_reference, its oracle) copy every slice
  first. H200, 2026-11-26, this step alone, launch / einsums: 0.50 / 1.56 ms at
  4,16384,16,128, 0.60 / 0.87 at 8,8192,32,64, 0.35 / 0.44 at 8,4096,16,128, equal at
  32,2048,32,64 and 32,4096,32,64. XLA's buffer assignment around it costs peak memory at
  32 heads: 5.66 -> 5.78 GiB at 8,8192,32,64 (11.33 -> 11.56 at 32,4096,32,64)."""
  B, H, R, D = qb.shape
  nb = (n - 1) // span
  whole = pl.BlockSpec((None, None, R, D), lambda j, h, b: (b, h, 0, 0))
  out = jax.ShapeDtypeStruct((B, H, nb, D, D), jnp.float32)
  kernel = functools.partial(bwd_span.far_y_kernel, n=n, span=span, chunk=chunk,
                             precision=precision)
  y = calls._call(kernel, (nb, H, B), [whole, whole],
                  pl.BlockSpec((None, None, None, D, D), lambda j, h, b: (b, h, j, 0, 0)), out,
                  backend, bs, bwd=True, stages=2, warps=4)(qb, a)
  return y.reshape(B, K, H // K, nb, D, D).sum(2)


def far_queries_y_reference(qb, a, *, K: int, n: int, chunk: int, span: int, precision):
  """far_queries_y in jnp: an einsum over each boundary's slices of qb and A."""
  B, H, _, D = qb.shape
  nb = (n - 1) // span
  block = lambda j: kernels.boundary_offset(j, n=n, span=span) * chunk   # block j's first row
  ys = [jnp.zeros((B, K, D, D), jnp.float32)]
  for j in range(1, nb):
    # b_J = (j + 1) span: the queries at and right of it are the far ones, the whole block j
    # of qb and block j - 1 of A less its first span of chunks
    q_ = qb[:, :, block(j):block(j + 1)]
    a_ = a[:, :, block(j - 1) + span * chunk:block(j)]   # (qb's dtype: far_dq writes both)
    y = jnp.einsum("bhtd,bhte->bhde", q_, a_, preferred_element_type=jnp.float32,
                   precision=precision)
    ys.append(y.reshape(B, K, H // K, D, D).sum(2))
  return jnp.stack(ys, axis=2)


def span_pairs(bs: calls.BlockSizes, *, dtype, head_dim: int, backend: str) -> bool:
  """Whether the span kernel takes query chunks two at a time (BlockSizes.dq_pairs): on the GPU
  where it fits in shared memory. H200, 2026-11-25: with the near dk, dv (bwd_spans 1) it asked
  for 240 KiB at head_dim 128 (bf16) and 305 KiB at 64 with float32 inputs and grouped heads,
  of 227; the leaner bwd_spans 2 kernel built at 128 in bf16 (the resource report: 224 KiB, as
  the sweep's dq/dP kernel with the same tiles). The interpreter has no such limit."""
  fits = jnp.dtype(dtype).itemsize <= 2 and (head_dim <= 64 or bs.bwd_spans != 1)
  return bs.dq_pairs and (fits or backend != "gpu")


def far_dkv_pairs(bs: calls.BlockSizes, *, dtype, backend: str) -> bool:
  """Whether the far dk/dv kernel takes key chunks two at a time (BlockSizes.far_dkv_pairs):
  on the GPU with 16-bit inputs only. With float32 inputs, grouped heads and 2C-row tiles the
  resource report gives 224 KiB of shared memory and 7 KB of spills a thread at head_dim 64,
  and `test_bwd_spans[float32-True-False-3]` failed on the H200 (2026-11-25); the interpreter
  has no such limit."""
  return bs.far_dkv_pairs and (jnp.dtype(dtype).itemsize <= 2 or backend != "gpu")


def backward(ops: Operands, do, lse, delta, *, scale: float, precision, backend: str,
             bs: calls.BlockSizes, span: int, boundary=None):
  """calls.backward's gradients (q, k, v, diag, dp, fq?, fk?) by the span-parallel form.
  boundary: (kb, pi) of the forward's launch at this span (calls.span_boundary), if kept."""
  B, H, n, C, D = ops.q.shape
  K = ops.k.shape[1]
  f = calls._flags(ops)
  nb = (n - 1) // span
  nsp = nb + 1
  kw = dict(precision=precision, backend=backend, bs=bs)
  kb, pi = boundary if boundary is not None else _boundary(ops, span=span, nb=nb, **kw)
  if routing.mosaic_launch(ops, bs, backend, "far_dq"):
    from kernels_pallas.path_attention import bwd_far_mosaic
    qb = _far_states(ops, pi, span=span, **kw)
    walk = bwd_far_mosaic.far_dq if backend == "gpu" else bwd_far_mosaic.far_dq_reference
    a, dfq = walk(ops, do, lse, delta, kb, qb, pi, scale=scale, span=span)
    dfq_far = [dfq] if f["gate"] else []
  else:
    qb, a, *dfq_far = _far_dq(ops, do, lse, delta, kb, pi, scale=scale, span=span, nb=nb,
                              **kw)
  kv = bs.bwd_spans == 1   # near dk, dv from the span kernel's states; 2, 3: the dk/dv kernel's
  if bs.bwd_spans != 2:
    afar, dvfar, *dfk_far = _far_dkv(ops, do, lse, delta, kb, qb, scale=scale, span=span, **kw)
  if bs.bwd_spans == 3:   # the dk/dv kernel's walk inside the span only, adding the far sums
    key_side = calls.backward_dkv(ops, do, lse, delta, scale=scale,
                                  far_in=(afar, dvfar, dfk_far[0] if dfk_far else None), **kw)
  elif not kv:
    key_side = calls.backward_dkv(ops, do, lse, delta, scale=scale, qb=qb, far_out=True, **kw)
    afar = key_side.pop("a")
  y = far_queries_y(qb, a, K=K, n=n, chunk=C, span=span, precision=precision,
                    backend=backend, bs=bs)

  merged = ops._replace(q=calls._merged(ops.q), diag=calls._merged(ops.diag),
                        fq=calls._merged(ops.fq), sq=calls._merged(ops.sq))
  bounds = calls._bounds(ops, backend)
  grid_kv = lambda j, kh, b: (b, kh)
  args, specs, grp = calls._bwd_inputs(merged, prepass.unchunked(do), calls._merged(lse),
                                       calls._merged(delta), grid_kv, bounds=bounds)
  kvh = lambda x: pl.BlockSpec((None, None) + x.shape[2:],
                               lambda *i: grid_kv(*i) + (0,) * (x.ndim - 2))
  first = len(args) + 2   # afar's position: it, dvfar and dfkfar become dk, dv and dfk in place
  args += [a, y, afar] + ([dvfar] + dfk_far if kv else [])
  specs += [grp(a), kvh(y), kvh(afar)] + ([kvh(dvfar)] + [grp(x) for x in dfk_far] if kv
                                            else [])
  f32 = jnp.float32
  gdt = ops.q.dtype
  pairs = span_pairs(bs, dtype=ops.q.dtype, head_dim=D, backend=backend)
  mosaic_sweep = routing.sweep_launch(ops, bs, backend, kv=kv, pairs=pairs)
  rows = 2 * C if pairs else C
  shapes = dict(q=((B, H, n * C, D), gdt), diag=((B, H, n * C, C), gdt), dp=((B, K, n, D, D), f32))
  shapes.update({name: ((B, K, n, C, D), f32) for name in (("k", "v") if kv else ())})
  shapes["st"] = ((B, K, nsp, span, rows, D), gdt)
  if mosaic_sweep:   # the sweeps' dq and states are the Mosaic launch's
    del shapes["q"], shapes["st"]
  names = list(shapes)
  out_shape = [jax.ShapeDtypeStruct(*shape) for shape in shapes.values()]
  if f["gate"]:
    names += ["fq"] + (["fk"] if kv else [])
    out_shape.append(jax.ShapeDtypeStruct((B, H, n * C, 1), f32))
    if kv:
      out_shape.append(jax.ShapeDtypeStruct((B, H, n, 1, C), f32))
  st_spec = pl.BlockSpec((None, None, None, span, rows, D),
                         lambda j, kh, b: (b, kh, j, 0, 0, 0))
  out_specs = [st_spec if name == "st" else grp(s) if name in ("q", "diag", "fq", "fk")
               else kvh(s) for name, s in zip(names, out_shape)]
  fine = chain_precision(ops.q, precision=precision, backend=backend, bs=bs)
  kernel = functools.partial(bwd_span.span_kernel, scale=scale, span=span, nb=nb,
                             gate=f["gate"], segments=f["segments"], bounds=bounds,
                             precision=precision, span_axis=0, pairs=pairs, kv=kv, fine=fine,
                             sweeps=not mosaic_sweep)
  aliases = {}
  if kv:
    aliases = {first: names.index("k"), first + 1: names.index("v")}
    if f["gate"]:
      aliases[first + 2] = names.index("fk")
  outs = calls._call(kernel, (nsp, K, B), specs, out_specs, out_shape, backend, bs, bwd=True,
                     warps=bs.dq_num_warps or (8 if pairs else None), aliases=aliases)(*args)
  g = dict(zip(names, outs))
  g.pop("st", None)
  if mosaic_sweep:
    from kernels_pallas.path_attention import span_mosaic
    walk = span_mosaic.sweeps if backend == "gpu" else span_mosaic.sweeps_reference
    dq, dfq, g["dp"] = walk(ops, do, lse, delta, a, g["dp"], scale=scale, span=span)
    g["q"] = dq.reshape(B, H, n * C, D)
    if f["gate"]:
      g["fq"] = g["fq"] + dfq.reshape(B, H, n * C, 1)
  for name in ("q", "diag", "fq"):   # back to [B, H, n, C, ...]
    if name in g:
      g[name] = g[name].reshape(B, H, n, C, *g[name].shape[3:])
  if kv:
    g["k"], g["v"] = g["k"].astype(gdt), prepass.time_major(g["v"].astype(gdt))
  else:
    g.update(key_side)
  if f["gate"]:
    g["fq"] = g["fq"] + dfq_far[0]
  return g
