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


def _shard(q, k, v, log_forget, segment_ids, *, n: int, scale: float, zigzag: bool,
           local: Callable | None, block: int):
  d = mesh.shard_index()
  args = (q, k, v, log_forget, segment_ids)
  slots = layout.to_zigzag(args, n, d) if zigzag else (args,)
  C = slots[0][0].shape[1]
  cat = lambda xs: None if xs[0] is None else jnp.concatenate(xs, axis=1)  # noqa: E731
  q_c, k_c, v_c, lf_c, seg_c = (cat([sl[i] for sl in slots]) for i in range(5))
  q_s = scale * q_c.astype(jnp.float32)
  q_pos, q_chunk = _positions(layout.chunk_ids(d, n, zigzag=zigzag), C)
  pre = tail = pairs = None
  if lf_c is not None:
    pre = jnp.concatenate([jnp.cumsum(sl[3].astype(jnp.float32), axis=1) for sl in slots],
                          axis=1)                                   # gate over (chunk start, i]
    totals = pre.reshape(pre.shape[0], len(slots), C, -1)[:, :, -1]  # [B, slots, H]
    tail = jnp.repeat(totals, C, axis=1) - pre                      # gate over (j, chunk end]
    pairs = _pair_bias(_chunk_totals(totals, n, zigzag))

  def attend(key, src):
    k_pos, k_chunk = _positions(layout.chunk_ids(src, n, zigzag=zigzag), C)
    k_s, v_s, tail_s, seg_s = key
    return tiles.attend(q_s, k_s, v_s, q_bias=pre, k_bias=tail_s, q_pos=q_pos, k_pos=k_pos,
                        q_seg=seg_c, k_seg=seg_s, q_chunk=q_chunk, k_chunk=k_chunk,
                        pair_bias=pairs, block=block)

  own = (k_c, v_c, tail, seg_c)
  if local is None:
    o, lse = attend(own, d)
  else:   # the local attention of each chunk, and under zig-zag chunk d for chunk 2N-1-d
    parts = [local(*sl[:4], segment_ids=sl[4], scale=scale) for sl in slots]
    if zigzag:
      first = (k_c[:, :C], v_c[:, :C], None if tail is None else tail[:, :C], 
               None if seg_c is None else seg_c[:, :C])
      k_pos, k_chunk = _positions((d,), C)
      cross = tiles.attend(q_s[:, C:], *first[:2], q_bias=None if pre is None else pre[:, C:],
                           k_bias=first[2], q_seg=None if seg_c is None else seg_c[:, C:],
                           k_seg=first[3], q_pos=q_pos[C:], k_pos=k_pos,
                           q_chunk=q_chunk[C:], k_chunk=k_chunk, pair_bias=pairs, block=block)
      parts[1] = merge(*parts[1], *cross)
    o = jnp.concatenate([p[0].astype(jnp.float32) for p in parts], axis=1)
    lse = jnp.concatenate([p[1] for p in parts], axis=1)

  def step(carry, s):
    o, lse, key = carry
    key = mesh.ring_shift(key, n)                                  # the chunks of device d - s
    o, lse = merge(o, lse, *attend(key, (d - s) % n))              # later chunks: all masked
    return (o, lse, key), None

  (o, lse, _), _ = jax.lax.scan(step, (o, lse, own), jnp.arange(1, n))
  o = o.astype(v.dtype)
  return layout.from_zigzag(o[:, :C], o[:, C:], n, d) if zigzag else o


def forgetting_attention(q, k, v, log_forget, *, segment_ids=None, scale: float,
                         zigzag: bool | None = None, local: Callable | None = None,
                         block: int = tiles.DEFAULT_BLOCK):
  """FoX (ALiBi: a constant gate; log_forget None: plain causal softmax) with T sharded over
  "context"; the arguments and result of unipotent.forgetting_attention_reference.
  zigzag: the load-balanced layout (None: on when each device's block splits in two).
  local: a chunk's causal attention with its lse (kernel_local on an accelerator; None: the
  device's chunks attend to themselves in one blockwise jnp pass)."""
  n = mesh.context_size()
  T = q.shape[1]
  if zigzag is None:
    zigzag = (T // n) % 2 == 0
  if zigzag and (T // n) % 2:
    raise ValueError(f"zigzag=True needs an even number of tokens per device; T={T} over "
                     f"context={n} gives {T // n}: use zigzag=False or pad T")
  fn = functools.partial(_shard, n=n, scale=scale, zigzag=zigzag, local=local, block=block)
  return mesh.run_sharded(fn, (q, k, v, log_forget, segment_ids))


def softmax_attention(q, k, v, *, segment_ids=None, scale: float, **kwargs):
  """Plain causal softmax attention with T sharded over "context" (forgetting_attention
  with no gate): NoPE, and every rotation encoding after its phases are applied."""
  return forgetting_attention(q, k, v, None, segment_ids=segment_ids, scale=scale, **kwargs)
