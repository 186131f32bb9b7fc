"""Softmax, FoX and ALiBi attention across devices: a ring of keys with gate prefix sums.

Each device holds one chunk of T (contiguous) or two (zig-zag, layout.py). The logit of query
i and key j is scale q_i . k_j + sum_{s=j+1}^{i} log_forget_s (no gate: softmax). The gate
sum of a pair in different chunks a > b splits into three exact parts:

    (query's prefix sum inside chunk a) + (key's tail sum inside chunk b)
    + (the totals of the chunks strictly between b and a)

The chunk totals are tiny ([B, chunks, H]) and all-gathered once; the keys travel with their
tails. A device's own chunks attend causally to themselves (the family's local attention,
with its lse); every other (query chunk, key chunk) pair with b < a is non-causal attention;
pairs with b > a are skipped. N - 1 ring passes; partial results merge by their lse.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.context_parallel import layout
from posenc_jax.context_parallel import mesh
from posenc_jax.context_parallel import tiles
from posenc_jax.context_parallel import pairs
from posenc_jax.context_parallel.merge import merge


def jnp_local(q, k, v, log_forget, *, segment_ids, scale, block: int = tiles.DEFAULT_BLOCK):
  """Causal attention of one chunk with itself (gate from in-chunk prefix sums) -> (o, lse)."""
  pos = jnp.arange(q.shape[1])
  pre = None if log_forget is None else jnp.cumsum(log_forget.astype(jnp.float32), axis=1)
  return tiles.attend(scale * q.astype(jnp.float32), k, v, q_bias=pre,
                      k_bias=None if pre is None else -pre, q_pos=pos, k_pos=pos,
                      q_seg=segment_ids, k_seg=segment_ids, block=block)


def kernel_local(q, k, v, log_forget, *, segment_ids, scale, block_sizes=None):
  """The Pallas FoX kernel (no gate: softmax) as the local attention, with its lse."""
  import kernels_pallas  # imported lazily: the kernels are optional on CPU
  return kernels_pallas.forgetting_attention(q, k, v, log_forget, scale=scale,
                                             segment_ids=segment_ids, block_sizes=block_sizes,
                                             interpret=jax.default_backend() == "cpu",
                                             return_lse=True)


def _chunk_totals(totals, n: int, zigzag: bool):
  """Each device's chunk totals [B, slots, H] -> every chunk's, in T order [B, chunks, H]."""
  everyone = jax.lax.all_gather(totals, mesh.AXIS)                    # [n, B, slots, H]
  B, H = totals.shape[0], totals.shape[-1]
  flat = jnp.moveaxis(everyone, 0, 1).reshape(B, -1, H)               # device-major
  order = layout.chunk_table(n, zigzag=zigzag).reshape(-1).argsort()
  return flat[:, order]


def _pair_bias(tot_g):
  """[B, H, a, b]: the gate sum a pair of chunks adds beyond (query prefix + key tail): the
  totals of the chunks strictly between b < a; on the diagonal -total[a] (prefix_i + tail_j
  - total = prefix_i - prefix_j); above it anything (masked)."""
  c = np.arange(tot_g.shape[1])
  between = (c[None, None, :] > c[None, :, None]) & (c[None, None, :] < c[:, None, None])
  mid = jnp.einsum("zch,xyc->zhxy", tot_g, between.astype(np.float32))
  return mid - jnp.einsum("zxh,xy->zhxy", tot_g, np.eye(len(c), dtype=np.float32))


def _positions(ids, C: int):
  """Global positions and chunk numbers [slots * C] of the chunks `ids` (traced ints)."""
  pos = jnp.concatenate([i * C + jnp.arange(C) for i in ids])
  return pos, jnp.concatenate([jnp.full((C,), i) for i in ids])


def _contiguous_shard(q, k, v, log_forget, segment_ids, *, n: int, scale: float,
                      local: Callable | None, block: int):
  """Device d holds block d of N: its own block with local (or one causal blockwise pass),
  then N - 1 ring steps of masked tiles (blocks after d are skipped tile by tile)."""
  d = mesh.shard_index()
  C = q.shape[1]
  q_s = scale * q.astype(jnp.float32)
  q_pos, q_chunk = _positions((d,), C)
  pre = tail = between = None
  if log_forget is not None:
    pre = jnp.cumsum(log_forget.astype(jnp.float32), axis=1)       # gate over (start, i]
    totals = pre[:, -1:]                                            # [B, 1, H]
    tail = totals - pre                                             # gate over (j, end]
    between = _pair_bias(_chunk_totals(totals, n, False))

  def attend(key, src):
    k_pos, k_chunk = _positions((src,), C)
    k_s, v_s, tail_s, seg_s = key
    return tiles.attend(q_s, k_s, v_s, q_bias=pre, k_bias=tail_s, q_pos=q_pos, k_pos=k_pos,
                        q_seg=segment_ids, k_seg=seg_s, q_chunk=q_chunk, k_chunk=k_chunk,
                        pair_bias=between, block=block)

  own = (k, v, tail, segment_ids)
  if local is None:
    o, lse = attend(own, d)
  else:
    o, lse = local(q, k, v, log_forget, segment_ids=segment_ids, scale=scale)

  def step(carry, s):
    o, lse, key = carry
    key = mesh.ring_shift(key, n)                                  # the block of device d - s
    o, lse = merge(o, lse, *attend(key, (d - s) % n))              # later blocks: all masked
    return (o, lse, key), None

  (o, lse, _), _ = jax.lax.scan(step, (o.astype(jnp.float32), lse, own), jnp.arange(1, n))
  return o.astype(v.dtype)


def _zigzag_shard(q, k, v, log_forget, segment_ids, *, n: int, scale: float,
                  local: Callable, cross: Callable):
  """Device d holds chunks d and 2N-1-d (pairs.run): each chunk's local attention, then one
  full block of `cross` per visible chunk pair; the gate totals in between join the keys'
  tails."""
  d = mesh.shard_index()
  slots = layout.to_zigzag((q, k, v, log_forget, segment_ids), n, d)
  parts, queries, keys, totals = [], [], [], []
  for q_c, k_c, v_c, lf_c, seg_c in slots:
    parts.append(local(q_c, k_c, v_c, lf_c, segment_ids=seg_c, scale=scale))
    pre = tail = None
    if lf_c is not None:
      pre = jnp.cumsum(lf_c.astype(jnp.float32), axis=1)           # gate over (start, i]
      totals.append(pre[:, -1])
      tail = pre[:, -1:] - pre                                      # gate over (j, end]
    queries.append((scale * q_c.astype(jnp.float32), pre, seg_c))
    keys.append((k_c, v_c, tail, seg_c))
  if log_forget is None:
    between = lambda a, b, k_b, bias: (k_b, bias)  # noqa: E731
  else:
    tot = pairs.chunk_sums(jnp.stack(totals, axis=1), n)          # [B, 2N, H]

    def between(a, b, k_b, bias):
      return k_b, bias + pairs.gate_between(tot, a, b)[:, None]
  (o0, _), (o1, _) = pairs.run(parts, queries, keys, n=n, cross=cross, between=between)
  return layout.from_zigzag(o0.astype(v.dtype), o1.astype(v.dtype), n, d)


def forgetting_attention(q, k, v, log_forget, *, segment_ids=None, scale: float,
                         zigzag: bool | None = None, local: Callable | None = None,
                         cross: Callable | None = None, block: int = tiles.DEFAULT_BLOCK):
  """FoX (ALiBi: a constant gate; log_forget None: plain causal softmax) with T sharded over
  "context"; the arguments and result of unipotent.forgetting_attention_reference.
  zigzag: the load-balanced layout (None: on when each device's block splits in two).
  local: a chunk's causal attention with its lse (kernel_local on an accelerator; None:
  jnp_local); cross: a query chunk's non-causal attention to a whole key chunk with its lse
  (the Pallas block kernel on an accelerator; None: tiles.attend). Zig-zag only: the
  contiguous layout keeps masked tiles.attend steps."""
  n = mesh.context_size()
  if layout.use_zigzag(zigzag, T=q.shape[1], n=n):
    fn = functools.partial(_zigzag_shard, n=n, scale=scale,
                           local=local or functools.partial(jnp_local, block=block),
                           cross=cross or functools.partial(tiles.attend, block=block))
  else:
    fn = functools.partial(_contiguous_shard, n=n, scale=scale, local=local, block=block)
  return mesh.run_sharded(fn, (q, k, v, log_forget, segment_ids))


def softmax_attention(q, k, v, *, segment_ids=None, scale: float, **kwargs):
  """Plain causal softmax attention with T sharded over "context" (forgetting_attention
  with no gate): NoPE, and every rotation encoding after its phases are applied."""
  return forgetting_attention(q, k, v, None, segment_ids=segment_ids, scale=scale, **kwargs)
