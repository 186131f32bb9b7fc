"""The three kernel bodies of causal GRAPE-A attention: forward (online softmax over the key
tiles up to the diagonal), dk/dv (one key tile against the query tiles from the diagonal on,
for each head of its GQA group) and dq (one query tile against the key tiles up to the
diagonal).

A tile's logit is

  l = scale q_i . k_j - (i - j) (rq_i + rk_j)

with per-token rates rq [T] (a query head's) and rk [T] (a key's, for that query head); its
cotangent ds gives d rq_i = -sum_j ds (i - j) and d rk_j = -sum_i ds (i - j), per-row sums
of the tile, so the rates' gradients cost no product. The distance i - j is the time index
difference: the caller's segment ids mask every pair across documents, and inside one
document it equals the difference of positions within it.

Refs are time-major, cut by api.py's BlockSpecs: a query tile [bq, X], a whole key sequence
[T, X] read a tile at a time, a group's queries [T, G, X] read one head at a time. Per-row
vectors (rates, lse, delta, segment ids) are 1-D. The caller pads T at the end: a padded query
(sliced off, zero cotangent) or key (seen only by padded queries, later in time) changes no
real row. With documents, every walk skips the tiles that share no document with its own
(tiles.document_bounds: lo for the query-major walks, hi for the key-major one); a skipped
tile is wholly masked, so the results are the same bits.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from kernels_pallas.common import tiles
from kernels_pallas.common.tiles import dot


@dataclasses.dataclass(frozen=True)
class Static:
  """What the bodies need to know at trace time."""
  scale: float
  block_q: int
  block_k: int
  precision: object     # of the q.k products (None: the inputs' own)
  v_precision: object   # of the products with v and dO


def _logits(st: Static, r, c, r_rate, c_rate, dist):
  """scale r . c - dist (r_rate + c_rate) of a tile whose rows read r / r_rate and columns
  c / c_rate (queries x keys, or keys x queries: the same logits, transposed); a missing
  rate is 0."""
  s = st.scale * dot(r, c, tb=True, precision=st.precision)
  fdist = dist.astype(jnp.float32)
  if r_rate is not None:
    s = s - fdist * r_rate[:, None]
  if c_rate is not None:
    s = s - fdist * c_rate[None, :]
  return s, fdist


def forward_kernel(q_ref, k_ref, rq_ref, rk_ref, v_ref, sq_ref, sk_ref, lo_ref, o_ref, lse_ref,
                   *, st: Static):
  """q [bq, D], k [T, D], (rq [bq]), (rk [T]), v [T, Dv], (sq [bq], sk [T], lo [nq, 1, 1])
  -> o [bq, Dv], lse [bq] float32."""
  bq, bk = st.block_q, st.block_k
  q = q_ref[...]
  rq = tiles.read_optional(rq_ref, ...)
  sq = tiles.read_optional(sq_ref, ...)
  qpos, n = tiles.query_tile(bq, bk)   # the key tiles up to the diagonal

  def body(j, state):
    rows, dist = tiles.key_tile(j, bk, qpos)
    s, _ = _logits(st, q, k_ref[rows, :], rq, tiles.read_optional(rk_ref, rows), dist)
    ok = tiles.causal_visible(dist, sq, tiles.read_optional(sk_ref, rows))
    return tiles.causal_softmax_step(state, s, ok, v_ref[rows, :], precision=st.v_precision)

  state = lax.fori_loop(tiles.first_key_tile(lo_ref), n, body,
                        tiles.causal_softmax_init(bq, v_ref.shape[-1]))
  o_ref[...], lse_ref[...] = tiles.causal_softmax_finish(state)


def dq_kernel(q_ref, k_ref, rq_ref, rk_ref, v_ref, sq_ref, sk_ref, lo_ref, do_ref, lse_ref,
              delta_ref, dq_ref, drq_ref, *, st: Static):
  """One query tile against the key tiles up to the diagonal: -> dq [bq, D], (drq [bq]),
  float32."""
  bq, bk = st.block_q, st.block_k
  q = q_ref[...]
  rq = tiles.read_optional(rq_ref, ...)
  sq = tiles.read_optional(sq_ref, ...)
  do = do_ref[...]
  lse = lse_ref[...][:, None]
  delta = delta_ref[...][:, None]
  qpos, n = tiles.query_tile(bq, bk)

  def body(j, carry):
    dq, drq = carry
    rows, dist = tiles.key_tile(j, bk, qpos)
    k = k_ref[rows, :]
    s, fdist = _logits(st, q, k, rq, tiles.read_optional(rk_ref, rows), dist)
    ok = tiles.causal_visible(dist, sq, tiles.read_optional(sk_ref, rows))
    p = jnp.where(ok, jnp.exp(s - lse), 0.0)
    ds = p * (dot(do, v_ref[rows, :], tb=True, precision=st.v_precision) - delta)
    dq = dq + dot(ds.astype(k.dtype), k, precision=st.precision)
    if drq is not None:
      drq = drq - jnp.sum(ds * fdist, axis=1)
    return dq, drq

  init = (jnp.zeros(q.shape, jnp.float32), None if rq is None else jnp.zeros((bq,), jnp.float32))
  dq, drq = lax.fori_loop(tiles.first_key_tile(lo_ref), n, body, init)
  dq_ref[...] = st.scale * dq
  if drq_ref is not None:
    drq_ref[...] = drq


def dkv_kernel(q_ref, k_ref, rq_ref, rk_ref, v_ref, sq_ref, sk_ref, hi_ref, do_ref, lse_ref,
               delta_ref, dk_ref, drk_ref, dv_ref, *, st: Static):
  """One key tile against its group's G query heads, the query tiles from the diagonal on.
  q [T, G, D], (rq [T, G]), do [T, G, Dv], lse, delta [T, G]; k [bk, D], (rk [bk, G]),
  v [bk, Dv], (sq [T], sk [bk], hi [nk, 1, 1]) -> dk [bk, D], dv [bk, Dv] float32, summed
  over the group, and (drk [bk, G]) float32, per query head.

  Key-major tiles ([keys, queries]) so that dk += dS^T q and dv += P^T dO take them as they
  are."""
  bq, bk = st.block_q, st.block_k
  k = k_ref[...]
  v = v_ref[...]
  sk = tiles.read_optional(sk_ref, ...)
  kpos, first, n, G = tiles.key_major(bq, bk, q_ref)
  n = tiles.query_tiles_end(hi_ref, n)
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  for g in range(G):
    rk = tiles.read_optional(rk_ref, (slice(None), g))

    def body(i, carry, g=g, rk=rk):
      dk, dv, drk = carry
      rows, dist = tiles.query_rows(i, bq, kpos)   # i - j, [keys, queries]
      q = q_ref[rows, g, :]
      rq = tiles.read_optional(rq_ref, (rows, g))
      s, fdist = _logits(st, k, q, rk, rq, dist)
      ok = tiles.causal_visible(dist, sk, tiles.read_optional(sq_ref, rows))
      p = jnp.where(ok, jnp.exp(s - lse_ref[rows, g][None, :]), 0.0)
      do = do_ref[rows, g, :]
      dv = dv + dot(p.astype(do.dtype), do, precision=st.v_precision)
      ds = p * (dot(v, do, tb=True, precision=st.v_precision) - delta_ref[rows, g][None, :])
      dk = dk + dot(ds.astype(q.dtype), q, precision=st.precision)
      if drk is not None:
        drk = drk - jnp.sum(ds * fdist, axis=1)
      return dk, dv, drk

    init = (dk, dv, None if rk is None else jnp.zeros((bk,), jnp.float32))
    dk, dv, drk = lax.fori_loop(first, n, body, init)
    if drk_ref is not None:
      drk_ref[:, g] = drk
  dk_ref[...] = st.scale * dk
  dv_ref[...] = dv
