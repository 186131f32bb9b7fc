"""Per-chunk UT pre-pass for the PaTH kernel, in plain jnp (differentiated by jax.vjp).

Within a chunk of C tokens with Householder vectors W [C, D] and strengths beta [C]:

  X = (I + strictLower(diag(beta) W W^T))^{-1} diag(beta)     lower triangular [C, C]
  H_{C-1} ... H_0 = I - W^T X W = I - W^T U,  U = X W

and every in-chunk product H_b ... H_a (latest on the left) is I - sum_{a<=s<=r<=b} X_rs w_r w_s^T.
From these the kernel needs, per chunk:
  q^ = q transported to its chunk's start:  Q^ = Q - (lower(Q W^T) X) W
  k^ = k transported to its chunk's end:    K^ = K - (X strictLower(W K^T))^T W
  diag logits (query and key in one chunk): scale (Q K^T - (lower(Q W^T) X) strictLower(W K^T))
so that for key chunk m < query chunk c: l = scale q^ P_{c-1} ... P_{m+1} k^ with
q~ <- q~ P_m = q~ - q~ E_m, where E = W^T U (D x D) is the chunk's whole transport as one
operator: one C x D x D product per step instead of two dependent C x C x D ones, and the kernels
never need W or U (dL/dE carries the transport gradient back here).

The triangular solve happens here, outside the kernel (it does not lower inside Pallas). All
arithmetic is float32. Layout out of here is head-major and blocked, [B, heads, n, C, ...],
except v, which stays time-major in chunks, [B, n, C, K, D] (a reshape of the input): the
kernels read its tiles as strided boxes, and dv and dO take that layout too, so no transpose of
v, dO or dv runs between the caller and the kernels (at 32,4096,32,64 on the H200 each was a
0.3 ms XLA pass).

Shape letters: B batch, T time (Tp padded), H query heads, K kv heads, G = H // K, n chunks, C chunk,
D head dim.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Operands(NamedTuple):
  """Kernel operands; None where a feature is off (no transport, no gate, no segments)."""
  q: jax.Array            # [B, H, n, C, D] q^ (transport) or q, kernel dtype
  k: jax.Array            # [B, K, n, C, D] k^ (transport) or k
  v: jax.Array            # [B, n, C, K, D] time-major chunks (chunked), kernel dtype
  e: jax.Array | None     # [B, K, n, D, D] E = W^T U, P = I - E (transport only)
  diag: jax.Array | None  # [B, H, n, C, C] scaled in-chunk logits, kernel dtype (transport only)
  fq: jax.Array | None    # [B, H, n, C, 1] float32 gate prefix sums, query layout
  fk: jax.Array | None    # [B, H, n, 1, C] the same, key layout
  sq: jax.Array | None    # [B, 1, n, C, 1] int32 segment ids, query layout
  sk: jax.Array | None    # [B, 1, n, 1, C]
  lo: jax.Array | None = None  # [B, 1, n, 1, 1] int32: the first key chunk that query chunk c
                               # can see (segments only; chunk_bounds)
  hi: jax.Array | None = None  # [B, 1, n, 1, 1] int32: the last query chunk that sees key chunk m


def blocked(x, C: int):
  """[B, Tp, X, ...] -> [B, X, n, C, ...] (head-major chunks)."""
  B, Tp = x.shape[:2]
  x = x.reshape(B, Tp // C, C, *x.shape[2:])
  return jnp.moveaxis(x, 3, 1)


def chunked(x, C: int):
  """[B, Tp, X, ...] -> [B, n, C, X, ...]: time-major chunks (a reshape: no copy). The layout
  of v, dO and dv."""
  return x.reshape(x.shape[0], x.shape[1] // C, C, *x.shape[2:])


def unchunked(x):
  """chunked [B, n, C, X, ...] -> [B, n*C, X, ...] (a reshape)."""
  return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def heads_major(x):
  """A chunked [B, n, C, X, ...] array -> blocked [B, X, n, C, ...] (a transpose), for the forms
  that read v or dO blocked (the TPU kernels, the jnp oracles)."""
  return None if x is None else jnp.moveaxis(x, 3, 1)


def time_major(x):
  """blocked [B, X, n, C, ...] -> chunked [B, n, C, X, ...] (heads_major's inverse)."""
  return None if x is None else jnp.moveaxis(x, 1, 3)


def pad_time(x, Tp: int, value=0):
  if x is None or x.shape[1] == Tp:
    return x
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, Tp - x.shape[1])
  return jnp.pad(x, pad, constant_values=value)


def segment_prefix_sum(x_BTH, seg_BT):
  """Inclusive cumulative sum over time restarting at every segment start (float32)."""
  if seg_BT is None:
    return jnp.cumsum(x_BTH, axis=1)
  start = jnp.concatenate([jnp.ones_like(seg_BT[:, :1], bool), seg_BT[:, 1:] != seg_BT[:, :-1]], 1)
  start = jnp.broadcast_to(start[..., None], x_BTH.shape)

  def combine(a, b):
    (va, fa), (vb, fb) = a, b
    return jnp.where(fb, vb, va + vb), fa | fb

  return jax.lax.associative_scan(combine, (x_BTH, start), axis=1)[0]


_HI = jax.lax.Precision.HIGHEST  # float32 pre-pass: no TF32 on GPU


def _ein(spec, *xs):
  return jnp.einsum(spec, *xs, precision=_HI)


def _mm(a, b):
  return jnp.matmul(a, b, precision=_HI)


def _tril(x, k=0):
  C = x.shape[-1]
  return jnp.where(jnp.arange(C)[:, None] - jnp.arange(C)[None, :] >= -k, x, 0.0)


def ut_transform(w_c, beta_c):
  """X = (I + strictLower(diag(beta) W W^T))^{-1} diag(beta); w_c [..., C, D], beta_c [..., C]."""
  C = w_c.shape[-2]
  a = _tril(beta_c[..., :, None] * _ein("...id,...jd->...ij", w_c, w_c), -1)
  eye = jnp.eye(C, dtype=w_c.dtype)
  rhs = jnp.broadcast_to(eye * beta_c[..., None, :], a.shape)
  return jax.scipy.linalg.solve_triangular(eye + a, rhs, lower=True)


def transport_jnp(q, k, w, bb, *, scale: float, dtype):
  """The transport operands in batched jnp (float32 inside): the oracle of prepass_kernel.py.

  q [B, Tp, H, D]; k, w [B, Tp, K, D] (time-major, Tp whole chunks); bb [B, K, n, C] -> q^ [B,
  H, n, C, D], k^ [B, K, n, C, D], E [B, K, n, D, D], diag [B, H, n, C, C] scaled in-chunk
  logits, all in dtype (bf16 logits: the rounding of a bf16 q . k product; half the memory of
  float32 logits, which were the largest buffers at the backward's peak).
  """
  C = bb.shape[-1]
  qb, kb, wb = (blocked(x, C) for x in (q, k, w))
  B, H, n, C, D = qb.shape
  K = kb.shape[1]
  f32 = jnp.float32
  qb, kb, wb, bb = (x.astype(f32) for x in (qb, kb, wb, bb))
  x = ut_transform(wb, bb)                                        # [B, K, n, C, C]
  u = _mm(x, wb)
  wk = _tril(_ein("bkncd,bknjd->bkncj", wb, kb), -1)             # w_r . k_j, r > j
  khat = kb - _ein("bknrj,bknrd->bknjd", _mm(x, wk), wb)
  qg = qb.reshape(B, K, H // K, n, C, D)
  gm = _mm(_tril(_ein("bkgnid,bknrd->bkgnir", qg, wb)), x[:, :, None])   # lower(Q W^T) X
  qhat = qg - _mm(gm, wb[:, :, None])
  diag = _ein("bkgnid,bknjd->bkgnij", qg, kb) - _mm(gm, wk[:, :, None])
  e = _ein("bkncd,bknce->bknde", wb, u)                             # W^T U  [D, D]
  return (qhat.reshape(B, H, n, C, D).astype(dtype), khat.astype(dtype), e.astype(dtype),
          (scale * diag).reshape(B, H, n, C, C).astype(dtype))


def prepare(q, k, v, w, beta, log_forget, seg, *, scale: float, C: int, dtype,
            transport=transport_jnp):
  """Pads T to whole chunks and builds the kernel operands (see the module docstring).

  q [B, T, H, D]; k, v, w [B, T, K, D]; beta [B, T, K]; log_forget [B, T, H]; seg [B, T] int.
  Padding uses beta = 0 (identity transport), a zero gate and segment id -1 (its own segment).
  `transport` builds (q^, k^, E, diag) from transport_inputs: transport_jnp here, or the Pallas
  pre-pass (prepass_kernel.transport_pallas). transport=None leaves those four None for the
  caller to fill (api._prepare_vjp runs the Pallas pre-pass and its VJP outside jax.vjp).
  """
  B, T, H, D = q.shape
  Tp = -(-T // C) * C
  n = Tp // C
  f32 = jnp.float32
  vb = chunked(pad_time(v, Tp), C).astype(dtype)   # [B, n, C, K, D]
  ops = dict(q=None, k=None, v=vb, e=None, diag=None, fq=None, fk=None, sq=None, sk=None)
  if w is None:
    ops.update(q=blocked(pad_time(q, Tp), C).astype(dtype),
               k=blocked(pad_time(k, Tp), C).astype(dtype))
  elif transport is not None:
    qhat, khat, e, diag = transport(*transport_inputs(q, k, w, beta, C=C), scale=scale,
                                    dtype=dtype)
    ops.update(q=qhat, k=khat, e=e, diag=diag)
  if log_forget is not None:
    segp = None if seg is None else pad_time(seg, Tp, -1)
    f = segment_prefix_sum(pad_time(log_forget.astype(f32), Tp), segp)   # [B, Tp, H]
    fb = blocked(f, C)                                                    # [B, H, n, C]
    ops.update(fq=fb[..., None], fk=fb[..., None, :])
  if seg is not None:
    sb = pad_time(seg.astype(jnp.int32), Tp, -1).reshape(B, 1, n, C)
    ops.update(sq=sb[..., None], sk=sb[..., None, :])
    lo, hi = chunk_bounds(seg.astype(jnp.int32), C=C)
    ops.update(lo=lo[:, None, :, None, None], hi=hi[:, None, :, None, None])
  return Operands(**ops)


def transport_inputs(q, k, w, beta, *, C: int):
  """The transport's inputs: q, k, w padded to whole chunks, time-major, and beta blocked
  [B, K, n, C] (padding: beta 0, the identity transport)."""
  Tp = -(-q.shape[1] // C) * C
  B = q.shape[0]
  bb = jnp.moveaxis(pad_time(beta, Tp).reshape(B, Tp // C, C, -1), 3, 1)
  return pad_time(q, Tp), pad_time(k, Tp), pad_time(w, Tp), bb


def chunk_bounds(seg_BT, *, C: int):
  """Which chunk pairs can hold a visible (query, key) pair, from segment ids: lo [B, n], the
  first key chunk any query of chunk c can see, and hi [B, n], the last query chunk that can
  see any key of chunk m (int32).

  Chunks c and m can share a segment only if their id ranges [min, max] overlap (padding
  excluded: its keys are only in the last chunk, which every walk visits). For packed
  documents (contiguous segments) this is exact; for any other layout it only over-counts,
  so the kernels stay exact. The kernels walk key chunks c-1 .. lo_c and query chunks
  m+1 .. hi_m: with documents shorter than a row, most chunk pairs of a causal walk lie
  wholly before the query's document and are skipped.
  """
  B, T = seg_BT.shape
  n = -(-T // C)
  big = jnp.iinfo(jnp.int32).max
  real = (jnp.arange(n * C) < T).reshape(n, C)
  s = pad_time(seg_BT, n * C).reshape(B, n, C)
  smin = jnp.where(real, s, big).min(-1)                                  # [B, n]
  smax = jnp.where(real, s, -big).max(-1)
  vis = ((smin[:, :, None] <= smax[:, None, :]) & (smin[:, None, :] <= smax[:, :, None])
         & (jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]))           # [B, c, m], m <= c
  lo = jnp.argmax(vis, axis=2).astype(jnp.int32)              # the diagonal is always visible
  hi = (n - 1 - jnp.argmax(vis[:, ::-1, :], axis=1)).astype(jnp.int32)
  return lo, hi
