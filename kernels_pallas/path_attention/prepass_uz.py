"""The pre-pass VJP written from dU and dZ, the cotangents of U = X W and Z = X WK (the "uz_*"
pre-pass variants): one chunk's math as pure functions of 2-D float32 values, run by
prepass_kernel.py's two "uz" kernels.

The operands (prepass_chunk.chunk_operands) are, with X = Y diag(beta), Y = (I + A)^{-1},
WK = strictLower(W K^T) and LQ = lower(Q W^T):

  U = X W,  Z = X WK,  E = W^T U,  k^ = K - Z^T W,
  q^ = Q - LQ U,  diag = scale (Q K^T - LQ Z)   (per query head).

So every output reaches X only through U and Z. With M_U = Y^T dU and M_Z = Y^T dZ:
  - X^T dU = diag(beta) M_U and X^T dZ = diag(beta) M_Z (the pullbacks to W and WK): no product;
  - X's share of dbeta_j is sum_i dX_ij Y_ij = rowsum(M_U * W + M_Z * WK)_j, elementwise;
  - dA = -strictLower(Y^T dY Y^T) with dY = dX diag(beta) is
    -strictLower((M_U W^T + M_Z WK^T) X^T).
dX, dY and the inverse VJP's -Y^T dY Y^T are never formed, and the query heads' terms need no
GM = LQ X. In bf16 passes of 64^3 a chunk at C = D = 64, one query head a kv head: inverse 33
(recomputed) + 32 (chunk_operands_vjp_uz) + 28 (chunk_uz_pullback) = 93, against the
"split2_*" VJP's 33 + 27 + 33 + 12 = 105.

Shape letters: C chunk, D head dim; q^, k^, E, diag as in prepass.py.
"""
from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.path_attention.prepass_chunk import (_add, _inverse_products, _masks, _read,
                                                         inverse_vjp_from_da)


def uz_common(k, w, y, beta_r, p):
  """What chunk_operands_vjp_uz recomputes from the inputs: (W, K, U, Z), marked as p marks
  them (prepass_chunk.Products): k, w [C, D], y [C, C], beta_r [1, C] float32."""
  strict, _, _ = _masks(w.shape[0])
  X, W, K = p.acc(y * beta_r), p.acc(w), p.hi(k)
  WK = p.acc(jnp.where(strict, p.mm(W, K, tb=True), 0.0))
  return W, K, p.acc(p.mm(X, W)), p.acc(p.mm(X, WK))


def chunk_operands_vjp_uz(common, qs, dqhs, dkh, de, dds, *, scale: float, p, put=None):
  """The operands' VJP as far as U and Z: cotangents (tuple of dq^ [C, D], dk^ [C, D], dE
  [D, D], tuple of d diag [C, C]) -> (tuple of dq, dk without WK's pullback, dw without X's
  and WK's pullbacks, dU [C, D], dZ [C, C]), float32.

  Each query head's terms first, ending its tiles' lives as they are formed; then k^'s and E's
  terms, storing each output as soon as it is final: put(name, g, x) ("dq" per head g; "dk",
  "dz", "dw", "du"), None taking its place in the returned tuple. dkh and de may be loaders."""
  W, K, U, Z = common
  mm, acc, hi = p.mm, p.acc, p.hi
  _, lower, _ = _masks(qs[0].shape[0])
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
  dk = store("dk", 0, dkh + dk)
  dw = dw - mm(Z, DKH)
  dz = store("dz", 0, dz - mm(W, DKH, tb=True))
  DE = hi(_read(de))                                          # E = W^T U
  # U's lo half is the one operand the outputs are insensitive to (Products: dw 1.6e-4).
  dw = store("dw", 0, dw + mm(hi(U), DE, tb=True))
  du = store("du", 0, du + mm(W, DE))
  return tuple(dqs), dk, dw, du, dz


def chunk_uz_pullback(w, k, y, beta_c, beta_r, du, dz, dw, dk, *, precision, put=None):
  """The rest of the VJP from chunk_operands_vjp_uz's dU, dZ and partial dw, dk: X's, WK's and
  the inverse's pullbacks (module docstring) -> (dw, dk, dbeta as a column [C, 1]), float32.
  w, k [C, D], y [C, C], beta_c [C, 1], beta_r [1, C]; every argument but the betas may be a
  loader (a kernel's ref read where it is used). Every product float32-accurate at `precision`
  (the inverse's: prepass_chunk._inverse_products). put(name, x) stores "dk" as soon as it is
  final. Ordered for few live tiles: M_Z's terms first (WK's pullback: dk final; K and WK
  die), then M_U's, then dA and the inverse's pullback."""
  p = _inverse_products(precision)
  store = put or (lambda name, x: x)
  strict, _, _ = _masks(beta_c.shape[0])
  mz = p.mm(p.acc(_read(y)), p.acc(_read(dz)), ta=True)       # M_Z = Y^T dZ  [C, C]
  W, K = p.acc(_read(w)), p.hi(_read(k))
  wk = jnp.where(strict, p.mm(W, K, tb=True), 0.0)
  dbeta = jnp.sum(mz * wk, axis=1, keepdims=True)             # X's share (with M_U's below)
  t = p.mm(p.acc(mz), p.acc(wk), tb=True)
  DWK = p.acc(jnp.where(strict, beta_c * mz, 0.0))            # dWK = X^T dZ
  dk = store("dk", _read(dk) + p.mm(DWK, W, ta=True))
  dw = _read(dw) + p.mm(DWK, K)                               # WK's pullback
  mu = p.mm(p.acc(_read(y)), p.acc(_read(du)), ta=True)       # M_U = Y^T dU  [C, D]
  t = t + p.mm(p.acc(mu), W, tb=True)
  dbeta = dbeta + jnp.sum(mu * _read(w), axis=1, keepdims=True)
  dw = dw + beta_c * mu                                       # X^T dU
  da = jnp.where(strict, -p.mm(p.acc(t), p.acc(_read(y) * beta_r), tb=True), 0.0)
  dw_a, dbeta_a = inverse_vjp_from_da(_read(w), beta_c, da, p)
  return dw + dw_a, dk, dbeta + dbeta_a
