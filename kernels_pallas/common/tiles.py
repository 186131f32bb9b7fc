"""Tile functions shared by every kernel family: the float32-accumulating product, a query
tile's and a key tile's positions (query-major and key-major programs), the causal mask with
documents and the tile bounds that let a walk skip other documents (document_bounds, computed
before a launch; bound, read in one), 0/1 triangles for sums along a tile, optional operands,
and the online softmax of the standalone causal kernels (tapa_attention, grape_ap_attention,
grape_a_attention, stick_breaking_attention, block_attention). PaTH's own tile functions
(chunk transports, boundary states) are in kernels_pallas/path_attention/tiles.py.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

NEG_INF = -1e30


def dot(a, b, *, ta=False, tb=False, precision=None):
  """a @ b (a^T, b^T with ta, tb) with float32 accumulation."""
  dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def query_tile(bq: int, bk: int):
  """(qpos [bq, 1], n) of this program's query tile (grid axis 0): its rows' positions and the
  number of bk-key tiles up to its diagonal."""
  q0 = pl.program_id(0) * bq
  return q0 + lax.broadcasted_iota(jnp.int32, (bq, 1), 0), pl.cdiv(q0 + bq, bk)


def key_tile(j, bk: int, qpos):
  """(rows, dist [bq, bk]) of key tile j against query rows at qpos: its slice of the key refs
  and the distances i - j."""
  k0 = pl.multiple_of(j * bk, bk)
  return pl.ds(k0, bk), qpos - (k0 + lax.broadcasted_iota(jnp.int32, (1, bk), 1))


def key_major(bq: int, bk: int, q_ref):
  """(kpos [bk, 1], first, n, G) of this program's key tile (grid axis 0) against a group's
  queries q_ref [T, G, ..]: its rows' positions, the query tile holding its diagonal (the first
  that sees it), the number of query tiles and the group's heads."""
  k0 = pl.program_id(0) * bk
  return (k0 + lax.broadcasted_iota(jnp.int32, (bk, 1), 0), k0 // bq, q_ref.shape[0] // bq,
          q_ref.shape[1])


def triangle(n: int, op: str, dtype=jnp.float32):
  """[n, n] 0/1 in dtype (exact in any float): t[r, c] = r op c, op one of > >= < <=. As a
  product's right factor, x @ t sums x's columns c' op-related to each column; as its left
  factor, t @ y sums y's rows."""
  r = lax.broadcasted_iota(jnp.int32, (n, n), 0)
  c = lax.broadcasted_iota(jnp.int32, (n, n), 1)
  return {">": r > c, ">=": r >= c, "<": r < c, "<=": r <= c}[op].astype(dtype)


def query_rows(i, bq: int, kpos):
  """(rows, dist [bk, bq]) of query tile i against key rows at kpos, key-major: its slice of
  the query refs and the distances i - j."""
  q0 = pl.multiple_of(i * bq, bq)
  return pl.ds(q0, bq), (q0 + lax.broadcasted_iota(jnp.int32, (1, bq), 1)) - kpos


def causal_visible(dist, seg_r, seg_c, *, strict: bool = False):
  """Causal (dist = i - j >= 0, or > 0 when strict: the key before the query) and, with segment
  ids (rows' and columns'), the same document."""
  ok = dist > 0 if strict else dist >= 0
  if seg_r is not None:
    ok = ok & (seg_r[:, None] == seg_c[None, :])
  return ok


def document_bounds(seg_BT, bq: int, bk: int):
  """Which tile pairs can hold a visible (query, key) pair, from segment ids [B, T] (T a
  multiple of both tiles; computed in XLA before a launch): lo [B, nq, 1, 1], the first key
  tile any query of query tile i can see, and hi [B, nk, 1, 1], the last query tile that sees
  any key of key tile j (int32; read in a kernel with `bound`).

  Two tiles can share a document only if their id ranges [min, max] overlap, so outside
  [lo_i, diagonal] (and [diagonal, hi_j]) every pair is masked whatever the ids' layout: a walk
  that skips those tiles computes the same bits. With packed documents shorter than a row,
  most tiles of a causal walk lie wholly before the query's document."""
  B, T = seg_BT.shape
  nq, nk = T // bq, T // bk
  sq, sk = seg_BT.reshape(B, nq, bq), seg_BT.reshape(B, nk, bk)
  qmin, qmax, kmin, kmax = sq.min(-1), sq.max(-1), sk.min(-1), sk.max(-1)
  causal = (jnp.arange(nk) * bk)[None, :] <= (jnp.arange(nq) * bq + bq - 1)[:, None]
  vis = ((qmin[:, :, None] <= kmax[:, None, :]) & (kmin[:, None, :] <= qmax[:, :, None])
         & causal)                                       # [B, nq, nk]; each row's diagonal
  lo = jnp.argmax(vis, axis=2).astype(jnp.int32)          # tile is visible (its own keys)
  hi = (nq - 1 - jnp.argmax(vis[:, ::-1, :], axis=1)).astype(jnp.int32)
  return lo[:, :, None, None], hi[:, :, None, None]


def bound(ref, i):
  """Entry i of a [n, 1, 1] int32 ref (document_bounds' lo or hi) as a scalar: a load and a
  reduction, which both the Triton lowering and the interpreter take."""
  return jnp.min(ref[i])


def documents(seg_BT, bq: int, bk: int):
  """The documents operand of a causal kernel: (segment ids, lo, hi) with document_bounds' lo
  and hi, computed once before the launches; None without ids."""
  return None if seg_BT is None else (seg_BT, *document_bounds(seg_BT, bq, bk))


def first_key_tile(lo_ref):
  """Where a query-major walk starts (grid axis 0: query tiles): 0, or past the key tiles of
  earlier documents (document_bounds' lo)."""
  return 0 if lo_ref is None else bound(lo_ref, pl.program_id(0))


def query_tiles_end(hi_ref, n):
  """Where a key-major walk stops (grid axis 0: key tiles): n, or after the last query tile
  that shares a document with this key tile (document_bounds' hi)."""
  return n if hi_ref is None else bound(hi_ref, pl.program_id(0)) + 1


def read_optional(ref, index):
  """ref[index], or None for an absent operand."""
  return None if ref is None else ref[index]


def causal_softmax_init(rows: int, dv: int):
  """(m, l, acc) before the first key tile."""
  return (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, dv), jnp.float32))


def causal_softmax_step(state, s, ok, v, *, precision):
  """(m, l, acc) after one key tile: logits s [rows, bk] where ok (masked elsewhere), values
  v [bk, Dv]."""
  m_i, l_i, acc = state
  s = jnp.where(ok, s, NEG_INF)
  m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
  corr = jnp.exp(m_i - m_new)
  p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)   # a row masked so far: s == m_new
  acc = corr[:, None] * acc + dot(p.astype(v.dtype), v, precision=precision)
  return m_new, corr * l_i + jnp.sum(p, axis=1), acc


def causal_softmax_finish(state):
  """(o, lse) of the final state; every row sees its own key, so l >= 1."""
  m_i, l_i, acc = state
  return acc / l_i[:, None], m_i + jnp.log(l_i)
