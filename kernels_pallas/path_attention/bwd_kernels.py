"""Backward kernel bodies (GPU Triton lowering and TPU Mosaic share them).

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
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.path_attention.kernels import dot, logits, tile_mask


def _unpack(refs, spec):
  """Splits refs by the (name, present) list `spec`; absent names map to None."""
  refs = list(refs)
  out = {}
  for name, present in spec:
    out[name] = refs.pop(0) if present else None
  assert not refs, len(refs)
  return out


def _in_spec(transport, gate, segments):
  return [("q", True), ("k", True), ("v", True), ("e", transport),
          ("do", True), ("lse", True), ("delta", True), ("fq", gate), ("fk", gate),
          ("sq", segments), ("sk", segments), ("diag", transport)]


def _eye(D):
  i = lax.broadcasted_iota(jnp.int32, (D, D), 0)
  return jnp.where(i == lax.broadcasted_iota(jnp.int32, (D, D), 1), 1.0, 0.0).astype(jnp.float32)


def dkv_kernel(*refs, scale, transport, gate, segments, precision):
  """In: q, do [G, n, C, D]; k, v [n, C, D]; (e [n, D, D]); lse, delta, (fq) [G, n, C, 1]; (fk) [G, n, 1, C];
  (sq [n, C, 1], sk [n, 1, C]); (diag [G, n, C, C]). Out: dk, dv [C, D] of key chunk m, (dfk [G, 1, C])."""
  r = _unpack(refs, _in_spec(transport, gate, segments)
              + [("dk", True), ("dv", True), ("dfk", gate)])
  G, n, C, D = r["q"].shape
  dt = r["q"].dtype
  f32 = jnp.float32
  m = pl.program_id(2)
  kh, vm = r["k"][m], r["v"][m]
  fk = [None if not gate else r["fk"][g, m] for g in range(G)]
  sk = None if not segments else r["sk"][m]

  def head(g, c, kt, causal):
    """p, dS of head g's query chunk c against this key chunk (key tile kt)."""
    qc = r["q"][g, c]
    if causal and transport:
      s = r["diag"][g, c]
    else:
      s = scale * dot(qc, kt, tb=True, precision=precision)
    gate_, ok = tile_mask(C, causal=causal, fq=None if not gate else r["fq"][g, c], fk=fk[g],
                          sq=None if not segments else r["sq"][c], sk=sk)
    p = jnp.exp(logits(s, gate_, ok) - r["lse"][g, c])
    do = r["do"][g, c]
    ds = p * (dot(do, vm, tb=True, precision=precision) - r["delta"][g, c])
    return qc, do, p, ds

  dv = jnp.zeros((C, D), f32)
  dk = jnp.zeros((C, D), f32)
  dfk = [jnp.zeros((1, C), f32) for _ in range(G)]
  for g in range(G):  # diagonal chunk; with transport its dS goes to the pre-pass (dq_kernel)
    qc, do, p, ds = head(g, m, kh, True)
    dv += dot(p.astype(dt), do, ta=True, precision=precision)
    if gate:
      dfk[g] = dfk[g] - jnp.sum(ds, axis=0, keepdims=True)
    if not transport:
      dk += scale * dot(ds.astype(dt), qc, ta=True, precision=precision)

  def body(c, carry):
    mop, dk, dv, dfk = carry
    kt = dot(kh, mop.astype(dt), tb=True, precision=precision).astype(dt) if transport else kh
    a = jnp.zeros((C, D), f32)
    dfk = list(dfk)
    for g in range(G):
      qc, do, p, ds = head(g, c, kt, False)
      dv += dot(p.astype(dt), do, ta=True, precision=precision)
      a += dot(ds.astype(dt), qc, ta=True, precision=precision)   # dS^T q^, summed over heads
      if gate:
        dfk[g] = dfk[g] - jnp.sum(ds, axis=0, keepdims=True)
    if transport:
      dk += scale * dot(a.astype(dt), mop.astype(dt), precision=precision)
      mop = mop - dot(r["e"][c], mop.astype(dt), precision=precision)  # P_c M = M - E_c M
    else:
      dk += scale * a
    return mop, dk, dv, tuple(dfk)

  mop = _eye(D) if transport else jnp.zeros((1, 1), f32)
  _, dk, dv, dfk = lax.fori_loop(m + 1, n, body, (mop, dk, dv, tuple(dfk)))
  r["dk"][...] = dk.astype(r["dk"].dtype)
  r["dv"][...] = dv.astype(r["dv"].dtype)
  if gate:
    for g in range(G):
      r["dfk"][g] = dfk[g]


def dq_kernel(*refs, scale, transport, gate, segments, precision, lanes=1):
  """In: as dkv_kernel. Out: dq [G, n, C, D], (ddiag [G, n, C, C], dP [n, D, D] of this lane,
  states [n, C, D] scratch), (dfq [G, n, C, 1]); dP and dfq float32, the rest kernel dtype."""
  r = _unpack(refs, _in_spec(transport, gate, segments)
              + [("dq", True), ("ddiag", transport), ("dp", transport), ("st", transport),
                 ("dfq", gate)])
  G, n, C, D = r["q"].shape
  dt = r["q"].dtype
  f32 = jnp.float32

  if transport:
    def zero(m, carry):
      r["dp"][m] = jnp.zeros((D, D), f32)
      return carry

    lax.fori_loop(0, n, zero, 0)

  def query_chunk(g, c):
    q, do, lse, delta = r["q"][g, c], r["do"][g, c], r["lse"][g, c], r["delta"][g, c]
    fq = None if not gate else r["fq"][g, c]
    sq = None if not segments else r["sq"][c]

    def softmax_grad(s, m, causal):
      gate_, ok = tile_mask(C, causal=causal, fq=fq, fk=None if not gate else r["fk"][g, m],
                            sq=sq, sk=None if not segments else r["sk"][m])
      p = jnp.exp(logits(s, gate_, ok) - lse)
      return p * (dot(do, r["v"][m], tb=True, precision=precision) - delta)

    if transport:
      ds = softmax_grad(r["diag"][g, c], c, True)
      r["ddiag"][g, c] = ds.astype(r["ddiag"].dtype)
      dq = jnp.zeros((C, D), f32)

      def store_state(i, qt):  # the state used against key chunk m, for m = c-1 .. 0
        m = c - 1 - i
        r["st"][m] = qt.astype(dt)
        return qt - dot(qt.astype(dt), r["e"][m], precision=precision)

      lax.fori_loop(0, c, store_state, q.astype(f32))
    else:
      ds = softmax_grad(scale * dot(q, r["k"][c], tb=True, precision=precision), c, True)
      dq = scale * dot(ds.astype(dt), r["k"][c], precision=precision)
    dfq = jnp.sum(ds, axis=1, keepdims=True)

    def key_chunk(m, carry):
      adj, dfq = carry  # adj: adjoint of the state after crossing chunk m (zero at m = 0)
      qt = r["st"][m] if transport else q
      kt = r["k"][m]
      ds = softmax_grad(scale * dot(qt, kt, tb=True, precision=precision), m, False)
      dfq = dfq + jnp.sum(ds, axis=1, keepdims=True)
      gk = scale * dot(ds.astype(dt), kt, precision=precision)
      if not transport:
        return adj + gk, dfq
      adjc = adj.astype(dt)
      r["dp"][m] += dot(qt, adjc, ta=True, precision=precision)     # dL/dP_m += s_m^T R
      return gk + adj - dot(adjc, r["e"][m], tb=True, precision=precision), dfq  # + R P_m^T

    dq, dfq = lax.fori_loop(0, c, key_chunk, (dq, dfq))
    r["dq"][g, c] = dq.astype(r["dq"].dtype)
    if gate:
      r["dfq"][g, c] = dfq

  # Lane l takes query chunks l, l + lanes, ...; static trip count (Triton), the tail skips.
  lane = pl.program_id(2) if lanes > 1 else 0
  for g in range(G):
    def lane_chunk(i, carry, g=g):
      c = lane + i * lanes
      if lanes == 1:
        query_chunk(g, c)
      else:
        pl.when(c < n)(lambda: query_chunk(g, c))
      return carry

    lax.fori_loop(0, -(-n // lanes), lane_chunk, 0)
