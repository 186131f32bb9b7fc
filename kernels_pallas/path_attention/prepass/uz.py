"""The pre-pass VJP written from dU and dZ, the cotangents of U = X W and Z = X WK (the "uz"
form): one chunk's math as pure functions of 2-D float32 values, run by kernels.py's two "uz"
VJP kernels.

The operands (chunk.chunk_operands) are, with X = Y diag(beta), Y = (I + A)^{-1},
WK = strictLower(W K^T) and LQ = lower(Q W^T):

  U = X W,  Z = X WK,  E = W^T U,  k^ = K - Z^T W,
  q^ = Q - LQ U,  diag = scale (Q K^T - LQ Z)   (per query head).

So every output reaches X only through U and Z. With M_U = Y^T dU and M_Z = Y^T dZ:
  - X^T dU = diag(beta) M_U and X^T dZ = diag(beta) M_Z (the pullbacks to W and WK): no product;
  - X's share of dbeta_j is sum_i dX_ij Y_ij = rowsum(M_U * W + M_Z * WK)_j, elementwise;
  - dA = -strictLower(Y^T dY Y^T) with dY = dX diag(beta) is
    -strictLower((M_U W^T + M_Z WK^T) X^T).
dX, dY and the inverse VJP's -Y^T dY Y^T are never formed, and the query heads' terms need no
GM = LQ X: fewer products than the "split" form's three kernels (93 bf16 passes of 64^3 a chunk
at C = D = 64 and one query head a kv head, against 105). The first kernel stops at T (the
second, chunk_t_pullback, is small): stopping earlier left a second kernel that spilled. At
head_dim 128 the first kernel spills, so the plan runs "split" there on the GPU.

Shape letters: C chunk, D head dim; q^, k^, E, diag as in operands.py.
"""
from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.path_attention.prepass.chunk import (_add, _inverse_products, _masks, _read,
                                                         inverse_vjp_from_da, vjp_common)


def uz_common(k, w, y, beta_r, p):
  """What chunk_operands_vjp_uz recomputes from the inputs: (W, K, U, Z), marked as p marks
  them (chunk.Products): k, w [C, D], y [C, C], beta_r [1, C] float32."""
  _, _, X, W, K, WK = vjp_common(k, w, y, beta_r, p)
  return W, K, p.acc(p.mm(X, W)), p.acc(p.mm(X, WK))


def chunk_operands_vjp_uz(common, qs, dqhs, dkh, de, dds, y, w, beta_c, *, scale: float, p,
                          put=None):
  """The first kernel's part: cotangents (tuple of dq^ [C, D], dk^ [C, D], dE [D, D], tuple of
  d diag [C, C]), Y [C, C], the float32 w [C, D] and beta_c [C, 1] -> (tuple of dq, dk, dw
  without the inverse's share, T = M_U W^T + M_Z WK^T [C, C], X's share of dbeta [C, 1]),
  float32: every term but dA's pullback (chunk_t_pullback).

  Each query head's terms first, ending its tiles' lives as they are formed; then k^'s and E's
  terms, which complete dU and dZ; then M_U, M_Z and WK's pullback. put(name, g, x) stores
  each output as soon as it is final ("dq" per head g; "t", "dk", "dw", "dbeta"), None taking
  its place in the returned tuple. dkh, de, y and w may be loaders."""
  W, K, U, Z = common
  mm, acc, hi = p.mm, p.acc, p.hi
  strict, lower, _ = _masks(qs[0].shape[0])
  store = put or (lambda name, g, x: x)
  du = dz = dw = dk = None
  dqs = []
  for g, (q, dqh, dd) in enumerate(zip(qs, dqhs, dds)):
    Q, DQH, DS = hi(q), hi(dqh), hi(scale * dd)
    # q^ = Q - LQ U and diag = scale (Q K^T - LQ Z): LQ's cotangent first (U's and Z's last use
    # in the loop), then LQ = lower(Q W^T) itself for U's and Z's
    DL = acc(jnp.where(lower, -(mm(DQH, U, tb=True) + mm(DS, Z, tb=True)), 0.0))
    dqs.append(store("dq", g, dqh + mm(DS, K) + mm(DL, W)))
    dw = _add(dw, mm(DL, Q, ta=True))
    dk = _add(dk, mm(DS, Q, ta=True))
    LQ = acc(jnp.where(lower, mm(Q, W, tb=True), 0.0))
    du = _add(du, -mm(LQ, DQH, ta=True))
    dz = _add(dz, -mm(LQ, DS, ta=True))
  dkh = _read(dkh)                                            # k^ = K - Z^T W
  DKH = hi(dkh)
  dk = dkh + dk
  dw = dw - mm(Z, DKH)
  dz = dz - mm(W, DKH, tb=True)
  DE = hi(_read(de))                                          # E = W^T U
  # U's lo half is the one operand the outputs are insensitive to (Products: dw 1.6e-4).
  dw = dw + mm(hi(U), DE, tb=True)
  du = du + mm(W, DE)
  Y = acc(_read(y))
  mz = mm(Y, acc(dz), ta=True)                                # M_Z = Y^T dZ  [C, C]
  mu = mm(Y, acc(du), ta=True)                                # M_U = Y^T dU  [C, D]
  # WK again (two passes) rather than uz_common's, which would stay live through the head loop;
  # its float32 value also serves dbeta exactly (the bf16 halves are not)
  wk = jnp.where(strict, mm(W, K, tb=True), 0.0)
  dbeta = (jnp.sum(mz * wk, axis=1, keepdims=True)            # X's share
           + jnp.sum(mu * _read(w), axis=1, keepdims=True))
  t = store("t", 0, mm(acc(mz), acc(wk), tb=True) + mm(acc(mu), W, tb=True))
  DWK = acc(jnp.where(strict, beta_c * mz, 0.0))              # dWK = X^T dZ
  dk = store("dk", 0, dk + mm(DWK, W, ta=True))
  dw = store("dw", 0, dw + beta_c * mu + mm(DWK, K))          # X^T dU + WK's pullback
  return tuple(dqs), dk, dw, t, store("dbeta", 0, dbeta)


def chunk_t_pullback(w, y, beta_c, beta_r, t, dw, dbeta, *, precision):
  """The second kernel's part: dA = -strictLower(T X^T) and the inverse's pullback, added to
  the first's dw and dbeta -> (dw, dbeta as a column [C, 1]). w [C, D], y, t [C, C], dw
  [C, D] (each may be a loader), beta_c, dbeta [C, 1], beta_r [1, C]; products
  float32-accurate at `precision` (the inverse's: chunk._inverse_products)."""
  p = _inverse_products(precision)
  strict, _, _ = _masks(beta_c.shape[0])
  da = jnp.where(strict, -p.mm(p.acc(_read(t)), p.acc(_read(y) * beta_r), tb=True), 0.0)
  dw_a, dbeta_a = inverse_vjp_from_da(_read(w), beta_c, da, p)
  return _read(dw) + dw_a, dbeta + dbeta_a
