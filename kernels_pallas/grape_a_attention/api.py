"""grape_a_attention: the public function, its custom VJP and the three launches.

Time is padded to whole tiles at the end (rates with 0, segment ids with -1) and the head dims
to powers of two >= 16 (zeros change no product). The custom_vjp core sees the padded
operands, so autodiff of the pads and slices carries the cotangents back to the caller's
shapes and dtypes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.grape_a_attention import kernels
from kernels_pallas.common import launch
from kernels_pallas.common import tiles
from kernels_pallas.common.launch import f32_shape, pad_axis

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64
WARPS = 4
STAGES = 2


def grape_a_attention(q, k, v, rate_q=None, rate_k=None, *, scale: float, segment_ids=None,
                      block_q=None, block_k=None, interpret: bool = False):
  """Causal softmax attention with GRAPE-A's bias -> o [B, T, H, Dv] in v's dtype
  (docs/encodings/additive.md#grape-a-grape_a_q-grape_a_k-grape_a_qk).

  l_ij = scale q_i . k_j - (i - j) (rate_q[b, i, h] + rate_k[b, j, h]) over j <= i in the same
  document. GRAPE-A's rates are omega_h lambda_q(q_i) and omega_h lambda_k(k_j), the key's
  gate taken with query head h's vector. q [B, T, H, D]; k [B, T, K, D]; v [B, T, K, Dv]
  (query head h reads kv head h // (H // K)); rate_q, rate_k [B, T, H] float or None (that
  term absent); segment_ids [B, T] int or None (one document). Products read q and k in k's
  dtype and accumulate in float32; the bias is float32. Differentiable in q, k, v and the
  rates. interpret=True runs the Pallas interpreter (CPU); otherwise the Triton kernels (GPU).
  """
  B, T, H, K, D = launch.check_self_attention("grape_a_attention", q, k, v)
  launch.check_shapes("grape_a_attention", ("rate_q", rate_q, (B, T, H)),
                      ("rate_k", rate_k, (B, T, H)), ("segment_ids", segment_ids, (B, T)))
  bq = launch.tile(block_q, DEFAULT_BLOCK_Q, T, "grape_a_attention: block_q")
  bk = launch.tile(block_k, DEFAULT_BLOCK_K, T, "grape_a_attention: block_k")
  Tp = -(-T // max(bq, bk)) * max(bq, bk)
  dtype = k.dtype
  pad = lambda x, width: pad_axis(pad_axis(x, 1, Tp), 3, width)  # noqa: E731
  Dp, Dv = launch.pow2(D, 16), v.shape[3]
  qp, kp = pad(q.astype(dtype), Dp), pad(k, Dp)
  vp = pad(v.astype(dtype), launch.pow2(Dv, 16))
  rate = lambda r: None if r is None else pad_axis(r.astype(jnp.float32), 1, Tp)  # noqa: E731
  seg = None if segment_ids is None else pad_axis(segment_ids.astype(jnp.int32), 1, Tp, value=-1)
  backend = "interpret" if interpret else "gpu"
  precision = launch.float32_precision(backend) if jnp.dtype(dtype).itemsize == 4 else None
  st = kernels.Static(scale=float(scale), block_q=bq, block_k=bk, precision=precision,
                      v_precision=precision)
  # The documents' tile bounds are computed once here, for the forward and both backward walks.
  docs = tiles.documents(seg, bq, bk)
  o = _attention_once((st, backend), qp, kp, rate(rate_q), rate(rate_k), vp, docs)
  return o[:, :T, :, :Dv].astype(v.dtype)


def _call(backend, kernel, grid, operands, outs, st):
  return launch.call_present(functools.partial(kernel, st=st), grid, operands, outs,
                             backend=backend, warps=WARPS, stages=STAGES)


def _query_major(st, q, k, rq, rk, v, docs):
  """Specs of a launch with one program per (query tile, head, batch) reading every key."""
  T, G = q.shape[1], q.shape[2] // k.shape[2]
  bq = st.block_q
  tile = lambda d: pl.BlockSpec((None, bq, None, d), lambda i, h, b: (b, i, h, 0))  # noqa: E731
  keys = lambda d: pl.BlockSpec((None, T, None, d), lambda i, h, b: (b, 0, h // G, 0))  # noqa
  rows = pl.BlockSpec((None, bq, None), lambda i, h, b: (b, i, h))
  # the key rates belong to the query head (its gate vector), not to the kv head
  key_rates = pl.BlockSpec((None, T, None), lambda i, h, b: (b, 0, h))
  return dict(
      tile=tile, rows=rows,
      inputs=[(q, tile(q.shape[-1])), (k, keys(k.shape[-1])), (rq, rows), (rk, key_rates),
              (v, keys(v.shape[-1])), *launch.query_major_documents(docs, bq, T)])


def _forward(cfg, q, k, rq, rk, v, docs):
  st, backend = cfg
  B, T, H, _ = q.shape
  m = _query_major(st, q, k, rq, rk, v, docs)
  outs = [(f32_shape(B, T, H, v.shape[-1]), m["tile"](v.shape[-1])),
          (f32_shape(B, T, H), m["rows"])]
  return _call(backend, kernels.forward_kernel, (T // st.block_q, H, B), m["inputs"], outs, st)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, rq, rk, v, docs):
  return _forward(cfg, q, k, rq, rk, v, docs)[0]


def _attention_fwd(cfg, q, k, rq, rk, v, docs):
  o, lse = _forward(cfg, q, k, rq, rk, v, docs)
  return o, (q, k, rq, rk, v, docs, o, lse)


def _attention_bwd(cfg, res, do):
  st, backend = cfg
  q, k, rq, rk, v, docs, o, lse = res
  B, T, H, D = q.shape
  K = k.shape[2]
  G = H // K
  delta = jnp.sum(do * o, axis=-1)
  do = do.astype(v.dtype)

  # dq (and d rate_q): one program per (query tile, head, batch)
  m = _query_major(st, q, k, rq, rk, v, docs)
  inputs = m["inputs"] + [(do, m["tile"](do.shape[-1])), (lse, m["rows"]), (delta, m["rows"])]
  outs = [(f32_shape(*q.shape), m["tile"](D)),
          (None if rq is None else f32_shape(B, T, H), m["rows"])]
  dq, *drq = _call(backend, kernels.dq_kernel, (T // st.block_q, H, B), inputs, outs, st)

  # dk, dv (and d rate_k): one program per (key tile, kv head, batch); the group's query heads
  # whole in time
  bk = st.block_k
  group = lambda d: pl.BlockSpec((None, T, G, d), lambda j, h, b: (b, 0, h, 0))  # noqa: E731
  ktile = lambda d: pl.BlockSpec((None, bk, None, d), lambda j, h, b: (b, j, h, 0))  # noqa
  group_rows = pl.BlockSpec((None, T, G), lambda j, h, b: (b, 0, h))
  key_rates = pl.BlockSpec((None, bk, G), lambda j, h, b: (b, j, h))
  inputs = [(q, group(D)), (k, ktile(D)), (rq, group_rows), (rk, key_rates),
            (v, ktile(v.shape[-1])), *launch.key_major_documents(docs, bk, T),
            (do, group(do.shape[-1])), (lse, group_rows), (delta, group_rows)]
  outs = [(f32_shape(*k.shape), ktile(D)), (None if rk is None else f32_shape(B, T, H), key_rates),
          (f32_shape(*v.shape), ktile(v.shape[-1]))]
  dk, *rest = _call(backend, kernels.dkv_kernel, (T // bk, K, B), inputs, outs, st)
  drk, dv = (rest[0], rest[1]) if rk is not None else (None, rest[0])
  return (dq.astype(q.dtype), dk.astype(k.dtype), drq[0] if drq else None, drk,
          dv.astype(v.dtype), None)


_attention.defvjp(_attention_fwd, _attention_bwd)
# Called through jit keyed by the static config, so a model's layers share one traced and
# lowered copy of the kernels (see kernels_pallas/path_attention/api.py's _attend_once).
_attention_once = jax.jit(_attention, static_argnums=0)
