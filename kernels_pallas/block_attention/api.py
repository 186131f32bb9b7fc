"""block_attention: the public function, its custom VJP and the three launches.

The wrapper pads time to whole tiles (padded keys are masked by their
index, padded queries sliced off) and head dims to a power of two (zeros: the products do not
change), then calls the custom_vjp core on the padded arrays, so autodiff of the pads and
slices carries the cotangents back to the caller's shapes and dtypes. q enters the core in
its own dtype and is cast to k's at each launch, so a float32 q gets its float32 dq unrounded.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.block_attention import kernels
from kernels_pallas.common import launch
from kernels_pallas.common.launch import f32_shape, pad_axis
from kernels_pallas.common.tiles import NEG_INF

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 64
WARPS = 4
STAGES = 2


@dataclasses.dataclass(frozen=True)
class _Config:
  scale: float
  block_q: int
  block_k: int
  tk: int          # true key count (keys at or past it are padding)
  backend: str     # "gpu" (Triton) or "interpret"

  def precision(self, dtype):
    """float32 operands keep float32 accuracy (path_attention's convention); 16-bit: one pass."""
    return launch.float32_precision(self.backend) if jnp.dtype(dtype).itemsize == 4 else None




def block_attention(q, k, v, *, scale: float, q_bias=None, k_bias=None, q_segment_ids=None,
                    k_segment_ids=None, block_q=None, block_k=None, interpret=False):
  """Non-causal softmax attention of queries against one block of keys -> (o, lse).

  l_ij = scale q_i . k_j + q_bias[b, i, h] + k_bias[b, j, h], over the keys j with
  q_segment_ids[b, i] == k_segment_ids[b, j] (all keys without segment ids). q [B, Tq, H, D];
  k [B, Tk, K, D]; v [B, Tk, K, Dv] (query head h reads kv head h // (H // K)); biases float32
  [B, Tq, H] / [B, Tk, H] or None; segment ids int32 [B, Tq] / [B, Tk], both or neither.
  Returns o [B, Tq, H, Dv] float32 and lse [B, Tq, H] float32; a row that sees no key has
  o = 0 and lse = NEG_INF (-1e30). The products read q and k in k's dtype and accumulate in
  float32. Differentiable in q, k, v and the biases, with cotangents on both outputs.
  interpret=True runs the Pallas interpreter (CPU); otherwise the Triton kernels (GPU).
  """
  B, Tq, H, D = q.shape
  if k.ndim != 4 or k.shape[0] != B or k.shape[3] != D or v.shape[:3] != k.shape[:3]:
    raise ValueError(f"block_attention: k {k.shape} / v {v.shape} must be [B, Tk, K, D] / "
                     f"[B, Tk, K, Dv] with q {q.shape}'s B and D")
  Tk, K, Dv = k.shape[1], k.shape[2], v.shape[3]
  if H % K:
    raise ValueError(f"block_attention: query heads {H} must be a multiple of kv heads {K}")
  if (q_segment_ids is None) != (k_segment_ids is None):
    raise ValueError("block_attention: pass q_segment_ids and k_segment_ids both or neither")
  launch.check_shapes("block_attention", ("q_bias", q_bias, (B, Tq, H)),
                      ("k_bias", k_bias, (B, Tk, H)), ("q_segment_ids", q_segment_ids, (B, Tq)),
                      ("k_segment_ids", k_segment_ids, (B, Tk)))
  bq = launch.tile(block_q, DEFAULT_BLOCK_Q, Tq, "block_attention: block_q")
  bk = launch.tile(block_k, DEFAULT_BLOCK_K, Tk, "block_attention: block_k")
  Tqp, Tkp = -(-Tq // bq) * bq, -(-Tk // bk) * bk
  Dp, Dvp = launch.pow2(D, 16), launch.pow2(Dv, 16)
  q = pad_axis(pad_axis(q, 1, Tqp), 3, Dp)
  k = pad_axis(pad_axis(k, 1, Tkp), 3, Dp)
  v = pad_axis(pad_axis(v, 1, Tkp), 3, Dvp)
  f32 = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731
  qb, kb = pad_axis(f32(q_bias), 1, Tqp), pad_axis(f32(k_bias), 1, Tkp)
  i32 = lambda x: None if x is None else x.astype(jnp.int32)  # noqa: E731
  sq, sk = pad_axis(i32(q_segment_ids), 1, Tqp), pad_axis(i32(k_segment_ids), 1, Tkp)
  cfg = _Config(scale=float(scale), block_q=bq, block_k=bk, tk=Tk,
                backend="interpret" if interpret else "gpu")
  o, lse = _attention_once(cfg, q, k, v, qb, kb, sq, sk)
  return o[:, :Tq, :, :Dv], lse[:, :Tq]




def _call(cfg, kernel, grid, operands, outs, **kw):
  return launch.call_present(functools.partial(kernel, **kw), grid, operands, outs,
                             backend=cfg.backend, warps=WARPS, stages=STAGES)


def _forward(cfg, q, k, v, qb, kb, sq, sk):
  B, Tq, H, D = q.shape
  Tk, K, Dv = k.shape[1], k.shape[2], v.shape[3]
  G = H // K
  kw = dict(scale=cfg.scale, block_k=cfg.block_k, tk=cfg.tk, precision=cfg.precision(k.dtype),
            v_precision=cfg.precision(v.dtype))
  bq = cfg.block_q
  tile = lambda d: pl.BlockSpec((None, bq, None, d), lambda i, h, b: (b, i, h, 0))  # noqa: E731
  keys = lambda d: pl.BlockSpec((None, Tk, None, d), lambda i, h, b: (b, 0, h // G, 0))  # noqa
  rows = pl.BlockSpec((None, bq, None), lambda i, h, b: (b, i, h))
  operands = [(q.astype(k.dtype), tile(D)), (k, keys(D)), (v, keys(Dv)), (qb, rows),
              (kb, pl.BlockSpec((None, Tk, None), lambda i, h, b: (b, 0, h))),
              (sq, pl.BlockSpec((None, bq), lambda i, h, b: (b, i))),
              (sk, pl.BlockSpec((None, Tk), lambda i, h, b: (b, 0)))]
  outs = [(f32_shape(B, Tq, H, Dv), tile(Dv)), (f32_shape(B, Tq, H), rows)]
  return _call(cfg, kernels.forward_kernel, (Tq // bq, H, B), operands, outs, **kw)


def _backward(cfg, q, k, v, do, lse, delta, kb, sq, sk):
  """-> dq [B, Tq, H, D], dk, dv [B, Tk, K, D/Dv], dkb [B, Tk, H] or None, all float32."""
  q = q.astype(k.dtype)
  B, Tq, H, D = q.shape
  Tk, K, Dv = k.shape[1], k.shape[2], v.shape[3]
  G = H // K
  bq, bk = cfg.block_q, cfg.block_k
  kw = dict(scale=cfg.scale, tk=cfg.tk, precision=cfg.precision(k.dtype),
            v_precision=cfg.precision(v.dtype))

  # dk, dv: one program per (key tile, kv head, batch); the group's heads whole in time
  group = lambda d: pl.BlockSpec((None, Tq, G, d), lambda j, h, b: (b, 0, h, 0))  # noqa: E731
  ktile = lambda d: pl.BlockSpec((None, bk, None, d), lambda j, h, b: (b, j, h, 0))  # noqa
  group_rows = pl.BlockSpec((None, Tq, G), lambda j, h, b: (b, 0, h))
  kb_tile = pl.BlockSpec((None, bk, G), lambda j, h, b: (b, j, h))
  operands = [(q, group(D)), (k, ktile(D)), (v, ktile(Dv)), (do, group(Dv)), (lse, group_rows),
              (delta, group_rows), (kb, kb_tile),
              (sq, pl.BlockSpec((None, Tq), lambda j, h, b: (b, 0))),
              (sk, pl.BlockSpec((None, bk), lambda j, h, b: (b, j)))]
  outs = [(f32_shape(B, Tk, K, D), ktile(D)), (f32_shape(B, Tk, K, Dv), ktile(Dv)),
          (None if kb is None else f32_shape(B, Tk, H), kb_tile)]
  dk, dv, *dkb = _call(cfg, kernels.dkv_kernel, (Tk // bk, K, B), operands, outs,
                       block_q=bq, **kw)

  # dq: one program per (query tile, head, batch)
  tile = lambda d: pl.BlockSpec((None, bq, None, d), lambda i, h, b: (b, i, h, 0))  # noqa: E731
  keys = lambda d: pl.BlockSpec((None, Tk, None, d), lambda i, h, b: (b, 0, h // G, 0))  # noqa
  rows = pl.BlockSpec((None, bq, None), lambda i, h, b: (b, i, h))
  operands = [(q, tile(D)), (k, keys(D)), (v, keys(Dv)), (do, tile(Dv)), (lse, rows),
              (delta, rows), (kb, pl.BlockSpec((None, Tk, None), lambda i, h, b: (b, 0, h))),
              (sq, pl.BlockSpec((None, bq), lambda i, h, b: (b, i))),
              (sk, pl.BlockSpec((None, Tk), lambda i, h, b: (b, 0)))]
  (dq,) = _call(cfg, kernels.dq_kernel, (Tq // bq, H, B), operands,
                [(f32_shape(B, Tq, H, D), tile(D))], block_k=bk, **kw)
  return dq, dk, dv, (dkb[0] if dkb else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, qb, kb, sq, sk):
  return tuple(_forward(cfg, q, k, v, qb, kb, sq, sk))


def _attention_fwd(cfg, q, k, v, qb, kb, sq, sk):
  o, lse = _forward(cfg, q, k, v, qb, kb, sq, sk)
  return (o, lse), (q, k, v, qb, kb, sq, sk, o, lse)


def _attention_bwd(cfg, res, cts):
  q, k, v, qb, kb, sq, sk, o, lse = res
  do, dlse = cts
  # dS = P (dP - Delta + dlse): one per-row vector carries both cotangents
  delta = jnp.sum(do * o, axis=-1) - dlse
  # the query bias is a row constant: p = exp(l - lse) = exp(l - q_bias - (lse - q_bias))
  rows_lse = lse if qb is None else lse - qb
  dq, dk, dv, dkb = _backward(cfg, q, k, v, do.astype(v.dtype), rows_lse, delta, kb, sq, sk)
  # d q_bias = row sums of dS = sum_j P (dP - Delta) + dlse sum_j P = dlse on rows that see a
  # key (sum_j P_ij dP_ij = dO_i . o_i = Delta_i, sum_j P_ij = 1), 0 on the others
  dqb = None if qb is None else jnp.where(lse > NEG_INF / 2, dlse, 0.0)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dqb, dkb, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
# Called through jit keyed by the static config, so a model's layers share one traced and
# lowered copy of the kernels (see kernels_pallas/path_attention/api.py's _attend_once).
_attention_once = jax.jit(_attention, static_argnums=0)
