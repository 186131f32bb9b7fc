"""grape_ap_attention: the public function, its custom VJP and the three launches.

The caller passes the key-side probes already rotated (r_l = R_l p_l, at within-document
positions: posenc_jax.path_integral.rotate_probes), and the wrapper broadcasts alpha to
per-row values in jnp, outside the kernels: autodiff of those steps carries the kernels' d r
and per-row d alpha back to p and alpha. Time is padded to whole tiles at the
end and the channel widths to powers of two >= 16 (zeros change no product). The custom_vjp
core sees the padded operands, so autodiff of the pads and slices carries the cotangents back
to the caller's shapes and dtypes.

Memory: besides o and lse the forward keeps C, and the dq launch writes Pre, each NK x T
float32 per head (NK: the key-tile count, padded to a power of two), stored [B, NK, T, H].
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.grape_ap_attention import kernels
from kernels_pallas.common import launch
from kernels_pallas.common.launch import f32_shape, pad_axis

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64
WARPS = 4
STAGES = 2


def grape_ap_attention(q, k, v, pq, r, alpha, *, scale: float, segment_ids=None,
                       block_q=None, block_k=None, interpret: bool = False):
  """Causal GRAPE-AP attention (docs/encodings/additive.md#grape_ap) -> o [B, T, H, Dv] in
  v's dtype.

  s_ij = scale q_i.k_j + sum_{l in (j, i]} alpha_h log_sigmoid(<pq_i, r_l> / P), with pq the
  query-side probes and r_l = R_l p_l the key-side probes rotated by their position inside the
  document. q [B, T, H, D]; k [B, T, K, D]; v [B, T, K, Dv] (query head h reads kv head
  h // (H // K)); pq, r [B, T, H, P]; alpha [H]; segment_ids [B, T] int or None. Products with
  q, k, v read k's dtype and accumulate in float32; the probes and the bias are float32.
  Differentiable in q, k, v, pq, r and alpha. interpret=True runs the Pallas interpreter
  (CPU); otherwise the Triton kernels (GPU).
  """
  B, T, H, K, D = launch.check_self_attention("grape_ap_attention", q, k, v)
  if pq.ndim != 4 or pq.shape[:3] != (B, T, H):
    raise ValueError(f"grape_ap_attention: pq {pq.shape} must be [B, T, H, P] with q's B, T "
                     "and H")
  if r.shape != pq.shape:
    raise ValueError(f"grape_ap_attention: r {r.shape} must have pq's shape {pq.shape}")
  launch.check_shapes("grape_ap_attention", ("alpha", jnp.asarray(alpha), (H,)),
                      ("segment_ids", segment_ids, (B, T)))
  bq = launch.tile(block_q, DEFAULT_BLOCK_Q, T, "grape_ap_attention: block_q")
  bk = launch.tile(block_k, DEFAULT_BLOCK_K, T, "grape_ap_attention: block_k")
  Tp = -(-T // max(bq, bk)) * max(bq, bk)
  P = pq.shape[3]
  dtype = k.dtype
  pad = lambda x: pad_axis(pad_axis(x, 1, Tp), 3, launch.pow2(x.shape[3], 16))  # noqa: E731
  pq, r = pq.astype(jnp.float32), r.astype(jnp.float32)
  al = jnp.broadcast_to(jnp.asarray(alpha, jnp.float32)[None, None, :], (B, Tp, H))
  Dv = v.shape[3]
  seg = None if segment_ids is None else pad_axis(segment_ids.astype(jnp.int32), 1, Tp, value=-1)
  backend = "interpret" if interpret else "gpu"
  f32 = launch.float32_precision(backend)
  st = kernels.Static(scale=float(scale), probe_dim=int(P), block_q=bq, block_k=bk,
                      precision=f32 if jnp.dtype(dtype).itemsize == 4 else None,
                      f32_precision=f32, fast=backend == "gpu",
                      passes=3 if jnp.dtype(dtype).itemsize == 4 else 2)
  o = _attention_once((st, backend), pad(q.astype(dtype)), pad(k), pad(v.astype(dtype)),
                      pad(pq), pad(r), al, seg)
  return o[:, :T, :, :Dv].astype(v.dtype)


def _call(backend, kernel, grid, operands, outs, st):
  return launch.call_present(functools.partial(kernel, st=st), grid, operands, outs,
                             backend=backend, warps=WARPS, stages=STAGES)


def _key_tiles(st, T: int) -> int:
  return launch.pow2(T // st.block_k, 16)


def _query_major(st, q, k, v, pq, r, al, seg):
  """Specs of a launch with one program per (query tile, head, batch) reading every key."""
  T, G = q.shape[1], q.shape[2] // k.shape[2]
  bq = st.block_q
  tile = lambda d: pl.BlockSpec((None, bq, None, d), lambda i, h, b: (b, i, h, 0))  # noqa: E731
  kv = lambda d: pl.BlockSpec((None, T, None, d), lambda i, h, b: (b, 0, h // G, 0))  # noqa
  rows = pl.BlockSpec((None, bq, None), lambda i, h, b: (b, i, h))
  nk = _key_tiles(st, T)
  columns = pl.BlockSpec((None, nk, bq, None), lambda i, h, b: (b, 0, i, h))
  return dict(
      tile=tile, rows=rows, columns=columns,
      inputs=[(q, tile(q.shape[3])), (k, kv(k.shape[3])), (v, kv(v.shape[3])),
              (pq, tile(pq.shape[3])),
              (r, pl.BlockSpec((None, T, None, r.shape[3]), lambda i, h, b: (b, 0, h, 0))),
              (al, rows),
              (seg, pl.BlockSpec((None, bq), lambda i, h, b: (b, i))),
              (seg, pl.BlockSpec((None, T), lambda i, h, b: (b, 0)))])


def _forward(cfg, q, k, v, pq, r, al, seg):
  st, backend = cfg
  B, T, H, _ = q.shape
  nk = _key_tiles(st, T)
  m = _query_major(st, q, k, v, pq, r, al, seg)
  outs = [(f32_shape(B, T, H, v.shape[-1]), m["tile"](v.shape[-1])),
          (f32_shape(B, T, H), m["rows"]),
          (f32_shape(B, nk, T, H), m["columns"])]
  return _call(backend, kernels.forward_kernel, (T // st.block_q, H, B), m["inputs"], outs, st)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, pq, r, al, seg):
  return _forward(cfg, q, k, v, pq, r, al, seg)[0]


def _attention_fwd(cfg, q, k, v, pq, r, al, seg):
  o, lse, c = _forward(cfg, q, k, v, pq, r, al, seg)
  return o, (q, k, v, pq, r, al, seg, o, lse, c)


def _attention_bwd(cfg, res, do):
  st, backend = cfg
  q, k, v, pq, r, al, seg, o, lse, c = res
  B, T, H, _ = q.shape
  K = k.shape[2]
  G = H // K
  nk = c.shape[1]
  delta = jnp.sum(do * o, axis=-1)
  do = do.astype(v.dtype)

  # dq, d pq, d alpha rows and Pre: one program per (query tile, head, batch)
  m = _query_major(st, q, k, v, pq, r, al, seg)
  inputs = m["inputs"] + [(do, m["tile"](do.shape[3])), (lse, m["rows"]), (delta, m["rows"]),
                          (c, m["columns"])]
  outs = [(f32_shape(*q.shape), m["tile"](q.shape[3])),
          (f32_shape(*pq.shape), m["tile"](pq.shape[3])),
          (f32_shape(B, T, H), m["rows"]), (f32_shape(B, nk, T, H), m["columns"])]
  dq, dpq, dal, pre = _call(backend, kernels.dq_kernel, (T // st.block_q, H, B), inputs, outs,
                            st)

  # dk, dv, dr: one program per (key tile, kv head, batch); the group's query heads whole in time
  bk = st.block_k
  group = lambda d: pl.BlockSpec((None, T, G, d), lambda j, h, b: (b, 0, h, 0))  # noqa: E731
  ktile = lambda d: pl.BlockSpec((None, bk, None, d), lambda j, h, b: (b, j, h, 0))  # noqa
  gtile = lambda d: pl.BlockSpec((None, bk, G, d), lambda j, h, b: (b, j, h, 0))  # noqa: E731
  group_rows = pl.BlockSpec((None, T, G), lambda j, h, b: (b, 0, h))
  # C and Pre at this key tile, for the group's heads
  column = pl.BlockSpec((None, None, T, G), lambda j, h, b: (b, j, 0, h))
  inputs = [(q, group(q.shape[3])), (k, ktile(k.shape[3])), (v, ktile(v.shape[3])),
            (pq, group(pq.shape[3])), (r, gtile(r.shape[3])), (al, group_rows),
            (seg, pl.BlockSpec((None, T), lambda j, h, b: (b, 0))),
            (seg, pl.BlockSpec((None, bk), lambda j, h, b: (b, j))),
            (do, group(do.shape[3])), (lse, group_rows), (delta, group_rows),
            (c, column), (pre, column)]
  outs = [(f32_shape(*k.shape), ktile(k.shape[3])), (f32_shape(*v.shape), ktile(v.shape[3])),
          (f32_shape(*r.shape), gtile(r.shape[3]))]
  dk, dv, dr = _call(backend, kernels.dkv_kernel, (T // bk, K, B), inputs, outs, st)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dpq, dr, dal, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
# Called through jit keyed by the static config, so a model's layers share one traced and
# lowered copy of the kernels (see kernels_pallas/path_attention/api.py's _attend_once).
_attention_once = jax.jit(_attention, static_argnums=0)
