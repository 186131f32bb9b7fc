"""Additive (unipotent) encodings: ALiBi, FoX, GRAPE-A and GRAPE-AP attention.

GRAPE (§4-5, App. C) derives every one of them from a unipotent action in homogeneous
coordinates; they all end up as a logit bias l_ij = scale q_i.k_j + b_ij with b_ij <= 0:

  FoX       b_ij = sum_{s=j+1}^{i} log_forget_s      (unscaled; per query head)
  ALiBi     FoX with the constant gate log_forget[..., h] = -slope_h, slope_h = 2^(-8h/H) for H a
            power of two (any H: `alibi_slopes`, the ALiBi reference code's rule)
  GRAPE-A   b_ij = -(i-j) omega_h [lambda_q(q_i) + lambda_k(k_j)]   (posenc_jax.grape_a)
  GRAPE-AP  b_ij = sum_{l=j+1}^{i} psi_h(i, l)        (posenc_jax.path_integral)

This module holds the forgetting family (FoX, ALiBi) and re-exports the others, so that
posenc_jax.attention finds every additive implementation here.

Shape letters: B batch, T time, H query heads, K kv heads (H % K == 0), D head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax import blockwise
from posenc_jax import masking
from posenc_jax.grape_a import grape_a_attention_reference  # noqa: F401  (re-export)
from posenc_jax.grape_a import grape_a_augment  # noqa: F401
from posenc_jax.grape_a import grape_a_bias  # noqa: F401
from posenc_jax.grape_a import grape_a_gates  # noqa: F401
from posenc_jax.grape_a import grape_a_lift_logits  # noqa: F401
from posenc_jax.path_integral import path_integral_attention_chunked  # noqa: F401
from posenc_jax.path_integral import path_integral_attention_reference  # noqa: F401
from posenc_jax.path_integral import content_logit_tile
from posenc_jax.path_integral import right_to_left_attention


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi slopes for any head count, as the ALiBi reference code and BLOOM compute them.

  With n = 2^floor(log2 H): the n slopes 2^(-8h/n), h = 1..n, then the first H - n of the
  odd-h slopes 2^(-8h/(2n)) = 2^(-4h/n) of the 2n-head set (h = 1, 3, 5, ...). For H a power
  of two this is 2^(-8h/H). The simpler 2^(-8h/H) for every H would change what a model
  moved from PyTorch computes (at H = 6 its attention outputs differ by ~50%).
  Returns float32 [H] (computed in float64).
  """
  if num_heads < 1:
    raise ValueError(f"num_heads={num_heads} must be >= 1 for ALiBi slopes")
  n = 1 << (int(num_heads).bit_length() - 1)             # largest power of two <= H
  base = 2.0 ** (-8.0 * np.arange(1, n + 1, dtype=np.float64) / n)
  odd = 2.0 ** (-8.0 * np.arange(1, 2 * (num_heads - n), 2, dtype=np.float64) / (2 * n))
  return np.concatenate([base, odd]).astype(np.float32)


def alibi_log_forget(B: int, T: int, num_heads: int):
  """The constant forget gate that turns FoX into ALiBi: [B, T, H] = -slope_h."""
  return jnp.broadcast_to(-jnp.asarray(alibi_slopes(num_heads)), (B, T, num_heads))


def forgetting_bias(log_forget_BTH, segment_ids=None):
  """Dense FoX bias [B, H, T, T]: b_ij = c_i - c_j, c the within-segment inclusive cumsum.

  Only entries with j <= i in one segment are meaningful (the rest are masked by callers).
  """
  c = masking.segment_cumsum(log_forget_BTH.astype(jnp.float32), segment_ids)
  c = jnp.transpose(c, (0, 2, 1))                            # [B, H, T]
  return c[:, :, :, None] - c[:, :, None, :]


def forgetting_attention_reference(q, k, v, log_forget, *, segment_ids=None, scale):
  """Dense FoX oracle. q [B,T,H,D]; k, v [B,T,K,D]; log_forget [B,T,H] -> o [B,T,H,Dv]."""
  T = q.shape[1]
  logits = masking.dot_logits(q, k, scale) + forgetting_bias(log_forget, segment_ids)
  return masking.dense_attention(logits, v, masking.causal_dense_mask(T, segment_ids))


def forgetting_attention_chunked(q, k, v, log_forget, *, segment_ids=None, scale,
                                 block_size: int | None = None):
  """Blocked FoX: never T x T, and no absolute prefix sums.

  FoX is the path sum with the endpoint-independent potential psi(i, l) = log_forget_l, so it
  runs on the same right-to-left walk as GRAPE-AP: the bias of a tile is the sum carried from
  the query down to the tile plus a reverse cumulative sum inside the tile. Its float32 error
  therefore grows with |b_ij| (which softmax already discounts) and not with the absolute
  position, which is what an absolute prefix-sum difference c_i - c_j would do at long T.
  The walk never needs to restart at segment starts: for a visible pair (same segment) the
  whole path (j, i] lies inside the segment, and other pairs are masked.
  """
  B, T, H, _ = q.shape
  # None: 64, grown so that T needs at most 32 blocks (blockwise.block_size_for).
  block_size = blockwise.block_size_for(T, block_size, default=64, max_blocks=32)
  Tp = blockwise.padded_length(T, block_size)
  lf = jnp.transpose(blockwise.pad_time(log_forget.astype(jnp.float32), Tp), (0, 2, 1))

  def psi_tile(q_start, k_start):
    del q_start  # endpoint-independent: the same row for every query
    lk = jax.lax.dynamic_slice_in_dim(lf, k_start, block_size, axis=2)
    return jnp.broadcast_to(lk[:, :, None, :], (B, H, block_size, block_size))

  return right_to_left_attention(psi_tile, content_logit_tile(q, k, scale, Tp, block_size), v,
                                 num_heads=H, segment_ids=segment_ids, block_size=block_size)
