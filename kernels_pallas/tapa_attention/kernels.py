"""The three kernel bodies of causal TAPA attention: forward (online softmax over the key
tiles up to the diagonal), dk/dv (one key tile against the query tiles from the diagonal on,
for each head of its GQA group) and dq (one query tile against the key tiles up to the
diagonal).

A tile's logit is l = amp cos(theta), with

  amp   = a_scale q_A . k_A
  theta = 2 pi |i - j|^alpha ph,   ph = p_scale q_P . k_P       (quadratic phase)
                                   ph = p_scale (sq_i + sk_j)    (linear phase: sq, sk are the
                                                                  rows' phase-channel sums)

and its cotangent ds = dl splits into d amp = ds cos(theta) and
d ph = -ds amp sin(theta) 2 pi |i - j|^alpha, which the products carry back to the amplitude
and phase channels (or, for the linear phase, sum along the tile into the per-row sums).

Refs are time-major, cut by api.py's BlockSpecs: a query tile [bq, X], a whole key sequence
[T, X] read a tile at a time, a group's queries [T, G, X] read one head at a time. Per-row
vectors (phase sums, lse, delta, segment ids) are 1-D. Positions are the time indices: the
caller pads T at the end, and a padded query (sliced off, zero cotangent) or key (seen only by
padded queries, which are later in time) changes no real row. With documents, every walk skips
the tiles that share no document with its own (tiles.document_bounds); a skipped tile is wholly
masked, so the results are the same bits.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from kernels_pallas.common import special
from kernels_pallas.common import tiles
from kernels_pallas.common.tiles import dot

TWO_PI = 2.0 * math.pi


@dataclasses.dataclass(frozen=True)
class Static:
  """What the bodies need to know at trace time."""
  alpha: float
  a_scale: float        # 1 / sqrt(A)
  p_scale: float        # 1 / sqrt(P)
  linear_phase: bool
  block_q: int
  block_k: int
  precision: object     # of the q.k products (None: the inputs' own)
  v_precision: object   # of the products with v and dO
  fast: bool            # the GPU's approximate cos, sin, ex2, lg2 (special.py); False in the
                        # interpreter


def _distance_power(dist, alpha: float, fast: bool):
  """|i - j|^alpha of the (non-negative on visible entries) distances, 0^alpha = [alpha == 0]."""
  d = dist.astype(jnp.float32)
  if alpha == 0.0:
    return jnp.ones_like(d)
  return jnp.where(d > 0, special.power(jnp.maximum(d, 1.0), alpha, fast=fast), 0.0)


def _parts(st: Static, ra, ca, rp, cp, rs, cs, dist):
  """(amp, theta, 2 pi |i-j|^alpha) of a tile whose rows read ra/rp/rs and columns ca/cp/cs
  (queries x keys, or keys x queries: the same products, transposed)."""
  amp = st.a_scale * dot(ra, ca, tb=True, precision=st.precision)
  if st.linear_phase:
    ph = st.p_scale * (rs[:, None] + cs[None, :])
  else:
    ph = st.p_scale * dot(rp, cp, tb=True, precision=st.precision)
  w = TWO_PI * _distance_power(dist, st.alpha, st.fast)
  return amp, w * ph, w


def forward_kernel(qa_ref, ka_ref, qp_ref, kp_ref, qs_ref, ks_ref, v_ref, sq_ref, sk_ref,
                   lo_ref, o_ref, lse_ref, *, st: Static):
  """qa [bq, A], ka [T, A], (qp [bq, P], kp [T, P]) or (qs [bq], ks [T]), v [T, Dv],
  (sq [bq], sk [T], lo [nq, 1, 1]) -> o [bq, Dv], lse [bq] float32."""
  bq, bk = st.block_q, st.block_k
  qa = qa_ref[...]
  qp = tiles.read_optional(qp_ref, ...)
  qs = tiles.read_optional(qs_ref, ...)
  sq = tiles.read_optional(sq_ref, ...)
  qpos, n = tiles.query_tile(bq, bk)   # the key tiles up to the diagonal

  def body(j, state):
    rows, dist = tiles.key_tile(j, bk, qpos)
    kp = tiles.read_optional(kp_ref, (rows, slice(None)))
    amp, theta, _ = _parts(st, qa, ka_ref[rows, :], qp, kp, qs,
                           tiles.read_optional(ks_ref, rows), dist)
    ok = tiles.causal_visible(dist, sq, tiles.read_optional(sk_ref, rows))
    return tiles.causal_softmax_step(state, amp * special.cos(theta, fast=st.fast), ok,
                                     v_ref[rows, :], precision=st.v_precision)

  state = lax.fori_loop(tiles.first_key_tile(lo_ref), n, body,
                        tiles.causal_softmax_init(bq, v_ref.shape[-1]))
  o_ref[...], lse_ref[...] = tiles.causal_softmax_finish(state)


def dq_kernel(qa_ref, ka_ref, qp_ref, kp_ref, qs_ref, ks_ref, v_ref, sq_ref, sk_ref, lo_ref,
              do_ref, lse_ref, delta_ref, dqa_ref, dqp_ref, dqs_ref, *, st: Static):
  """One query tile against the key tiles up to the diagonal: -> dqa [bq, A], and dqp
  [bq, P] (quadratic) or dqs [bq] (linear), float32."""
  bq, bk = st.block_q, st.block_k
  qa = qa_ref[...]
  qp = tiles.read_optional(qp_ref, ...)
  qs = tiles.read_optional(qs_ref, ...)
  sq = tiles.read_optional(sq_ref, ...)
  do = do_ref[...]
  lse = lse_ref[...][:, None]
  delta = delta_ref[...][:, None]
  qpos, n = tiles.query_tile(bq, bk)

  def body(j, carry):
    dqa, dqp, dqs = carry
    rows, dist = tiles.key_tile(j, bk, qpos)
    ka = ka_ref[rows, :]
    kp = tiles.read_optional(kp_ref, (rows, slice(None)))
    amp, theta, w = _parts(st, qa, ka, qp, kp, qs, tiles.read_optional(ks_ref, rows), dist)
    ok = tiles.causal_visible(dist, sq, tiles.read_optional(sk_ref, rows))
    cos, sin = special.cos_sin(theta, fast=st.fast)
    p = jnp.where(ok, jnp.exp(amp * cos - lse), 0.0)
    ds = p * (dot(do, v_ref[rows, :], tb=True, precision=st.v_precision) - delta)
    dqa = dqa + dot((ds * cos).astype(ka.dtype), ka, precision=st.precision)
    dph = -(ds * amp * sin * w)
    if st.linear_phase:
      dqs = dqs + jnp.sum(dph, axis=1)
    else:
      dqp = dqp + dot(dph.astype(kp.dtype), kp, precision=st.precision)
    return dqa, dqp, dqs

  init = (jnp.zeros(qa.shape, jnp.float32),
          None if qp is None else jnp.zeros(qp.shape, jnp.float32),
          None if qs is None else jnp.zeros((bq,), jnp.float32))
  dqa, dqp, dqs = lax.fori_loop(tiles.first_key_tile(lo_ref), n, body, init)
  dqa_ref[...] = st.a_scale * dqa
  if dqp_ref is not None:
    dqp_ref[...] = st.p_scale * dqp
  if dqs_ref is not None:
    dqs_ref[...] = st.p_scale * dqs


def dkv_kernel(qa_ref, ka_ref, qp_ref, kp_ref, qs_ref, ks_ref, v_ref, sq_ref, sk_ref, hi_ref,
               do_ref, lse_ref, delta_ref, dka_ref, dkp_ref, dks_ref, dv_ref, *, st: Static):
  """One key tile against its group's G query heads, the query tiles from the diagonal on.
  qa [T, G, A], (qp [T, G, P] or qs [T, G]), do [T, G, Dv], lse, delta [T, G]; ka [bk, A],
  (kp [bk, P] or ks [bk]), v [bk, Dv], (sq [T], sk [bk], hi [nk, 1, 1]) -> dka [bk, A], (dkp
  [bk, P] or dks [bk]), dv [bk, Dv], float32, summed over the group.

  Key-major tiles ([keys, queries]) so that dk += dS^T q and dv += P^T dO take them as they
  are."""
  bq, bk = st.block_q, st.block_k
  ka = ka_ref[...]
  kp = tiles.read_optional(kp_ref, ...)
  ks = tiles.read_optional(ks_ref, ...)
  sk = tiles.read_optional(sk_ref, ...)
  v = v_ref[...]
  kpos, first, n, G = tiles.key_major(bq, bk, qa_ref)
  n = tiles.query_tiles_end(hi_ref, n)
  dka = jnp.zeros(ka.shape, jnp.float32)
  dkp = None if kp is None else jnp.zeros(kp.shape, jnp.float32)
  dks = None if ks is None else jnp.zeros((bk,), jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  for g in range(G):

    def body(i, carry, g=g):
      dka, dkp, dks, dv = carry
      rows, dist = tiles.query_rows(i, bq, kpos)   # i - j, [keys, queries]
      qa = qa_ref[rows, g, :]
      qp = tiles.read_optional(qp_ref, (rows, g, slice(None)))
      qs = tiles.read_optional(qs_ref, (rows, g))
      amp, theta, w = _parts(st, ka, qa, kp, qp, ks, qs, dist)
      sq = tiles.read_optional(sq_ref, rows)
      ok = tiles.causal_visible(dist, sk, sq)
      cos, sin = special.cos_sin(theta, fast=st.fast)
      p = jnp.where(ok, jnp.exp(amp * cos - lse_ref[rows, g][None, :]), 0.0)
      do = do_ref[rows, g, :]
      dv = dv + dot(p.astype(do.dtype), do, precision=st.v_precision)
      ds = p * (dot(v, do, tb=True, precision=st.v_precision) - delta_ref[rows, g][None, :])
      dka = dka + dot((ds * cos).astype(qa.dtype), qa, precision=st.precision)
      dph = -(ds * amp * sin * w)
      if st.linear_phase:
        dks = dks + jnp.sum(dph, axis=1)
      else:
        dkp = dkp + dot(dph.astype(qp.dtype), qp, precision=st.precision)
      return dka, dkp, dks, dv

    dka, dkp, dks, dv = lax.fori_loop(first, n, body, (dka, dkp, dks, dv))
  dka_ref[...] = st.a_scale * dka
  if dkp_ref is not None:
    dkp_ref[...] = st.p_scale * dkp
  if dks_ref is not None:
    dks_ref[...] = st.p_scale * dks
  dv_ref[...] = dv
