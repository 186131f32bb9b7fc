"""PaTH and PaTH-FoX across devices: the ring of Householder-transported keys.

Device d holds the contiguous block d of T. Its local attention is ordinary causal PaTH over
its own tokens, kept as (o, lse). For a query i of block d and a key j of an earlier block e,

    q_i^T (H_i ... H_{j+1}) k_j = q_start_i^T  P^(d-1) ... P^(e+1)  k_end_j

(householder.boundary_transport: queries moved to their block's start, keys to their block's
end, P^(e) a block's product). So the ring passes (k_end, v, gate tails, segment ids) forward;
a device that has attended to what it received multiplies the keys by its own P^(d) (and adds
its gate total to the tails) before passing them on, so keys arriving at device d are always
carried to d's start, and the cross-block part is plain non-causal softmax attention of
q_start against them (plus the gate: the query's in-block prefix sum + the key's carried
tail). Partial results merge by their lse. N - 1 passes; the products never travel.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from posenc_jax import householder
from posenc_jax.context_parallel import mesh
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


def _shard(q, k, v, w, beta, log_forget, segment_ids, *, n: int, scale: float,
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


def path_attention(q, k, v, w, beta, *, log_forget=None, segment_ids=None, scale: float,
                   local: Callable | None = None, chunk_size: int = 64,
                   block: int = tiles.DEFAULT_BLOCK):
  """PaTH (PaTH-FoX with log_forget) with T sharded over "context"; the arguments and result
  of householder.path_attention_reference. local: the per-block attention returning (o, lse)
  (default: jnp_local; kernel_local on an accelerator)."""
  n = mesh.context_size()
  fn = functools.partial(_shard, n=n, scale=scale, local=local or jnp_local,
                         chunk_size=chunk_size, block=block)
  return mesh.run_sharded(fn, (q, k, v, w, beta, log_forget, segment_ids))
