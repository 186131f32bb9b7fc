"""tapa_attention: the public function, its custom VJP and the three launches.

The wrapper splits each head into its amplitude (first A channels) and phase parts, so that a
kernel reads two power-of-two-wide operands instead of slicing channels in a tile; for the
linear phase it passes the phase channels' float32 sums instead (the tile needs only
sq_i + sk_j, and autodiff of the sum spreads d sq over the channels). Time is padded to whole
tiles at the end and the channel parts to powers of two >= 16 (zeros change no product). The
custom_vjp core sees the padded operands, so autodiff of the splits, pads and slices carries
the cotangents back to the caller's shapes and dtypes.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.common import launch
from kernels_pallas.common import tiles
from kernels_pallas.common.launch import f32_shape, pad_axis
from kernels_pallas.tapa_attention import kernels

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64
WARPS = 4
STAGES = 2


def split_sizes(theta: float, head_dim: int) -> tuple[int, int]:
  """(A, P): the amplitude and phase widths, A = round(theta * head_dim)."""
  a = int(round(theta * head_dim))
  return a, head_dim - a




def tapa_attention(q, k, v, *, alpha: float, theta: float, linear_phase: bool = False,
                   segment_ids=None, block_q=None, block_k=None, interpret: bool = False):
  """Causal TAPA attention (docs/encodings/tapa.md#tapa) -> o [B, T, H, Dv] in v's dtype.

  l_ij = (q_A . k_A / sqrt(A)) cos(2 pi |i - j|^alpha phi_ij), A = round(theta D) channels
  of amplitude, P = D - A of phase; phi_ij = q_P . k_P / sqrt(P), or with linear_phase
  (sum(q_P) + sum(k_P)) / sqrt(P). q [B, T, H, D]; k [B, T, K, D]; v [B, T, K, Dv] (query
  head h reads kv head h // (H // K)); segment_ids [B, T] int or None (one document).
  Products read q and k in k's dtype and accumulate in float32. Differentiable in q, k and v.
  interpret=True runs the Pallas interpreter (CPU); otherwise the Triton kernels (GPU).
  """
  B, T, H, K, D = launch.check_self_attention("tapa_attention", q, k, v)
  A, P = split_sizes(theta, D)
  if not (A >= 1 and P >= 1):
    raise ValueError(f"tapa_attention: theta={theta} with head_dim {D} leaves an empty "
                     "amplitude or phase part")
  if alpha < 0:
    raise ValueError(f"tapa_attention: alpha={alpha} must be >= 0")
  launch.check_shapes("tapa_attention", ("segment_ids", segment_ids, (B, T)))
  bq = launch.tile(block_q, DEFAULT_BLOCK_Q, T, "tapa_attention: block_q")
  bk = launch.tile(block_k, DEFAULT_BLOCK_K, T, "tapa_attention: block_k")
  Tp = -(-T // max(bq, bk)) * max(bq, bk)
  dtype = k.dtype
  q = q.astype(dtype)
  pad = lambda x, width: pad_axis(pad_axis(x, 1, Tp), 3, width)  # noqa: E731
  qa, ka = pad(q[..., :A], launch.pow2(A, 16)), pad(k[..., :A], launch.pow2(A, 16))
  if linear_phase:
    qp = kp = None
    qs = pad_axis(q[..., A:].astype(jnp.float32).sum(-1), 1, Tp)
    ks = pad_axis(k[..., A:].astype(jnp.float32).sum(-1), 1, Tp)
  else:
    qp, kp = pad(q[..., A:], launch.pow2(P, 16)), pad(k[..., A:], launch.pow2(P, 16))
    qs = ks = None
  Dv = v.shape[3]
  vp = pad(v.astype(dtype), launch.pow2(Dv, 16))
  seg = None if segment_ids is None else pad_axis(segment_ids.astype(jnp.int32), 1, Tp, value=-1)
  backend = "interpret" if interpret else "gpu"
  precision = launch.float32_precision(backend) if jnp.dtype(dtype).itemsize == 4 else None
  st = kernels.Static(alpha=float(alpha), a_scale=1.0 / math.sqrt(A), p_scale=1.0 / math.sqrt(P),
                      linear_phase=bool(linear_phase), block_q=bq, block_k=bk,
                      precision=precision, v_precision=precision, fast=backend == "gpu")
  # The documents' tile bounds are computed once here, for the forward and both backward walks.
  docs = tiles.documents(seg, st.block_q, st.block_k)
  o = _attention_once((st, backend), qa, ka, qp, kp, qs, ks, vp, docs)
  return o[:, :T, :, :Dv].astype(v.dtype)




def _call(backend, kernel, grid, operands, outs, st):
  return launch.call_present(functools.partial(kernel, st=st), grid, operands, outs,
                             backend=backend, warps=WARPS, stages=STAGES)


def _width(x):
  return None if x is None else x.shape[-1]


def _query_major(st, qa, ka, qp, kp, qs, ks, v, docs):
  """Specs of a launch with one program per (query tile, head, batch) reading every key."""
  T, G = qa.shape[1], qa.shape[2] // ka.shape[2]
  bq = st.block_q
  tile = lambda d: pl.BlockSpec((None, bq, None, d), lambda i, h, b: (b, i, h, 0))  # noqa: E731
  keys = lambda d: pl.BlockSpec((None, T, None, d), lambda i, h, b: (b, 0, h // G, 0))  # noqa
  rows = pl.BlockSpec((None, bq, None), lambda i, h, b: (b, i, h))
  key_rows = pl.BlockSpec((None, T, None), lambda i, h, b: (b, 0, h // G))
  return dict(
      tile=tile, rows=rows,
      inputs=[(qa, tile(_width(qa))), (ka, keys(_width(ka))), (qp, tile(_width(qp))),
              (kp, keys(_width(kp))), (qs, rows), (ks, key_rows), (v, keys(_width(v))),
              *launch.query_major_documents(docs, bq, T)])


def _forward(cfg, qa, ka, qp, kp, qs, ks, v, docs):
  st, backend = cfg
  B, T, H, _ = qa.shape
  m = _query_major(st, qa, ka, qp, kp, qs, ks, v, docs)
  outs = [(f32_shape(B, T, H, v.shape[-1]), m["tile"](v.shape[-1])),
          (f32_shape(B, T, H), m["rows"])]
  return _call(backend, kernels.forward_kernel, (T // st.block_q, H, B), m["inputs"], outs, st)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, qa, ka, qp, kp, qs, ks, v, docs):
  return _forward(cfg, qa, ka, qp, kp, qs, ks, v, docs)[0]


def _attention_fwd(cfg, qa, ka, qp, kp, qs, ks, v, docs):
  o, lse = _forward(cfg, qa, ka, qp, kp, qs, ks, v, docs)
  return o, (qa, ka, qp, kp, qs, ks, v, docs, o, lse)


def _attention_bwd(cfg, res, do):
  st, backend = cfg
  qa, ka, qp, kp, qs, ks, v, docs, o, lse = res
  B, T, H, _ = qa.shape
  K = ka.shape[2]
  G = H // K
  delta = jnp.sum(do * o, axis=-1)
  do = do.astype(v.dtype)

  # dq: one program per (query tile, head, batch)
  m = _query_major(st, qa, ka, qp, kp, qs, ks, v, docs)
  inputs = m["inputs"] + [(do, m["tile"](_width(do))), (lse, m["rows"]), (delta, m["rows"])]
  outs = [(f32_shape(*qa.shape), m["tile"](_width(qa))),
          (None if qp is None else f32_shape(*qp.shape), m["tile"](_width(qp))),
          (None if qs is None else f32_shape(B, T, H), m["rows"])]
  dqa, *rest = _call(backend, kernels.dq_kernel, (T // st.block_q, H, B), inputs, outs, st)
  dqp, dqs = (rest[0], None) if qp is not None else (None, rest[0])

  # dk, dv: one program per (key tile, kv head, batch); the group's query heads whole in time
  bk = st.block_k
  group = lambda d: pl.BlockSpec((None, T, G, d), lambda j, h, b: (b, 0, h, 0))  # noqa: E731
  ktile = lambda d: pl.BlockSpec((None, bk, None, d), lambda j, h, b: (b, j, h, 0))  # noqa
  group_rows = pl.BlockSpec((None, T, G), lambda j, h, b: (b, 0, h))
  key_rows = pl.BlockSpec((None, bk, None), lambda j, h, b: (b, j, h))
  inputs = [(qa, group(_width(qa))), (ka, ktile(_width(ka))), (qp, group(_width(qp))),
            (kp, ktile(_width(kp))), (qs, group_rows), (ks, key_rows), (v, ktile(_width(v))),
            *launch.key_major_documents(docs, bk, T),
            (do, group(_width(do))), (lse, group_rows), (delta, group_rows)]
  outs = [(f32_shape(*ka.shape), ktile(_width(ka))),
          (None if kp is None else f32_shape(*kp.shape), ktile(_width(kp))),
          (None if ks is None else f32_shape(B, T, K), key_rows),
          (f32_shape(*v.shape), ktile(_width(v)))]
  dka, *rest = _call(backend, kernels.dkv_kernel, (T // bk, K, B), inputs, outs, st)
  dkp, dks = (rest[0], None) if kp is not None else (None, rest[0])
  dv = rest[-1]
  cast = lambda x, like: None if x is None else x.astype(like.dtype)  # noqa: E731
  return (cast(dqa, qa), cast(dka, ka), cast(dqp, qp), cast(dkp, kp), dqs, dks,
          cast(dv, v), None)


_attention.defvjp(_attention_fwd, _attention_bwd)
# Called through jit keyed by the static config, so a model's layers share one traced and
# lowered copy of the kernels (see kernels_pallas/path_attention/api.py's _attend_once).
_attention_once = jax.jit(_attention, static_argnums=0)
