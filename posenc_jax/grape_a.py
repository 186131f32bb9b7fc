"""GRAPE-A: content-gated linear logit biases as unipotent actions (GRAPE §4, (4.4)-(4.7)).

Lift queries and keys to homogeneous coordinates q^ = [q; 1; 0], k^ = [k; 0; 1] in R^{D+2}
and take the rank-1 nilpotent A0 = e_{D+2} e_{D+1}^T (A0^2 = 0). With the gates
lambda_q(q) = softplus(v_h.q / sqrt(D)), lambda_k(k) = softplus(u_h.k / sqrt(D)) and
A_ij = -(lambda_q(q_i) + lambda_k(k_j)) A0, the unipotent G_add(m) = I + m omega_h A_ij gives

  q^_i^T G_add(j - i)^{-T} k^_j = q_i.k_j + b_ij,
  b_ij = -(i - j) omega_h [lambda_q(q_i) + lambda_k(k_j)]      (closed form, (4.6))

Variants: q-only (grape_a_q), k-only (grape_a_k), both (grape_a_qk); constant gates give ALiBi.
Positions are indices inside the packed segment (only i - j within a segment matters).

Fast path (`grape_a_augment`): the bias is bilinear in (per-query, per-key) features, so a few
extra q/k channels make ANY softmax kernel (cuDNN, flash, the blockwise jnp path) compute it:
  omega a_i (j - i) + omega c_j (j - i) = (omega a_i) j  [- omega a_i i: per-row, dropped]
                                          + (omega c_j)(-i) + (omega c_j j) 1.
The -omega a_i i term is the same for every key of row i, and softmax ignores such constants.
Positions, gates and the product c_j j are split into pieces of 8 significant bits (exact in
bfloat16), so every channel product is exact in the float32 accumulator even when the kernel
rounds its inputs to bf16 (bf16 activations, TPU default precision) or TF32: a single channel
holding omega a_i i would lose the bias to cancellation beyond a few hundred tokens.
A forget-gate form does not apply: the bias multiplies the distance by a per-query or per-key
rate, which is not a sum of per-position potentials along the path (except for ALiBi).

Shape letters: B batch, T time, H query heads, K kv heads, D head dim.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from posenc_jax import masking
from posenc_jax.path_integral import segment_positions

LANE = 8  # augmented head dims are padded to a multiple of this (cuDNN/TPU friendly)


def grape_a_gates(q_BTHD, k_BTKD, v_HD=None, u_HD=None):
  """lambda_q [B,T,H] = softplus(v_h.q_i/sqrt D), lambda_k [B,T,H] = softplus(u_h.k_j/sqrt D).

  A gate whose parameter is None is returned as None (that variant has no such term).
  """
  H, D = q_BTHD.shape[2], q_BTHD.shape[3]
  lam_q = lam_k = None
  if v_HD is not None:
    lam_q = jax.nn.softplus(jnp.einsum("bthd,hd->bth", q_BTHD.astype(jnp.float32), v_HD) / D**0.5)
  if u_HD is not None:
    k = masking.repeat_kv(k_BTKD, H).astype(jnp.float32)
    lam_k = jax.nn.softplus(jnp.einsum("bthd,hd->bth", k, u_HD) / D**0.5)
  return lam_q, lam_k


def _pair_rates(lam_q, lam_k):
  """Lambda_ij [B, H, T, S] = lambda_q(q_i) + lambda_k(k_j) (a missing gate counts as 0)."""
  rate = 0.0
  if lam_q is not None:
    rate = rate + jnp.transpose(lam_q, (0, 2, 1))[..., :, None]
  if lam_k is not None:
    rate = rate + jnp.transpose(lam_k, (0, 2, 1))[..., None, :]
  return jnp.asarray(rate, jnp.float32)


def grape_a_bias(omega_H, lam_q, lam_k, pos_BT):
  """Closed form (4.6): b_ij = -(pos_i - pos_j) omega_h [lambda_q_i + lambda_k_j], [B,H,T,T]."""
  dist = (pos_BT[:, :, None] - pos_BT[:, None, :]).astype(jnp.float32)[:, None]
  return -dist * omega_H.astype(jnp.float32)[None, :, None, None] * _pair_rates(lam_q, lam_k)


def grape_a_lift_logits(q, k, omega_H, lam_q, lam_k, pos_BT, *, scale):
  """The literal unipotent lift (a reference: (D+2) x (D+2) matrices for every i, j, h).

  Returns q^_i^T G_add(j - i)^{-T} k^_j with q^ = [scale q_i; 1; 0], k^ = [k_j; 0; 1],
  G_add(m) = I + m omega_h A_ij, A_ij = -Lambda_ij e_{D+2} e_{D+1}^T; [B, H, T, T] float32.
  """
  B, T, H, D = q.shape
  f32 = jnp.float32
  ones, zeros = jnp.ones((B, T, H, 1), f32), jnp.zeros((B, T, H, 1), f32)
  q_hat = jnp.concatenate([scale * q.astype(f32), ones, zeros], -1)
  k_hat = jnp.concatenate([masking.repeat_kv(k, H).astype(f32), zeros, ones], -1)
  a0 = jnp.zeros((D + 2, D + 2), f32).at[D + 1, D].set(1.0)      # e_{D+2} e_{D+1}^T
  a_ij = -_pair_rates(lam_q, lam_k)[..., None, None] * a0         # [B, H, T, T, D+2, D+2]
  m = (pos_BT[:, None, :] - pos_BT[:, :, None]).astype(f32)[:, None]  # j - i
  g = (jnp.eye(D + 2, dtype=f32)
       + (m * omega_H.astype(f32)[None, :, None, None])[..., None, None] * a_ij)
  g_inv_t = jnp.swapaxes(jnp.linalg.inv(g), -1, -2)                # group inverse, then transpose
  return jnp.einsum("bihd,bhijde,bjhe->bhij", q_hat, g_inv_t, k_hat)


def grape_a_attention_reference(q, k, v, *, omega, lam_q, lam_k, segment_ids=None, scale):
  """Dense GRAPE-A attention with the closed-form bias (the oracle of the fast path)."""
  B, T = q.shape[:2]
  bias = grape_a_bias(omega, lam_q, lam_k, segment_positions(segment_ids, B, T))
  logits = masking.dot_logits(q, k, scale) + bias
  return masking.dense_attention(logits, v, masking.causal_dense_mask(T, segment_ids))


def _bf16_pieces(x, n: int):
  """x ~= sum of n float32 arrays, each exactly representable in bfloat16 (8 bits each)."""
  pieces = []
  for _ in range(n):
    hi = x.astype(jnp.bfloat16).astype(jnp.float32)
    pieces.append(hi)
    x = x - hi                                                    # exact in float32
  return pieces


def _position_pieces(pos_BT, n: int):
  """Exact split of integer positions into n pieces of 8 bits: pos = sum_p pieces[p]."""
  return [((pos_BT >> (8 * p)) & 255).astype(jnp.float32) * 2.0 ** (8 * p) for p in range(n)]


def _gate_pieces(dtype) -> int:
  """bf16 pieces per gate: 3 carry a float32 gate exactly (3 x 8 = 24 significant bits); two
  (2^-17) cost float32 training ~1e-5 relative error in the slope gradients."""
  return 1 if jnp.dtype(dtype).itemsize <= 2 else 3


def augmented_channels(T: int, dtype, *, q_gate: bool, k_gate: bool) -> int:
  """How many extra channels grape_a_augment appends (before padding to LANE)."""
  n_pos = max(1, math.ceil(max(T - 1, 1).bit_length() / 8))
  g = _gate_pieces(dtype)
  return (g * n_pos if q_gate else 0) + ((g * n_pos + min(g + n_pos, 3)) if k_gate else 0)


def augmented_head_dim(T: int, D: int, dtype, *, q_gate: bool, k_gate: bool) -> int:
  """The head dim grape_a_augment returns: D plus its extra channels, padded to LANE."""
  extra = augmented_channels(T, dtype, q_gate=q_gate, k_gate=k_gate)
  return -(-(D + extra) // LANE) * LANE


def grape_a_augment(q, k, v, *, omega, lam_q, lam_k, segment_ids=None, scale, attn_scale=None):
  """Extends q and k so that plain softmax attention computes GRAPE-A exactly.

  Returns (q_aug [B,T,H,Da], k_aug [B,T,K',Da], v [B,T,K',Dv]) with Da = D + extra channels padded
  to a multiple of LANE, such that softmax(attn_scale q_aug.k_aug) == softmax(scale q.k + b), b the
  closed form. attn_scale defaults to 1/sqrt(Da), the default scale of
  posenc_jax.softmax_attention for the augmented head dim. K' = K unless a key gate is
  present: the key gate is per query head, so then k and v are repeated to K' = H heads.
  Float32 gates are carried as three bf16
  pieces (exact), 16-bit inputs as one piece (gate rounded to bf16).
  """
  B, T, H, D = q.shape
  if lam_q is None and lam_k is None:
    raise ValueError("grape_a_augment needs lam_q or lam_k (or both); got neither")
  if q.dtype == jnp.float16:
    raise ValueError("q.dtype=float16 is not supported by GRAPE-A augmentation (positions "
                     "exceed its range); use bfloat16 or float32")
  Da = augmented_head_dim(T, D, q.dtype, q_gate=lam_q is not None, k_gate=lam_k is not None)
  s = 1.0 / Da**0.5 if attn_scale is None else attn_scale
  n_pos = max(1, math.ceil(max(T - 1, 1).bit_length() / 8))
  g = _gate_pieces(q.dtype)
  pos = segment_positions(segment_ids, B, T)
  pos_pieces = [p[:, :, None] for p in _position_pieces(pos, n_pos)]    # [B, T, 1]
  om = omega.astype(jnp.float32)[None, None, :]
  q_ch, k_ch = [], []
  if lam_q is not None:                    # (omega a_i / s) * j, split exactly
    for w in _bf16_pieces(om * lam_q / s, g):
      for jp in pos_pieces:
        q_ch.append(w)
        k_ch.append(jnp.broadcast_to(jp, (B, T, H)))
  if lam_k is not None:                    # (omega c_j / s) * (-i) + (omega c_j j / s) * 1
    c_pieces = _bf16_pieces(om * lam_k / s, g)
    c_used = sum(c_pieces)                 # the gate as the channels carry it (exact sum)
    for c in c_pieces:
      for ip in pos_pieces:
        q_ch.append(jnp.broadcast_to(-ip, (B, T, H)))
        k_ch.append(c)
    for x in _bf16_pieces(c_used * pos[:, :, None].astype(jnp.float32), min(g + n_pos, 3)):
      q_ch.append(jnp.ones((B, T, H), jnp.float32))
      k_ch.append(x)
  pad = [jnp.zeros((B, T, H), jnp.float32)] * (Da - D - len(q_ch))
  q_ext, k_ext = jnp.stack(q_ch + pad, -1), jnp.stack(k_ch + pad, -1)
  if lam_k is None:  # the key side holds positions only: the same for every head, keep K
    k_main, v_out = k, v
    k_ext = jnp.broadcast_to(k_ext[:, :, :1], (B, T, k.shape[2], Da - D))
  else:
    k_main, v_out = masking.repeat_kv(k, H), masking.repeat_kv(v, H)
  q_aug = jnp.concatenate([q.astype(jnp.float32) * (scale / s), q_ext], -1).astype(q.dtype)
  k_aug = jnp.concatenate([k_main.astype(jnp.float32), k_ext], -1).astype(k.dtype)
  return q_aug, k_aug, v_out
