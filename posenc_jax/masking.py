"""Causal and segment masks, grouped-query heads, and dense softmax attention from logits.

Shape letters: B batch, T query time, S key time, H query heads, K key/value heads
(H % K == 0, query head h reads kv head h // (H // K)), D head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite stand-in for -inf: keeps exp() at exactly 0 without NaN gradients through where().
NEG_INF = -1e30


def causal_mask(q_pos, k_pos, segment_ids_q=None, segment_ids_k=None):
  """Boolean mask [B or 1, 1, T, S]: key j visible from query i iff j <= i, same segment."""
  mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
  if segment_ids_q is not None:
    mask = mask & (segment_ids_q[:, None, :, None] == segment_ids_k[:, None, None, :])
  return mask


def repeat_kv(x_BSKD, num_heads: int):
  """[B, S, K, D] -> [B, S, H, D] by repeating each kv head H // K times (GQA)."""
  K = x_BSKD.shape[2]
  return x_BSKD if K == num_heads else jnp.repeat(x_BSKD, num_heads // K, axis=2)


def dense_attention(logits_BHTS, v_BSKD, mask):
  """softmax over visible keys, then weights @ v. Logits in float32; output in v's dtype."""
  H = logits_BHTS.shape[1]
  logits = jnp.where(mask, logits_BHTS.astype(jnp.float32), NEG_INF)
  a = jax.nn.softmax(logits, axis=-1)
  a = jnp.where(mask, a, 0.0)
  v = repeat_kv(v_BSKD, H)
  return jnp.einsum("bhts,bshd->bthd", a, v.astype(jnp.float32)).astype(v_BSKD.dtype)


def dot_logits(q_BTHD, k_BSKD, scale):
  """scale * q_i . k_j for every head, float32 [B, H, T, S]."""
  k = repeat_kv(k_BSKD, q_BTHD.shape[2])
  return scale * jnp.einsum("bthd,bshd->bhts", q_BTHD.astype(jnp.float32), k.astype(jnp.float32))


def causal_dense_mask(T: int, segment_ids_BT=None):
  pos = jnp.arange(T)
  return causal_mask(pos, pos, segment_ids_BT, segment_ids_BT)


def segment_starts(segment_ids_BT):
  """True where a new packed segment begins (always at t = 0)."""
  # A shift by one (pad and slice) rather than a concatenation of slices: with T sharded
  # over devices it is a one-token exchange with the neighbour, not a gather of T.
  T = segment_ids_BT.shape[1]
  previous = jnp.pad(segment_ids_BT, ((0, 0), (1, 0)))[:, :T]
  return (jnp.arange(T) == 0) | (segment_ids_BT != previous)


def segment_cumsum(x_BT, segment_ids_BT=None, *, exclusive: bool = False):
  """Cumulative sum over time (axis 1) that restarts at every segment start.

  x has shape [B, T, ...]. Restarting (rather than subtracting an absolute prefix sum)
  keeps long packed batches precise in float32. A segmented associative scan: O(T log T)
  work, parallel over time.
  """
  if segment_ids_BT is None:
    out = jnp.cumsum(x_BT, axis=1)
  else:
    starts = segment_starts(segment_ids_BT).reshape(segment_ids_BT.shape + (1,) * (x_BT.ndim - 2))
    starts = jnp.broadcast_to(starts, x_BT.shape)

    def combine(a, b):
      (va, fa), (vb, fb) = a, b
      return jnp.where(fb, vb, va + vb), fa | fb

    out, _ = jax.lax.associative_scan(combine, (x_BT, starts), axis=1)
  if exclusive:
    out = out - x_BT
  return out
