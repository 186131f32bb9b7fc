"""Stick-breaking attention (SBA; docs/encodings/stick_breaking.md#stick-breaking-attention).

For query i and a key j it may see (same segment; j < i, or j <= i with attend_current), with
z_ij = scale q_i . k_j and no positional transform of q or k:

    A_ij = sigmoid(z_ij) * prod_{l visible, j < l} (1 - sigmoid(z_il))
    log A_ij = log_sigmoid(z_ij) + sum_{l visible, j < l} log_sigmoid(-z_il)

The nearest visible key takes its share of a unit stick first, each farther key a share of
what is left. The weights are not normalised: sum_j A_ij = 1 - r_i with the leftover stick
r_i = prod_{j visible} (1 - sigmoid(z_ij)) = exp(sum_j log_sigmoid(-z_ij)). The output is

    o_i = sum_j A_ij v_j + r_i v_i     remainder="current" (default)
    o_i = sum_j A_ij v_j               remainder="none"

Keys of other segments have A = 0 and break nothing: the stick restarts at every document.
The log forms keep every term <= 0 and finite: no exp() of a positive number, no 1 - x
cancellation (r_i is exp of a sum, not 1 - sum A), float32 throughout.

Shape letters: B batch, T time, H query heads, K kv heads (H % K == 0), D head dim, Dv value
dim, Q query-block length, C key-block length (Q = C = block_size).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from posenc_jax import blockwise
from posenc_jax import masking
from posenc_jax.path_integral import content_logit_tile

REMAINDERS = ("current", "none")


def check_options(*, attend_current, remainder) -> None:
  """The two choices of the formula; a wrong one is a ValueError naming it."""
  if remainder not in REMAINDERS:
    raise ValueError(f"remainder={remainder!r} must be one of {REMAINDERS}: 'current' gives the "
                     "leftover stick to the query's own value, 'none' drops it")
  if not isinstance(attend_current, bool):
    raise ValueError(f"attend_current={attend_current!r} must be True or False")


def visible(q_pos, k_pos, *, attend_current: bool, seg_q=None, seg_k=None):
  """[B or 1, 1, Q, C] bool: key k_pos[c] breaks the stick of query q_pos[r]."""
  rel = (k_pos[None, :] <= q_pos[:, None]) if attend_current else (k_pos[None, :] < q_pos[:, None])
  mask = rel[None, None]
  if seg_q is not None:
    mask = mask & (seg_q[:, None, :, None] == seg_k[:, None, None, :])
  return mask


def tile_weights(z, mask, stick_before):
  """One block of keys for a block of queries: (A [.., Q, C], the block's log-stick sum [.., Q]).

  z [.., Q, C] float32 logits; mask as `visible`; stick_before [.., Q] the log of the stick
  the queries have left after every nearer block (0 for the nearest).
  """
  log_beta = jnp.where(mask, jax.nn.log_sigmoid(-z), 0.0)
  # Sum over the nearer keys of this block, l > j: a reverse cumsum shifted by one column,
  # not (inclusive - log_beta), which would cancel.
  inclusive = jax.lax.cumsum(log_beta, axis=log_beta.ndim - 1, reverse=True)
  nearer = jnp.concatenate([inclusive[..., 1:], jnp.zeros_like(inclusive[..., :1])], axis=-1)
  log_a = jax.nn.log_sigmoid(z) + nearer + stick_before[..., None]
  return jnp.where(mask, jnp.exp(log_a), 0.0), inclusive[..., 0]


def _add_remainder(o_BTHD, stick_BHT, v_BTKD, remainder: str):
  """o + r v_i (remainder="current"), [B, T, H, Dv] in o's dtype."""
  if remainder == "none":
    return o_BTHD
  H = o_BTHD.shape[2]
  r = jnp.exp(jnp.transpose(stick_BHT, (0, 2, 1)))[..., None]
  return o_BTHD + r * masking.repeat_kv(v_BTKD, H).astype(o_BTHD.dtype)


def stick_breaking_attention_reference(q_BTHD, k_BTKD, v_BTKD, *, segment_ids=None, scale=None,
                                       attend_current: bool = False, remainder: str = "current"):
  """Dense O(T^2) oracle. q [B,T,H,D]; k [B,T,K,D]; v [B,T,K,Dv] -> o [B,T,H,Dv] in v's dtype.

  scale None: 1/sqrt(D). Holds [B, H, T, T] arrays, float32 (float64 for float64 inputs: the
  tests' exact runs).
  """
  check_options(attend_current=attend_current, remainder=remainder)
  T, H, D = q_BTHD.shape[1:]
  scale = D**-0.5 if scale is None else scale
  dtype = jnp.promote_types(q_BTHD.dtype, jnp.float32)
  pos = jnp.arange(T)
  z = scale * jnp.einsum("bthd,bshd->bhts", q_BTHD.astype(dtype),
                         masking.repeat_kv(k_BTKD, H).astype(dtype))     # [B, H, T, T]
  mask = visible(pos, pos, attend_current=attend_current, seg_q=segment_ids, seg_k=segment_ids)
  a, stick = tile_weights(z, mask, jnp.zeros(z.shape[:-1], dtype))
  o = jnp.einsum("bhts,bshd->bthd", a, masking.repeat_kv(v_BTKD, H).astype(dtype))
  return _add_remainder(o, stick, v_BTKD, remainder).astype(v_BTKD.dtype)


def stick_breaking_attention_chunked(q_BTHD, k_BTKD, v_BTKD, *, segment_ids=None, scale=None,
                                     attend_current: bool = False, remainder: str = "current",
                                     block_size: int | None = None,
                                     parallel: bool | None = None):
  """Blockwise SBA: never a T x T array; same arguments and result as the reference.

  Each query block walks its key blocks from the nearest (its own) to the farthest, carrying
  per query the log of the stick still left and the weighted sum of values; a block's
  weights need only that carry (the stick its nearer blocks used), so one pass suffices and
  nothing is renormalised. Blocks above the diagonal are skipped by `lax.cond`; each step and
  each query block are rematerialised in the backward (`jax.checkpoint`), so gradient memory
  is O(T * block_size) per head. block_size None: 128, grown so that T needs at most 16 blocks
  (blockwise.block_size_for). parallel: blockwise.map_query_blocks.
  """
  check_options(attend_current=attend_current, remainder=remainder)
  B, T, H, D = q_BTHD.shape
  K, Dv = v_BTKD.shape[2], v_BTKD.shape[3]
  scale = D**-0.5 if scale is None else scale
  Q = blockwise.block_size_for(T, block_size, default=128, max_blocks=16)
  Tp = blockwise.padded_length(T, Q)
  n = Tp // Q
  logits = content_logit_tile(q_BTHD, k_BTKD, scale, Tp, Q)
  v = blockwise.pad_time(v_BTKD, Tp).astype(jnp.float32)
  seg = None if segment_ids is None else blockwise.pad_time(segment_ids, Tp, value=-1)
  local = jnp.arange(Q)

  def query_block(qi):
    q_start = qi * Q

    def visit(carry, ki):
      stick, acc = carry
      k_start = ki * Q
      k_pos = k_start + local
      seg_at = lambda start: (None if seg is None  # noqa: E731
                              else jax.lax.dynamic_slice_in_dim(seg, start, Q, axis=1))
      mask = visible(q_start + local, k_pos, attend_current=attend_current,
                     seg_q=seg_at(q_start), seg_k=seg_at(k_start))
      mask = mask & (k_pos < T)[None, None, None, :]
      a, used = tile_weights(logits(q_start, k_start), mask, stick)
      vk = jax.lax.dynamic_slice_in_dim(v, k_start, Q, axis=1)            # [B, C, K, Dv]
      pv = jnp.einsum("bkgqc,bckd->bkgqd", a.reshape(B, K, H // K, Q, Q), vk)
      return stick + used, acc + pv.reshape(B, H, Q, Dv)

    # The whole step checkpointed, cond included (blockwise.blockwise_attention says why).
    @jax.checkpoint
    def step(carry, offset):
      ki = qi - offset
      return jax.lax.cond(ki >= 0, visit, lambda c, _: c, carry, ki), None

    init = (jnp.zeros((B, H, Q), jnp.float32), jnp.zeros((B, H, Q, Dv), jnp.float32))
    (stick, acc), _ = jax.lax.scan(step, init, jnp.arange(n))
    return jnp.transpose(acc, (0, 2, 1, 3)), stick                        # [B, Q, H, Dv], [B, H, Q]

  o, stick = blockwise.map_query_blocks(query_block, n, parallel=parallel)
  o = jnp.moveaxis(o, 0, 1).reshape(B, Tp, H, Dv)[:, :T]
  stick = jnp.moveaxis(stick, 0, 2).reshape(B, H, Tp)[:, :, :T]
  return _add_remainder(o, stick, v_BTKD, remainder).astype(v_BTKD.dtype)
