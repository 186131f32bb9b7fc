"""path_decode_step: the new token's Householder transport of every cached key, and the new
query's logits, in one pass that reads each cached key once and writes it once.

With H_t = I - beta w w^T and u = beta w, the logits against the transported keys are
scale q . H_t k_j = q' . k_j, q' = scale (q - (q . u) w): a product with the key as it was
read. So each key tile is read once, gives the logits and k_j . w, and is written back as
k_j - (k_j . w) u over its own buffer (input_output_aliases). The XLA form
(posenc_jax/encodings/transport_decode.py) reads the cache twice: once for the matmul, once
for the update.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.path_attention import launch

DEFAULT_BLOCK_S = 512
WARPS = 4


def _block(S: int, requested: int | None) -> int:
  """The slot tile: `requested`, else the largest power of two <= DEFAULT_BLOCK_S dividing S."""
  if requested is not None:
    if requested < 8 or requested & (requested - 1) or S % requested:
      raise ValueError(f"path_decode_step: block_s={requested} must be a power of two >= 8 "
                       f"that divides the cache's {S} slots")
    return requested
  b = DEFAULT_BLOCK_S
  while b >= 8 and S % b:
    b //= 2
  if b < 8:
    raise ValueError(f"path_decode_step: the cache's {S} slots have no power-of-two tile >= 8; "
                     f"use a multiple of 8 slots")
  return b


def _kernel(qp_ref, w_ref, u_ref, k_ref, knew_ref, end_ref, logits_ref, keys_ref, *,
            groups: int):
  k = k_ref[...]                                          # [tS, D] float32
  for g in range(groups):                                 # G query heads share this kv head
    logits_ref[g, :] = jnp.sum(k * qp_ref[g, :][None, :], axis=1)
  kw = jnp.sum(k * w_ref[...], axis=1, keepdims=True)     # [tS, 1]
  keys = k - kw * u_ref[...]
  if knew_ref is not None:                                # the new key joins at slot `end`
    tS = k.shape[0]
    slot = pl.program_id(2) * tS + jax.lax.broadcasted_iota(jnp.int32, (tS, 1), 0)
    keys = jnp.where(slot == end_ref[...], knew_ref[...].astype(jnp.float32), keys)
  keys_ref[...] = keys


@functools.partial(jax.jit, static_argnames=("scale", "block_s", "interpret", "backend"))
def path_decode_step(q, w, beta, k, *, scale: float, k_new=None, end=None,
                     block_s: int | None = None, interpret: bool = False,
                     backend: str | None = None):
  """(logits, keys) of one PaTH decode step (docs/encodings/decoding.md).

  q [B, K, G, D]: the new token's queries, G per kv head; w [B, K, D], beta [B, K]: its
  Householder vector and strength; k [B, K, S, D] float32: the cache, every key transported to
  the previous token. Returns logits [B, K, G, S] float32 = scale q . H_t k_j and keys
  [B, K, S, D] = H_t k_j, written over k's buffer; with k_new [B, K, D] and end [B] int, row
  b's slot end[b] holds k_new instead (the new token's key joins untransported), so the cache
  needs no separate write. interpret=True runs the Pallas interpreter (CPU); otherwise the
  default device's kernel (Triton on a GPU, Mosaic on a TPU); backend (launch.BACKENDS)
  overrides both.
  """
  B, K, G, D = q.shape
  if k.ndim != 4 or k.shape[:2] != (B, K) or k.shape[3] != D or k.dtype != jnp.float32:
    raise ValueError(f"path_decode_step: k must be float32 [B={B}, K={K}, S, D={D}], got "
                     f"{k.dtype} {k.shape}")
  if w.shape != (B, K, D) or beta.shape != (B, K):
    raise ValueError(f"path_decode_step: w must be [{B}, {K}, {D}] and beta [{B}, {K}], got "
                     f"{w.shape} and {beta.shape}")
  if (k_new is None) != (end is None):
    raise ValueError("path_decode_step: k_new and end come together (the new key and its slot)")
  if k_new is not None and (k_new.shape != (B, K, D) or end.shape != (B,)):
    raise ValueError(f"path_decode_step: k_new must be [{B}, {K}, {D}] and end [{B}], got "
                     f"{k_new.shape} and {end.shape}")
  S = k.shape[2]
  tS = _block(S, block_s)
  backend = launch.resolve_backend(interpret, backend)
  f32 = jnp.float32
  w = w.astype(f32)
  u = beta.astype(f32)[..., None] * w
  q = q.astype(f32)
  qp = scale * (q - jnp.einsum("bkgd,bkd->bkg", q, u)[..., None] * w[:, :, None])
  Gp = launch.pow2(G)   # Triton's blocks are powers of two: zero rows pad G
  qp = launch.pad_axis(qp, 2, Gp)
  vec = pl.BlockSpec((None, None, 1, D), lambda b, h, s: (b, h, 0, 0))
  logits, keys = launch.call_present(
      functools.partial(_kernel, groups=G), (B, K, S // tS),
      [(qp, pl.BlockSpec((None, None, Gp, D), lambda b, h, s: (b, h, 0, 0))),
       (w[:, :, None], vec), (u[:, :, None], vec),
       (k, pl.BlockSpec((None, None, tS, D), lambda b, h, s: (b, h, s, 0))),
       (None if k_new is None else k_new[:, :, None], vec),
       (None if end is None else end.astype(jnp.int32)[:, None, None],
        pl.BlockSpec((None, 1, 1), lambda b, h, s: (b, 0, 0)))],
      [(jax.ShapeDtypeStruct((B, K, Gp, S), f32),
        pl.BlockSpec((None, None, Gp, tS), lambda b, h, s: (b, h, 0, s))),
       (jax.ShapeDtypeStruct(k.shape, f32),
        pl.BlockSpec((None, None, tS, D), lambda b, h, s: (b, h, s, 0)))],
      backend=backend, warps=WARPS, stages=1, aliases={3: 1})
  return (logits if Gp == G else logits[:, :, :G]), keys
