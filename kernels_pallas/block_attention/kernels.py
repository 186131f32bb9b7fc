"""The three kernel bodies: forward (online softmax over key tiles), dk/dv (one key tile
against every query tile of the GQA group's heads) and dq (one query tile against every key
tile).

Refs are time-major, cut by launch.py's BlockSpecs: a query tile q [bq, D], a whole key
sequence k [Tk, D] read a tile at a time (k[pl.ds(j * bk, bk)]), a group's queries [Tq, G, D]
read one head at a time (q[rows, g]: a static g, strided rows). Per-row vectors (biases, lse,
delta, segment ids) are 1-D and become [bq, 1] columns or [1, bq] rows where a tile needs them.

The query bias is a row constant, so it never enters a tile: the forward adds it to the lse,
and the backward reads lse - q_bias. tk is the true key count; keys at or past it are padding
and invisible.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.common.tiles import NEG_INF, dot


def _visible(sq, sk, start, size, tk, *, ragged, axis):
  """Boolean visibility of a tile whose keys start at `start` (along `axis`: 1 for [queries,
  keys] tiles, 0 for [keys, queries]), or None when every key is visible."""
  ok = None
  if sq is not None:
    ok = sq == sk
  if ragged:
    shape = (1, size) if axis == 1 else (size, 1)
    live = start + lax.broadcasted_iota(jnp.int32, shape, axis) < tk
    ok = live if ok is None else ok & live
  return ok


def forward_kernel(q_ref, k_ref, v_ref, qb_ref, kb_ref, sq_ref, sk_ref, o_ref, lse_ref, *,
                   scale, block_k, tk, precision, v_precision):
  """q [bq, D], k [Tk, D], v [Tk, Dv], (qb [bq]), (kb [Tk]), (sq [bq], sk [Tk]) -> o [bq, Dv]
  float32 (0 for a row that sees no key), lse [bq] float32 (NEG_INF there)."""
  q = q_ref[...]
  bq = q.shape[0]
  dv_dim = v_ref.shape[-1]
  n = k_ref.shape[0] // block_k
  ragged = tk % block_k != 0
  sq = None if sq_ref is None else sq_ref[...][:, None]

  def body(j, carry):
    m_i, l_i, acc = carry
    start = pl.multiple_of(j * block_k, block_k)
    rows = pl.ds(start, block_k)
    s = scale * dot(q, k_ref[rows, :], tb=True, precision=precision)
    if kb_ref is not None:
      s = s + kb_ref[rows][None, :]
    sk = None if sk_ref is None else sk_ref[rows][None, :]
    ok = _visible(sq, sk, start, block_k, tk, ragged=ragged, axis=1)
    if ok is not None:
      s = jnp.where(ok, s, NEG_INF)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    alpha = jnp.exp(m_i - m_new)
    p = jnp.exp(s - m_new[:, None])
    if ok is not None:   # a fully masked tile has s == m_new == NEG_INF: exp gives 1, not 0
      p = jnp.where(ok, p, 0.0)
    l_i = alpha * l_i + jnp.sum(p, axis=1)
    v = v_ref[rows, :]
    acc = alpha[:, None] * acc + dot(p.astype(v.dtype), v, precision=v_precision)
    return m_new, l_i, acc

  init = (jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros((bq, dv_dim), jnp.float32))
  m_i, l_i, acc = lax.fori_loop(0, n, body, init)
  seen = l_i > 0
  o_ref[...] = acc / jnp.where(seen, l_i, 1.0)[:, None]
  lse = m_i + jnp.log(jnp.where(seen, l_i, 1.0))
  if qb_ref is not None:
    lse = lse + qb_ref[...]
  lse_ref[...] = jnp.where(seen, lse, NEG_INF)


def dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kb_ref, sq_ref, sk_ref,
               dk_ref, dv_ref, dkb_ref, *, scale, block_q, tk, precision, v_precision):
  """One key tile against the group's G query heads, every query tile. q [Tq, G, D], do
  [Tq, G, Dv] (v's dtype), lse, delta [Tq, G] (lse - q_bias; Delta - dlse), k [bk, D], v
  [bk, Dv], (kb [bk, G]), (sq [Tq], sk [bk]) -> dk [bk, D], dv [bk, Dv], (dkb [bk, G]) float32.

  Key-major tiles ([keys, queries]: s^T = k q^T, dP^T = v dO^T), so dk += dS^T q and
  dv += P^T dO take them as they are, no register tile transposed."""
  k = k_ref[...]
  v = v_ref[...]
  bk = k.shape[0]
  G = q_ref.shape[1]
  n = q_ref.shape[0] // block_q
  start_k = pl.program_id(0) * bk
  ragged = tk % bk != 0
  sk = None if sk_ref is None else sk_ref[...][:, None]
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  for g in range(G):
    kb = None if kb_ref is None else kb_ref[:, g][:, None]

    def body(i, carry, g=g, kb=kb):
      dk, dv, dkb = carry
      rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
      q = q_ref[rows, g, :]
      do = do_ref[rows, g, :]
      s = scale * dot(k, q, tb=True, precision=precision)
      if kb is not None:
        s = s + kb
      sq = None if sq_ref is None else sq_ref[rows][None, :]
      ok = _visible(sq, sk, start_k, bk, tk, ragged=ragged, axis=0)
      p = jnp.exp(s - lse_ref[rows, g][None, :])
      if ok is not None:   # also where lse is NEG_INF (a row that sees no key): exp is inf
        p = jnp.where(ok, p, 0.0)
      dp = dot(v, do, tb=True, precision=v_precision)
      ds = p * (dp - delta_ref[rows, g][None, :])
      dv = dv + dot(p.astype(do.dtype), do, precision=v_precision)
      dk = dk + dot(ds.astype(q.dtype), q, precision=precision)
      return dk, dv, dkb if dkb_ref is None else dkb + jnp.sum(ds, axis=1)

    dk, dv, dkb = lax.fori_loop(0, n, body, (dk, dv, jnp.zeros((bk,), jnp.float32)))
    if dkb_ref is not None:
      dkb_ref[:, g] = dkb
  dk_ref[...] = scale * dk
  dv_ref[...] = dv


def dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kb_ref, sq_ref, sk_ref, dq_ref,
              *, scale, block_k, tk, precision, v_precision):
  """One query tile against every key tile: q [bq, D], do [bq, Dv], lse, delta [bq], k [Tk, D],
  v [Tk, Dv], (kb [Tk]), (sq [bq], sk [Tk]) -> dq [bq, D] float32."""
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...][:, None]
  delta = delta_ref[...][:, None]
  sq = None if sq_ref is None else sq_ref[...][:, None]
  n = k_ref.shape[0] // block_k
  ragged = tk % block_k != 0

  def body(j, dq):
    start = pl.multiple_of(j * block_k, block_k)
    rows = pl.ds(start, block_k)
    k = k_ref[rows, :]
    s = scale * dot(q, k, tb=True, precision=precision)
    if kb_ref is not None:
      s = s + kb_ref[rows][None, :]
    sk = None if sk_ref is None else sk_ref[rows][None, :]
    ok = _visible(sq, sk, start, block_k, tk, ragged=ragged, axis=1)
    p = jnp.exp(s - lse)
    if ok is not None:
      p = jnp.where(ok, p, 0.0)
    ds = p * (dot(do, v_ref[rows, :], tb=True, precision=v_precision) - delta)
    return dq + dot(ds.astype(k.dtype), k, precision=precision)

  dq_ref[...] = scale * lax.fori_loop(0, n, body, jnp.zeros(q.shape, jnp.float32))
