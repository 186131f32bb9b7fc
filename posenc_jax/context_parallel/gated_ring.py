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

from posenc_jax.context_parallel import layout
from posenc_jax.context_parallel import mesh
from posenc_jax.context_parallel import tiles
from posenc_jax.context_parallel.merge import merge
from posenc_jax.masking import NEG_INF


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


def _empty(q, v):
  B, T, H = q.shape[:3]
  return (jnp.zeros((B, T, H, v.shape[-1]), jnp.float32),
          jnp.full((B, T, H), NEG_INF, jnp.float32))


def _chunk_totals(totals, n: int, zigzag: bool):
  """Each device's chunk totals [B, slots, H] -> every chunk's, in T order [B, chunks, H]."""
  everyone = jax.lax.all_gather(totals, mesh.AXIS)                    # [n, B, slots, H]
  B, H = totals.shape[0], totals.shape[-1]
  flat = jnp.moveaxis(everyone, 0, 1).reshape(B, -1, H)               # device-major
  order = layout.chunk_table(n, zigzag=zigzag).reshape(-1).argsort()
  return flat[:, order]


def _between(tot_g, a, b):
  """sum of chunk totals strictly between chunks b < a -> [B, H]."""
  c = jnp.arange(tot_g.shape[1])
  return jnp.einsum("bch,c->bh", tot_g, ((c > b) & (c < a)).astype(tot_g.dtype))


def _shard(q, k, v, log_forget, segment_ids, *, n: int, scale: float, zigzag: bool,
           local: Callable, block: int):
  d = mesh.shard_index()
  args = (q, k, v, log_forget, segment_ids)
  slots = layout.to_zigzag(args, n, d) if zigzag else (args,)
  ids = layout.chunk_ids(d, n, zigzag=zigzag)
  gate = log_forget is not None
  queries, keys, pres = [], [], []
  for q_s, k_s, v_s, lf_s, seg_s in slots:
    pre = tail = None
    if gate:
      pre = jnp.cumsum(lf_s.astype(jnp.float32), axis=1)          # gate over (chunk start, i]
      tail = pre[:, -1:] - pre                                     # gate over (j, chunk end]
    queries.append((scale * q_s.astype(jnp.float32), pre, seg_s))
    keys.append((k_s, v_s, tail, seg_s))
    pres.append(pre)
  tot_g = (_chunk_totals(jnp.stack([p[:, -1] for p in pres], axis=1), n, zigzag)
           if gate else None)

  def cross(qry, key, a, b):
    q_s, pre, seg_q = qry
    k_s, v_s, tail, seg_k = key
    k_bias = None if tail is None else tail + _between(tot_g, a, b)[:, None]
    return tiles.attend(q_s, k_s, v_s, q_bias=pre, k_bias=k_bias, q_seg=seg_q, k_seg=seg_k,
                        block=block)

  # Step 0: the device's own chunks. Slot 0 precedes slot 1 under zig-zag (d < 2N-1-d).
  out = [local(*slots[i][:4], segment_ids=slots[i][4], scale=scale) for i in range(len(slots))]
  if zigzag:
    out[1] = merge(*out[1], *cross(queries[1], keys[0], ids[1], ids[0]))
  payload = tuple(keys)
  for s in range(1, n):
    payload = mesh.ring_shift(payload, n)                          # the chunks of device d - s
    src_ids = layout.chunk_ids((d - s) % n, n, zigzag=zigzag)
    for i, qry in enumerate(queries):
      for j, key in enumerate(payload):
        part = jax.lax.cond(src_ids[j] < ids[i],
                            lambda qk: cross(*qk, ids[i], src_ids[j]),
                            lambda qk: _empty(qk[0][0], qk[1][1]), (qry, key))
        out[i] = merge(*out[i], *part)
  o = [o_i.astype(v.dtype) for o_i, _ in out]
  return layout.from_zigzag(*o, n, d) if zigzag else o[0]


def forgetting_attention(q, k, v, log_forget, *, segment_ids=None, scale: float,
                         zigzag: bool | None = None, local: Callable | None = None,
                         block: int = tiles.DEFAULT_BLOCK):
  """FoX (ALiBi: a constant gate; log_forget None: plain causal softmax) with T sharded over
  "context"; the arguments and result of unipotent.forgetting_attention_reference.
  zigzag: the load-balanced layout (None: on when each device's block splits in two).
  local: a chunk's causal attention with its lse (default jnp_local; kernel_local on an
  accelerator)."""
  n = mesh.context_size()
  T = q.shape[1]
  if zigzag is None:
    zigzag = (T // n) % 2 == 0
  if zigzag and (T // n) % 2:
    raise ValueError(f"zigzag=True needs an even number of tokens per device; T={T} over "
                     f"context={n} gives {T // n}: use zigzag=False or pad T")
  local = local or functools.partial(jnp_local, block=block)
  fn = functools.partial(_shard, n=n, scale=scale, zigzag=zigzag, local=local, block=block)
  return mesh.run_sharded(fn, (q, k, v, log_forget, segment_ids))


def softmax_attention(q, k, v, *, segment_ids=None, scale: float, **kwargs):
  """Plain causal softmax attention with T sharded over "context" (forgetting_attention
  with no gate): NoPE, and every rotation encoding after its phases are applied."""
  return forgetting_attention(q, k, v, None, segment_ids=segment_ids, scale=scale, **kwargs)
