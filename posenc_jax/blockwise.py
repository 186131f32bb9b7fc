"""Flash-style causal attention in plain jnp: an online softmax over key blocks.

Never holds a T x S array: each (query block, key block) tile of logits is computed by a
caller-supplied function, masked (causal, segment, padding) and folded into a running
(max, normaliser, accumulator) triple. Tiles above the diagonal are skipped with `lax.cond`,
and the per-tile step is rematerialised in the backward pass (`jax.checkpoint`) so gradients
keep O(T) memory per query block instead of storing every tile.

Query blocks run one after another by default, or all at once (`map_query_blocks`).

Shape letters: B batch, T time (padded to Tp), H query heads, K kv heads, G = H // K, D dims,
Q query-block length, C key-block length (both equal `block_size` here).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from posenc_jax.masking import NEG_INF


class SoftmaxState(NamedTuple):
  """Running online-softmax state of one query block."""
  m_BHQ: jax.Array      # running max of logits
  l_BHQ: jax.Array      # running sum of exp(logit - m)
  acc_BHQD: jax.Array   # running sum of exp(logit - m) * v


def init_state(B: int, H: int, Q: int, Dv: int) -> SoftmaxState:
  return SoftmaxState(jnp.full((B, H, Q), NEG_INF, jnp.float32), jnp.zeros((B, H, Q), jnp.float32),
                      jnp.zeros((B, H, Q, Dv), jnp.float32))


def update_state(state: SoftmaxState, s_BHQC, mask, v_BCKD) -> SoftmaxState:
  """Folds one masked tile of logits and its values into the running state."""
  B, H, Q, C = s_BHQC.shape
  K = v_BCKD.shape[2]
  s = jnp.where(mask, s_BHQC, NEG_INF)
  m_new = jnp.maximum(state.m_BHQ, s.max(-1))
  p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
  corr = jnp.exp(state.m_BHQ - m_new)
  pv = jnp.einsum("bkgqc,bckd->bkgqd", p.reshape(B, K, H // K, Q, C), v_BCKD.astype(jnp.float32))
  return SoftmaxState(m_new, state.l_BHQ * corr + p.sum(-1),
                      state.acc_BHQD * corr[..., None] + pv.reshape(B, H, Q, -1))


def finalize(state: SoftmaxState):
  """Normalised output [B, Q, H, Dv] (float32).

  Rows that saw no key (padding rows) have l = 0; dividing by 1 there keeps them at 0 and
  their gradients finite.
  """
  l = jnp.where(state.l_BHQ > 0, state.l_BHQ, 1.0)
  return jnp.transpose(state.acc_BHQD / l[..., None], (0, 2, 1, 3))


def pad_time(x, Tp: int, value=0):
  """Pads axis 1 (time) of x up to length Tp."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, Tp - x.shape[1])
  return jnp.pad(x, pad, constant_values=value)


def padded_length(T: int, block_size: int) -> int:
  return -(-T // block_size) * block_size


def block_size_for(T: int, block_size: int | None, *, default: int, max_blocks: int) -> int:
  """The tile edge: `block_size` if given, else `default` doubled until T needs at most
  `max_blocks` blocks.

  Why grow it: every query block scans all n key blocks (the tiles above the diagonal are
  skipped by `lax.cond`, but the step still runs), so a pass takes n^2 scan steps, and at a
  fixed edge the per-step overhead grows with T faster than the tile work does (measured on
  the CPU and in the 12-layer train step: the cost per token of fixed tiles grew about three
  times faster than the tile work). The callers' `max_blocks` keep their T = 2048 tiling.
  """
  if block_size is not None:
    return block_size
  size = default
  while padded_length(T, size) // size > max_blocks:
    size *= 2
  return size


def tile_mask(q_start, k_start, Q: int, C: int, T: int, seg_BTp=None):
  """Visibility of a (query block, key block) tile: causal, not padding, same segment."""
  qp = q_start + jnp.arange(Q)
  kp = k_start + jnp.arange(C)
  mask = ((kp[None, :] <= qp[:, None]) & (kp[None, :] < T))[None, None]
  if seg_BTp is not None:
    sq = jax.lax.dynamic_slice_in_dim(seg_BTp, q_start, Q, axis=1)
    sk = jax.lax.dynamic_slice_in_dim(seg_BTp, k_start, C, axis=1)
    mask = mask & (sq[:, None, :, None] == sk[:, None, None, :])
  return mask


def map_query_blocks(query_block: Callable, n: int, *, parallel: bool | None = None):
  """[query_block(qi) for qi < n] stacked on a new leading axis, rematerialised in the backward.

  parallel=False (and None): `lax.map`, one query block at a time; the working set stays
  one block's.
  parallel=True: `vmap`, every query block at once, so the key-block loop inside runs n
  steps over [n, B, H, Q, C] tiles instead of n^2 steps over [B, H, Q, C] ones. The tiles
  above the diagonal are then computed and masked instead of skipped (twice the tile work),
  and the backward holds one carry per key step for all blocks (O(n T) transient memory).
  In the 12-layer bf16 train step (docs/benchmarks/train_throughput.md's git history) it does
  not pay: TAPA ran slower in parallel than one block at a time (the tile arithmetic, not the
  launches, bounds it), ran out of memory at T = 8192, and GRAPE-AP's step took minutes to
  compile. So None means sequential on every backend.
  """
  block = jax.checkpoint(query_block)   # only the block's inputs are kept for the backward
  return jax.vmap(block)(jnp.arange(n)) if parallel else jax.lax.map(block, jnp.arange(n))


def blockwise_attention(tile_logits: Callable, v_BTKD, *, num_heads: int, segment_ids=None,
                        block_size: int = 128, parallel: bool | None = None):
  """Causal softmax attention whose logits come tile by tile from `tile_logits`.

  Args:
    tile_logits: `(q_start, k_start) -> [B, H, block_size, block_size]` float32 logits of
      query rows q_start.. and key columns k_start.. in the padded index space (the caller
      pads its own inputs to `padded_length(T, block_size)`; padded rows/columns are masked).
    v_BTKD: values (unpadded).
    num_heads: H, the number of query heads (a multiple of K).
    segment_ids: optional [B, T] packed-sequence ids.
    block_size: tile edge.
    parallel: query blocks at once or one by one (`map_query_blocks`; None: one by one).

  Returns:
    [B, T, H, Dv] in v's dtype.
  """
  B, T, K, Dv = v_BTKD.shape
  H, Q = num_heads, block_size
  Tp = padded_length(T, Q)
  n = Tp // Q
  v = pad_time(v_BTKD, Tp)
  seg = None if segment_ids is None else pad_time(segment_ids, Tp, value=-1)

  def query_block(qi):
    q_start = qi * Q

    def visit(state, ki):
      k_start = ki * Q
      s = tile_logits(q_start, k_start).astype(jnp.float32)
      mask = tile_mask(q_start, k_start, Q, Q, T, seg)
      return update_state(state, s, mask, jax.lax.dynamic_slice_in_dim(v, k_start, Q, axis=1))

    # Checkpoint the whole step, cond included: a checkpoint inside the cond still makes the
    # cond save its operands' tiles at every step (gradient memory quadratic in T).
    @jax.checkpoint
    def step(state, ki):
      return jax.lax.cond(ki <= qi, visit, lambda s, _: s, state, ki), None

    state, _ = jax.lax.scan(step, init_state(B, H, Q, Dv), jnp.arange(n))
    return finalize(state)

  out = map_query_blocks(query_block, n, parallel=parallel)   # [n, B, Q, H, Dv]
  out = jnp.moveaxis(out, 0, 1).reshape(B, Tp, H, Dv)
  return out[:, :T].astype(v_BTKD.dtype)
