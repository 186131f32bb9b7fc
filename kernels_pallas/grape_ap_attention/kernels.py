"""The three kernel bodies of causal GRAPE-AP attention: forward, dq (with the query probes'
and alpha's cotangents) and dk/dv (with the rotated key probes' cotangent).

The logit of query i and key j is s_ij = scale q_i.k_j + b_ij, with the path-sum bias

  b_ij = sum_{l in (j, i]} w_il,   w_il = alpha_i log_sigmoid(z_il / P),  z_il = pq_i . r_l

(alpha_i: the query's head's alpha, given per row). A program walks the key tiles; inside a
tile the part of the sum over the tile's own positions is a reverse exclusive cumulative sum,
taken as a product with a constant triangular matrix (Triton has no cheap cumsum), and the part
beyond the tile is a per-row carry. The forward walks the key tiles right to left and records
the carry at entering each tile, C[i, kt] = sum_{l >= (kt + 1) bk, l <= i} w_il; the dq kernel
records Pre[i, kt] = sum_{j < kt bk} ds_ij, the part of d w_il = sum_{j < l} ds_ij that lies
left of tile kt. The dk/dv kernel, which sees one key tile against all later queries, reads both
instead of re-walking the tiles. Both are stored key-tile-major ([NK, T] per head, NK: the
key-tile count padded to a power of two), so each kernel reads or writes one row vector of
them a tile.

Refs are time-major, cut by api.py's BlockSpecs. Positions are the time indices: the caller
pads T at the end, and a padded query (sliced off, zero cotangent) or key (later than every
real query) changes no real row.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from kernels_pallas.common import special
from kernels_pallas.common import tiles
from kernels_pallas.common.tiles import dot


@dataclasses.dataclass(frozen=True)
class Static:
  """What the bodies need to know at trace time."""
  scale: float
  probe_dim: int        # P before padding: z is divided by it
  block_q: int
  block_k: int
  precision: object     # of the q.k and v / dO products (None: the inputs' own)
  f32_precision: object  # of the probe products (float32 operands)
  passes: int           # bf16 terms of a float32 operand of the triangular products
  fast: bool            # the GPU's approximate ex2, lg2, rcp (special.py); False in the
                        # interpreter


def _tri_dot(st: Static, x, tri, *, tri_left: bool):
  """x @ tri (tri @ x with tri_left) of float32 x and a 0/1 matrix tri, as bf16 products: tri
  is exact in bf16, so splitting x alone into st.passes bf16 terms (x = h_1 + h_2 + ...,
  each the rounding of what the earlier ones left) keeps ~8 bits per term. Two terms (bf16
  inputs: ~16 bits, finer than the bf16 logits the sums are added to) cost a third of a
  three-pass TF32 product's tensor-core time; three (float32 inputs) keep float32's 24."""
  acc = None
  for _ in range(st.passes):
    h = x.astype(jnp.bfloat16)
    x = x - h.astype(jnp.float32)
    d = dot(tri, h) if tri_left else dot(h, tri)
    acc = d if acc is None else acc + d
  return acc


def _potentials(st: Static, a, b, alpha, on_path, alpha_rows: bool, *, grad: bool = False):
  """(w, log_sigmoid(x), sigmoid(-x)) of a tile: x = a . b / P (query probes x rotated probes,
  or the transpose), w = alpha log_sigmoid(x) where on_path (l <= i), else 0; the last two only
  with grad (the backward's d w / d x)."""
  x = dot(a, b, tb=True, precision=st.f32_precision) / st.probe_dim
  al = alpha[:, None] if alpha_rows else alpha[None, :]
  if grad:
    ls, sn = special.log_sigmoid_and_sigmoid_neg(x, fast=st.fast)
  else:
    ls, sn = special.log_sigmoid(x, fast=st.fast), None
  return jnp.where(on_path, al * ls, 0.0), ls, sn


def forward_kernel(q_ref, k_ref, v_ref, pq_ref, r_ref, al_ref, sq_ref, sk_ref,
                   o_ref, lse_ref, c_ref, *, st: Static):
  """q [bq, D], k [T, D], v [T, Dv], pq [bq, P], r [T, P], alpha [bq], (sq [bq], sk [T])
  -> o [bq, Dv], lse [bq], C [NK, bq] float32."""
  bq, bk = st.block_q, st.block_k
  q = q_ref[...]
  pq = pq_ref[...]
  alpha = al_ref[...]
  sq = tiles.read_optional(sq_ref, ...)
  qpos, n = tiles.query_tile(bq, bk)
  greater = tiles.triangle(bk, ">", jnp.bfloat16)   # (w @ greater)_ij = sum_{l > j} w_il

  def body(t, state):
    softmax, carry = state
    kt = n - 1 - t
    rows, dist = tiles.key_tile(kt, bk, qpos)
    w, _, _ = _potentials(st, pq, r_ref[rows, :], alpha, dist >= 0, True)
    c_ref[kt, :] = carry
    bias = carry[:, None] + _tri_dot(st, w, greater, tri_left=False)
    s = st.scale * dot(q, k_ref[rows, :], tb=True, precision=st.precision) + bias
    ok = tiles.causal_visible(dist, sq, tiles.read_optional(sk_ref, rows))
    softmax = tiles.causal_softmax_step(softmax, s, ok, v_ref[rows, :], precision=st.precision)
    return softmax, carry + jnp.sum(w, axis=1)

  init = (tiles.causal_softmax_init(bq, v_ref.shape[-1]), jnp.zeros((bq,), jnp.float32))
  softmax, _ = lax.fori_loop(0, n, body, init)
  o_ref[...], lse_ref[...] = tiles.causal_softmax_finish(softmax)


def dq_kernel(q_ref, k_ref, v_ref, pq_ref, r_ref, al_ref, sq_ref, sk_ref, do_ref, lse_ref,
              delta_ref, c_ref, dq_ref, dpq_ref, dal_ref, pre_ref, *, st: Static):
  """One query tile against the key tiles up to the diagonal, left to right: -> dq [bq, D],
  dpq [bq, P], dalpha [bq] (this row's share), Pre [NK, bq], float32."""
  bq, bk = st.block_q, st.block_k
  q = q_ref[...]
  pq = pq_ref[...]
  alpha = al_ref[...]
  sq = tiles.read_optional(sq_ref, ...)
  do = do_ref[...]
  lse = lse_ref[...][:, None]
  delta = delta_ref[...][:, None]
  qpos, n = tiles.query_tile(bq, bk)
  greater = tiles.triangle(bk, ">", jnp.bfloat16)   # (w @ greater)_ij = sum_{l > j} w_il
  less = tiles.triangle(bk, "<", jnp.bfloat16)         # (ds @ less)_il = sum_{j < l} ds_ij

  def body(kt, state):
    dq, dpq, dal, pre = state
    rows, dist = tiles.key_tile(kt, bk, qpos)
    r = r_ref[rows, :]
    on_path = dist >= 0
    w, ls, sn = _potentials(st, pq, r, alpha, on_path, True, grad=True)
    bias = c_ref[kt, :][:, None] + _tri_dot(st, w, greater, tri_left=False)
    k = k_ref[rows, :]
    s = st.scale * dot(q, k, tb=True, precision=st.precision) + bias
    ok = tiles.causal_visible(dist, sq, tiles.read_optional(sk_ref, rows))
    p = jnp.where(ok, jnp.exp(s - lse), 0.0)
    ds = p * (dot(do, v_ref[rows, :], tb=True, precision=st.precision) - delta)
    dq = dq + dot(ds.astype(k.dtype), k, precision=st.precision)
    pre_ref[kt, :] = pre
    dpsi = jnp.where(on_path, pre[:, None] + _tri_dot(st, ds, less, tri_left=False), 0.0)
    dz = dpsi * alpha[:, None] * sn / st.probe_dim
    dpq = dpq + dot(dz, r, precision=st.f32_precision)
    dal = dal + jnp.sum(dpsi * ls, axis=1)   # dpsi is 0 off the path
    return dq, dpq, dal, pre + jnp.sum(ds, axis=1)

  init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(pq.shape, jnp.float32),
          jnp.zeros((bq,), jnp.float32), jnp.zeros((bq,), jnp.float32))
  dq, dpq, dal, _ = lax.fori_loop(0, n, body, init)
  dq_ref[...] = st.scale * dq
  dpq_ref[...] = dpq
  dal_ref[...] = dal


def dkv_kernel(q_ref, k_ref, v_ref, pq_ref, r_ref, al_ref, sq_ref, sk_ref, do_ref, lse_ref,
               delta_ref, c_ref, pre_ref, dk_ref, dv_ref, dr_ref, *, st: Static):
  """One key tile against its group's G query heads, the query tiles from the diagonal on.
  q [T, G, D], pq [T, G, P], alpha, lse, delta, and C, Pre at this key tile [T, G],
  do [T, G, Dv];
  k [bk, D], v [bk, Dv], r [bk, G, P], (sq [T], sk [bk]) -> dk [bk, D], dv [bk, Dv] (summed
  over the group), dr [bk, G, P], float32.

  Key-major tiles ([keys, queries]): the bias is the in-tile sum (less @ w^T) plus the queries'
  carry C[i, kt], and d w^T the in-tile sum (greater @ ds^T) plus Pre[i, kt]."""
  bq, bk = st.block_q, st.block_k
  k = k_ref[...]
  v = v_ref[...]
  sk = tiles.read_optional(sk_ref, ...)
  kpos, first, n, G = tiles.key_major(bq, bk, q_ref)
  greater = tiles.triangle(bk, ">", jnp.bfloat16)   # (greater @ ds^T)_li = sum_{j < l} ds_ij
  less = tiles.triangle(bk, "<", jnp.bfloat16)         # (less @ w^T)_ji = sum_{l > j} w_il
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  for g in range(G):
    r = r_ref[:, g, :]

    def body(i, carry, g=g, r=r):
      dk, dv, dr = carry
      rows, dist = tiles.query_rows(i, bq, kpos)   # i - j
      on_path = dist >= 0
      pq = pq_ref[rows, g, :]
      alpha = al_ref[rows, g]
      # [keys l, queries i]
      w, ls, sn = _potentials(st, r, pq, alpha, on_path, False, grad=True)
      c = c_ref[rows, g]
      pre = pre_ref[rows, g]
      bias = c[None, :] + _tri_dot(st, w, less, tri_left=True)
      q = q_ref[rows, g, :]
      s = st.scale * dot(k, q, tb=True, precision=st.precision) + bias
      ok = tiles.causal_visible(dist, sk, tiles.read_optional(sq_ref, rows))
      p = jnp.where(ok, jnp.exp(s - lse_ref[rows, g][None, :]), 0.0)
      do = do_ref[rows, g, :]
      dv = dv + dot(p.astype(do.dtype), do, precision=st.precision)
      ds = p * (dot(v, do, tb=True, precision=st.precision) - delta_ref[rows, g][None, :])
      dk = dk + dot(ds.astype(q.dtype), q, precision=st.precision)
      dpsi = jnp.where(on_path, pre[None, :] + _tri_dot(st, ds, greater, tri_left=True), 0.0)
      dz = dpsi * alpha[None, :] * sn / st.probe_dim
      dr = dr + dot(dz, pq, precision=st.f32_precision)
      return dk, dv, dr

    dk, dv, dr = lax.fori_loop(first, n, body, (dk, dv, jnp.zeros(r.shape, jnp.float32)))
    dr_ref[:, g, :] = dr
  dk_ref[...] = st.scale * dk
  dv_ref[...] = dv
