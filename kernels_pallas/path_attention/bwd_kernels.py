"""Backward kernel bodies for the GPU (Triton lowering) and the interpreter, and the tile
functions (tile_grads, dq_step, dkv_step, dkv_diagonal) that the TPU forms (bwd_tpu.py) share.

Notation (NOTES_kernel.md has the derivation): chunk transport P_m = I - E_m (E_m = W_m^T U_m,
D x D, from the pre-pass) acting on row vectors, M_cm = P_{c-1} ... P_{m+1} (D x D), logits of query chunk c against key chunk m < c
l = scale q^_c M_cm k^_m^T, dS = p (dO V^T - Delta). Two kernels:

dkv_kernel, one program per (batch, kv head, key chunk m), fully parallel: walks query chunks
  c = m+1 .. n-1 left to right carrying the D x D operator M (M <- P_c M), so the key tile is
  k~ = k^ M^T and dk^_m = scale sum_c (dS^T q^_c) M, dv_m = sum_c p^T dO_c. The GQA group's
  query heads are a loop inside, so dk, dv are per kv head (no per-query-head copies).

dq_kernel, one program per (batch, kv head, lane), sequential over (group head, query chunk):
  for query chunk c the states s_m = q^_c M_cm are stored right to left, then a left-to-right
  sweep carries the adjoint R of the state (R <- R P_m^T + scale dS k^_m); what is left after the
  last key chunk is dq^_c, and dL/dP_m = s_m^T R accumulates in a D x D buffer per chunk (dW, dU
  follows outside: dL/dE = -G, through the pre-pass's VJP). The sum over c of state-adjoint pairs at m is what
  prevents a parallel form without per-query-chunk copies; every accumulation has one fixed
  order: deterministic, no atomics.
  With `pairs` (BlockSizes.dq_pairs, the default), query chunks go in pairs (c, c + 1) as one
  stacked 2C-row tile: the state of c + 1 at m < c is (q^_{c+1} P_c) M_cm, so both walk
  m = c-1 .. 0 with the same E_m; per key chunk one load of k_m, v_m, E_m, one product per term
  and one dP_m read-modify-write serve both chunks (half the dP traffic, the largest), and the
  products are 2C rows tall. The pair (c + 1, m = c), state q^_{c+1}, ends the pair with the
  rows of chunk c masked out. With n odd the last chunk runs alone; lanes take pairs round
  robin, the odd chunk on lane 0. Measured on the H200 (8 warps): dq/dP 12.7 -> 11.7 ms at
  32,2048,32,64 and 26.5 -> 18.2 ms at 8,4096,16,128 against one chunk per sweep (the earlier
  two-chain form of pairs measured 15.9 and 26.5).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.path_attention.kernels import (NEG_INF, HeadsMinor, boundary_rows,
                                                   chunk_bound, chunk_id, dot, logits, tile_mask)


def _unpack(refs, spec):
  """Splits refs by the (name, present) list `spec`; absent names map to None."""
  refs = list(refs)
  out = {}
  for name, present in spec:
    out[name] = refs.pop(0) if present else None
  assert not refs, len(refs)
  return out


def _in_spec(transport, gate, segments, bounds):
  return [("q", True), ("k", True), ("v", True), ("e", transport),
          ("do", True), ("lse", True), ("delta", True), ("fq", gate), ("fk", gate),
          ("sq", segments), ("sk", segments), ("diag", transport), ("lo", bounds),
          ("hi", bounds)]


def _eye(D):
  i = lax.broadcasted_iota(jnp.int32, (D, D), 0)
  return jnp.where(i == lax.broadcasted_iota(jnp.int32, (D, D), 1), 1.0, 0.0).astype(jnp.float32)


def tile_grads(qc, kc, s, causal, *, precision):
  """p and dS of one [R, C] tile: qc holds the query rows (do, lse, delta, fq, sq), kc the key
  chunk (v, fk, sk), s the scaled logits before gate and mask."""
  gate_, ok = tile_mask(kc["v"].shape[0], causal=causal, fq=qc["fq"], fk=kc["fk"], sq=qc["sq"],
                        sk=kc["sk"])
  p = jnp.exp(logits(s, gate_, ok) - qc["lse"])
  return p, p * (dot(qc["do"], kc["v"], tb=True, precision=precision) - qc["delta"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MmaColSums:
  """A gate column-sum accumulator of the "mma" form: colsum(dS) as a [C, 16] float32 tile (every
  column the same) from tensor-core products of dS^T with a ones tile, in bf16 halves of dS
  (`terms` of them: 2 give ~2^-17 relative, 3 float32's ~2^-24)."""
  acc: jax.Array
  terms: int = dataclasses.field(metadata=dict(static=True), default=2)


def col_sums_init(mode, rows, cols, *, gate=True, exact=False):
  """The zero accumulator of minus_col_sums for a [rows, cols] dS tile: "reduce" a [1, cols] row,
  "carry" a [rows, cols] tile, "mma" a [cols, 16] one (exact: three bf16 halves, for float32
  kernels). Without a gate nothing adds to it: the smallest form, whatever `mode`."""
  if mode == "reduce" or not gate:
    return jnp.zeros((1, cols), jnp.float32)
  if mode == "carry":
    return jnp.zeros((rows, cols), jnp.float32)
  return MmaColSums(jnp.zeros((cols, 16), jnp.float32), 3 if exact else 2)


def minus_col_sums(acc, ds):
  """acc - colsum(dS) in acc's form (col_sums_init). Why not always "reduce" (one reduction over
  dS's rows per step): with the gate the dk/dv kernel took 3.88 -> 7.11 ms at 32,2048,32,64 (H100
  trace, 2026-11-25) and the far dk/dv kernel 5.08 -> 14.27, while the forward and the dq
  kernels (row sums only) moved by < 10%: a reduction over the rows of a product's tile crosses
  warps, and in the Triton lowering that is a round trip through shared memory and a barrier
  every step. "carry" adds dS elementwise and reduces once at the end (more live registers);
  "mma" sums over rows on the tensor cores, where the rows are the contraction."""
  if isinstance(acc, MmaColSums):
    ones = jnp.ones((ds.shape[0], acc.acc.shape[1]), jnp.bfloat16)
    out, rest = acc.acc, ds
    for _ in range(acc.terms):   # dS = hi + lo (+ lo2): each half exact in bf16, the sum ~exact
      part = rest.astype(jnp.bfloat16)
      out = out - dot(part, ones, ta=True)
      rest = rest - part.astype(jnp.float32)
    return MmaColSums(out, acc.terms)
  return acc - (jnp.sum(ds, axis=0, keepdims=True) if acc.shape[0] == 1 else ds)


def col_total(acc):
  """A minus_col_sums accumulator as the [1, C] row it stands for."""
  if isinstance(acc, MmaColSums):   # equal columns: max is exact; [C, 1] -> [1, C]
    return jnp.max(acc.acc, axis=1, keepdims=True).T
  return acc if acc.shape[0] == 1 else jnp.sum(acc, axis=0, keepdims=True)


def pair_state(q, e, *, precision):
  """Query chunks c, c + 1 stacked as one 2C-row tile q (kernel dtype), E_c = e -> (the float32
  state with chunk c + 1's rows moved across chunk c, the [2C, 1] mask of those rows)."""
  low = lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0) >= q.shape[0] // 2
  return q.astype(jnp.float32) - jnp.where(low, dot(q, e, precision=precision), 0.0), low


def dq_step(qc, kc, qt, adj, dfq, *, scale, transport, precision, live=None, kv=False):
  """One key chunk m < c for a query tile (one chunk, or two stacked): state qt (kernel dtype),
  adj = R, the adjoint of the state after crossing chunk m -> (R P_m^T + scale dS k^_m, dfq,
  s_m^T R, the contribution to dL/dP_m (None without transport), key-side parts). Rows
  outside `live` ([R, 1] bool) take no part.

  With kv the key-side parts are this tile's share of key chunk m's gradients, (dk^_m, dv_m,
  dfk_m) = (scale dS^T s_m, p^T dO, -colsum dS): the state s_m = q^_c M_cm already carries the
  transport, so dS^T s_m is the dk/dv kernel's (dS^T q^_c) M_cm without the D x D operator.
  Else None."""
  dt = qt.dtype
  s = scale * dot(qt, kc["k"], tb=True, precision=precision)
  if live is not None:
    s = jnp.where(live, s, NEG_INF)
  p, ds = tile_grads(qc, kc, s, False, precision=precision)
  dfq = dfq + jnp.sum(ds, axis=1, keepdims=True)
  dsc = ds.astype(dt)
  gk = scale * dot(dsc, kc["k"], precision=precision)
  parts = None
  if kv:
    parts = (scale * dot(dsc, qt, ta=True, precision=precision),
             dot(p.astype(dt), qc["do"], ta=True, precision=precision),
             -jnp.sum(ds, axis=0, keepdims=True))
  if not transport:
    return adj + gk, dfq, None, parts
  adjc = (adj if live is None else jnp.where(live, adj, 0.0)).astype(dt)
  return (gk + adj - dot(adjc, kc["e"], tb=True, precision=precision), dfq,
          dot(qt, adjc, ta=True, precision=precision), parts)


def dkv_step(query, kc, mop, dk, dv, dfk, *, scale, transport, precision):
  """Query chunk c > m of every head of the group (query(g): head g's dict, loaded when its
  turn comes, so that one head's tiles are live at a time) against key chunk m
  (kc: k^, v, fk (a list over heads), sk), mop = M_cm -> dk, dv, dfk with chunk c added (the
  caller moves the operator on: M <- P_c M)."""
  dt = kc["k"].dtype
  kt = dot(kc["k"], mop.astype(dt), tb=True, precision=precision).astype(dt) if transport \
      else kc["k"]
  # Without transport dS^T q^ goes straight into dk (scale taken into dS before its cast): a
  # product added to a carried tile becomes the product's accumulator, where a per-step sum
  # over heads would be one more [R, D] float32 tile (the far dk/dv kernel's 2C-row tiles
  # spill at head_dim 128).
  a = jnp.zeros(dk.shape, jnp.float32) if transport else None
  dfk = list(dfk)
  for g in range(len(dfk)):
    qc = query(g)
    p, ds = tile_grads(qc, dict(kc, fk=kc["fk"][g]), scale * dot(qc["q"], kt, tb=True,
                                                                  precision=precision),
                       False, precision=precision)
    dv += dot(p.astype(dt), qc["do"], ta=True, precision=precision)
    if transport:
      a += dot(ds.astype(dt), qc["q"], ta=True, precision=precision)   # dS^T q^, over heads
    else:
      dk += dot((scale * ds).astype(dt), qc["q"], ta=True, precision=precision)
    if qc["fq"] is not None:
      dfk[g] = minus_col_sums(dfk[g], ds)
  if transport:
    dk += scale * dot(a.astype(dt), mop.astype(dt), precision=precision)
  return dk, dv, tuple(dfk)


def dkv_step_keys(query, kc, mop, dk, dv, dfk, *, scale, transport, precision, causal=False,
                  diag=None):
  """dkv_step (or with `diag`, dkv_diagonal) in key-major tiles: every tile is [S keys, R
  queries], so the key rows are M in all four products (l^T = k~ q^T, dP^T = v dO^T, dv +=
  p^T dO, dS^T q^ with p^T, dS^T formed as they are used) and no register tile is transposed;
  the query-major form transposes p and dS for its dv and dk products, and with R < 64 rows at
  8 warps its l and dP products fall back from wgmma to mma.sync (triton 3.9's PTX, head_dim
  128). query(g): head g's q, dO [R, D] and lse, delta, (fq, sq) as rows [1, R]; kc: k, v
  [S, D], fk (a list over heads) and sk as columns [S, 1]; dfk: [S, 1] float32 accumulators,
  colsum(dS) taken over the queries (a reduction along a row: no cross-warp round trip).
  causal: the diagonal chunk (key <= query); its logits are diag(g), the in-chunk logits [C
  queries, C keys] with transport (transposed here, once per program), else formed from k."""
  dt = kc["k"].dtype
  S = kc["k"].shape[0]
  moved = transport and diag is None   # a step of the operator walk: keys moved by mop
  kt = kc["k"]
  if moved:
    kt = dot(kc["k"], mop.astype(dt), tb=True, precision=precision).astype(dt)
  a = jnp.zeros(dk.shape, jnp.float32) if moved else None
  dfk = list(dfk)
  for g in range(len(dfk)):
    qc = query(g)
    gate_, ok = tile_mask(S, causal=False, fq=qc["fq"], fk=kc["fk"][g], sq=qc["sq"],
                          sk=kc["sk"])
    if causal:
      seen = (lax.broadcasted_iota(jnp.int32, (S, S), 0)
              <= lax.broadcasted_iota(jnp.int32, (S, S), 1))
      ok = seen if ok is None else ok & seen
    if diag is not None:
      st = diag(g).astype(jnp.float32).T
    else:
      st = scale * dot(kt, qc["q"], tb=True, precision=precision)
    pt = jnp.exp(logits(st, gate_, ok) - qc["lse"])
    dst = pt * (dot(kc["v"], qc["do"], tb=True, precision=precision) - qc["delta"])
    dv += dot(pt.astype(dt), qc["do"], precision=precision)
    if moved:
      a += dot(dst.astype(dt), qc["q"], precision=precision)   # dS^T q^, over heads
    elif not transport:   # with transport the diagonal's dS is the pre-pass's
      dk += dot((scale * dst).astype(dt), qc["q"], precision=precision)
    if qc["fq"] is not None:
      dfk[g] = dfk[g] - jnp.sum(dst, axis=1, keepdims=True)
  if moved:
    dk += scale * dot(a.astype(dt), mop.astype(dt), precision=precision)
  return dk, dv, tuple(dfk)


def dkv_diagonal(query, kc, diag, dk, dv, dfk, *, scale, transport, precision):
  """The diagonal chunk c = m of every head (query(g), diag(g): head g's tiles and in-chunk
  logits); with transport its dS goes to the pre-pass (the dq kernels write it), so only dv and
  dfk take it."""
  dt = kc["k"].dtype
  dfk = list(dfk)
  for g in range(len(dfk)):
    qc = query(g)
    s = diag(g).astype(jnp.float32) if transport else scale * dot(qc["q"], kc["k"], tb=True,
                                                                   precision=precision)
    p, ds = tile_grads(qc, dict(kc, fk=kc["fk"][g]), s, True, precision=precision)
    dv += dot(p.astype(dt), qc["do"], ta=True, precision=precision)
    if qc["fq"] is not None:
      dfk[g] = minus_col_sums(dfk[g], ds)
    if not transport:
      dk += scale * dot(ds.astype(dt), qc["q"], ta=True, precision=precision)
  return dk, dv, tuple(dfk)


def dkv_kernel(*refs, scale, transport, gate, segments, precision, chunk_axis, bounds=False,
               span=0, far_out=False, far_in=False, gate_colsum="reduce", keys_major=False):
  """In: q, do [G, n, C, D]; k, v [n, C, D]; (e [n, D, D]); lse, delta, (fq) [G, n, C, 1]; (fk) [G, n, 1, C];
  (sq [n, C, 1], sk [n, 1, C]); (diag [G, n, C, C]); (lo, hi [n, 1, 1]); (qb [G, R, D]
  with span: the boundary states packed, kernels.boundary_offset). Out: dk, dv [C, D] of key chunk m, (dfk [G, 1, C]). With `bounds` the walk stops
  at hi_m, the last query chunk that shares a segment with chunk m (prepass.chunk_bounds).

  With `span` (BlockSizes.dkv_span, transport only) the operator walk stops at the end of key
  chunk m's span, s = (m // span + 1) span, where it is M_sm; the query chunks c >= s are then
  plain attention steps of the stored states qb^(s)_c = q^_c M_cs' (s' = s - 1, the
  dq/dP kernel's) against k~ = k^ M_sm^T, since q^_c M_cm = (q^_c P_{c-1} ... P_s) M_sm, and
  their dk^ share is (scale sum_c dS^T qb_c) M_sm, one operator product in all. With
  `far_out` (the span-parallel backward, bwd_span.py) that sum, a [C, D] float32, is an output
  too (zero for the last span's chunks). With `far_in` (bwd_spans 3) another launch
  (bwd_span.far_dkv_kernel) walked the far query chunks: its a, dv [C, D] and (dfk [G, 1, C])
  float32 of chunk m come in where qb would, and only the operator walk inside the span runs
  here. gate_colsum: the form of dfk's column sums (col_sums_init, minus_col_sums).
  keys_major (BlockSizes.dkv_keys_major): key-major tiles (dkv_step_keys); lse, delta, (fq) then
  come in as rows [G, n, 1, C], (sq [n, 1, C]), fk as columns [G, n, C, 1], (sk [n, C, 1]),
  and dfk (and fdfk) are columns [G, C, 1]: the same memory as the other layout's."""
  far_spec = [("qb", transport and span > 0 and not far_in), ("fa", far_in), ("fdv", far_in),
              ("fdfk", far_in and gate)]
  r = _unpack(refs, _in_spec(transport, gate, segments, bounds) + far_spec
              + [("dk", True), ("dv", True), ("dfk", gate), ("a", far_out)])
  r["do"] = HeadsMinor(r["do"])   # time-major, the group's heads minor (calls._bwd_inputs)
  G, n, C, D = r["q"].shape
  f32 = jnp.float32
  m = chunk_id(n, axis=chunk_axis, reverse=False)  # chunk 0 (the longest walk) first
  kc = dict(k=r["k"][m], v=r["v"][m], fk=[None if not gate else r["fk"][g, m] for g in range(G)],
            sk=None if not segments else r["sk"][m])

  def query(g, c, q=None):  # (load order as the products use them: fewer spills at D 128)
    return dict(q=r["q"][g, c] if q is None else q, fq=None if not gate else r["fq"][g, c],
                sq=None if not segments else r["sq"][c], lse=r["lse"][g, c], do=r["do"][g, c],
                delta=r["delta"][g, c])

  kw = dict(scale=scale, transport=transport, precision=precision)
  zeros = lambda: (jnp.zeros((C, D), f32), jnp.zeros((C, D), f32))
  total = (lambda x: x) if keys_major else col_total   # dfk's accumulator -> its output
  if keys_major:
    walk = dkv_step_keys
    dfk = tuple(jnp.zeros((C, 1), f32) for _ in range(G))
    dk, dv, dfk = dkv_step_keys(lambda g: query(g, m), kc, None, *zeros(), dfk, causal=True,
                                diag=(lambda g: r["diag"][g, m]) if transport else None, **kw)
  else:
    walk = dkv_step
    dfk = tuple(col_sums_init(gate_colsum, C, C, gate=gate, exact=r["q"].dtype == f32)
                for _ in range(G))
    dk, dv, dfk = dkv_diagonal(lambda g: query(g, m), kc, lambda g: r["diag"][g, m], *zeros(),
                               dfk, **kw)

  def body(c, carry):
    mop, dk, dv, dfk = carry
    first = query(0, c)  # head 0's loads ahead of the operator product, the others lazily
    dk, dv, dfk = walk(lambda g: first if g == 0 else query(g, c), kc, mop, dk, dv, dfk, **kw)
    if transport:
      mop = mop - dot(r["e"][c], mop.astype(r["q"].dtype), precision=precision)  # P_c M
    return mop, dk, dv, dfk

  mop = _eye(D) if transport else jnp.zeros((1, 1), f32)
  end = chunk_bound(r["hi"], m) + 1 if bounds else n
  if not (transport and span):
    _, dk, dv, dfk = lax.fori_loop(m + 1, end, body, (mop, dk, dv, tuple(dfk)))
  else:
    dt = r["q"].dtype
    j = lax.div(m, span)   # m's span; qb's boundary index for the next span's first chunk s
    s = (j + 1) * span
    mop, dk, dv, dfk = lax.fori_loop(m + 1, jnp.minimum(s, end), body, (mop, dk, dv, tuple(dfk)))
    mop = mop.astype(dt)   # M_sm (the product below takes it in the kernel dtype)

    def far_body(c, carry):
      def step(carry):
        a, dv, dfk = carry
        t = boundary_rows(j, c, C, n=n, span=span, C=C)
        return walk(lambda g: query(g, c, q=r["qb"][g, t]), far, None, a, dv, dfk,
                    scale=scale, transport=False, precision=precision)

      if not bounds:
        return step(carry)
      # The dq/dP sweep of chunk c starts at key chunk lo_c (its pair's: the smaller lo), so
      # when lo_c >= s it may have stored no state at s: the row can be unwritten memory. Tile
      # (c, m) is then fully masked (m < s <= lo_c), so skipping it is exact.
      return lax.cond(chunk_bound(r["lo"], c) < s, step, lambda carry: carry, carry)

    if far_in:
      a, dv = r["fa"][...], dv + r["fdv"][...]
      dfk = tuple(total(dfk[g]) + r["fdfk"][g] for g in range(G)) if gate else dfk
    else:
      far = dict(kc, k=dot(kc["k"], mop, tb=True, precision=precision).astype(dt))
      a, dv, dfk = lax.fori_loop(s, end, far_body, (jnp.zeros((C, D), f32), dv, dfk))
    dk += dot(a.astype(dt), mop, precision=precision)   # a is already scaled
    if far_out:
      r["a"][...] = a
  r["dk"][...] = dk.astype(r["dk"].dtype)
  r["dv"][...] = dv.astype(r["dv"].dtype)
  if gate:
    for g in range(G):
      r["dfk"][g] = total(dfk[g])


def dq_kernel(*refs, scale, transport, gate, segments, precision, lanes, pairs, bounds=False,
              kv=False, span=0):
  """In: as dkv_kernel, except that the query-side operands have their chunks merged into time
  (q, do [G, n*C, D]; lse, delta, (fq) [G, n*C, 1]; (sq [n*C, 1]); (diag [G, n*C, C])), so that
  one load reads the rows of one chunk or of two adjacent ones. Out: dq [G, n*C, D],
  (ddiag [G, n*C, C], dP [n, D, D] of this lane, states [n, R, D] scratch with R = C, 2C with
  pairs), (dfq [G, n*C, 1]); dP and dfq float32, the rest kernel dtype. `pairs` (transport
  only) and `lanes` come from calls.backward_dq. With `bounds` (lo, hi [n, 1, 1]) a query
  chunk walks key chunks lo_c .. c-1 only (prepass.chunk_bounds): left of lo_c every tile is
  masked, so the adjoint starts at zero there and no dP_m gets a contribution.
  With `kv` (BlockSizes.dkv_in_dq) the kernel also accumulates this lane's dk^, dv [n, C, D]
  and (dfk [G, n, 1, C]) in float32 (dq_step's key-side parts), and calls.backward launches no
  dk/dv kernel.
  With `span` (BlockSizes.dkv_span, transport only) it also writes qb [G, R, D], packed
  (kernels.boundary_offset): row block (j, chunk c) holds q^_c P_{c-1} ... P_s, the state against key chunk s - 1 for the
  boundary s = (j + 1) span <= c, which the right-to-left state pass computes anyway (the dk/dv
  kernel's far walk reads it)."""
  r = _unpack(refs, _in_spec(transport, gate, segments, bounds)
              + [("dq", True), ("ddiag", transport), ("dp", transport), ("st", transport),
                 ("qb", transport and span > 0), ("dfq", gate), ("dka", kv), ("dva", kv),
                 ("dfka", kv and gate)])
  r["do"] = HeadsMinor(r["do"])   # time-major, the group's heads minor (calls._bwd_inputs)
  G = r["q"].shape[0]
  n, C, D = r["k"].shape
  dt = r["q"].dtype
  f32 = jnp.float32

  if transport or kv:
    def zero(m, carry):
      if transport:
        r["dp"][m] = jnp.zeros((D, D), f32)
      if kv:
        r["dka"][m] = jnp.zeros((C, D), f32)
        r["dva"][m] = jnp.zeros((C, D), f32)
        if gate:
          for g in range(G):
            r["dfka"][g, m] = jnp.zeros((1, C), f32)
      return carry

    lax.fori_loop(0, n, zero, 0)

  def add_kv(g, m, parts):  # key chunk m's gradients, read-modify-write (kv)
    if parts is None:
      return
    dk, dv, dfk = parts
    r["dka"][m] += dk
    r["dva"][m] += dv
    if gate:
      r["dfka"][g, m] += dfk

  def rows(c, size):  # (a static chunk index, e.g. the odd last chunk, needs no hint)
    start = c * C
    return pl.ds(start if isinstance(start, int) else pl.multiple_of(start, C), size)

  def load_query(g, c, size=C):  # `size` rows from the start of query chunk c
    t = rows(c, size)
    return dict(q=r["q"][g, t], do=r["do"][g, t], lse=r["lse"][g, t], delta=r["delta"][g, t],
                fq=None if not gate else r["fq"][g, t], sq=None if not segments else r["sq"][t])

  def load_key(g, m, with_e=transport):  # loaded once per key chunk, shared by every query row
    return dict(k=r["k"][m], v=r["v"][m], e=r["e"][m] if with_e else None,
                fk=None if not gate else r["fk"][g, m], sk=None if not segments else r["sk"][m])

  def diagonal(g, c, qc, kc):
    """-> initial adjoint (the diagonal's dq with FoX; with transport its dS goes to ddiag), dfq."""
    if transport:
      p, ds = tile_grads(qc, kc, r["diag"][g, rows(c, C)].astype(f32), True, precision=precision)
      r["ddiag"][g, rows(c, C)] = ds.astype(r["ddiag"].dtype)
      adj = jnp.zeros((C, D), f32)
    else:
      p, ds = tile_grads(qc, kc, scale * dot(qc["q"], kc["k"], tb=True, precision=precision),
                         True, precision=precision)
      adj = scale * dot(ds.astype(dt), kc["k"], precision=precision)
    if kv:  # the diagonal's dS reaches k^ through the pre-pass with transport (ddiag)
      dk = (jnp.zeros((C, D), f32) if transport
            else scale * dot(ds.astype(dt), qc["q"], ta=True, precision=precision))
      add_kv(g, c, (dk, dot(p.astype(dt), qc["do"], ta=True, precision=precision),
                    -jnp.sum(ds, axis=0, keepdims=True)))
    return adj, jnp.sum(ds, axis=1, keepdims=True)

  step = functools.partial(dq_step, scale=scale, transport=transport, precision=precision,
                           kv=kv)

  def move(qt, e):  # q~ <- q~ P_m = q~ - q~ E_m (float32 state)
    return qt - dot(qt.astype(dt), e, precision=precision)

  def keep_boundary(g, c, size, m, st):
    """With span: st, the state against key chunk m, is the boundary state of s = m + 1."""
    if span:
      @pl.when(lax.rem(m + 1, span) == 0)   # (lax: jnp's floored % and // lower as selects)
      def _():
        r["qb"][g, boundary_rows(lax.div(m + 1, span) - 1, c, size, n=n, span=span, C=C)] = st

  # dP_m read-modify-write. At head_dim <= 64 the read is issued before the step, so that its
  # latency hides behind the step's products; at 128 the early [D, D] float32 tile costs more
  # in register spills than it hides (H200: dq/dP 18.2 -> 23.8 ms at 8,4096,16,128; 12.3 ->
  # 11.7 ms at 32,2048,32,64).
  early = D <= 64

  def early_dp(m):
    return r["dp"][m] if early else None

  def add_dp(m, acc, dp):
    r["dp"][m] = (acc if early else r["dp"][m]) + dp

  def finish(g, c, size, adj, dfq, dfq_diag_written):
    r["dq"][g, rows(c, size)] = adj.astype(r["dq"].dtype)
    if gate:
      t = rows(c, size)
      r["dfq"][g, t] = (r["dfq"][g, t] + dfq) if dfq_diag_written else dfq

  def first_key(c, last=None):
    """The first key chunk that query chunk c (and chunk `last`, with pairs) can see."""
    if not bounds:
      return 0
    lo = chunk_bound(r["lo"], c)
    return lo if last is None else jnp.minimum(lo, chunk_bound(r["lo"], last))

  def query_chunk(g, c):
    """One query chunk alone (FoX; with transport the odd last chunk): state rows [0, C)."""
    qc = load_query(g, c)
    adj, dfq = diagonal(g, c, qc, load_key(g, c, with_e=False))
    state = lambda m: r["st"][m, pl.ds(0, C)]
    lo = first_key(c)
    if transport:
      def store_state(i, qt):  # the state used against key chunk m, for m = c-1 .. lo
        m = c - 1 - i
        st = qt.astype(dt)
        r["st"][m, pl.ds(0, C)] = st
        keep_boundary(g, c, C, m, st)
        return move(qt, r["e"][m])

      lax.fori_loop(0, c - lo, store_state, qc["q"].astype(f32))

    def key_chunk(m, carry):
      adj, dfq = carry
      acc = early_dp(m) if transport else None
      adj, dfq, dp, parts = step(qc, load_key(g, m), state(m) if transport else qc["q"], adj,
                                 dfq)
      if transport:
        add_dp(m, acc, dp)
      add_kv(g, m, parts)
      return adj, dfq

    finish(g, c, C, *lax.fori_loop(lo, c, key_chunk, (adj, dfq)), False)

  def query_pair(g, c):
    """Query chunks c, c + 1 as one stacked 2C-row tile (transport): their states at key chunk
    m < c are q^_c M_cm and (q^_{c+1} P_c) M_cm, so one walk moves both with E_m, and per key
    chunk one load of k_m, v_m, E_m, one product per term (2C rows) and one dP_m
    read-modify-write serve both chunks. The diagonals run per chunk; the step of chunk c + 1
    against key chunk c (state q^_{c+1}) comes last, with the rows of chunk c masked out."""
    kc = load_key(g, c)
    for j in range(2):  # diagonals: dS to ddiag, their dfq straight to the output
      _, dfq = diagonal(g, c + j, load_query(g, c + j), load_key(g, c + j, with_e=False))
      if gate:
        r["dfq"][g, rows(c + j, C)] = dfq
    qp = load_query(g, c, 2 * C)
    qt, low = pair_state(qp["q"], kc["e"], precision=precision)

    lo = first_key(c, c + 1)

    def store_states(i, qt):  # stacked states against key chunk m = c-1 .. lo
      m = c - 1 - i
      st = qt.astype(dt)
      r["st"][m] = st
      keep_boundary(g, c, 2 * C, m, st)   # (span even: no boundary falls between c and c + 1)
      return move(qt, r["e"][m])

    lax.fori_loop(0, c - lo, store_states, qt)

    def key_chunk(m, carry):
      adj, dfq = carry
      acc = early_dp(m)
      adj, dfq, dp, parts = step(qp, load_key(g, m), r["st"][m], adj, dfq)
      add_dp(m, acc, dp)
      add_kv(g, m, parts)
      return adj, dfq

    init = (jnp.zeros((2 * C, D), f32), jnp.zeros((2 * C, 1), f32))
    adj, dfq = lax.fori_loop(lo, c, key_chunk, init)
    adj, dfq, dp, parts = step(qp, kc, qp["q"], adj, dfq, live=low)  # chunk c + 1 vs key c
    r["dp"][c] += dp
    add_kv(g, c, parts)
    finish(g, c, 2 * C, adj, dfq, True)

  # Lane l takes units l, l + lanes, ... (a unit: a query pair with pairs, else a chunk);
  # static trip count (Triton), the tail skips. With pairs and n odd, the last chunk runs alone
  # on lane 0.
  lane = pl.program_id(2) if lanes > 1 else 0
  units = n // 2 if pairs else n
  for g in range(G):
    def lane_unit(i, carry, g=g):
      u = lane + i * lanes
      run = (lambda: query_pair(g, 2 * u)) if pairs else (lambda: query_chunk(g, u))
      if lanes == 1:
        run()
      else:
        pl.when(u < units)(run)
      return carry

    lax.fori_loop(0, -(-units // lanes), lane_unit, 0)
    if pairs and n % 2:
      if lanes == 1:
        query_chunk(g, n - 1)
      else:
        pl.when(lane == 0)(lambda g=g: query_chunk(g, n - 1))
