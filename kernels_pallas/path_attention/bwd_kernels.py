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
  With `pairs` (BlockSizes.dq_pairs), query chunks go in pairs (c, c + 1): the state of c + 1
  at m < c is (q^_{c+1} P_c) M_cm, so both state chains walk m = c-1 .. 0 in one loop (slots 0, 1
  of the states buffer), and the key sweep carries two adjoints: per key chunk m one load of
  k_m, v_m, E_m and one dP_m read-modify-write (s1^T R1 + s2^T R2) serve both chunks, which
  halves the D x D read-modify-writes and the key-side loads, and the two chains are independent
  products. The pair (c + 1, m = c), state q^_{c+1}, ends the pair. With n odd the last chunk
  runs alone; lanes take pairs round robin, the odd chunk on lane 0. Measured on the H200 this
  pays at head_dim 128 (-5% / -16%) and not at 64 (+21%: two chains' live tiles), hence the
  default (calls.py).
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
      s = r["diag"][g, c].astype(jnp.float32)
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


def dq_kernel(*refs, scale, transport, gate, segments, precision, lanes=1, pairs=True):
  """In: as dkv_kernel. Out: dq [G, n, C, D], (ddiag [G, n, C, C], dP [n, D, D] of this lane,
  states [n, 1 + pairs, C, D] scratch), (dfq [G, n, C, 1]); dP and dfq float32, the rest kernel dtype."""
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

  def load_query(g, c):
    return dict(q=r["q"][g, c], do=r["do"][g, c], lse=r["lse"][g, c], delta=r["delta"][g, c],
                fq=None if not gate else r["fq"][g, c], sq=None if not segments else r["sq"][c])

  def load_key(g, m, with_e=transport):  # loaded once per key chunk, shared by a pair's chains
    return dict(k=r["k"][m], v=r["v"][m], e=r["e"][m] if with_e else None,
                fk=None if not gate else r["fk"][g, m], sk=None if not segments else r["sk"][m])

  def softmax_grad(qc, kc, s, causal):
    gate_, ok = tile_mask(C, causal=causal, fq=qc["fq"], fk=kc["fk"], sq=qc["sq"], sk=kc["sk"])
    p = jnp.exp(logits(s, gate_, ok) - qc["lse"])
    return p * (dot(qc["do"], kc["v"], tb=True, precision=precision) - qc["delta"])

  def diagonal(g, c, qc, kc):
    """-> initial adjoint (the diagonal's dq with FoX; with transport its dS goes to ddiag), dfq."""
    if transport:
      ds = softmax_grad(qc, kc, r["diag"][g, c].astype(f32), True)
      r["ddiag"][g, c] = ds.astype(r["ddiag"].dtype)
      adj = jnp.zeros((C, D), f32)
    else:
      ds = softmax_grad(qc, kc, scale * dot(qc["q"], kc["k"], tb=True, precision=precision), True)
      adj = scale * dot(ds.astype(dt), kc["k"], precision=precision)
    return adj, jnp.sum(ds, axis=1, keepdims=True)

  def step(qc, kc, qt, adj, dfq):
    """One pair (query chunk, key chunk m < c) of one chain: state qt (kernel dtype), adj = R,
    the adjoint of the state after crossing chunk m -> (R P_m^T + scale dS k^_m, dfq, s_m^T R)."""
    ds = softmax_grad(qc, kc, scale * dot(qt, kc["k"], tb=True, precision=precision), False)
    dfq = dfq + jnp.sum(ds, axis=1, keepdims=True)
    gk = scale * dot(ds.astype(dt), kc["k"], precision=precision)
    if not transport:
      return adj + gk, dfq, None
    adjc = adj.astype(dt)
    return (gk + adj - dot(adjc, kc["e"], tb=True, precision=precision), dfq,
            dot(qt, adjc, ta=True, precision=precision))

  def move(qt, e):  # q~ <- q~ P_m = q~ - q~ E_m (float32 state)
    return qt - dot(qt.astype(dt), e, precision=precision)

  def finish(g, c, adj, dfq):
    r["dq"][g, c] = adj.astype(r["dq"].dtype)
    if gate:
      r["dfq"][g, c] = dfq

  def query_chunk(g, c):
    """One query chunk alone (FoX; with transport the odd last chunk): state slot 0."""
    qc = load_query(g, c)
    adj, dfq = diagonal(g, c, qc, load_key(g, c, with_e=False))
    if transport:
      def store_state(i, qt):  # the state used against key chunk m, for m = c-1 .. 0
        m = c - 1 - i
        r["st"][m, 0] = qt.astype(dt)
        return move(qt, r["e"][m])

      lax.fori_loop(0, c, store_state, qc["q"].astype(f32))

    def key_chunk(m, carry):
      adj, dfq = carry
      adj, dfq, dp = step(qc, load_key(g, m), r["st"][m, 0] if transport else qc["q"], adj, dfq)
      if transport:
        r["dp"][m] += dp
      return adj, dfq

    finish(g, c, *lax.fori_loop(0, c, key_chunk, (adj, dfq)))

  def query_pair(g, c):
    """Query chunks c, c + 1 together (transport): two independent chains per step, one load of
    k_m, v_m, E_m and one dP_m read-modify-write per key chunk m < c; then (c + 1, m = c)."""
    q1, q2 = load_query(g, c), load_query(g, c + 1)
    kc = load_key(g, c)
    adj1, dfq1 = diagonal(g, c, q1, kc)
    adj2, dfq2 = diagonal(g, c + 1, q2, load_key(g, c + 1, with_e=False))

    def store_states(i, carry):  # states against key chunk m = c-1 .. 0 of both chunks
      m = c - 1 - i
      qt1, qt2 = carry
      r["st"][m, 0] = qt1.astype(dt)
      r["st"][m, 1] = qt2.astype(dt)
      e = r["e"][m]
      return move(qt1, e), move(qt2, e)

    lax.fori_loop(0, c, store_states, (q1["q"].astype(f32), move(q2["q"].astype(f32), kc["e"])))

    def key_chunk(m, carry):
      adj1, dfq1, adj2, dfq2 = carry
      km = load_key(g, m)
      adj1, dfq1, dp1 = step(q1, km, r["st"][m, 0], adj1, dfq1)
      adj2, dfq2, dp2 = step(q2, km, r["st"][m, 1], adj2, dfq2)
      r["dp"][m] += dp1 + dp2
      return adj1, dfq1, adj2, dfq2

    adj1, dfq1, adj2, dfq2 = lax.fori_loop(0, c, key_chunk, (adj1, dfq1, adj2, dfq2))
    adj2, dfq2, dp2 = step(q2, kc, q2["q"], adj2, dfq2)  # chunk c + 1 against key chunk c
    r["dp"][c] += dp2
    finish(g, c, adj1, dfq1)
    finish(g, c + 1, adj2, dfq2)

  # Lane l takes units l, l + lanes, ... (a unit: a query pair with pairs, else a chunk);
  # static trip count (Triton), the tail skips. With pairs and n odd, the last chunk runs alone
  # on lane 0.
  lane = pl.program_id(2) if lanes > 1 else 0
  pairs = pairs and transport
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
