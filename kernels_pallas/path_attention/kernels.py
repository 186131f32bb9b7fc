"""Kernel bodies shared by the GPU (Triton lowering) and TPU (Mosaic) pallas_calls.

Operands come from prepass.py, head-major and blocked: a [n, C, D] ref holds a whole sequence
of chunks for one (batch, head) and `ref[m]` reads chunk m (a dynamic index on a leading,
untiled dimension, which both backends lower).

Forward, one program per (batch, query head, query chunk c):
  diagonal chunk from the pre-computed in-chunk logits, then key chunks m = c-1 .. 0 right to
  left with an online softmax, the query tile moving one chunk left after each key chunk:
  q~ <- q~ - (q~ W_m^T) U_m. Causal block skipping is the loop bound.

Backward, one program per (batch, query head), sequential over query chunks so that every
accumulation happens in one fixed order (deterministic, no atomics) and nothing of size T x T
or per query-chunk copies of q is held:
  for each query chunk c: pass 1 right to left stores the transported tiles q~_m (one [T, D]
  buffer per program, reused for every c); pass 2 left to right recomputes the softmax and
  carries the adjoint R of q~ (R <- R P_m^T + scale dS_m k^_m), which gives dU_m, dW_m (the
  transport's gradient needs the state from the right and the adjoint from the left, hence
  the stored tiles), while dk^, dv, dU, dW accumulate in their outputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

NEG_INF = -1e30


def _dot(a, b, *, ta=False, tb=False, precision=None):
  dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _mask(c, m, C, *, causal, fq_ref, fk_ref, sq_ref, sk_ref, fq, sq):
  """Additive gate F_i - F_j and the boolean visibility of [C, C] tile (c, m)."""
  gate = None if fq_ref is None else fq - fk_ref[m]
  ok = None
  if causal:
    ok = lax.broadcasted_iota(jnp.int32, (C, C), 1) <= lax.broadcasted_iota(jnp.int32, (C, C), 0)
  if sq_ref is not None:
    same = sq == sk_ref[m]
    ok = same if ok is None else ok & same
  return gate, ok


def _logits(s, gate, ok):
  if gate is not None:
    s = s + gate
  if ok is not None:
    s = jnp.where(ok, s, NEG_INF)
  return s


def fwd_kernel(*refs, scale, transport, gate, segments, precision):
  """refs: q [C,D], k, v, (w, u, diag), (fq [C,1], fk [n,1,C]), (sq [C,1], sk [n,1,C]) -> o, lse."""
  refs = list(refs)
  q_ref, k_ref, v_ref = refs[:3]
  del refs[:3]
  w_ref = u_ref = d_ref = fq_ref = fk_ref = sq_ref = sk_ref = None
  if transport:
    w_ref, u_ref, d_ref = refs[:3]
    del refs[:3]
  if gate:
    fq_ref, fk_ref = refs[:2]
    del refs[:2]
  if segments:
    sq_ref, sk_ref = refs[:2]
    del refs[:2]
  o_ref, lse_ref = refs
  c = pl.program_id(2)
  q = q_ref[...]
  C = q.shape[0]
  dt = q.dtype
  fq = None if fq_ref is None else fq_ref[...]
  sq = None if sq_ref is None else sq_ref[...]
  mk = functools.partial(_mask, fq_ref=fq_ref, fk_ref=fk_ref, sq_ref=sq_ref, sk_ref=sk_ref,
                         fq=fq, sq=sq)

  # Diagonal chunk first: every row sees itself, so the running max is finite from here on.
  s = d_ref[...] if transport else scale * _dot(q, k_ref[c], tb=True, precision=precision)
  s = _logits(s, *mk(c, c, C, causal=True))
  m_i = jnp.max(s, axis=1, keepdims=True)
  p = jnp.exp(s - m_i)
  l_i = jnp.sum(p, axis=1, keepdims=True)
  acc = _dot(p.astype(dt), v_ref[c], precision=precision)

  def body(i, carry):
    qt, m_i, l_i, acc = carry
    m = c - 1 - i
    s = scale * _dot(qt.astype(dt), k_ref[m], tb=True, precision=precision)
    s = _logits(s, *mk(c, m, C, causal=False))
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_i - m_new)
    p = jnp.exp(s - m_new)
    l_i = alpha * l_i + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + _dot(p.astype(dt), v_ref[m], precision=precision)
    if transport:  # q~ <- q~ P_m: move the query tile across key chunk m
      a = _dot(qt.astype(dt), w_ref[m], tb=True, precision=precision)
      qt = qt - _dot(a.astype(dt), u_ref[m], precision=precision)
    return qt, m_new, l_i, acc

  _, m_i, l_i, acc = lax.fori_loop(0, c, body, (q.astype(jnp.float32), m_i, l_i, acc))
  o_ref[...] = (acc / l_i).astype(o_ref.dtype)
  lse_ref[...] = m_i + jnp.log(l_i)


def bwd_kernel(*refs, scale, transport, gate, segments, precision, lanes=1):
  """One (batch, query head): refs = q, k, v, (w, u), do, lse, delta, (fq, fk), (sq, sk) [n, ...]
  -> dq, dk, dv, (dw, du, ddiag, states), (dfq, dfk), all float32 [n, ...]."""
  refs = list(refs)
  q_ref, k_ref, v_ref = refs[:3]
  del refs[:3]
  w_ref = u_ref = fq_ref = fk_ref = sq_ref = sk_ref = None
  if transport:
    w_ref, u_ref = refs[:2]
    del refs[:2]
  do_ref, lse_ref, dl_ref = refs[:3]
  del refs[:3]
  if gate:
    fq_ref, fk_ref = refs[:2]
    del refs[:2]
  if segments:
    sq_ref, sk_ref = refs[:2]
    del refs[:2]
  if transport:
    d_ref = refs.pop(0)
  dq_ref, dk_ref, dv_ref = refs[:3]
  del refs[:3]
  dw_ref = du_ref = dd_ref = st_ref = dfq_ref = dfk_ref = None
  if transport:
    dw_ref, du_ref, dd_ref, st_ref = refs[:4]
    del refs[:4]
  if gate:
    dfq_ref, dfk_ref = refs[:2]
    del refs[:2]
  assert not refs
  n, C, D = q_ref.shape
  dt = q_ref.dtype
  f32 = jnp.float32

  def zero(m, _):
    for r in (dk_ref, dv_ref, dw_ref, du_ref, dfk_ref):
      if r is not None:
        r[m] = jnp.zeros(r.shape[1:], f32)
    return 0

  lax.fori_loop(0, n, zero, 0)

  def query_chunk(c, _):
    q = q_ref[c]
    do = do_ref[c]
    lse = lse_ref[c]
    delta = dl_ref[c]
    fq = None if fq_ref is None else fq_ref[c]
    sq = None if sq_ref is None else sq_ref[c]
    mk = functools.partial(_mask, fq_ref=fq_ref, fk_ref=fk_ref, sq_ref=sq_ref, sk_ref=sk_ref,
                           fq=fq, sq=sq)

    def softmax_grad(s_raw, m, causal):
      gate_, ok = mk(c, m, C, causal=causal)
      p = jnp.exp(_logits(s_raw, gate_, ok) - lse)
      dp = _dot(do, v_ref[m], tb=True, precision=precision)
      ds = p * (dp - delta)
      dv_ref[m] += _dot(p.astype(dt), do, ta=True, precision=precision)
      if dfk_ref is not None:
        dfk_ref[m] -= jnp.sum(ds, axis=0, keepdims=True)
      return ds

    # Diagonal chunk: its logits came from the pre-pass, so its gradient goes back there.
    s = d_ref[c] if transport else scale * _dot(q, k_ref[c], tb=True, precision=precision)
    ds = softmax_grad(s, c, True)
    dfq = jnp.sum(ds, axis=1, keepdims=True)
    if transport:
      dd_ref[c] = ds
      dq = jnp.zeros((C, D), f32)
    else:
      dq = scale * _dot(ds.astype(dt), k_ref[c], precision=precision)
      dk_ref[c] += scale * _dot(ds.astype(dt), q, ta=True, precision=precision)

    if transport:
      def store_state(i, qt):  # q~ used against key chunk m, for m = c-1 .. 0
        m = c - 1 - i
        st_ref[m] = qt
        a = _dot(qt.astype(dt), w_ref[m], tb=True, precision=precision)
        return qt - _dot(a.astype(dt), u_ref[m], precision=precision)

      lax.fori_loop(0, c, store_state, q.astype(f32))

    def key_chunk(m, carry):
      r, dfq = carry  # r: adjoint of q~_{m-1} = q~_m P_m (zero before the first chunk)
      qt = st_ref[m] if transport else q.astype(f32)
      qtc = qt.astype(dt)
      kt = k_ref[m]
      ds = softmax_grad(scale * _dot(qtc, kt, tb=True, precision=precision), m, False)
      dsc = ds.astype(dt)
      dk_ref[m] += scale * _dot(dsc, qtc, ta=True, precision=precision)
      dfq = dfq + jnp.sum(ds, axis=1, keepdims=True)
      g = scale * _dot(dsc, kt, precision=precision)
      if transport:
        w, u = w_ref[m], u_ref[m]
        rc = r.astype(dt)
        a = _dot(qtc, w, tb=True, precision=precision)             # q~ W^T      [C, C]
        ru = _dot(rc, u, tb=True, precision=precision)             # R U^T       [C, C]
        du_ref[m] -= _dot(a.astype(dt), rc, ta=True, precision=precision)
        dw_ref[m] -= _dot(ru.astype(dt), qtc, ta=True, precision=precision)
        return g + r - _dot(ru.astype(dt), w, precision=precision), dfq
      return r + g, dfq

    dq, dfq = lax.fori_loop(0, c, key_chunk, (dq, dfq))
    dq_ref[c] = dq
    if dfq_ref is not None:
      dfq_ref[c] = dfq
    return 0

  # Lane l of `lanes` programs takes query chunks l, l + lanes, ...; its accumulators are its own.
  if lanes == 1:
    lax.fori_loop(0, n, query_chunk, 0)
  else:
    lane = pl.program_id(2)

    def lane_chunk(i, carry):  # static trip count (Triton lowering); the tail lane skips
      @pl.when(lane + i * lanes < n)
      def _():
        query_chunk(lane + i * lanes, 0)
      return carry

    lax.fori_loop(0, -(-n // lanes), lane_chunk, 0)
