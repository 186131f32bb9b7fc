"""PaTH and PaTH-FoX across devices: rings of Householder-transported keys.

For a query i of chunk a and a key j of an earlier chunk b,

    q_i^T (H_i ... H_{j+1}) k_j = q_start_i^T  P^(a-1) ... P^(b+1)  k_end_j

(householder.boundary_transport: queries moved to their chunk's start, keys to their chunk's
end, P^(c) a chunk's product). Each chunk's own attention is ordinary causal PaTH (the local
function, with its lse); every earlier chunk is plain non-causal softmax of q_start against
carried keys, merged by lse. The forget gate (PaTH-FoX) splits into the query's in-chunk
prefix sum, the key's in-chunk tail sum and the totals in between.

Zig-zag (default where T / N is even): chunks d and 2N-1-d on device d (pairs.run); the 2N
chunk products are all-gathered ([B, K, D, D] each) and a receiver carries each key chunk
itself, so keys travel as their owner made them. Contiguous (otherwise): block d on device d;
a device multiplies the keys it has attended to by its own P^(d) before passing them on, and
keys that wrapped round the ring are masked by position.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from posenc_jax import householder
from posenc_jax.context_parallel import layout
from posenc_jax.context_parallel import mesh
from posenc_jax.context_parallel import pairs
from posenc_jax.context_parallel import tiles
from posenc_jax.context_parallel.merge import merge


def jnp_local(q, k, v, w, beta, *, log_forget, segment_ids, scale):
  """The default local attention: the chunked jnp PaTH with its lse."""
  return householder.path_attention_chunked_lse(q, k, v, w, beta, log_forget=log_forget,
                                                segment_ids=segment_ids, scale=scale)


def kernel_local(q, k, v, w, beta, *, log_forget, segment_ids, scale, block_sizes=None):
  """The Pallas kernel as the local attention (GPU / TPU), with its lse."""
  import kernels_pallas  # imported lazily: the kernels are optional on CPU
  return kernels_pallas.path_attention(q, k, v, w, beta, log_forget, scale=scale,
                                       segment_ids=segment_ids, block_sizes=block_sizes,
                                       interpret=jax.default_backend() == "cpu",
                                       return_lse=True)


def _contiguous_shard(q, k, v, w, beta, log_forget, segment_ids, *, n: int, scale: float,
                      local: Callable, chunk_size: int, block: int):
  d = mesh.shard_index()
  Tl = q.shape[1]
  o, lse = local(q, k, v, w, beta, log_forget=log_forget, segment_ids=segment_ids, scale=scale)
  q_start, k_end, P = householder.boundary_transport(scale * q.astype(jnp.float32), k, w, beta,
                                                     chunk_size=chunk_size)
  pre = tail = total = None
  if log_forget is not None:
    pre = jnp.cumsum(log_forget.astype(jnp.float32), axis=1)   # gate sum over (start, i]
    total = pre[:, -1]
    tail = total[:, None] - pre                                 # gate sum over (j, end]
  q_pos = d * Tl + jnp.arange(Tl)

  def step(carry, s):
    o, lse, key = carry
    key = mesh.ring_shift(key, n)                               # keys of block d - s (mod n)
    k_c, v_c, tail_c, seg_c = key
    # Blocks after d (wrapped round the ring) are masked by position and their tiles skipped.
    part = tiles.attend(q_start, k_c, v_c, q_bias=pre, k_bias=tail_c, q_pos=q_pos,
                        k_pos=((d - s) % n) * Tl + jnp.arange(Tl), q_seg=segment_ids,
                        k_seg=seg_c, block=block)
    o, lse = merge(o, lse, *part)
    # Carry the keys across this block before passing them on.
    k_c = jnp.einsum("bkde,btke->btkd", P, k_c)
    key = (k_c, v_c, None if tail_c is None else tail_c + total[:, None], seg_c)
    return (o, lse, key), None

  init = (o.astype(jnp.float32), lse, (k_end, v, tail, segment_ids))
  (o, lse, _), _ = jax.lax.scan(step, init, jnp.arange(1, n))
  return o.astype(v.dtype)


def _zigzag_shard(q, k, v, w, beta, log_forget, segment_ids, *, n: int, scale: float,
                  local: Callable, cross: Callable, chunk_size: int):
  """Device d holds chunks d and 2N-1-d (pairs.run). Every chunk's product P is all-gathered
  ([B, K, D, D] a chunk: tiny), so a receiver carries a key chunk b to a query chunk a's start
  through the products of the chunks strictly between, and keys travel only as their owner
  moved them (to their chunk's end)."""
  d = mesh.shard_index()
  slots = layout.to_zigzag((q, k, v, w, beta, log_forget, segment_ids), n, d)
  parts, queries, keys, products, totals = [], [], [], [], []
  for q_c, k_c, v_c, w_c, b_c, lf_c, seg_c in slots:
    parts.append(local(q_c, k_c, v_c, w_c, b_c, log_forget=lf_c, segment_ids=seg_c,
                       scale=scale))
    q_start, k_end, P = householder.boundary_transport(scale * q_c.astype(jnp.float32), k_c,
                                                       w_c, b_c, chunk_size=chunk_size)
    pre = tail = None
    if lf_c is not None:
      pre = jnp.cumsum(lf_c.astype(jnp.float32), axis=1)           # gate over (start, i]
      totals.append(pre[:, -1])
      tail = pre[:, -1:] - pre                                      # gate over (j, end]
    queries.append((q_start, pre, seg_c))
    keys.append((k_end, v_c, tail, seg_c))
    products.append(P)
  count = 2 * n
  P_all = pairs.chunk_order(jax.lax.all_gather(jnp.stack(products, axis=1), mesh.AXIS, axis=1),
                            n)                                      # [B, 2N, K, D, D]
  tot = None if log_forget is None else pairs.chunk_sums(jnp.stack(totals, axis=1), n)

  def between(a, b, k_b, bias):
    # P_{a-1} ... P_{b+1}: every chunk's product, the ones outside (b, a) replaced by I.
    inside = pairs.strictly_between(a, b, count)
    M = jnp.broadcast_to(jnp.eye(P_all.shape[-1], dtype=jnp.float32), P_all[:, 0].shape)
    for c in range(count):
      M = jnp.where(inside[c] > 0, P_all[:, c] @ M, M)
    k_b = jnp.einsum("bkde,btke->btkd", M, k_b)
    return k_b, None if bias is None else bias + pairs.gate_between(tot, a, b)[:, None]

  (o0, _), (o1, _) = pairs.run(parts, queries, keys, n=n, cross=cross, between=between)
  return layout.from_zigzag(o0.astype(v.dtype), o1.astype(v.dtype), n, d)


def path_attention(q, k, v, w, beta, *, log_forget=None, segment_ids=None, scale: float,
                   local: Callable | None = None, cross: Callable | None = None,
                   chunk_size: int = 64, block: int = tiles.DEFAULT_BLOCK,
                   zigzag: bool | None = None):
  """PaTH (PaTH-FoX with log_forget) with T sharded over "context"; the arguments and result
  of householder.path_attention_reference. local: the per-chunk attention returning
  (o, lse) (default: jnp_local; kernel_local on an accelerator); cross: non-causal attention
  of a query chunk to a whole key chunk with its lse (default: tiles.attend; the Pallas block
  kernel on an accelerator). zigzag: the load-balanced layout (None: on when each device's
  block splits in two); off, each device holds one contiguous block and the keys are carried
  round the ring by each device's product (masked tiles.attend steps)."""
  n = mesh.context_size()
  if layout.use_zigzag(zigzag, T=q.shape[1], n=n):
    fn = functools.partial(_zigzag_shard, n=n, scale=scale, local=local or jnp_local,
                           cross=cross or functools.partial(tiles.attend, block=block),
                           chunk_size=chunk_size)
  else:
    fn = functools.partial(_contiguous_shard, n=n, scale=scale, local=local or jnp_local,
                           chunk_size=chunk_size, block=block)
  return mesh.run_sharded(fn, (q, k, v, w, beta, log_forget, segment_ids))
