"""The pre-pass's math on one chunk, as pure functions of 2-D values (kernels.py runs them in
its kernels; reference.transport_jnp is their batched oracle).

The operands (chunk_operands) are built from dot_general, iota masks and elementwise ops only;
their VJP (chunk_operands_vjp_kv, then chunk_operands_vjp_q: the "split" form; uz.py has the
"uz" form) is written out by hand (recompute U, WK, Z from the inputs, then pull back; nothing
but the inputs is saved), where jax.vjp traced inside a kernel left transposed products and many
live float32 tiles. The UT inverse (I + A)^{-1}, A = strictLower(diag(beta) W W^T), is a
recursive block inversion (chunk_inverse): matmuls only (no triangular solve inside a kernel),
every intermediate O(1); its VJP is written in closed form (chunk_inverse_vjp).

Precision: every product keeps float32 accuracy at every input dtype (exact float32 in the
interpreter and on the TPU; on the GPU bf16 hi / lo halves for 16-bit inputs (Products), three
TF32 passes for float32 ones). With near-parallel w the products cancel: Y's entries alternate in
sign, so U = X W, E = W^T U, Z = X WK and lower(Q W^T) X are small differences of O(1) terms,
and the transport depends on the differences between neighbouring w (~eps), which a rounding of
w or X perturbs relatively by (rounding / eps). Single-pass TF32 products (the tensor cores read
the top 10 mantissa bits) failed the GPU tests at w_t = normalize(a + 0.01 n_t), beta = 2;
test_gpu_rounding.py emulates that truncation in the interpreter and shows where: the operands'
products, not the inverse nor the attention kernels.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.common.tiles import dot


@dataclasses.dataclass(frozen=True)
class Products:
  """How the operands chunk math forms its products.

  The chunk functions name, per product, which operands must keep float32 accuracy: acc(x)
  marks an operand whose rounding the result is sensitive to, hi(x) one whose bf16 rounding is
  harmless there (or exact: q, k and the cotangents of bf16 inputs are bf16 values). Then
  - hilo=False: acc and hi are the value itself, mm is one dot at `precision` with float32
    accumulation: every product at one precision (float32 inputs; the TPU);
  - hilo=True (16-bit inputs on the GPU): acc(x) is a bf16 pair (hi, lo = x - hi), hi(x) the pair
    without lo, and mm sums hi*hi + lo*hi + hi*lo over the halves present: an operand is split
    once however many products read it, a bf16-exact operand costs one pass instead of two, and
    an insensitive one drops its lo.
  Which operands may drop lo was measured, not guessed: one chunk (C = D = 64) at w shared to
  eps 0.01 / 1, antiparallel and random, beta 2 and uniform, each product's lo halves dropped
  alone and then together (greedy) against float64, keeping every output's worst relative RMS
  error <= 2.5e-4 (bf16 storage of q^, k^ adds ~1e-3). Only the bf16-exact operands (q, k, the
  cotangents) and U in dw's U dE^T term qualify: 26 of 30 bf16 passes in the forward (23 of 27
  since q^ and the logits' correction are formed from U and Z: the study's baseline errors
  2.6e-5 / 2.0e-5 / 2.0e-3 / 1.5e-5 for q^, k^, E, diag became 2.3e-5 / 2.0e-5 / 2.0e-3 /
  1.2e-5) and 58 of 75 in the VJP instead of three per product. Dropping W's lo anywhere costs
  ~2e-3 (Z^T W in k^: the rounding of W times an O(1) Z).
  """
  precision: object = None
  hilo: bool = False

  def acc(self, x):
    if not self.hilo:
      return x
    if isinstance(x, tuple):
      return x
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)

  def hi(self, x):
    if not self.hilo:
      return self.acc(x)
    return (x[0] if isinstance(x, tuple) else x.astype(jnp.bfloat16)), None

  def mm(self, a, b, ta=False, tb=False):
    if not self.hilo:
      return dot(a, b, ta=ta, tb=tb, precision=self.precision)
    (ah, al), (bh, bl) = a, b
    out = dot(ah, bh, ta=ta, tb=tb)
    if al is not None:
      out = out + dot(al, bh, ta=ta, tb=tb)
    if bl is not None:
      out = out + dot(ah, bl, ta=ta, tb=tb)
    return out


def _masks(C):
  row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
  col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
  return row > col, row >= col, jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)


def _inverse_products(precision) -> Products:
  """The inverse's and its VJP's products: bf16 hi / lo halves formed once per operand where
  `precision` asks for three bf16 passes (Products(hilo=True): the same three terms as the
  BF16_BF16_F32_X3 preset, which splits both operands again inside every product), else one
  dot at `precision` per product."""
  if precision == jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3:
    return Products(hilo=True)
  return Products(precision)


def _a_matrix(w, beta_c, strict, p):
  """A = strictLower(diag(beta) W W^T) [C, C], float32-accurate as p forms products; strict:
  the row > col mask."""
  W = p.acc(w)
  return jnp.where(strict, beta_c * p.mm(W, W, tb=True), 0.0)


def chunk_inverse(w, beta_c, *, precision):
  """Y = (I + A)^{-1}, A = strictLower(diag(beta) W W^T): w [C, D], beta_c [C, 1] float32.

  Recursive block inversion: with Y_s the block-diagonal inverse at block size s (exact inverses
  of the principal [s, s] blocks), merging pairs of blocks is one block forward-substitution
  step, [[Y1, 0], [A21, I]] -> Y21 = -Y2 A21 Y1, i.e. Y_2s = Y_s - Y_s (A21 Y_s) with A21 the
  lower-left quadrant of every [2s, 2s] block. log2 C levels of two [C, C] products (the first
  level is free); masks replace slicing, which the Triton lowering lacks. (r, c) lies in that
  quadrant at level s when r > c and the highest bit in which r and c differ is s's
  (s <= r ^ c < 2 s): one xor for all levels instead of two divisions a level.

  Why not the Neumann product prod_i (I + (-A)^(2^i)) used before: its factors are powers of A,
  whose entries grow like beta^m binom(C, m) when neighbouring w share a direction (the PaTH
  layer's w do: a low-rank projection and a short convolution), ~1e27 at C = 64 and beta = 2,
  and cancel to the O(1) entries of Y. Even exact float32 products then return garbage (TF32 on
  the GPU: 1e24), which reached the attention logits as inf / NaN in bf16 training. Every
  intermediate here is an inverse of a principal sub-block, i.e. the Y of a shorter chunk,
  whose entries stay O(1) (|Y_ij| <= 2 for parallel w); the recursion is backward stable like a
  blocked triangular solve.
  """
  C = w.shape[0]
  p = _inverse_products(precision)
  row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
  col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
  lower, bits = row > col, row ^ col
  a = _a_matrix(w, beta_c, lower, p)
  y = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
  half = 1
  while half < C:
    a21 = jnp.where(lower & (bits >= half) & (bits < 2 * half), a, 0.0)
    if half == 1:   # Y_1 = I
      y = y - a21
    else:
      Y = p.acc(y)
      y = y - p.mm(Y, p.acc(p.mm(p.acc(a21), Y)))
    half *= 2
  return y


def chunk_inverse_refine(w, beta_c, y0, *, precision):
  """Y = (I + A)^{-1} from y0, its bf16 rounding, by one Newton step: R = I - (I + A) Y0, Y =
  Y0 + Y0 R; w [C, D], beta_c [C, 1], y0 [C, C] (bf16 values), float32.

  With Y0 = Y + E the step leaves -E (I + A) E: second order in the rounding. With the bf16
  halves (16-bit inputs on the GPU) that is below what the halves cost the direct inverse:
  worst relative RMS against float64 numpy over 60 seeds a layout (C = D = 64; random w, w
  shared to 1 / 0.1 / 0.01, antiparallel), chunk_inverse 5.9e-6 / 5.2e-5 / 5.5e-4 / 1.9e-4 /
  1.4e-4, this step 5.3e-6 / 4.4e-5 / 2.4e-4 / 1.1e-4 / 1.4e-4 (Y0 alone ~1e-3). With exact
  float32 products the inverse is 10-35x finer (1.8e-7 .. 1.8e-5) than the step, so it is
  used only with the halves (kernels.transport_pallas).
  7 bf16 passes of C^3 (A 3, A Y0 2: Y0 is bf16-exact, Y0 R 2) against the inverse's 33."""
  C = w.shape[0]
  p = _inverse_products(precision)
  strict, _, eye = _masks(C)
  a = _a_matrix(w, beta_c, strict, p)
  Y0 = p.hi(y0)
  r = eye - y0 - p.mm(p.acc(a), Y0)
  return y0 + p.mm(Y0, p.acc(r))


def chunk_inverse_vjp(w, beta_c, y, dy, *, precision):
  """Cotangents (dw, dbeta_c) of chunk_inverse from dY, in closed form:
  dT = -Y^T dY Y^T, dA = strictLower(dT), A_ij = beta_i (w_i . w_j); with dS = diag(beta) dA,
  dW = dS W + dS^T W and dbeta_i = sum_j dA_ij (w_i . w_j).

  At head_dim <= C, dbeta_i = w_i . (dA W)_i: dA W serves dbeta and dS W = diag(beta) dA W, and
  W W^T is not formed again (two products after dT instead of three). Above C the
  three-product form stays: the split of beta W ([C, D]) cost more than the product saved."""
  p = _inverse_products(precision)
  strict, _, _ = _masks(w.shape[0])
  Y = p.acc(y)
  da = jnp.where(strict, -p.mm(p.acc(p.mm(Y, p.acc(dy), ta=True)), Y, tb=True), 0.0)
  return inverse_vjp_from_da(w, beta_c, da, p)


def inverse_vjp_from_da(w, beta_c, da, p):
  """(dw, dbeta_c) from dA (strictly lower), A = strictLower(diag(beta) W W^T): with
  dS = diag(beta) dA, dW = dS W + dS^T W and dbeta_i = sum_j dA_ij (w_i . w_j); products as
  p forms them (chunk_inverse_vjp's form by head_dim)."""
  C, D = w.shape
  W = p.acc(w)
  if D <= C:
    DA = p.acc(da)
    daw = p.mm(DA, W)
    dbeta = jnp.sum(daw * w, axis=1, keepdims=True)
    return beta_c * daw + p.mm(DA, p.acc(beta_c * w), ta=True), dbeta
  dbeta = jnp.sum(da * p.mm(W, W, tb=True), axis=1, keepdims=True)
  DS = p.acc(beta_c * da)
  return p.mm(DS, W) + p.mm(DS, W, ta=True), dbeta


def chunk_operands(qs, k, w, y, beta_r, *, scale: float, precision=None, hilo: bool = False,
                   put=None):
  """One chunk given Y. qs: tuple of G [C, D] queries (the heads sharing this kv head); k, w
  [C, D]; y [C, C]; beta_r [1, C]; float32. -> (tuple of q^ [C, D], k^ [C, D], E [D, D], tuple
  of scaled diag logits [C, C]). Products as Products(precision, hilo) forms them; acc /
  hi mark each operand's sensitivity (Products). put(i, g, x) (a kernel's store) takes output
  i (0 q^, 1 k^, 2 E, 3 diag; g the head) as soon as it is formed, so that it is not held to
  the end (E alone is 512 B a thread at D = 128 with 4 warps); None in its place."""
  C = w.shape[0]
  p = Products(precision, hilo)
  mm, acc, hi = p.mm, p.acc, p.hi
  strict, lower, _ = _masks(C)
  x = y * beta_r                                                # X = (I + A)^{-1} diag(beta)
  X, W, K = acc(x), acc(w), hi(k)
  out = lambda i, x, g=0: x if put is None else put(i, g, x)
  U = acc(mm(X, W))                                             # U = X W
  e = out(2, mm(W, U, ta=True))                                 # E = W^T U
  WK = acc(jnp.where(strict, mm(W, K, tb=True), 0.0))           # w_r . k_j, r > j
  Z = acc(mm(X, WK))                                            # Z = X WK
  khat = out(1, k - mm(Z, W, ta=True))                          # K - Z^T W
  qhats, diags = [], []
  for g, q in enumerate(qs):
    # q^ = Q - lower(Q W^T) X W and its logits' correction lower(Q W^T) X WK, from U and Z:
    # three bf16 passes fewer a head than forming GM = lower(Q W^T) X first
    Q = hi(q)
    LQ = acc(jnp.where(lower, mm(Q, W, tb=True), 0.0))
    qhats.append(out(0, q - mm(LQ, U), g))
    diags.append(out(3, scale * (mm(Q, K, tb=True) - mm(LQ, Z)), g))
  return tuple(qhats), khat, e, tuple(diags)


def _add(a, b):
  """a + b, with None for a sum not yet started."""
  return b if a is None else a + b


def _read(x):
  """x, or x() where a kernel passed a loader (a ref read where first used: fewer live tiles)."""
  return x() if callable(x) else x


def vjp_common(k, w, y, beta_r, p):
  """What both halves of the VJP recompute from the inputs: X = Y diag(beta), the marked
  operands and WK = strictLower(W K^T)."""
  strict, _, _ = _masks(w.shape[0])
  X, W, K = p.acc(y * beta_r), p.acc(w), p.hi(k)
  WK = p.acc(jnp.where(strict, p.mm(W, K, tb=True), 0.0))
  return y, beta_r, X, W, K, WK


def chunk_operands_vjp_kv(common, dkh, de, p):
  """The VJP's terms of E = W^T U and k^ = K - Z^T W, which read no query head: -> partial
  (dw [C, D], dx [C, C], dwk [C, C], unmasked) float32."""
  _, _, X, W, _, WK = common
  mm, acc, hi = p.mm, p.acc, p.hi

  def k_terms(dw, dx):                                          # k^ = K - Z^T W
    DKH = hi(_read(dkh))
    DZ = acc(-mm(W, DKH, tb=True))
    dwk = mm(X, DZ, ta=True)
    dx = _add(dx, mm(DZ, WK, tb=True))
    dw = _add(dw, -mm(acc(mm(X, WK)), DKH))                      # Z = X WK
    return dw, dx, dwk

  def e_terms(dw, dx):                                          # E = W^T U
    DE = hi(_read(de))
    DU = acc(mm(W, DE))
    # U's lo half is the one operand the outputs are insensitive to (dw 1.6e-4 without it).
    dw = _add(dw, mm(hi(mm(X, W)), DE, tb=True) + mm(X, DU, ta=True))
    return dw, _add(dx, mm(DU, W, tb=True))

  # Order for few live tiles (resource report, 4 warps, spill bytes a thread): at D = 64 E's
  # terms first (216 against 672); at 128 k^'s first (DE alone is 256 B a thread there).
  if jax.tree.leaves(W)[0].shape[-1] <= 64:
    dw, dx = e_terms(None, None)
    dw, dx, dwk = k_terms(dw, dx)
  else:
    dw, dx, dwk = k_terms(None, None)
    dw, dx = e_terms(dw, dx)
  return dw, dx, dwk


def chunk_operands_vjp_q(common, qs, dqhs, dkh, dds, partial, *, scale: float, p, put=None):
  """The rest of the VJP: each query head's terms (q^ = Q - GM W, diag = Q K^T - GM WK) added
  to chunk_operands_vjp_kv's partial (dw, dx, dwk), then WK's and X's pullbacks:
  -> (tuple of dq, dk, dw, dy, dbeta_r).

  Written for few live tiles: each head's terms end their operands' lives in the order they
  are formed (DGM first, WK's last use; DL and dq; then Q's terms), and put(name, g, x), where
  given, stores each output as soon as it is final ("dq" per head; "dy" and "dbeta" once the
  last head's dx is added; then "dw", "dk"), None taking its place in the returned tuple.
  Any of common's six, dkh and `partial`'s three may be loaders (functions that read a
  kernel's ref where the value is used); the kernel passes Y, dkh and the partials so. X, W,
  K as loaders too (in three combinations) reported 336-388 B of spill stores a thread at
  D = 64 against 356, and 324-668 at 128 against 332: no clear gain, so they stay values."""
  y, beta_r, X, W, K, WK = common
  mm, acc, hi = p.mm, p.acc, p.hi
  strict, lower, _ = _masks(beta_r.shape[-1])   # beta_r [1, C] (y may be a loader)
  store = put or (lambda name, g, x: x)
  dw = dx = dwk = dk = dy = dbeta = None
  dqs = []
  for g, (q, dqh, dd) in enumerate(zip(qs, dqhs, dds)):
    last = g == len(qs) - 1
    DQH, DS = hi(dqh), hi(scale * dd)
    DGM = acc(-(mm(DQH, _read(W), tb=True) + mm(DS, _read(WK), tb=True)))  # q^ = Q - GM W,
    DL = acc(jnp.where(lower, mm(DGM, _read(X), tb=True), 0.0))          # diag = .. - GM WK
    dqs.append(store("dq", g, dqh + mm(DS, _read(K)) + mm(DL, _read(W))))
    Q = hi(q)
    LQ = acc(jnp.where(lower, mm(Q, _read(W), tb=True), 0.0))
    dx = _add(dx, mm(LQ, DGM, ta=True))
    if last:   # X = Y diag(beta): dY = dX diag(beta), dbeta = the column sums of dX * Y
      dx = _read(partial[1]) + dx
      dy = store("dy", 0, dx * beta_r)
      dbeta = store("dbeta", 0, jnp.sum(dx * _read(y), axis=0, keepdims=True))
    GM = acc(mm(LQ, _read(X)))                                           # GM = L X
    dw = _add(dw, mm(DL, Q, ta=True) - mm(GM, DQH, ta=True))
    dwk = _add(dwk, -mm(GM, DS, ta=True))
    dk = _add(dk, mm(DS, Q, ta=True))
  dw_kv, _, dwk_kv = partial
  DWK = acc(jnp.where(strict, _read(dwk_kv) + dwk, 0.0))               # WK = strictLower(W K^T)
  dw = store("dw", 0, _read(dw_kv) + dw + mm(DWK, _read(K)))
  dk = store("dk", 0, _read(dkh) + dk + mm(DWK, _read(W), ta=True))
  return tuple(dqs), dk, dw, dy, dbeta
