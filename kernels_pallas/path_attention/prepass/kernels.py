"""The transport pre-pass as Pallas kernels, one program per (batch, kv head, chunk), with the
same outputs as reference.transport_jnp, its oracle.

Forward: the inverse kernel (Y = (I + A)^{-1} per chunk, chunk.chunk_inverse) and the operands
kernel (q^, k^, E, diag). Backward, in one of two forms (the plan picks by head_dim and dtype):
  "uz":    the VJP from dU and dZ (uz.py) in two kernels, with T and a partial dw through HBM;
  "split": the operands' VJP as two kernels (the E and k^ terms, then each query head's) and
           the inverse's VJP as a third, with partial dw, dx, dwk through HBM.
Y is kept from the forward for the VJP (keep_inverse True: float32; "bf16": its bf16 rounding,
which the VJP refines by one Newton step) or recomputed there (False).

Why kernels: in batched jnp the pre-pass is many small float32 einsums, layout copies and a
batched triangular solve, whose float32 intermediates set the peak memory; per chunk it is a
handful of C x C and C x D products that stay on chip, and the kernels read q, k, w, beta once
and write q^, k^, E, diag once. chunk.py has the chunk math and how each product keeps float32
accuracy.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.common import launch
from kernels_pallas.path_attention import operands
from kernels_pallas.path_attention.prepass.chunk import (Products, chunk_inverse,
                                                         chunk_inverse_refine, chunk_inverse_vjp,
                                                         chunk_operands, chunk_operands_vjp_kv,
                                                         chunk_operands_vjp_q, vjp_common)
from kernels_pallas.path_attention.prepass.uz import (chunk_operands_vjp_uz, chunk_t_pullback,
                                                      uz_common)

FORMS = ("uz", "split")   # the VJP's form (module docstring)


@dataclasses.dataclass(frozen=True)
class _Cfg:
  scale: float
  dtype: jnp.dtype      # dtype of q^, k^, E
  backend: str
  precision: object     # the operands' products (with hilo: how the halves are formed)
  inv_precision: object  # the inverse and its VJP: float32 accuracy at every input dtype
  hilo: bool            # the operands' products from bf16 hi / lo halves (chunk.Products)
  time_major: bool      # q, k, w (and dq, dk, dw) as [B, Tp, heads, D], read in place
  warps: tuple          # ((kernel name, warps), ...)
  keep_inverse: object  # Y a residual of the VJP: False, True (float32) or "bf16"
  uz: bool              # the VJP form: "uz" (True) or "split"
  de_from_dp: bool = False  # the VJP's E cotangent arrives as the attention backward's float32
                            # dL/dP (P = I - E), which the kernels negate and round to E's
                            # dtype as they read it (transport_pallas_vjp)


def _f32(*refs):
  return tuple(r[...].astype(jnp.float32) for r in refs)


def _loader(ref):
  """A float32 read of ref for the chunk functions to make where they first use it."""
  return lambda: ref[...].astype(jnp.float32)


def _heads(ref):
  return tuple(ref[g].astype(jnp.float32) for g in range(ref.shape[0]))


def _q_heads(ref, cfg):
  """The G query heads of this kv head: ref [G, C, D] (blocked) or [C, G, D] (time-major)."""
  if not cfg.time_major:
    return _heads(ref)
  return tuple(ref[:, g, :].astype(jnp.float32) for g in range(ref.shape[1]))


def _put_q(ref, g, x, cfg):
  if cfg.time_major:
    ref[:, g, :] = x.astype(ref.dtype)
  else:
    ref[g] = x.astype(ref.dtype)


def _putter(dq_ref, outs, cfg):
  """A chunk VJP's put(name, g, x): "dq" of query head g into dq_ref, any other name into its
  ref in `outs`, each in its ref's dtype."""
  def put(name, g, x):
    if name == "dq":
      _put_q(dq_ref, g, x, cfg)
    else:
      outs[name][...] = x.astype(outs[name].dtype)
  return put


def _de_loader(ref, cfg):
  """dL/dE for the chunk functions to read. With cfg.de_from_dp the ref holds dL/dP in float32:
  negated and rounded to E's dtype here, it is bitwise the cotangent an XLA negate-and-convert
  pass over the whole [B, K, n, D, D] array would make, without that pass."""
  if not cfg.de_from_dp:
    return _loader(ref)
  return lambda: (-ref[...]).astype(cfg.dtype).astype(jnp.float32)


def _inv_kernel(w_ref, bc_ref, y_ref, *y16_ref, cfg):
  """y16_ref (keep_inverse "bf16"): Y's bf16 rounding too, the VJP's residual."""
  y = chunk_inverse(*_f32(w_ref, bc_ref), precision=cfg.inv_precision)
  y_ref[...] = y
  if y16_ref:
    y16_ref[0][...] = y.astype(y16_ref[0].dtype)


def _refine_kernel(w_ref, bc_ref, y0_ref, y_ref, *, cfg):
  """Y from the forward's bf16 Y0 (keep_inverse "bf16"): chunk_inverse_refine."""
  y_ref[...] = chunk_inverse_refine(*_f32(w_ref, bc_ref, y0_ref), precision=cfg.inv_precision)


def _inv_bwd_kernel(w_ref, bc_ref, y_ref, dy_ref, dwo_ref, dw_ref, dbc_ref, *, cfg):
  """dwo_ref: the operands VJP's dw (float32); dw_ref receives the whole dw in w's dtype (the
  sum here, not in XLA: one elementwise pass over a float32 [B, T, K, D] fewer)."""
  dw, dbc = chunk_inverse_vjp(*_f32(w_ref, bc_ref, y_ref, dy_ref),
                               precision=cfg.inv_precision)
  dw = dwo_ref[...].astype(jnp.float32) + dw
  dw_ref[...] = dw.astype(dw_ref.dtype)
  dbc_ref[...] = dbc


def _ops_kernel(q_ref, k_ref, w_ref, y_ref, br_ref, qh_ref, kh_ref, e_ref, d_ref, *, cfg):
  """y_ref: Y from _inv_kernel."""
  k, w, y, br = _f32(k_ref, w_ref, y_ref, br_ref)
  refs = (qh_ref, kh_ref, e_ref, d_ref)

  def put(i, g, x):
    if i in (0, 3):
      refs[i][g] = x.astype(refs[i].dtype)
    else:
      refs[i][...] = x.astype(refs[i].dtype)

  chunk_operands(_q_heads(q_ref, cfg), k, w, y, br, scale=cfg.scale, precision=cfg.precision,
                 hilo=cfg.hilo, put=put)


def _ops_bwd_kv_kernel(k_ref, w_ref, y_ref, br_ref, dkh_ref, de_ref, dw_ref, dx_ref, dwk_ref, *,
                       cfg):
  """The first of the "split" form's two operands-VJP kernels: the E and k^ terms."""
  p = Products(cfg.precision, cfg.hilo)
  common = vjp_common(*_f32(k_ref, w_ref, y_ref, br_ref), p)
  dw, dx, dwk = chunk_operands_vjp_kv(common, _loader(dkh_ref), _de_loader(de_ref, cfg), p)
  dw_ref[...] = dw
  dx_ref[...] = dx
  dwk_ref[...] = dwk


def _ops_bwd_q_kernel(q_ref, k_ref, w_ref, y_ref, br_ref, dqh_ref, dkh_ref, dd_ref, dwa_ref,
                      dxa_ref, dwka_ref, dq_ref, dk_ref, dw_ref, dy_ref, dbr_ref, *, cfg):
  """The second: the query heads' terms on top of the first kernel's partials. Each output is
  stored as soon as it is final (put), which keeps its tile from living to the end (fewer
  spills: the resource report's spill stores fell about threefold at head_dim 64)."""
  p = Products(cfg.precision, cfg.hilo)
  common = vjp_common(*_f32(k_ref, w_ref, y_ref, br_ref), p)
  common = (_loader(y_ref),) + common[1:]   # Y read again where dbeta needs it
  put = _putter(dq_ref, dict(dk=dk_ref, dw=dw_ref, dy=dy_ref, dbeta=dbr_ref), cfg)
  chunk_operands_vjp_q(
      common, _q_heads(q_ref, cfg), _heads(dqh_ref), _loader(dkh_ref), _heads(dd_ref),
      tuple(_loader(r) for r in (dwa_ref, dxa_ref, dwka_ref)), scale=cfg.scale, p=p, put=put)


def _ops_bwd_uz_kernel(q_ref, k_ref, w_ref, y_ref, br_ref, bc_ref, dqh_ref, dkh_ref, de_ref,
                       dd_ref, dq_ref, dk_ref, dw_ref, t_ref, dbx_ref, *, cfg):
  """The "uz" VJP's first kernel (chunk_operands_vjp_uz): dq, dk final, dw but for the
  inverse's share, T and X's share of dbeta, each stored as soon as it is final."""
  p = Products(cfg.precision, cfg.hilo)
  common = uz_common(*_f32(k_ref, w_ref, y_ref, br_ref), p)
  put = _putter(dq_ref, dict(dk=dk_ref, dw=dw_ref, t=t_ref, dbeta=dbx_ref), cfg)

  chunk_operands_vjp_uz(common, _q_heads(q_ref, cfg), _heads(dqh_ref), _loader(dkh_ref),
                        _de_loader(de_ref, cfg), _heads(dd_ref), _loader(y_ref),
                        _loader(w_ref), bc_ref[...].astype(jnp.float32), scale=cfg.scale, p=p,
                        put=put)


def _t_pullback_kernel(w_ref, y_ref, bc_ref, br_ref, t_ref, dwp_ref, dbx_ref, dw_ref, dbc_ref, *,
                       cfg):
  """The second: dA's pullback from T (chunk_t_pullback) -> dw in w's dtype, dbeta as a
  column."""
  dw, dbc = chunk_t_pullback(_loader(w_ref), _loader(y_ref), *_f32(bc_ref, br_ref),
                             _loader(t_ref), _loader(dwp_ref), *_f32(dbx_ref),
                             precision=cfg.inv_precision)
  dw_ref[...] = dw.astype(dw_ref.dtype)
  dbc_ref[...] = dbc


def _uz_bwd(cfg, q, k, w, bb, y, cts):
  """The "uz" VJP: (dq, dk, dw, dbeta) from the cotangents of (q^, k^, E, diag) and Y, with
  dw (float32), T and X's share of dbeta through HBM between its two kernels."""
  B, H, K, n, C, D, G = _dims(q, bb)
  grp, one = _specs(G)
  spec_q, spec_1 = _input_specs(cfg, G, C, D)
  sd = jax.ShapeDtypeStruct
  f32 = jnp.float32
  br, bc = bb[..., None, :], bb[..., None]
  kernel = functools.partial(_ops_bwd_uz_kernel, cfg=cfg)
  in_specs = [spec_q, spec_1, spec_1, one(C, C), one(1, C), one(C, 1), grp(C, D), one(C, D),
              one(D, D), grp(C, C)]
  out_shape = [sd(q.shape, q.dtype), sd(k.shape, k.dtype), sd(w.shape, f32),
               sd((B, K, n, C, C), f32), sd((B, K, n, C, 1), f32)]
  out_specs = [spec_q, spec_1, spec_1, one(C, C), one(C, 1)]
  # dL/dP (de_from_dp: float32 [.., D, D]) becomes T in place where D = C: each program reads
  # its own block of it before it stores T there (T depends on dE), and it has no other reader;
  # otherwise dL/dP would stay alive beside T through the kernel (peak memory).
  aliases = {8: 3} if cfg.de_from_dp and cts[2].shape == out_shape[3].shape else None
  dq, dk, dwp, t, dbx = _call(cfg, kernel, (B, K, n), in_specs, out_specs, out_shape, aliases)(
      q, k, w, y, br, bc, *cts)
  kernel = functools.partial(_t_pullback_kernel, cfg=cfg)
  in_specs = [spec_1, one(C, C), one(C, 1), one(1, C), one(C, C), spec_1, one(C, 1)]
  out_shape = [sd(w.shape, w.dtype), sd((B, K, n, C, 1), f32)]
  aliases = {5: 0} if w.dtype == f32 else {}   # the partial dw becomes dw in place
  dw, dbc = _call(cfg, kernel, (B, K, n), in_specs, [spec_1, one(C, 1)], out_shape, aliases)(
      w, y, bc, br, t, dwp, dbx)
  return dq, dk, dw, dbc[..., 0].astype(bb.dtype)


def _specs(G):
  """BlockSpecs of the grid (B, K, n) for blocked [B, heads, n, ...] arrays: `grp` blocks hold
  the G query heads of kv head kh, `one` blocks one kv head."""
  grp = lambda *tail: pl.BlockSpec((None, G, None) + tail, lambda b, kh, c: (b, kh, c, 0, 0))
  one = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda b, kh, c: (b, kh, c, 0, 0))
  return grp, one


def _input_specs(cfg, G, C, D):
  """Specs of q (G heads) and of k, w (one head): blocked, or time-major [B, Tp, heads, D]
  read in place (chunk c of heads kh*G .. kh*G + G - 1)."""
  if not cfg.time_major:
    grp, one = _specs(G)
    return grp(C, D), one(C, D)
  return (pl.BlockSpec((None, C, G, D), lambda b, kh, c: (b, c, kh, 0)),
          pl.BlockSpec((None, C, None, D), lambda b, kh, c: (b, c, kh, 0)))


def _call(cfg, kernel, grid, in_specs, out_specs, out_shape, aliases=None):
  """Every grid axis independent, no pipelining; each kernel's warps from cfg.warps."""
  return launch.call(kernel, grid, in_specs, out_specs, out_shape, backend=cfg.backend,
                     warps=dict(cfg.warps)[kernel.func.__name__], stages=1, aliases=aliases)


def _dims(q, bb):
  """(B, H, K, n, C, D, G) from q (blocked or time-major) and the blocked beta [B, K, n, C]."""
  B, K, n, C = bb.shape
  H = q.shape[1] if q.ndim == 5 else q.shape[2]
  return B, H, K, n, C, q.shape[-1], H // K


def _outs(cfg, B, H, K, n, C, D):
  grp, one = _specs(H // K)
  sd = jax.ShapeDtypeStruct
  shapes = [sd((B, H, n, C, D), cfg.dtype), sd((B, K, n, C, D), cfg.dtype),
            sd((B, K, n, D, D), cfg.dtype), sd((B, H, n, C, C), cfg.dtype)]
  return shapes, [grp(C, D), one(C, D), one(D, D), grp(C, C)]


def _inverse(cfg, w, bc, spec_w, *, rounded: bool = False):
  """-> Y [B, K, n, C, C] float32, or (Y, its bf16 rounding) with rounded."""
  B, K, n, C, _ = bc.shape
  _, one = _specs(1)
  dtypes = (jnp.float32, jnp.bfloat16) if rounded else (jnp.float32,)
  out = _call(cfg, functools.partial(_inv_kernel, cfg=cfg), (B, K, n), [spec_w, one(C, 1)],
              [one(C, C)] * len(dtypes),
              [jax.ShapeDtypeStruct((B, K, n, C, C), d) for d in dtypes])(w, bc)
  return tuple(out) if rounded else out[0]


def _refined_inverse(cfg, w, bc, y0, spec_w):
  """Y [B, K, n, C, C] float32 from the kept bf16 Y0 (_refine_kernel)."""
  B, K, n, C, _ = bc.shape
  _, one = _specs(1)
  return _call(cfg, functools.partial(_refine_kernel, cfg=cfg), (B, K, n),
               [spec_w, one(C, 1), one(C, C)], one(C, C),
               jax.ShapeDtypeStruct((B, K, n, C, C), jnp.float32))(w, bc, y0)


def _fwd(cfg, q, k, w, bb):
  """-> (q^, k^, E, diag), and the VJP's Y: [B, K, n, C, C] float32 (keep_inverse "bf16": its
  bf16 rounding)."""
  B, H, K, n, C, D, G = _dims(q, bb)
  _, one = _specs(G)
  spec_q, spec_1 = _input_specs(cfg, G, C, D)
  bc, br = bb[..., None], bb[..., None, :]   # beta as a column [.., C, 1] and a row [.., 1, C]
  out_shape, out_specs = _outs(cfg, B, H, K, n, C, D)
  if cfg.keep_inverse == "bf16":
    y, kept = _inverse(cfg, w, bc, spec_1, rounded=True)
  else:
    y = kept = _inverse(cfg, w, bc, spec_1)
  kernel = functools.partial(_ops_kernel, cfg=cfg)
  in_specs = [spec_q, spec_1, spec_1, one(*y.shape[-2:]), one(1, C)]
  ops = tuple(_call(cfg, kernel, (B, K, n), in_specs, out_specs, out_shape)(q, k, w, y, br))
  return ops, kept


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _transport(cfg, q, k, w, bb):
  return _fwd(cfg, q, k, w, bb)[0]


def _transport_fwd(cfg, q, k, w, bb):
  ops, y = _fwd(cfg, q, k, w, bb)
  return ops, (q, k, w, bb, y if cfg.keep_inverse else None)


def _transport_bwd(cfg, res, cts):
  q, k, w, bb, y = res
  B, H, K, n, C, D, G = _dims(q, bb)
  grp, one = _specs(G)
  spec_q, spec_1 = _input_specs(cfg, G, C, D)
  bc, br = bb[..., None], bb[..., None, :]
  sd = jax.ShapeDtypeStruct
  f32 = jnp.float32
  if y is None:   # recomputed unless kept (keep_inverse): [C, C] float32 per chunk and kv head
    y = _inverse(cfg, w, bc, spec_1)
  elif y.dtype != jnp.float32:   # its bf16 rounding kept: one Newton step
    y = _refined_inverse(cfg, w, bc, y, spec_1)
  if cfg.uz:
    return _uz_bwd(cfg, q, k, w, bb, y, cts)
  out_shape = [sd(q.shape, q.dtype), sd(k.shape, k.dtype), sd(w.shape, f32),
               sd((B, K, n, C, C), f32), sd((B, K, n, 1, C), f32)]
  out_specs = [spec_q, spec_1, spec_1, one(C, C), one(1, C)]
  dqh, dkh, de, dd = cts
  kernel = functools.partial(_ops_bwd_kv_kernel, cfg=cfg)
  partial = _call(cfg, kernel, (B, K, n), [spec_1, spec_1, one(C, C), one(1, C), one(C, D),
                                            one(D, D)],
                  [one(C, D), one(C, C), one(C, C)],
                  [sd((B, K, n, C, D), f32), sd((B, K, n, C, C), f32),
                   sd((B, K, n, C, C), f32)])(k, w, y, br, dkh, de)
  kernel = functools.partial(_ops_bwd_q_kernel, cfg=cfg)
  in_specs = [spec_q, spec_1, spec_1, one(C, C), one(1, C), grp(C, D), one(C, D), grp(C, C),
              one(C, D), one(C, C), one(C, C)]
  aliases = {8 + i: o for i, o in ((0, 2), (1, 3), (2, 5))  # partial dw, dx, dwk in place
             if o < len(out_shape) and partial[i].shape == out_shape[o].shape
             and out_shape[o].dtype == f32}
  dq, dk, dw, dy, dbr = _call(cfg, kernel, (B, K, n), in_specs, out_specs, out_shape,
                              aliases)(q, k, w, y, br, dqh, dkh, dd, *partial)
  kernel = functools.partial(_inv_bwd_kernel, cfg=cfg)
  dw, dbc = _call(cfg, kernel, (B, K, n), [spec_1, one(C, 1), one(C, C), one(C, C), spec_1],
                  [spec_1, one(C, 1)], [sd(w.shape, w.dtype), sd((B, K, n, C, 1), f32)])(
                      w, bc, y, dy, dw)
  dbeta = (dbc[..., 0] + dbr[..., 0, :]).astype(bb.dtype)
  return dq, dk, dw, dbeta


_transport.defvjp(_transport_fwd, _transport_bwd)


def transport_pallas(q, k, w, bb, *, scale: float, dtype, backend: str, form: str,
                     warps: tuple, keep_inverse: bool | str):
  """The Pallas pre-pass: reference.transport_jnp's arguments, shapes and dtypes (q [B, Tp, H,
  D]; k, w [B, Tp, K, D], time-major, Tp whole chunks; bb [B, K, n, C]) -> (q^, k^, E, diag).

  form: the VJP's form ("uz" or "split", FORMS); warps: ((kernel name, warps), ...);
  keep_inverse: False, True or "bf16" (the plan resolves it: "bf16" only where the inverse's
  products are bf16 halves, whose error the refining step matches). Products keep float32
  accuracy at every input dtype: bf16 hi / lo halves for 16-bit inputs, three-pass TF32 for
  float32 ones on the GPU, HIGHEST on the TPU and in the interpreter (chunk.py).

  On the GPU (and the generic interpreter) the kernels read q, k, w and write their gradients
  in that layout through BlockSpecs, so no blocked copies exist. Mosaic (TPU) wants whole
  (8, 128) tiles in a block's last two dims, which a one-head slice of [.., heads, D] is not:
  there the inputs are blocked first."""
  cfg = _config(q, form=form, scale=scale, dtype=dtype, backend=backend, warps=warps,
                keep_inverse=keep_inverse)
  if not cfg.time_major:
    C = bb.shape[-1]
    q, k, w = (operands.blocked(x, C) for x in (q, k, w))
  return _transport(cfg, q, k, w, bb)


def transport_pallas_vjp(q, k, w, bb, **kwargs):
  """transport_pallas's outputs (same arguments) and their pullback, a pytree (a custom_vjp
  may keep it as a residual): pullback((dq^, dk^, dp, ddiag)) -> (dq, dk, dw, dbb), where dp is
  dL/dP in float32 [B, K, n, D, D], P = I - E, as the attention backward accumulates it. The
  VJP kernels negate it and round it to E's dtype as they read it: no XLA pass over it and no
  rounded copy of it in HBM. Bitwise the gradients of jax.vjp(transport_pallas) at
  dE = (-dp).astype(E.dtype)."""
  cfg = _config(q, **kwargs)
  blocked = not cfg.time_major
  C = bb.shape[-1]
  if blocked:
    q, k, w = (operands.blocked(x, C) for x in (q, k, w))
  ops, res = _transport_fwd(cfg, q, k, w, bb)
  pullback = functools.partial(_pullback_from_dp, dataclasses.replace(cfg, de_from_dp=True),
                               blocked)
  return ops, jax.tree_util.Partial(pullback, res)


def _pullback_from_dp(cfg, blocked, res, cts):
  dq, dk, dw, dbb = _transport_bwd(cfg, res, cts)
  if blocked:   # back to the caller's time-major [B, Tp, heads, D]
    dq, dk, dw = (operands.unchunked(operands.time_major(x)) for x in (dq, dk, dw))
  return dq, dk, dw, dbb


def _config(q, *, form: str, scale: float, dtype, backend: str, warps: tuple,
            keep_inverse: bool | str) -> _Cfg:
  """transport_pallas's keyword arguments -> the kernels' _Cfg (q: the inputs' dtype)."""
  if form not in FORMS:
    raise ValueError(f"form={form!r} must be one of {FORMS}")
  hilo = jnp.dtype(q.dtype).itemsize < 4
  accurate = (launch.bf16x3_precision if hilo else launch.float32_precision)(backend)
  return _Cfg(scale=float(scale), dtype=jnp.dtype(dtype), backend=backend, precision=accurate,
              inv_precision=accurate, hilo=hilo, time_major=backend in ("gpu", "interpret"),
              warps=tuple(warps), keep_inverse=keep_inverse, uz=form == "uz")
