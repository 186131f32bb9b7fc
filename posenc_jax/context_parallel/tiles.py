"""Blockwise softmax attention of local queries against one block of keys, with its lse.

The work unit of every ring step: queries [B, Tq, ...] against keys [B, Tk, ...] that may
come from another device, with an additive bias that splits into a query part and a key part
(gate prefix sums), a causal mask by global positions (or none: the keys all lie before the
queries) and a segment mask. Never holds more than a (block x block) tile of logits per head;
tiles that the causal mask empties are skipped.

Shape letters: B batch, H query heads, K kv heads (H % K == 0), D head dim, Dv value dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from posenc_jax import blockwise
from posenc_jax.masking import NEG_INF

DEFAULT_BLOCK = 128


def _blocks(x, n: int, C: int, value=0):
  """[B, T, ...] -> [n, B, C, ...] padded to n * C along T."""
  x = blockwise.pad_time(x, n * C, value=value)
  return jnp.moveaxis(x.reshape(x.shape[:1] + (n, C) + x.shape[2:]), 1, 0)


def _pos_blocks(pos, n: int, C: int, value):
  return jnp.pad(pos, (0, n * C - pos.shape[0]), constant_values=value).reshape(n, C)


def attend(q, k, v, *, q_bias=None, k_bias=None, q_pos=None, k_pos=None, q_seg=None,
           k_seg=None, q_chunk=None, k_chunk=None, pair_bias=None,
           block: int = DEFAULT_BLOCK):
  """softmax_j(q_i . k_j + q_bias_i + k_bias_j [+ pair_bias[chunk_i, chunk_j]]) over visible
  keys -> (o, lse).

  q [B, Tq, H, D] (already scaled); k [B, Tk, K, D]; v [B, Tk, K, Dv]; q_bias [B, Tq, H] and
  k_bias [B, Tk, H] or None; q_pos [Tq] / k_pos [Tk] global int positions (both or neither:
  causal k_pos <= q_pos); q_seg [B, Tq] / k_seg [B, Tk] or None; q_chunk [Tq] / k_chunk [Tk]
  int chunk numbers indexing pair_bias [B, H, chunks, chunks] (all three or none).
  Returns o [B, Tq, H, Dv] float32 and lse [B, Tq, H] float32 (NEG_INF where no key is seen).
  """
  B, Tq, H, D = q.shape
  Tk, K, Dv = k.shape[1], k.shape[2], v.shape[-1]
  G = H // K
  Cq, Ck = min(block, Tq), min(block, Tk)
  nq, nk = -(-Tq // Cq), -(-Tk // Ck)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  qb = _blocks(f32(q), nq, Cq).reshape(nq, B, Cq, K, G, D)
  kb, vb = _blocks(f32(k), nk, Ck), _blocks(f32(v), nk, Ck)
  zq, zk = jnp.zeros((B, Tq, H), jnp.float32), jnp.zeros((B, Tk, H), jnp.float32)
  qbias = _blocks(zq if q_bias is None else f32(q_bias), nq, Cq)
  kbias = _blocks(zk if k_bias is None else f32(k_bias), nk, Ck)
  causal = q_pos is not None
  big = jnp.iinfo(jnp.int32).max
  qp = _pos_blocks(jnp.zeros(Tq, jnp.int32) if q_pos is None else q_pos, nq, Cq, -1)
  kp = _pos_blocks(jnp.zeros(Tk, jnp.int32) if k_pos is None else k_pos, nk, Ck, big)
  kvalid = _pos_blocks(jnp.ones(Tk, bool), nk, Ck, False)
  seg = q_seg is not None
  qs = _blocks(q_seg, nq, Cq, -1) if seg else jnp.zeros((nq, 1, 1), jnp.int32)
  ks = _blocks(k_seg, nk, Ck, -2) if seg else jnp.zeros((nk, 1, 1), jnp.int32)
  pairs = pair_bias is not None
  if pairs:
    qc, kc = _pos_blocks(q_chunk, nq, Cq, 0), _pos_blocks(k_chunk, nk, Ck, 0)

  def query_block(a):
    q_a, qb_a, qp_a, qs_a = qb[a], qbias[a], qp[a], qs[a]

    def visit(state, c):
      s = jnp.einsum("bikgd,bjkd->bkgij", q_a, kb[c]).reshape(B, H, Cq, Ck)
      s = s + jnp.moveaxis(qb_a, 1, 2)[..., :, None] + jnp.moveaxis(kbias[c], 1, 2)[..., None, :]
      if pairs:
        s = s + pair_bias.astype(jnp.float32)[:, :, qc[a]][..., kc[c]]
      mask = kvalid[c][None, None, None, :]
      if causal:
        mask = mask & (kp[c][None, None, None, :] <= qp_a[None, None, :, None])
      if seg:
        mask = mask & (qs_a[:, None, :, None] == ks[c][:, None, None, :])
      return blockwise.update_state(state, s, mask, vb[c])

    @jax.checkpoint
    def step(state, c):
      live = (kp[c].min() <= qp_a.max()) if causal else jnp.bool_(True)
      return jax.lax.cond(live, visit, lambda s, _: s, state, c), None

    state = blockwise.init_state(B, H, Cq, Dv)
    if nk == 1:   # one key tile: no loop to build (cheaper to compile; same arithmetic)
      state = visit(state, 0)
    else:
      state, _ = jax.lax.scan(step, state, jnp.arange(nk))
    lse = jnp.where(state.l_BHQ > 0, state.m_BHQ + jnp.log(jnp.maximum(state.l_BHQ, 1e-30)),
                    NEG_INF)
    return blockwise.finalize(state), jnp.moveaxis(lse, 1, 2)     # [B,Cq,H,Dv], [B,Cq,H]

  if nq == 1:
    o, lse = jax.tree.map(lambda x: x[None], query_block(0))
  else:
    o, lse = jax.lax.map(jax.checkpoint(query_block), jnp.arange(nq))
  o = jnp.moveaxis(o, 0, 1).reshape(B, nq * Cq, H, Dv)[:, :Tq]
  lse = jnp.moveaxis(lse, 0, 1).reshape(B, nq * Cq, H)[:, :Tq]
  return o, lse
