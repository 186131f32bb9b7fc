"""The transport pre-pass in batched jnp, float32 inside: the Pallas pre-pass's oracle, and the
form that runs where no pre-pass kernel fits (grouped heads at head_dim 128 on the GPU).

Per chunk: X = (I + strictLower(diag(beta) W W^T))^{-1} diag(beta) by a triangular solve, then
  Q^ = Q - (lower(Q W^T) X) W,  K^ = K - (X strictLower(W K^T))^T W,  E = W^T X W,
  diag = scale (Q K^T - (lower(Q W^T) X) strictLower(W K^T)).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.path_attention.operands import blocked

_HI = jax.lax.Precision.HIGHEST  # float32 pre-pass: no TF32 on GPU


def _ein(spec, *xs):
  return jnp.einsum(spec, *xs, precision=_HI)


def _mm(a, b):
  return jnp.matmul(a, b, precision=_HI)


def _tril(x, k=0):
  C = x.shape[-1]
  return jnp.where(jnp.arange(C)[:, None] - jnp.arange(C)[None, :] >= -k, x, 0.0)


def ut_transform(w_c, beta_c):
  """X = (I + strictLower(diag(beta) W W^T))^{-1} diag(beta); w_c [..., C, D], beta_c [..., C]."""
  C = w_c.shape[-2]
  a = _tril(beta_c[..., :, None] * _ein("...id,...jd->...ij", w_c, w_c), -1)
  eye = jnp.eye(C, dtype=w_c.dtype)
  rhs = jnp.broadcast_to(eye * beta_c[..., None, :], a.shape)
  return jax.scipy.linalg.solve_triangular(eye + a, rhs, lower=True)


def transport_jnp(q, k, w, bb, *, scale: float, dtype):
  """The transport operands in batched jnp (float32 inside).

  q [B, Tp, H, D]; k, w [B, Tp, K, D] (time-major, Tp whole chunks); bb [B, K, n, C] -> q^ [B,
  H, n, C, D], k^ [B, K, n, C, D], E [B, K, n, D, D], diag [B, H, n, C, C] scaled in-chunk
  logits, all in dtype (bf16 logits: the rounding of a bf16 q . k product; half the memory of
  float32 logits, which were the largest buffers at the backward's peak).
  """
  C = bb.shape[-1]
  qb, kb, wb = (blocked(x, C) for x in (q, k, w))
  B, H, n, C, D = qb.shape
  K = kb.shape[1]
  f32 = jnp.float32
  qb, kb, wb, bb = (x.astype(f32) for x in (qb, kb, wb, bb))
  x = ut_transform(wb, bb)                                        # [B, K, n, C, C]
  u = _mm(x, wb)
  wk = _tril(_ein("bkncd,bknjd->bkncj", wb, kb), -1)             # w_r . k_j, r > j
  khat = kb - _ein("bknrj,bknrd->bknjd", _mm(x, wk), wb)
  qg = qb.reshape(B, K, H // K, n, C, D)
  gm = _mm(_tril(_ein("bkgnid,bknrd->bkgnir", qg, wb)), x[:, :, None])   # lower(Q W^T) X
  qhat = qg - _mm(gm, wb[:, :, None])
  diag = _ein("bkgnid,bknjd->bkgnij", qg, kb) - _mm(gm, wk[:, :, None])
  e = _ein("bkncd,bknce->bknde", wb, u)                             # W^T U  [D, D]
  return (qhat.reshape(B, H, n, C, D).astype(dtype), khat.astype(dtype), e.astype(dtype),
          (scale * diag).reshape(B, H, n, C, C).astype(dtype))


