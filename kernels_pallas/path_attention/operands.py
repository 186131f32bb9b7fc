"""The kernels' operands: their layout, and their assembly from the caller's arrays.

Layout: head-major and blocked, [B, heads, n, C, ...], except v, which stays time-major in
chunks, [B, n, C, K, D] (a reshape of the input): the kernels read its tiles as strided boxes,
and dv and dO take that layout too, so no transpose of v, dO or dv runs between the caller and
the kernels. T is padded to whole chunks: padding has beta 0 (identity transport), a zero gate
and segment id -1 (its own segment).

With transport, the pre-pass (prepass/) gives, per chunk of C tokens with Householder vectors
W [C, D] and strengths beta [C], X = (I + strictLower(diag(beta) W W^T))^{-1} diag(beta) and
U = X W, so that the chunk's whole transport is one operator P = I - E, E = W^T U [D, D]:
  q^ = q transported to its chunk's start, k^ = k transported to its chunk's end,
  diag = the scaled in-chunk logits (query and key in one chunk),
so that for key chunk m < query chunk c the logits are l = scale q^ P_{c-1} ... P_{m+1} k^.

Shape letters: B batch, T time (Tp padded), H query heads, K kv heads, G = H // K, n chunks,
C chunk, D head dim.
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


def prepare(q, k, v, w, beta, log_forget, seg, *, scale: float, C: int, dtype, transport):
  """Pads T to whole chunks and builds the kernel operands (see the module docstring).

  q [B, T, H, D]; k, v, w [B, T, K, D]; beta [B, T, K]; log_forget [B, T, H]; seg [B, T] int.
  Padding uses beta = 0 (identity transport), a zero gate and segment id -1 (its own segment).
  `transport` builds (q^, k^, E, diag) from transport_inputs (a pre-pass form: prepass/).
  transport=None leaves those four None for the caller to fill (api runs the Pallas pre-pass
  and its VJP outside jax.vjp).
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


def features(ops: Operands) -> dict:
  """The kernels' static switches: transport (PaTH), gate (FoX), segments."""
  return dict(transport=ops.e is not None, gate=ops.fq is not None, segments=ops.sq is not None)


def skips_chunks(ops: Operands, backend: str) -> bool:
  """Segment-aware chunk skipping (chunk_bounds) on the GPU and in the interpreter. TPU kernels
  walk every chunk pair: a loop bound read from a VMEM block is a vector value there."""
  return ops.lo is not None and backend in ("gpu", "interpret")
