"""TAPA: token-aware phase attention (TAPA paper eq. 12, ablation eq. 16;
docs/encodings/tapa.md#tapa).

Each head splits q = (q_A, q_P), k = (k_A, k_P), the amplitude part being the first
round(theta * D) channels, and the softmax logit is

    l_ij = (q_A . k_A / sqrt(theta D)) * cos(2 pi |i - j|^alpha * phi_ij)

with the quadratic (stationary) phase phi_ij = q_P . k_P / sqrt((1 - theta) D) (eq. 12), or
the linear phase of the ablation (eq. 16), phi_ij = (sum(q_P) + sum(k_P)) / sqrt((1 - theta) D)
(`linear_phase=True`). Eq. 9 defines TAPA for any phase function phi(q, k) inside the same
cos(2 pi |m - n|^alpha phi(q, k)), so the distance factor |i - j|^alpha multiplies the linear
phase exactly as it multiplies the quadratic one. theta D is read as round(theta * D) channels
wherever it appears (the split and both normalisers). There is no other positional encoding
and no further 1/sqrt(D) scale: the amplitude carries its own normaliser.

|i - j|^alpha is 0 on the diagonal for alpha > 0 (cos = 1 there) and 1 for alpha = 0
(0^0 = 1: alpha = 0 removes position entirely). It is computed as exp(alpha log max(d, 1))
masked to the diagonal value, so its derivative in alpha stays finite at d = 0.

Shape letters: B batch, T time, H query heads, K kv heads, D head dim, A / P the amplitude /
phase widths (A + P = D).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from posenc_jax import blockwise
from posenc_jax import masking


def split_sizes(theta: float, head_dim: int) -> tuple[int, int]:
  """(A, P): amplitude and phase widths."""
  a = int(round(theta * head_dim))
  return a, head_dim - a


def distance_power(dist, alpha):
  """|i - j|^alpha for integer distances >= 0, with 0^alpha = [alpha == 0] and finite grads."""
  d = dist.astype(jnp.float32)
  off = jnp.exp(alpha * jnp.log(jnp.maximum(d, 1.0)))
  return jnp.where(d > 0, off, jnp.where(alpha == 0, 1.0, 0.0))


def _parts(q_BTHD, k_BTKD, theta):
  """Float32 (q_A / sqrt(A), k_A, q_P, k_P), kv heads repeated to H."""
  H, D = q_BTHD.shape[2], q_BTHD.shape[3]
  A, _ = split_sizes(theta, D)
  q = q_BTHD.astype(jnp.float32)
  k = masking.repeat_kv(k_BTKD, H).astype(jnp.float32)
  return q[..., :A] / math.sqrt(A), k[..., :A], q[..., A:], k[..., A:]


def _logits(qa, ka, qp, kp, dpow_QC, linear_phase: bool):
  """TAPA logits of a (query rows, key columns) tile, [B, H, Q, C]."""
  amp = jnp.einsum("bqhd,bchd->bhqc", qa, ka)
  if linear_phase:
    sq, sk = qp.sum(-1).transpose(0, 2, 1), kp.sum(-1).transpose(0, 2, 1)   # [B, H, Q|C]
    phase = sq[..., :, None] + sk[..., None, :]
  else:
    phase = jnp.einsum("bqhd,bchd->bhqc", qp, kp)
  phase = phase / math.sqrt(qp.shape[-1])
  return amp * jnp.cos(2.0 * math.pi * dpow_QC * phase)


def _dist(q_pos, k_pos):
  return jnp.abs(q_pos[:, None] - k_pos[None, :])


def tapa_logits(q_BQHD, k_BCKD, dist, *, alpha, theta, linear_phase):
  """TAPA logits [B, H, Q, C] of queries against keys at integer distances |i - j|.

  dist broadcasts against [B, Q, C] (e.g. [B, 1, S] for one decoded query over a cache).
  """
  qa, ka, qp, kp = _parts(q_BQHD, k_BCKD, theta)
  dpow = distance_power(jnp.broadcast_to(dist, (q_BQHD.shape[0],) + jnp.shape(dist)[-2:]), alpha)
  return _logits(qa, ka, qp, kp, dpow[:, None], linear_phase)


def tapa_attention_reference(q, k, v, *, alpha, theta, linear_phase, segment_ids):
  """Dense O(T^2) oracle. q [B, T, H, D]; k, v [B, T, K, D(v)] -> o [B, T, H, Dv]."""
  T = q.shape[1]
  pos = jnp.arange(T)
  qa, ka, qp, kp = _parts(q, k, theta)
  logits = _logits(qa, ka, qp, kp, distance_power(_dist(pos, pos), alpha), linear_phase)
  return masking.dense_attention(logits, v, masking.causal_dense_mask(T, segment_ids))


def tapa_attention_chunked(q, k, v, *, alpha, theta, linear_phase, segment_ids,
                           block_size: int | None = None, parallel: bool | None = None):
  """Blockwise online-softmax TAPA: logits tile by tile, never a T x T array. block_size None:
  128, grown so that T needs at most 16 blocks (blockwise.block_size_for)."""
  B, T, H, D = q.shape
  block_size = blockwise.block_size_for(T, block_size, default=128, max_blocks=16)
  Tp = blockwise.padded_length(T, block_size)
  qa, ka, qp, kp = (blockwise.pad_time(x, Tp) for x in _parts(q, k, theta))

  def tile(q0, k0):
    sl = lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, block_size, axis=1)
    dpow = distance_power(_dist(q0 + jnp.arange(block_size), k0 + jnp.arange(block_size)), alpha)
    return _logits(sl(qa, q0), sl(ka, k0), sl(qp, q0), sl(kp, k0), dpow, linear_phase)

  return blockwise.blockwise_attention(tile, v, num_heads=H, segment_ids=segment_ids,
                                       block_size=block_size, parallel=parallel)
