"""stick_breaking_attention: the public function, its custom VJP and the three launches.

Time is padded to whole tiles at the end and the head dims to powers of two >= 16 (zeros change
no product; a padded key is later than every real query, so it breaks no real stick). The
custom_vjp core sees the padded operands and returns (acc, stick); the remainder, the leftover
stick's share of the query's own value, is added outside it, so autodiff of the pads, slices
and remainder carries the cotangents back: dacc = dO, and dstick from the remainder.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.common import launch
from kernels_pallas.common.launch import f32_shape, pad_axis
from kernels_pallas.stick_breaking_attention import kernels

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64
WARPS = 4
STAGES = 2
REMAINDERS = ("current", "none")


def stick_breaking_attention(q, k, v, *, segment_ids=None, scale=None,
                             attend_current: bool = False, remainder: str = "current",
                             block_q=None, block_k=None, interpret: bool = False):
  """Causal stick-breaking attention (docs/encodings/stick_breaking.md) -> o [B, T, H, Dv] in
  v's dtype: o_i = sum_j A_ij v_j (+ r_i v_i with remainder "current", r_i the stick left).

  A_ij = sigmoid(z_ij) prod_{j < l < i} (1 - sigmoid(z_il)), z = scale q_i . k_j (scale None:
  1/sqrt(D)), over keys j < i (j <= i with attend_current) of the same document. q [B, T, H, D];
  k [B, T, K, D]; v [B, T, K, Dv] (query head h reads kv head h // (H // K)); segment_ids [B, T]
  int or None. Products read q and k in k's dtype and accumulate in float32. Differentiable in
  q, k and v. interpret=True runs the Pallas interpreter (CPU); otherwise Triton (GPU).
  """
  B, T, H, K, D = launch.check_self_attention("stick_breaking_attention", q, k, v)
  if remainder not in REMAINDERS:
    raise ValueError(f"stick_breaking_attention: remainder={remainder!r} must be one of "
                     f"{REMAINDERS}")
  launch.check_shapes("stick_breaking_attention", ("segment_ids", segment_ids, (B, T)))
  bq = launch.tile(block_q, DEFAULT_BLOCK_Q, T, "stick_breaking_attention: block_q")
  bk = launch.tile(block_k, DEFAULT_BLOCK_K, T, "stick_breaking_attention: block_k")
  Tp = -(-T // max(bq, bk)) * max(bq, bk)
  dtype = k.dtype
  Dv = v.shape[3]
  pad = lambda x, width: pad_axis(pad_axis(x, 1, Tp), 3, width)  # noqa: E731
  qp, kp = pad(q.astype(dtype), launch.pow2(D, 16)), pad(k, launch.pow2(D, 16))
  vp = pad(v.astype(dtype), launch.pow2(Dv, 16))
  seg = None if segment_ids is None else pad_axis(segment_ids.astype(jnp.int32), 1, Tp, value=-1)
  backend = "interpret" if interpret else "gpu"
  f32 = launch.float32_precision(backend)
  precision = f32 if jnp.dtype(dtype).itemsize == 4 else None
  st = kernels.Static(scale=float(D ** -0.5 if scale is None else scale),
                      attend_current=bool(attend_current), block_q=bq, block_k=bk,
                      precision=precision, v_precision=precision, sum_precision=f32,
                      fast=backend == "gpu")
  acc, stick = _attention_once((st, backend), qp, kp, vp, seg)
  o = acc[:, :T, :, :Dv]
  if remainder == "current":
    left = jnp.exp(stick[:, :T])[..., None]                       # [B, T, H, 1]
    o = o + left * jnp.repeat(v, H // K, axis=2).astype(jnp.float32)
  return o.astype(v.dtype)


def _call(backend, kernel, grid, operands, outs, st):
  return launch.call_present(functools.partial(kernel, st=st), grid, operands, outs,
                             backend=backend, warps=WARPS, stages=STAGES)


def _query_major(st, q, k, v, seg):
  """Specs of a launch with one program per (query tile, head, batch) reading every key."""
  T, G = q.shape[1], q.shape[2] // k.shape[2]
  bq = st.block_q
  tile = lambda d: pl.BlockSpec((None, bq, None, d), lambda i, h, b: (b, i, h, 0))  # noqa: E731
  keys = lambda d: pl.BlockSpec((None, T, None, d), lambda i, h, b: (b, 0, h // G, 0))  # noqa
  rows = pl.BlockSpec((None, bq, None), lambda i, h, b: (b, i, h))
  return dict(
      tile=tile, rows=rows,
      inputs=[(q, tile(q.shape[-1])), (k, keys(k.shape[-1])), (v, keys(v.shape[-1])),
              (seg, pl.BlockSpec((None, bq), lambda i, h, b: (b, i))),
              (seg, pl.BlockSpec((None, T), lambda i, h, b: (b, 0)))])


def _forward(cfg, q, k, v, seg):
  st, backend = cfg
  B, T, H, _ = q.shape
  m = _query_major(st, q, k, v, seg)
  outs = [(f32_shape(B, T, H, v.shape[-1]), m["tile"](v.shape[-1])),
          (f32_shape(B, T, H), m["rows"])]
  return _call(backend, kernels.forward_kernel, (T // st.block_q, H, B), m["inputs"], outs, st)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, seg):
  return tuple(_forward(cfg, q, k, v, seg))


def _attention_fwd(cfg, q, k, v, seg):
  acc, stick = _forward(cfg, q, k, v, seg)
  return (acc, stick), (q, k, v, seg, acc)


def _attention_bwd(cfg, res, cotangents):
  st, backend = cfg
  q, k, v, seg, acc = res
  dacc, dstick = cotangents
  B, T, H, _ = q.shape
  K = k.shape[2]
  G = H // K
  do = dacc.astype(v.dtype)
  # sum_j g_ij, from the same rounded operands as the kernels' g (do in v's dtype, and acc
  # made from A in v's dtype): `before` in the kernels is a difference of the two, so a
  # mismatch would shift every logit's cotangent in the row
  delta = jnp.sum(do.astype(jnp.float32) * acc, axis=-1)
  nk = launch.pow2(T // st.block_k)                     # key tiles, a power of two for Triton

  # dq, and the carries at every key tile: one program per (query tile, head, batch)
  m = _query_major(st, q, k, v, seg)
  carries = pl.BlockSpec((None, st.block_q, None, nk), lambda i, h, b: (b, i, h, 0))
  inputs = m["inputs"] + [(do, m["tile"](do.shape[-1])), (delta, m["rows"]),
                          (dstick, m["rows"])]
  outs = [(f32_shape(*q.shape), m["tile"](q.shape[-1])),
          (f32_shape(B, T, H, nk), carries), (f32_shape(B, T, H, nk), carries)]
  dq, c1, cg = _call(backend, kernels.dq_kernel, (T // st.block_q, H, B), inputs, outs, st)

  # dk, dv: one program per (key tile, kv head, batch); the group's query heads whole in time
  bk = st.block_k
  group = lambda d: pl.BlockSpec((None, T, G, d), lambda j, h, b: (b, 0, h, 0))  # noqa: E731
  ktile = lambda d: pl.BlockSpec((None, bk, None, d), lambda j, h, b: (b, j, h, 0))  # noqa
  group_rows = pl.BlockSpec((None, T, G), lambda j, h, b: (b, 0, h))
  inputs = [(q, group(q.shape[-1])), (k, ktile(k.shape[-1])), (v, ktile(v.shape[-1])),
            (seg, pl.BlockSpec((None, T), lambda j, h, b: (b, 0))),
            (seg, pl.BlockSpec((None, bk), lambda j, h, b: (b, j))),
            (do, group(do.shape[-1])), (delta, group_rows), (dstick, group_rows),
            (c1, group(nk)), (cg, group(nk))]
  outs = [(f32_shape(*k.shape), ktile(k.shape[-1])), (f32_shape(*v.shape), ktile(v.shape[-1]))]
  dk, dv = _call(backend, kernels.dkv_kernel, (T // bk, K, B), inputs, outs, st)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)
# Called through jit keyed by the static config, so a model's layers share one traced and
# lowered copy of the kernels (see kernels_pallas/path_attention/api.py's _attend_once).
_attention_once = jax.jit(_attention, static_argnums=0)
