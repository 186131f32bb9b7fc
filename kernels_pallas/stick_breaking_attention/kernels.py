"""The three kernel bodies of causal stick-breaking attention: forward, dq (one query tile
against its key tiles, nearest first) and dk/dv (one key tile against the query tiles from the
diagonal on, for each head of its GQA group).

Query i breaks its stick over the visible keys j, nearest first:

  A_ij = sigmoid(z_ij) prod_{j < l < i, l visible} (1 - sigmoid(z_il)),   z = scale q_i . k_j,
  log A_ij = ls_ij + sum_{j < l} l1_il,   ls = log sigmoid(z), l1 = log sigmoid(-z) (0 where
  not visible),

so a tile needs, per row, the log-stick l1 summed over the nearer key tiles (a carry, walked
from the diagonal down) and over the nearer keys inside the tile (a product with a strictly
triangular 0/1 matrix). The kernels return acc_i = sum_j A_ij v_j and stick_i = sum_l l1_il
(the log of what is left); the caller adds the remainder.

With cotangents dacc (dO) and dstick, g_ij = A_ij (dO_i . v_j) and delta_i = dO_i . acc_i =
sum_j g_ij, the logit cotangent is

  dz_il = g_il sigmoid(-z_il) - sigmoid(z_il) (P_il + dstick_i),   P_il = sum_{j < l} g_ij,

since z_il enters log A_il through ls and log A_ij (j < l) and the stick through l1. P is
delta minus the suffix sum over j >= l: the dq kernel carries that suffix over the nearer key
tiles as it walks, and writes both carries (log-stick, g suffix) at every key tile, per query
row, for the dk/dv kernel, which visits the query tiles of one key tile and so cannot walk them.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.common import special
from kernels_pallas.common import tiles
from kernels_pallas.common.tiles import dot


@dataclasses.dataclass(frozen=True)
class Static:
  """What the bodies need to know at trace time."""
  scale: float
  attend_current: bool  # query i breaks its stick over keys j <= i (True) or j < i
  block_q: int
  block_k: int
  precision: object     # of the q.k products (None: the inputs' own)
  v_precision: object   # of the products with v and dO
  sum_precision: object  # of the float32 sums along a tile (products with 0/1 triangles)
  fast: bool            # the GPU's approximate exp and log (special.py); False in the
                        # interpreter


def _tile(st: Static, z, ok, carry, nearer_of):
  """(A, l1 masked, sigmoid(z), sigmoid(-z)) of a tile whose rows carry `carry` (log-stick of
  the nearer key tiles); nearer_of(l1) sums l1 over each entry's nearer keys in the tile."""
  ls, sig_neg = special.log_sigmoid_and_sigmoid_neg(z, fast=st.fast)
  l1, sig = special.log_sigmoid_and_sigmoid_neg(-z, fast=st.fast)
  l1 = jnp.where(ok, l1, 0.0)
  a = jnp.where(ok, jnp.exp(ls + nearer_of(l1) + carry), 0.0)
  return a, l1, sig, sig_neg


def _rounded_as(a, v):
  """A as the forward's product with v read it (in v's dtype), back in float32: the g of the
  backward must sum to delta = dO . acc, which that product made."""
  return a.astype(v.dtype).astype(jnp.float32)


def forward_kernel(q_ref, k_ref, v_ref, sq_ref, sk_ref, acc_ref, stick_ref, *, st: Static):
  """q [bq, D], k [T, D], v [T, Dv], (sq [bq], sk [T]) -> acc [bq, Dv], stick [bq], float32."""
  bq, bk = st.block_q, st.block_k
  q = q_ref[...]
  sq = tiles.read_optional(sq_ref, ...)
  qpos, n = tiles.query_tile(bq, bk)
  nearer = tiles.triangle(bk, ">")        # [l, j]: l > j

  def body(t, state):
    stick, acc = state
    rows, dist = tiles.key_tile(n - 1 - t, bk, qpos)   # the nearest key tile first
    z = st.scale * dot(q, k_ref[rows, :], tb=True, precision=st.precision)
    ok = tiles.causal_visible(dist, sq, tiles.read_optional(sk_ref, rows),
                               strict=not st.attend_current)
    a, l1, _, _ = _tile(st, z, ok, stick[:, None],
                        lambda l1: dot(l1, nearer, precision=st.sum_precision))
    v = v_ref[rows, :]
    acc = acc + dot(a.astype(v.dtype), v, precision=st.v_precision)
    return stick + jnp.sum(l1, axis=1), acc

  init = (jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, v_ref.shape[-1]), jnp.float32))
  stick, acc = lax.fori_loop(0, n, body, init)
  acc_ref[...] = acc
  stick_ref[...] = stick


def dq_kernel(q_ref, k_ref, v_ref, sq_ref, sk_ref, do_ref, delta_ref, dstick_ref,
              dq_ref, c1_ref, cg_ref, *, st: Static):
  """One query tile against its key tiles, nearest first: -> dq [bq, D] float32, and per key
  tile j the rows' carries before it: c1 [bq, NK] (log-stick) and cg [bq, NK] (g suffix)."""
  bq, bk = st.block_q, st.block_k
  q = q_ref[...]
  sq = tiles.read_optional(sq_ref, ...)
  do = do_ref[...]
  delta = delta_ref[...][:, None]
  dstick = dstick_ref[...][:, None]
  qpos, n = tiles.query_tile(bq, bk)
  nearer = tiles.triangle(bk, ">")        # [l, j]: l > j
  not_before = tiles.triangle(bk, ">=")   # [j', j]: j' >= j
  c1_ref[...] = jnp.zeros(c1_ref.shape, jnp.float32)
  cg_ref[...] = jnp.zeros(cg_ref.shape, jnp.float32)

  def body(t, carry):
    stick, suffix, dq = carry
    j = n - 1 - t
    c1_ref[:, pl.ds(j, 1)] = stick[:, None]
    cg_ref[:, pl.ds(j, 1)] = suffix[:, None]
    rows, dist = tiles.key_tile(j, bk, qpos)
    k = k_ref[rows, :]
    z = st.scale * dot(q, k, tb=True, precision=st.precision)
    ok = tiles.causal_visible(dist, sq, tiles.read_optional(sk_ref, rows),
                               strict=not st.attend_current)
    a, l1, sig, sig_neg = _tile(st, z, ok, stick[:, None],
                                lambda l1: dot(l1, nearer, precision=st.sum_precision))
    v = v_ref[rows, :]
    g = _rounded_as(a, v) * dot(do, v, tb=True, precision=st.v_precision)
    before = delta - suffix[:, None] - dot(g, not_before, precision=st.sum_precision)
    dz = jnp.where(ok, g * sig_neg - sig * (before + dstick), 0.0)
    dq = dq + dot(dz.astype(k.dtype), k, precision=st.precision)
    return stick + jnp.sum(l1, axis=1), suffix + jnp.sum(g, axis=1), dq

  init = (jnp.zeros((bq,), jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros(q.shape, jnp.float32))
  _, _, dq = lax.fori_loop(0, n, body, init)
  dq_ref[...] = st.scale * dq


def dkv_kernel(q_ref, k_ref, v_ref, sq_ref, sk_ref, do_ref, delta_ref, dstick_ref, c1_ref,
               cg_ref, dk_ref, dv_ref, *, st: Static):
  """One key tile against its group's G query heads, the query tiles from the diagonal on.
  q [T, G, D], do [T, G, Dv], delta, dstick [T, G], c1, cg [T, G, NK]; k [bk, D], v [bk, Dv],
  (sq [T], sk [bk]) -> dk [bk, D], dv [bk, Dv], float32, summed over the group.

  Key-major tiles ([keys, queries]), so dk += dZ^T q and dv += A^T dO take them as they are."""
  bq, bk = st.block_q, st.block_k
  kt = pl.program_id(0)
  k = k_ref[...]
  v = v_ref[...]
  sk = tiles.read_optional(sk_ref, ...)
  kpos, first, n, G = tiles.key_major(bq, bk, q_ref)
  nearer = tiles.triangle(bk, "<")        # [j, l]: l > j
  not_before = tiles.triangle(bk, "<=")   # [j, j']: j' >= j
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  for g in range(G):

    def body(i, carry, g=g):
      dk, dv = carry
      rows, dist = tiles.query_rows(i, bq, kpos)   # i - j, [keys, queries]
      q = q_ref[rows, g, :]
      do = do_ref[rows, g, :]
      z = st.scale * dot(k, q, tb=True, precision=st.precision)
      ok = tiles.causal_visible(dist, sk, tiles.read_optional(sq_ref, rows),
                                 strict=not st.attend_current)
      stick = c1_ref[rows, g, pl.ds(kt, 1)][:, 0][None, :]
      suffix = cg_ref[rows, g, pl.ds(kt, 1)][:, 0][None, :]
      a, _, sig, sig_neg = _tile(st, z, ok, stick,
                                 lambda l1: dot(nearer, l1, precision=st.sum_precision))
      gm = _rounded_as(a, v) * dot(v, do, tb=True, precision=st.v_precision)
      before = (delta_ref[rows, g][None, :] - suffix
                - dot(not_before, gm, precision=st.sum_precision))
      dz = jnp.where(ok, gm * sig_neg - sig * (before + dstick_ref[rows, g][None, :]), 0.0)
      dv = dv + dot(a.astype(do.dtype), do, precision=st.v_precision)
      dk = dk + dot(dz.astype(q.dtype), q, precision=st.precision)
      return dk, dv

    dk, dv = lax.fori_loop(first, n, body, (dk, dv))
  dk_ref[...] = st.scale * dk
  dv_ref[...] = dv

