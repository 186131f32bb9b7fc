"""The transport pre-pass as Pallas kernels, one program per (batch, kv head, chunk): forward =
inverse kernel + operands kernel, backward = their VJP kernels. Same operands as
prepass.transport_jnp, its oracle.

Why a kernel: in batched jnp the pre-pass is many small float32 einsums, layout copies and a
batched triangular solve; measured on the H200 at B,T,H,D = 32,2048,32,64 it took 16.5 ms forward
and 41.6 ms for its VJP, against 4.4 ms for the attention kernel itself, and its float32
intermediates set the peak memory. Per chunk it is a handful of C x C and C x D products that stay
on chip: the kernel reads q, k, w, beta once and writes q^, k^, E, diag once.

Kernel split, measured on the H200 (B,T,H,D = 32,2048,32,64 / 8,4096,16,128): "split" variants:
forward = inverse kernel + operands kernel, backward = inverse (recomputed) + operands-VJP
kernel + inverse-VJP kernel. "fold" variants run the inverse inside the operands kernel and the
inverse VJP inside the operands-VJP kernel, so Y, dY and a partial dW never reach HBM: peak
memory of the whole step 4.53 -> 4.28 GiB at the first shape (2.38 -> 2.63 at the second) for
+6% / +3% time (VJP 8.5 -> 10.3 ms: register pressure). Recomputing Y inside the backward
kernel as well was slower still (VJP 13.2 ms).

The chunk math the kernels run (the UT inverse, the operands, their VJPs, and how each
product keeps float32 accuracy) is prepass_chunk.py; which variant runs where (and each
kernel's warps) is prepass_variants.py.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.path_attention import calls
from kernels_pallas.path_attention import prepass
from kernels_pallas.path_attention.prepass_chunk import (Products, chunk_inverse,
                                                         chunk_inverse_refine,
                                                         chunk_inverse_vjp, chunk_operands,
                                                         chunk_operands_vjp,
                                                         chunk_operands_vjp_kv,
                                                         chunk_operands_vjp_q, vjp_common,
                                                         wk_pullback)
from kernels_pallas.path_attention.prepass_uz import (chunk_operands_vjp_uz, chunk_t_pullback,
                                                      uz_common)
from kernels_pallas.path_attention.prepass_variants import VARIANTS, auto_warps, kept_inverse


@dataclasses.dataclass(frozen=True)
class _Cfg:
  scale: float
  dtype: jnp.dtype      # dtype of q^, k^, E
  backend: str
  precision: object
  inv_precision: object  # the inverse and its VJP: float32 accuracy at every input dtype
  odt: object = None    # operand dtype of the non-inverse products (None: float32)
  hilo: bool = False    # the non-inverse products from bf16 hi / lo halves (Products)
  fold: bool = False    # forward: inverse inside the operands kernel (no Y in HBM); backward:
                        # inverse VJP inside the operands-VJP kernel (no dY or second dW in
                        # HBM; Y is still recomputed by its own kernel)
  time_major: bool = False  # q, k, w (and dq, dk, dw) as [B, Tp, heads, D], read in place
  num_warps: object = 4  # every pre-pass kernel's warps, or a tuple of (kernel name, warps)
  vjp2: bool = False    # the operands VJP as two kernels (chunk_operands_vjp_kv, then _q), its
                        # partial dw, dx, dwk through HBM: fewer live tiles per program
  keep_inverse: object = False  # split variants: Y is a residual of the VJP (True: a [C, C]
                                # float32 per chunk and kv head; "bf16": its bf16 rounding, which
                                # the backward refines by one Newton step) instead of
                                # recomputed in the backward
  late_wk: bool = False  # vjp2: WK's pullback (two products) in the inverse-VJP kernel, not in
                         # the q part's: its dwk and dk reach it through HBM (float32)
  uz: bool = False      # the VJP from dU, dZ (prepass_uz.py) as two kernels, _ops_bwd_uz_kernel
                        # then _t_pullback_kernel
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
  negated and rounded to E's dtype here, it is bitwise the cotangent that an XLA
  negate-and-convert pass over the whole [B, K, n, D, D] array used to make (0.38 ms at
  32,4096,32,64 on the H200)."""
  if not cfg.de_from_dp:
    return _loader(ref)
  return lambda: (-ref[...]).astype(cfg.dtype).astype(jnp.float32)


def _cts(dqh_ref, dkh_ref, de_ref, dd_ref, cfg):
  return (_heads(dqh_ref),) + _f32(dkh_ref) + (_de_loader(de_ref, cfg)(), _heads(dd_ref))


def _inv_kernel(w_ref, bc_ref, y_ref, *y16_ref, cfg):
  """y16_ref (keep_inverse "bf16"): Y's bf16 rounding too, the VJP's residual."""
  y = chunk_inverse(*_f32(w_ref, bc_ref), precision=cfg.inv_precision)
  y_ref[...] = y
  if y16_ref:
    y16_ref[0][...] = y.astype(y16_ref[0].dtype)


def _refine_kernel(w_ref, bc_ref, y0_ref, y_ref, *, cfg):
  """Y from the forward's bf16 Y0 (keep_inverse "bf16"): chunk_inverse_refine."""
  y_ref[...] = chunk_inverse_refine(*_f32(w_ref, bc_ref, y0_ref), precision=cfg.inv_precision)


def _inv_bwd_kernel(w_ref, bc_ref, y_ref, dy_ref, dwo_ref, *refs, cfg):
  """dwo_ref: the operands VJP's dw (float32); dw_ref receives the whole dw in w's dtype (the
  sum here, not in XLA: one elementwise pass over a float32 [B, T, K, D] fewer). late_wk: refs
  start with k, the q part's dwk and dk (float32), and end with dk_ref, which receives dk
  with WK's pullback added."""
  dw_ref, dbc_ref = refs[-3:-1] if cfg.late_wk else refs
  dw_wk = None
  if cfg.late_wk:   # first: its operands die before the inverse VJP's (fewer spills)
    k_ref, dwk_ref, dkp_ref, dk_ref = refs[:3] + refs[-1:]
    p = Products(cfg.precision, cfg.odt, cfg.hilo)
    k, w = _f32(k_ref, w_ref)
    dw_wk, dk_wk = wk_pullback(dwk_ref[...], p.hi(k), p.acc(w), p)
    dk_ref[...] = (dkp_ref[...] + dk_wk).astype(dk_ref.dtype)
  dw, dbc = chunk_inverse_vjp(*_f32(w_ref, bc_ref, y_ref, dy_ref),
                               precision=cfg.inv_precision)
  dw = dwo_ref[...].astype(jnp.float32) + dw
  dw_ref[...] = (dw if dw_wk is None else dw + dw_wk).astype(dw_ref.dtype)
  dbc_ref[...] = dbc


def _ops_kernel(q_ref, k_ref, w_ref, y_ref, br_ref, qh_ref, kh_ref, e_ref, d_ref, *, cfg):
  """y_ref: Y from _inv_kernel, or (fold) beta as a column and Y computed here."""
  k, w, y, br = _f32(k_ref, w_ref, y_ref, br_ref)
  if cfg.fold:
    y = chunk_inverse(w, y, precision=cfg.inv_precision)
  refs = (qh_ref, kh_ref, e_ref, d_ref)

  def put(i, g, x):
    if i in (0, 3):
      refs[i][g] = x.astype(refs[i].dtype)
    else:
      refs[i][...] = x.astype(refs[i].dtype)

  chunk_operands(_q_heads(q_ref, cfg), k, w, y, br, scale=cfg.scale, precision=cfg.precision,
                 odt=cfg.odt, hilo=cfg.hilo, put=put)


def _ops_bwd_kernel(q_ref, k_ref, w_ref, y_ref, br_ref, bc_ref, dqh_ref, dkh_ref, de_ref, dd_ref,
                    dq_ref, dk_ref, dw_ref, dy_ref, dbr_ref, *, cfg):
  """fold: dy_ref receives dbeta as a column (the inverse VJP runs here); else dY."""
  k, w, y = _f32(k_ref, w_ref, y_ref)
  dqs, dk, dw, dy, dbr = chunk_operands_vjp(
      _q_heads(q_ref, cfg), k, w, y, *_f32(br_ref), _cts(dqh_ref, dkh_ref, de_ref, dd_ref, cfg),
      scale=cfg.scale, precision=cfg.precision, odt=cfg.odt, hilo=cfg.hilo)
  if cfg.fold:
    dw2, dy = chunk_inverse_vjp(w, *_f32(bc_ref), y, dy, precision=cfg.inv_precision)
    dw = dw + dw2
  for g in range(len(dqs)):   # dq (G heads), dk, dw in their refs' dtypes, dy, dbeta_r
    _put_q(dq_ref, g, dqs[g], cfg)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dw_ref[...] = dw.astype(dw_ref.dtype)
  dy_ref[...] = dy
  dbr_ref[...] = dbr


def _ops_bwd_kv_kernel(k_ref, w_ref, y_ref, br_ref, dkh_ref, de_ref, dw_ref, dx_ref, dwk_ref, *,
                       cfg):
  """The first of the two operands-VJP kernels ("split2_*"): the E and k^ terms."""
  p = Products(cfg.precision, cfg.odt, cfg.hilo)
  common = vjp_common(*_f32(k_ref, w_ref, y_ref, br_ref), p)
  dw, dx, dwk = chunk_operands_vjp_kv(common, _loader(dkh_ref), _de_loader(de_ref, cfg), p)
  dw_ref[...] = dw
  dx_ref[...] = dx
  dwk_ref[...] = dwk


def _ops_bwd_q_kernel(q_ref, k_ref, w_ref, y_ref, br_ref, dqh_ref, dkh_ref, dd_ref, dwa_ref,
                      dxa_ref, dwka_ref, dq_ref, dk_ref, dw_ref, dy_ref, dbr_ref, *dwk_ref, cfg):
  """The second: the query heads' terms on top of the first kernel's partials (late_wk: dk, dw
  without WK's pullback, and dwk_ref receives dwk for _inv_bwd_kernel). Each output is stored
  as soon as it is final (put): with the terms' order in chunk_operands_vjp_q, 356 instead of
  1,048 B of spill stores a thread at head_dim 64 (4 warps) and 332 instead of 724 at 128 (8
  warps; resource report, 2,2048,2,2,D); that order storing everything at the end: 816 and
  564. H200 at 32,2048,32,64: 4.25 -> 3.33 ms (traces of two calls), fwd+bwd 27.87 -> 26.94
  against the old kernel in one call."""
  p = Products(cfg.precision, cfg.odt, cfg.hilo)
  common = vjp_common(*_f32(k_ref, w_ref, y_ref, br_ref), p)
  common = (_loader(y_ref),) + common[1:]   # Y read again where dbeta needs it
  put = _putter(dq_ref, dict(dk=dk_ref, dw=dw_ref, dy=dy_ref, dbeta=dbr_ref), cfg)

  grads = chunk_operands_vjp_q(
      common, _q_heads(q_ref, cfg), _heads(dqh_ref), _loader(dkh_ref), _heads(dd_ref),
      tuple(_loader(r) for r in (dwa_ref, dxa_ref, dwka_ref)), scale=cfg.scale, p=p, put=put,
      late_wk=cfg.late_wk)
  if cfg.late_wk:
    dwk_ref[0][...] = grads[-1]


def _ops_bwd_uz_kernel(q_ref, k_ref, w_ref, y_ref, br_ref, bc_ref, dqh_ref, dkh_ref, de_ref,
                       dd_ref, dq_ref, dk_ref, dw_ref, t_ref, dbx_ref, *, cfg):
  """The "uz_*" VJP's first kernel (chunk_operands_vjp_uz): dq, dk final, dw but for the
  inverse's share, T and X's share of dbeta, each stored as soon as it is final."""
  p = Products(cfg.precision, cfg.odt, cfg.hilo)
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
  """The "uz_*" VJP: (dq, dk, dw, dbeta) from the cotangents of (q^, k^, E, diag) and Y, with
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
  # its own block of it before it stores T there (T depends on dE), and it has no other reader.
  # Peak memory: without this, dL/dP stays alive beside T through the kernel (+0.11 GiB at
  # 32,4096,32,64 on the H200 against the rounded copy it replaced).
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
  kwargs = {"input_output_aliases": aliases} if aliases else {}
  warps = cfg.num_warps
  if not isinstance(warps, int):
    warps = dict(warps)[kernel.func.__name__]
  params = calls.prepass_compiler_params(cfg.backend, len(grid), warps)
  if params is not None:
    kwargs["compiler_params"] = params
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=calls._interpret(cfg.backend), **kwargs)


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
  bf16 rounding); None with fold."""
  B, H, K, n, C, D, G = _dims(q, bb)
  _, one = _specs(G)
  spec_q, spec_1 = _input_specs(cfg, G, C, D)
  bc, br = bb[..., None], bb[..., None, :]   # beta as a column [.., C, 1] and a row [.., 1, C]
  out_shape, out_specs = _outs(cfg, B, H, K, n, C, D)
  if cfg.fold:   # Y formed inside the operands kernel, from beta as a column
    y, kept = bc, None
  elif cfg.keep_inverse == "bf16":
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
  in_specs = [spec_q, spec_1, spec_1, one(C, C), one(1, C), one(C, 1),
              grp(C, D), one(C, D), one(D, D), grp(C, C)]   # inputs, then cotangents
  dy_shape = (B, K, n, C, 1) if cfg.fold else (B, K, n, C, C)   # fold: dbeta as a column
  late = cfg.late_wk   # (split2 only) dk and dwk float32 to the inverse-VJP kernel
  out_shape = [sd(q.shape, q.dtype), sd(k.shape, f32 if late else k.dtype),
               sd(w.shape, w.dtype if cfg.fold else f32), sd(dy_shape, f32),
               sd((B, K, n, 1, C), f32)]
  out_specs = [spec_q, spec_1, spec_1, one(*dy_shape[-2:]), one(1, C)]
  if cfg.vjp2:
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
    if late:
      out_shape.append(partial[2])
      out_specs.append(one(C, C))
    aliases = {8 + i: o for i, o in ((0, 2), (1, 3), (2, 5))  # partial dw, dx, dwk in place
               if o < len(out_shape) and partial[i].shape == out_shape[o].shape
               and out_shape[o].dtype == f32}
    dq, dk, dw, dy, dbr, *dwk = _call(cfg, kernel, (B, K, n), in_specs, out_specs, out_shape,
                                      aliases)(q, k, w, y, br, dqh, dkh, dd, *partial)
  else:
    kernel = functools.partial(_ops_bwd_kernel, cfg=cfg)
    dq, dk, dw, dy, dbr = _call(cfg, kernel, (B, K, n), in_specs, out_specs, out_shape)(
        q, k, w, y, br, bc, *cts)
  if cfg.fold:
    dbc = dy
  else:
    kernel = functools.partial(_inv_bwd_kernel, cfg=cfg)
    args, specs = [w, bc, y, dy, dw], [spec_1, one(C, 1), one(C, C), one(C, C), spec_1]
    out_shape, out_specs = [sd(w.shape, w.dtype), sd((B, K, n, C, 1), f32)], [spec_1, one(C, 1)]
    if late:
      args, specs = args + [k, dwk[0], dk], specs + [spec_1, one(C, C), spec_1]
      out_shape, out_specs = out_shape + [sd(k.shape, k.dtype)], out_specs + [spec_1]
    dw, dbc, *dk_late = _call(cfg, kernel, (B, K, n), specs, out_specs, out_shape)(*args)
    dk = dk_late[0] if late else dk
  dbeta = (dbc[..., 0] + dbr[..., 0, :]).astype(bb.dtype)
  return dq, dk, dw, dbeta


_transport.defvjp(_transport_fwd, _transport_bwd)


def transport_pallas(q, k, w, bb, *, scale: float, dtype, backend: str, precision=None,
                     variant: str = "split", num_warps: int | None = 4,
                     keep_inverse: bool | str = "bf16", late_wk: bool = False):
  """Drop-in for prepass.transport_jnp (same arguments, shapes and dtypes) as Pallas kernels on
  `backend`: q [B, Tp, H, D]; k, w [B, Tp, K, D] (time-major, Tp whole chunks); bb [B, K, n, C].

  On the GPU (and the generic interpreter) the kernels read q, k, w and write their gradients in
  that layout through BlockSpecs, so no blocked copies exist (they were the pre-pass VJP's
  residuals: 4 [B, T, H, D]-sized arrays alive through the whole backward). Mosaic (TPU) wants
  whole (8, 128) tiles in a block's last two dims, which a one-head slice of [.., heads, D] is
  not: there the inputs are blocked first.

  precision None: float32-accurate (calls.float32_precision) for every variant; "*_bf16" give
  the non-inverse products bf16 operands for bf16 inputs (float32 q keeps float32): faster, but
  not accurate enough once the w of a chunk share a direction (module docstring: Precision).
  "split" / "fold": the inverse in its own kernel or inside the operands kernel (module
  docstring: kernel split). "split_bf16x3": every product as three bf16 passes
  (calls.bf16x3_precision) instead of three TF32 ones. As accurate on the correlated-w cases:
  in the interpreter's emulation dw 4.3e-3 against 4.4e-3 at eps = 0.01, and on the H100 the
  GPU correlated tests pass (G = 2, D = 64). "split_hilo" (BlockSizes' default): the same
  halves formed once per operand, and one half for the bf16-exact operands (Products); its
  correlated rows at T = 2048 on the H100 equal split_bf16x3's to two digits. Case 5 of
  path_kernel.py (16, 2048, 12, 64, bf16, H100, 2026-11-24), forward+backward: split_hilo 8.78
  ms, split_bf16x3 11.71-11.88, three-pass TF32 20.71, bf16 operands 7.73; the pre-pass VJP
  3.22 / 6.12-6.35 / 13.55 / 2.32 ms.

  "split2_*": the operands VJP as two kernels, the E and k^ terms (chunk_operands_vjp_kv), then
  each query head's terms (chunk_operands_vjp_q), with float32 partial dw, dx, dwk through HBM,
  so that fewer tiles are live per program; it builds at head_dim 128, where the one-kernel
  VJP does not, and is faster at 64 too, for more memory (RESULTS.md round 10).
  Resource report (bf16, G 1, D 128, 4 warps; shared KiB / spill loads per thread): one kernel
  208 / 12,456 (split_hilo) and 160 / 11,296 (split_bf16x3); two kernels 160 + 122 / 2,940 +
  4,148 (split2_hilo) and 80 + 96 / 3,596 + 5,460 (split2_bf16x3). At D = 64: 120 / 2,748
  against 80 + 82 / 276 + 2,180 (hilo). Those were before the chunk functions were ordered for
  few live tiles (2026-11-25) and the q part stored its outputs as formed (2026-11-26):
  split2_hilo's two VJP kernels now report 96 + 144 / 2,680 + 364 at D = 128 (4 + 8 warps,
  auto_warps) and 56 + 88 / 216 + 380 at D = 64; the operands kernel 812 (D 128, 8 warps)
  and 36 (D 64). num_warps sets the pre-pass kernels' warps; None: each
  kernel's own, by head_dim (auto_warps). keep_inverse: the split variants keep Y from the
  forward for the VJP (one inverse kernel less there, for a [C, C] float32 residual per chunk
  and kv head); "bf16" keeps its bf16 rounding (half the residual) and the VJP restores float32
  accuracy by one Newton step, a 7-pass kernel in place of the inverse's 33
  (prepass_chunk.chunk_inverse_refine), where the inverse's products are bf16 halves (16-bit
  inputs on the GPU: the step is as accurate as they are); finer products (float32 inputs,
  the TPU) recompute Y (kept_inverse). The fold variants form Y inside their kernels and ignore it.
  late_wk ("split2_*" only): the pullback of WK = strictLower(W K^T) (two products) runs in
  the inverse-VJP kernel, not the q part's, which spills its tiles to DRAM (NOTES_kernel round
  22); dwk and a float32 dk go through HBM between them.

  Measured in the interpreter with w_t = normalize(a + eps n_t), beta = 2 (C = D = 64, T = 256,
  bf16 q, k, v, relative RMS against the float32 oracle): float32-accurate products 3-4e-3 in
  every gradient, the floor set by the bf16 outputs; bf16 operands 1.1-1.5e-2 (dw, dbeta); TF32
  products (emulated: truncated to 10 mantissa bits) 5e-2 to 9e-2 (dw, dbeta at eps = 0.01 and
  for antiparallel neighbours).
  """
  cfg = _config(q, variant=variant, scale=scale, dtype=dtype, backend=backend,
                precision=precision, num_warps=num_warps, keep_inverse=keep_inverse,
                late_wk=late_wk)
  if not cfg.time_major:
    C = bb.shape[-1]
    q, k, w = (prepass.blocked(x, C) for x in (q, k, w))
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
    q, k, w = (prepass.blocked(x, C) for x in (q, k, w))
  ops, res = _transport_fwd(cfg, q, k, w, bb)
  pullback = functools.partial(_pullback_from_dp, dataclasses.replace(cfg, de_from_dp=True),
                               blocked)
  return ops, jax.tree_util.Partial(pullback, res)


def _pullback_from_dp(cfg, blocked, res, cts):
  dq, dk, dw, dbb = _transport_bwd(cfg, res, cts)
  if blocked:   # back to the caller's time-major [B, Tp, heads, D]
    dq, dk, dw = (prepass.unchunked(prepass.time_major(x)) for x in (dq, dk, dw))
  return dq, dk, dw, dbb


def _config(q, *, variant: str = "split", scale: float, dtype, backend: str, precision=None,
            num_warps: int | None = 4, keep_inverse: bool | str = "bf16",
            late_wk: bool = False) -> _Cfg:
  """transport_pallas's keyword arguments -> the kernels' _Cfg (q: the inputs' dtype and
  head_dim)."""
  if variant not in VARIANTS:
    raise ValueError(f"variant={variant!r} must be one of {VARIANTS}")
  f32_inputs = jnp.dtype(q.dtype) == jnp.float32
  hilo = variant.endswith("_hilo") and not f32_inputs
  accurate = (calls.bf16x3_precision if variant.endswith("_bf16x3") or hilo
              else calls.float32_precision)(backend)
  if precision is None:
    precision = accurate
  odt = jnp.bfloat16 if variant.endswith("_bf16") and not f32_inputs else None
  return _Cfg(scale=float(scale), dtype=jnp.dtype(dtype), backend=backend, precision=precision,
              inv_precision=accurate, odt=odt, hilo=hilo, fold=variant.startswith("fold"),
              time_major=backend in ("gpu", "interpret"), vjp2=variant.startswith("split2"),
              num_warps=auto_warps(q.shape[-1]) if num_warps is None else num_warps,
              keep_inverse=kept_inverse(keep_inverse, accurate),
              late_wk=late_wk and variant.startswith("split2"),
              uz=variant.startswith("uz"))
