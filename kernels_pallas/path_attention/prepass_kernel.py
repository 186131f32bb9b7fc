"""The transport pre-pass as two Pallas kernels (forward and its VJP), one program per
(batch, kv head, chunk). Same operands as prepass.transport_jnp, its oracle.

Why a kernel: in batched jnp the pre-pass is many small float32 einsums, layout copies and a
batched triangular solve; measured on the H200 at B,T,H,D = 32,2048,32,64 it took 16.5 ms forward
and 41.6 ms for its VJP, against 4.4 ms for the attention kernel itself, and its float32
intermediates set the peak memory. Per chunk it is a handful of C x C and C x D products that stay
on chip: the kernel reads q, k, w, beta once and writes q^, k^, E, diag once.

The chunk math (chunk_transport) is a pure function of 2-D values built from dot_general, iota
masks and elementwise ops only, so the backward kernel is jax.vjp of it, traced inside the kernel
body (recompute, then pull back; nothing but the inputs is saved). The UT inverse
(I + A)^{-1}, A = strictLower(diag(beta) W W^T) nilpotent, is the product of squarings
prod_i (I + (-A)^(2^i)), i < log2 C: matmuls only (no triangular solve inside a kernel).

Precision: float32 operands use Precision.HIGHEST (exact float32 products); lower-precision
inputs use the default (TF32 on the GPU, ~1e-3 relative per product), which is finer than the
bf16 rounding of the outputs that follow.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.path_attention.kernels import dot


def chunk_transport(qs, k, w, beta_c, beta_r, *, scale: float, precision):
  """One chunk. qs: tuple of G [C, D] queries (one per head sharing this kv head); k, w [C, D];
  beta_c [C, 1], beta_r [1, C] (beta as a column and as a row); all float32.
  -> (tuple of q^ [C, D], k^ [C, D], E [D, D], tuple of scaled diag logits [C, C])."""
  C = w.shape[0]
  mm = functools.partial(dot, precision=precision)
  row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
  col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
  strict, lower = row > col, row >= col
  eye = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
  power = jnp.where(strict, -beta_c * mm(w, w, tb=True), 0.0)   # N = -A
  inv = eye + power
  for _ in range(max(0, C.bit_length() - 2)):                  # (I+N)(I+N^2)(I+N^4)...
    power = mm(power, power)
    inv = mm(inv, eye + power)
  x = inv * beta_r                                              # X = (I + A)^{-1} diag(beta)
  e = mm(w, mm(x, w), ta=True)                                  # E = W^T U, U = X W
  wk = jnp.where(strict, mm(w, k, tb=True), 0.0)                # w_r . k_j, r > j
  khat = k - mm(mm(x, wk), w, ta=True)
  qhats, diags = [], []
  for q in qs:
    gm = mm(jnp.where(lower, mm(q, w, tb=True), 0.0), x)       # lower(Q W^T) X
    qhats.append(q - mm(gm, w))
    diags.append(scale * (mm(q, k, tb=True) - mm(gm, wk)))
  return tuple(qhats), khat, e, tuple(diags)


@dataclasses.dataclass(frozen=True)
class _Cfg:
  scale: float
  dtype: jnp.dtype      # dtype of q^, k^, E
  backend: str
  precision: object


def _load(q_ref, k_ref, w_ref, bc_ref, br_ref):
  f32 = jnp.float32
  qs = tuple(q_ref[g].astype(f32) for g in range(q_ref.shape[0]))
  return qs, k_ref[...].astype(f32), w_ref[...].astype(f32), bc_ref[...].astype(f32), \
      br_ref[...].astype(f32)


def _fwd_kernel(q_ref, k_ref, w_ref, bc_ref, br_ref, qh_ref, kh_ref, e_ref, d_ref, *, cfg):
  qh, kh, e, d = chunk_transport(*_load(q_ref, k_ref, w_ref, bc_ref, br_ref),
                                 scale=cfg.scale, precision=cfg.precision)
  for g in range(len(qh)):
    qh_ref[g] = qh[g].astype(qh_ref.dtype)
    d_ref[g] = d[g]
  kh_ref[...] = kh.astype(kh_ref.dtype)
  e_ref[...] = e.astype(e_ref.dtype)


def _bwd_kernel(q_ref, k_ref, w_ref, bc_ref, br_ref, dqh_ref, dkh_ref, de_ref, dd_ref,
                dq_ref, dk_ref, dw_ref, dbc_ref, dbr_ref, *, cfg):
  f32 = jnp.float32
  G = q_ref.shape[0]
  fn = functools.partial(chunk_transport, scale=cfg.scale, precision=cfg.precision)
  _, pull = jax.vjp(fn, *_load(q_ref, k_ref, w_ref, bc_ref, br_ref))
  cts = (tuple(dqh_ref[g].astype(f32) for g in range(G)), dkh_ref[...].astype(f32),
         de_ref[...].astype(f32), tuple(dd_ref[g].astype(f32) for g in range(G)))
  dqs, dk, dw, dbc, dbr = pull(cts)
  for g in range(G):
    dq_ref[g] = dqs[g].astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dw_ref[...] = dw.astype(dw_ref.dtype)
  dbc_ref[...] = dbc
  dbr_ref[...] = dbr


def _specs(qb, kb):
  """BlockSpecs of the grid (B, K, n): query blocks hold the G heads of kv head kh."""
  G = qb.shape[1] // kb.shape[1]
  grp = lambda *tail: pl.BlockSpec((None, G, None) + tail, lambda b, kh, c: (b, kh, c, 0, 0))
  one = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda b, kh, c: (b, kh, c, 0, 0))
  return grp, one


def _call(cfg, kernel, grid, in_specs, out_specs, out_shape):
  from kernels_pallas.path_attention import calls  # the backends' compiler params live there
  kwargs = {}
  params = calls.prepass_compiler_params(cfg.backend, len(grid))
  if params is not None:
    kwargs["compiler_params"] = params
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=calls._interpret(cfg.backend), **kwargs)


def _inputs(qb, kb, wb, bb):
  bc, br = bb[..., None], bb[..., None, :]   # beta as a column [.., C, 1] and a row [.., 1, C]
  return qb, kb, wb, bc, br


def _fwd(cfg, qb, kb, wb, bb):
  B, H, n, C, D = qb.shape
  K = kb.shape[1]
  grp, one = _specs(qb, kb)
  args = _inputs(qb, kb, wb, bb)
  in_specs = [grp(C, D), one(C, D), one(C, D), one(C, 1), one(1, C)]
  sd = jax.ShapeDtypeStruct
  out_shape = [sd((B, H, n, C, D), cfg.dtype), sd((B, K, n, C, D), cfg.dtype),
               sd((B, K, n, D, D), cfg.dtype), sd((B, H, n, C, C), jnp.float32)]
  out_specs = [grp(C, D), one(C, D), one(D, D), grp(C, C)]
  kernel = functools.partial(_fwd_kernel, cfg=cfg)
  return tuple(_call(cfg, kernel, (B, K, n), in_specs, out_specs, out_shape)(*args))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _transport(cfg, qb, kb, wb, bb):
  return _fwd(cfg, qb, kb, wb, bb)


def _transport_fwd(cfg, qb, kb, wb, bb):
  return _fwd(cfg, qb, kb, wb, bb), (qb, kb, wb, bb)


def _transport_bwd(cfg, res, cts):
  qb, kb, wb, bb = res
  B, H, n, C, D = qb.shape
  K = kb.shape[1]
  grp, one = _specs(qb, kb)
  dqh, dkh, de, dd = cts
  args = _inputs(qb, kb, wb, bb) + (dqh, dkh, de, dd)
  in_specs = [grp(C, D), one(C, D), one(C, D), one(C, 1), one(1, C),
              grp(C, D), one(C, D), one(D, D), grp(C, C)]
  sd = jax.ShapeDtypeStruct
  f32 = jnp.float32
  out_shape = [sd(qb.shape, qb.dtype), sd(kb.shape, kb.dtype), sd(wb.shape, wb.dtype),
               sd((B, K, n, C, 1), f32), sd((B, K, n, 1, C), f32)]
  out_specs = [grp(C, D), one(C, D), one(C, D), one(C, 1), one(1, C)]
  kernel = functools.partial(_bwd_kernel, cfg=cfg)
  dq, dk, dw, dbc, dbr = _call(cfg, kernel, (B, K, n), in_specs, out_specs, out_shape)(*args)
  dbeta = (dbc[..., 0] + dbr[..., 0, :]).astype(bb.dtype)
  return dq, dk, dw, dbeta


_transport.defvjp(_transport_fwd, _transport_bwd)


def transport_pallas(qb, kb, wb, bb, *, scale: float, dtype, backend: str, precision=None):
  """Drop-in for prepass.transport_jnp (same shapes and dtypes) as Pallas kernels on `backend`.
  precision None: HIGHEST for float32 q, else the backend's default."""
  if precision is None and jnp.dtype(qb.dtype) == jnp.float32:
    precision = lax.Precision.HIGHEST
  return _transport(_Cfg(scale=float(scale), dtype=jnp.dtype(dtype), backend=backend,
                         precision=precision), qb, kb, wb, bb)
