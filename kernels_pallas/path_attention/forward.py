"""The forward walk on the GPU and in the interpreter: fwd_kernel and its launch.

One program per (batch, query head, query chunk c): the diagonal chunk from the pre-computed
in-chunk logits, then key chunks m = c-1 .. 0 right to left with an online softmax, the query
tile moving one chunk left after each key chunk: q~ <- q~ - q~ E_m. The logits q~ k^T and the
move read the same q~, so the two products are independent and the dependent chain per step is
one product. Causal block skipping is the loop bound; with packed documents the walk also stops
at lo_c, the first key chunk that shares a segment with chunk c (operands.chunk_bounds).

The span form (plan.forward "span") walks chunk by chunk only inside c's span and attends to the
key chunks of earlier spans as plain attention against the tile's states at the span
boundaries and the keys moved to their span's end (spans.boundary); its far keys run inside
this kernel ("triton") or as a Mosaic GPU launch of their own, merged with this one's softmax
(mosaic_gpu/forward_far.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.common import launch
from kernels_pallas.path_attention import operands
from kernels_pallas.path_attention.mosaic_gpu import forward_far
from kernels_pallas.path_attention.tiles import (boundary_array_rows, boundary_rows,
                                                 chunk_bound, chunk_id, diagonal, dot, move,
                                                 softmax_step, tile_mask, unpack_forward)


def fwd_kernel(*refs, scale, transport, gate, segments, precision, chunk_axis, reverse,
               bounds=False, span=0, fine=None, far=True):
  """refs: q [C,D], k, v [n,C,D], (e [n,D,D], diag [C,C]), (fq [C,1], fk [n,1,C]),
  (sq [C,1], sk [n,1,C]), (lo [n,1,1]), (kb [n,C,D], pi [nb,D,D] with `span`) -> o [C,D],
  lse [C,1], (with `span`: qb [R, D], the head's packed boundary states, scratch). The query
  chunk is grid axis chunk_axis (reversed with `reverse`, see launch.chunk_grid).

  With `span` (transport; chunks cut into spans of `span` as in spans.py) the tile moves
  chunk by chunk only inside its own span. At the span's start it is the boundary state
  qb = q^_c P_{c-1} ... P_a, and every key chunk m of an earlier span J is plain attention
  against kb_m = k^_m M_bm^T (spans.boundary_kernel's keys moved to their span's end b):
  q^_c M_cm = qb^(b) M_bm. Between spans the state crosses the whole span at once,
  qb^(a) = qb^(b) Pi_J (float32, precision `fine`). Far steps take two products instead of
  the walk's three (four at head_dim 128: the move is C x D x D). far=False: the far keys are
  left to another launch (mosaic_gpu/forward_far.py), which reads the states stored here; o and lse
  are then those of the near keys alone."""
  q_ref, k_ref, v_ref, e_ref, d_ref, fq_ref, fk_ref, sq_ref, sk_ref, lo_ref, (kb_ref, pi_ref), \
      outs = unpack_forward(refs, transport, gate, segments, bounds, spans=bool(span))
  o_ref, lse_ref, *qb_ref = outs
  qb_ref = qb_ref[0] if span else None   # [R, D]: the packed boundary states (boundary_rows)
  c = chunk_id(k_ref.shape[0], axis=chunk_axis, reverse=reverse)
  q = q_ref[...]
  C = q.shape[0]
  dt = q.dtype
  fq = None if fq_ref is None else fq_ref[...]
  sq = None if sq_ref is None else sq_ref[...]
  fk_of = lambda m: None if fk_ref is None else fk_ref[m]
  sk_of = lambda m: None if sk_ref is None else sk_ref[m]
  m_i, l_i, acc = diagonal(q, k_ref[c], v_ref[c], d_ref, fq, fk_of(c), sq, sk_of(c), scale=scale,
                        precision=precision)

  def attend(qt, m, kt, m_i, l_i, acc):
    gate_, ok = tile_mask(C, causal=False, fq=fq, fk=fk_of(m), sq=sq, sk=sk_of(m))
    return softmax_step(qt, m_i, l_i, acc, kt, v_ref[m], gate_, ok, scale=scale, dt=dt,
                 precision=precision)

  def body(i, carry):
    qt, m_i, l_i, acc = carry
    m = c - 1 - i
    m_i, l_i, acc = attend(qt, m, k_ref[m], m_i, l_i, acc)
    if transport:
      qt = move(qt, e_ref[m], dt=dt, precision=precision)
    return qt, m_i, l_i, acc

  lo = chunk_bound(lo_ref, c) if bounds else 0
  jc = lax.div(c, span) if span else 0   # c's span
  near = jnp.maximum(lo, jc * span) if span else lo   # the walk stops at c's span start
  qt, m_i, l_i, acc = lax.fori_loop(0, c - near, body, (q.astype(jnp.float32), m_i, l_i, acc))
  if span:
    n = k_ref.shape[0]
    j0 = jnp.minimum(lax.div(lo, span), jc)   # spans wholly left of c's document: skipped
    packed = lambda J: boundary_rows(J, c, C, n=n, span=span, C=C)

    # Two loops, as span_backward.far_dq_kernel's: the states at the boundaries
    # s_J = (J + 1) span first (qb^(s_{J-1}) = qb^(s_J) Pi_J, float32 at precision `fine`), kept
    # in qb_ref, then the far keys of each span against its state read back in the kernel dtype.
    # With the crossing inside the loop over spans its float32 state stays live across the far
    # keys (slower, and it spills).
    def cross(i, qt):   # store the state at span J's end, move it to J's start
      J = jc - 1 - i
      qb_ref[packed(J)] = qt.astype(qb_ref.dtype)
      return dot(qt, pi_ref[J], precision=fine)

    # spans jc-1 .. j0+1 crossed (no step when j0 >= jc - 1), j0's state stored without the
    # move past it (never read)
    qt = lax.fori_loop(0, jc - j0 - 1, cross, qt)

    @pl.when(j0 < jc)
    def _():
      qb_ref[packed(j0)] = qt.astype(qb_ref.dtype)

    def far_span(J, carry):   # plain attention of qb^(s_J) against span J's moved keys
      qt = qb_ref[packed(J)]

      def key(m, carry):
        return attend(qt, m, kb_ref[m], *carry)

      return lax.fori_loop(jnp.maximum(lo, J * span), (J + 1) * span, key, carry)

    if far:
      m_i, l_i, acc = lax.fori_loop(j0, jc, far_span, (m_i, l_i, acc))
  o_ref[...] = (acc / l_i).astype(o_ref.dtype)
  lse_ref[...] = m_i + jnp.log(l_i)


def forward(ops: operands.Operands, plan, *, boundary=None):
  """-> o [B, n, C, H, D] (chunked: time-major, as the caller takes it; v's dtype), lse
  [B, H, n, C, 1] float32. With the span form, `boundary` is spans.boundary's (kb, pi)."""
  backend = plan.spec.backend
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  f = operands.features(ops)
  grid, ids, axis = launch.chunk_grid(B, H, n, backend, reverse=True)

  def chunk(x):  # this program's query chunk
    return pl.BlockSpec((None, None, None) + x.shape[3:], lambda *p: ids(*p) + (0, 0))

  kv = lambda x: launch.full(x, ids, lambda h: h // G)
  args = [ops.q, ops.k, ops.v]
  specs = [chunk(ops.q), kv(ops.k), launch.time_major_spec(ops.v, ids, lambda h: h // G)]
  if f["transport"]:
    args += [ops.e, ops.diag]
    specs += [kv(ops.e), chunk(ops.diag)]
  if f["gate"]:
    args += [ops.fq, ops.fk]
    specs += [chunk(ops.fq), launch.full(ops.fk, ids, lambda h: h)]
  if f["segments"]:
    args += [ops.sq, ops.sk]
    specs += [pl.BlockSpec((None, None, None, C, 1),
                           lambda *p: (ids(*p)[0], 0, ids(*p)[2], 0, 0)),
              launch.full(ops.sk, ids, lambda h: 0)]
  bounds = operands.skips_chunks(ops, backend)
  if bounds:
    args.append(ops.lo)
    specs.append(launch.full(ops.lo, ids, lambda h: 0))
  span = plan.span if plan.forward == "span" else 0
  far = plan.forward_far == "mosaic"
  if span:
    kb, pi = boundary
    args += [kb, pi]
    specs += [kv(kb), kv(pi)]
  # with the far keys in a launch of their own, the near part's o stays float32 for the merge;
  # o time-major: the caller's [B, T, H, D] is a reshape of it (no transpose pass)
  out_shape = [jax.ShapeDtypeStruct((B, n, C, H, D), jnp.float32 if far else ops.v.dtype),
               jax.ShapeDtypeStruct((B, H, n, C, 1), jnp.float32)]
  out_specs = [launch.time_major_chunk(out_shape[0], ids), chunk(out_shape[1])]
  if span:   # the query states at the span boundaries, packed (the far launch reads them)
    out_shape.append(jax.ShapeDtypeStruct(
        (B, H, boundary_array_rows(n=n, span=span, C=C), D), ops.q.dtype))
    out_specs.append(launch.full(out_shape[-1], ids, lambda h: h))
  kernel = functools.partial(fwd_kernel, scale=plan.scale, precision=plan.precision,
                             chunk_axis=axis, reverse=True, bounds=bounds, span=span,
                             fine=plan.chain_precision if span else None, far=not far, **f)
  outs = launch.call(kernel, grid, specs, out_specs, out_shape, backend=backend,
                     warps=plan.warps("forward"), stages=plan.stages("forward"))(*args)
  if not far:
    return tuple(outs[:2])
  far_fn = forward_far.far_forward if backend == "gpu" else forward_far.far_reference
  o_far, lse_far = far_fn(ops, kb, outs[2], scale=plan.scale, span=span)
  return forward_far.merge_far(outs[0], outs[1], o_far, lse_far, dtype=ops.v.dtype)
