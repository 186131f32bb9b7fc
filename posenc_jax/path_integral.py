"""Path-sum logit biases: GRAPE-AP, and the right-to-left blocked walk it shares with FoX.

Both biases sum edge potentials over the path (j, i] from key j to query i:

  FoX       b_ij = sum_{l=j+1}^{i} log_forget_l                      (psi independent of i)
  GRAPE-AP  b_ij = sum_{l=j+1}^{i} psi(i, l),
            psi(i, l) = alpha_h log_sigmoid(<p_i, R_l p_l> / d_p)    (GRAPE §5, (5.1)-(5.2))

The query side of psi may use its own probe (`p_query`, in place of p_i): the official GRAPE
code RMS-normalises only the key-side probe p_l and takes the raw projection for p_i.

R_l rotates every adjacent pair (p[2m], p[2m+1]) by the angle l (all frequencies 1). Here l is
the index of the position inside its packed segment (0 at the segment start; the absolute
index when segment_ids is None), so a packed document is encoded exactly as if it were alone.

The blocked form never builds a T x T array: for one query block it walks key blocks right to
left, carrying per query row the sum of psi over every position between the current key block
and the query (`carry`). Inside a tile the remaining part is a reverse cumulative sum over the
tile's key positions. Every sum is relative to the query (never an absolute prefix sum), so its
float32 error scales with the bias itself, not with the position.

Shape letters: B batch, T time (Tp padded), H query heads, K kv heads, D head dim,
P = d_p probe dim, Q query-block and C key-block length (both `block_size`).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from posenc_jax import blockwise
from posenc_jax import masking


def segment_positions(segment_ids_BT, B: int, T: int):
  """Index of each position inside its packed segment, int32 [B, T] (arange(T) if None)."""
  idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  if segment_ids_BT is None:
    return idx
  starts = masking.segment_starts(segment_ids_BT)
  return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def rotate_probes(p_BTHP, pos_BT):
  """R_pos p: every adjacent pair of p rotated by the angle pos (float32)."""
  p = p_BTHP.astype(jnp.float32)
  ang = pos_BT.astype(jnp.float32)[:, :, None, None]
  c, s = jnp.cos(ang), jnp.sin(ang)
  x0, x1 = p[..., 0::2], p[..., 1::2]
  return jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(p.shape)


def edge_potentials(p_BQHP, r_BCHP, alpha_H):
  """psi [B, H, Q, C] = alpha_h log_sigmoid(<p_i, r_l> / d_p), r_l = R_l p_l."""
  z = jnp.einsum("bqhp,bchp->bhqc", p_BQHP.astype(jnp.float32), r_BCHP.astype(jnp.float32))
  return alpha_H.astype(jnp.float32)[None, :, None, None] * jax.nn.log_sigmoid(z / p_BQHP.shape[-1])


def sum_after(w):
  """out[..., j] = sum_{l > j} w[..., l] (reverse exclusive cumulative sum, last axis)."""
  rc = jnp.flip(jnp.cumsum(jnp.flip(w, -1), axis=-1), -1)
  return jnp.concatenate([rc[..., 1:], jnp.zeros_like(rc[..., :1])], axis=-1)


def path_sum_bias(psi_BHTS, q_pos, k_pos):
  """b_ij = sum_{l in (j, i]} psi[i, l] for query positions q_pos [T], key positions k_pos [S].

  Entries of psi with l > i are ignored; k_pos must be contiguous and increasing.
  """
  w = jnp.where(k_pos[None, :] <= q_pos[:, None], psi_BHTS, 0.0)
  return sum_after(w), w.sum(-1)


def path_integral_attention_reference(q, k, v, p, alpha, *, segment_ids=None, scale,
                                      p_query=None):
  """Dense GRAPE-AP oracle: builds psi and the bias as T x T arrays.

  q [B,T,H,D]; k, v [B,T,K,D]; p [B,T,H,P]; alpha [H]; p_query [B,T,H,P] or None (= p)
  -> o [B,T,H,Dv].
  """
  B, T = q.shape[:2]
  r = rotate_probes(p, segment_positions(segment_ids, B, T))
  psi = edge_potentials(p if p_query is None else p_query, r, alpha)
  pos = jnp.arange(T)
  bias, _ = path_sum_bias(psi, pos, pos)
  logits = masking.dot_logits(q, k, scale) + bias
  return masking.dense_attention(logits, v, masking.causal_dense_mask(T, segment_ids))


def right_to_left_attention(psi_tile: Callable, logit_tile: Callable, v_BTKD, *, num_heads: int,
                            segment_ids=None, block_size: int = 64, parallel: bool | None = None):
  """Causal attention with a path-sum bias, blocked, walking key blocks right to left.

  Args:
    psi_tile: (q_start, k_start) -> psi [B, H, Q, C] float32, the edge potentials psi(i, l)
      of query rows q_start.. and path positions l = k_start.. (padded index space).
    logit_tile: (q_start, k_start) -> [B, H, Q, C] float32 content logits (scale q.k).
    v_BTKD: values (unpadded); the callers pad their own inputs to padded_length(T, Q).
    num_heads, segment_ids, block_size, parallel: as blockwise.blockwise_attention.

  Returns:
    [B, T, H, Dv] in v's dtype.
  """
  B, T, K, Dv = v_BTKD.shape
  H, Q = num_heads, block_size
  Tp = blockwise.padded_length(T, Q)
  n = Tp // Q
  v = blockwise.pad_time(v_BTKD, Tp)
  seg = None if segment_ids is None else blockwise.pad_time(segment_ids, Tp, value=-1)
  local = jnp.arange(Q)

  def query_block(qi):
    q_start = qi * Q

    def visit(carry, ki):
      state, beyond_BHQ = carry
      k_start = ki * Q
      bias, row_sum = path_sum_bias(psi_tile(q_start, k_start), q_start + local, k_start + local)
      s = logit_tile(q_start, k_start) + beyond_BHQ[..., None] + bias
      mask = blockwise.tile_mask(q_start, k_start, Q, Q, T, seg)
      state = blockwise.update_state(state, s, mask,
                                     jax.lax.dynamic_slice_in_dim(v, k_start, Q, axis=1))
      return state, beyond_BHQ + row_sum

    # Checkpoint the whole step, cond included (as blockwise.blockwise_attention does): a
    # checkpoint inside the cond still makes the cond save its operands' tiles at every step,
    # and gradient memory grew faster than T^2 (x55 from T = 512 to 2048).
    @jax.checkpoint
    def step(carry, offset):
      ki = qi - offset
      return jax.lax.cond(ki >= 0, visit, lambda c, _: c, carry, ki), None

    init = (blockwise.init_state(B, H, Q, Dv), jnp.zeros((B, H, Q), jnp.float32))
    (state, _), _ = jax.lax.scan(step, init, jnp.arange(n))
    return blockwise.finalize(state)

  out = blockwise.map_query_blocks(query_block, n, parallel=parallel)   # [n, B, Q, H, Dv]
  out = jnp.moveaxis(out, 0, 1).reshape(B, Tp, H, Dv)
  return out[:, :T].astype(v_BTKD.dtype)


def content_logit_tile(q_BTHD, k_BTKD, scale, Tp: int, block_size: int):
  """(q_start, k_start) -> scale q.k tile [B, H, Q, C] on time-padded copies of q, k."""
  qp, kp = blockwise.pad_time(q_BTHD, Tp), blockwise.pad_time(k_BTKD, Tp)

  def tile(q_start, k_start):
    return masking.dot_logits(jax.lax.dynamic_slice_in_dim(qp, q_start, block_size, 1),
                              jax.lax.dynamic_slice_in_dim(kp, k_start, block_size, 1), scale)

  return tile


def path_integral_attention_chunked(q, k, v, p, alpha, *, segment_ids=None, scale,
                                    block_size: int | None = None, p_query=None,
                                    parallel: bool | None = None):
  """Blocked GRAPE-AP (never T x T); same arguments and result as the reference. block_size
  None: 64, grown so that T needs at most 32 blocks (blockwise.block_size_for)."""
  B, T, H, _ = q.shape
  block_size = blockwise.block_size_for(T, block_size, default=64, max_blocks=32)
  Tp = blockwise.padded_length(T, block_size)
  r = rotate_probes(p, segment_positions(segment_ids, B, T))
  pq = p if p_query is None else p_query
  pp, rp = blockwise.pad_time(pq.astype(jnp.float32), Tp), blockwise.pad_time(r, Tp)

  def psi_tile(q_start, k_start):
    return edge_potentials(jax.lax.dynamic_slice_in_dim(pp, q_start, block_size, 1),
                           jax.lax.dynamic_slice_in_dim(rp, k_start, block_size, 1), alpha)

  return right_to_left_attention(psi_tile, content_logit_tile(q, k, scale, Tp, block_size), v,
                                 num_heads=H, segment_ids=segment_ids, block_size=block_size,
                                 parallel=parallel)
