"""The span forward's far keys as a Mosaic GPU launch (TMA, wgmma): plan.forward_far "mosaic".

With the span forward, a query chunk c attends to the key chunks of every earlier span J as plain
attention: its boundary state qb_c^(s_J) against the keys moved to that span's end, kb_m
(spans.boundary_kernel), m = J span .. (J + 1) span - 1. In the Triton forward those far steps
share one program with the near walk (forward.fwd_kernel); here they are a launch of their own,
a flash-attention forward whose query tile changes at each span boundary, and forward.forward
merges its (o, lse) with the near kernel's (merge_far). Why: far pairs are most of the causal
triangle at long sequences, and at head_dim 128 the Triton forward ran them at about half of
cuDNN's rate, where this form (organised as jax's own Mosaic GPU flash forward) comes close to it.

One program per (two query chunks c, c + 1, query head, batch): c even and the span even, so
both lie in one span and attend to the same far keys. Two compute warpgroups take one query
chunk (64 rows) each, a third copies the key chunks m = 0 .. jc span - 1 (jc = c // span) into a
ring (common.key_value_ring): each key chunk is read once for 128 query rows, and while one
compute warpgroup takes its softmax the other can use the tensor cores. Each compute warpgroup
fetches its own boundary states through a two-slot ring, the next span's issued while this
one's keys run.

A row whose far keys are all masked (packed documents starting inside c's span) ends with l = 0:
o = 0 and lse = -inf, which merge_far weighs as nothing. With packed documents the walk starts at
the span of the earliest key chunk the pair's documents reach (common.first_span), as the Triton
kernel skips; a masked tile inside the walk contributes exp2(-inf) = 0. The near kernel stores no
state for the spans wholly left of chunk c's documents, so for the second chunk of a pair those
rows of qb can be whatever the buffer held; every key of those spans is masked for every row of
that chunk, and the mask's where() replaces whatever their products gave (NaN included) with
-inf. An odd n's last program runs chunk n - 1 on both compute warpgroups (the same values
written twice).

Scope: bf16 or f16, chunk 64, head_dim a multiple of 64 (plan.mosaic_takes). far_reference is
its oracle, which the interpreter runs in its place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.path_attention import operands
from kernels_pallas.path_attention.mosaic_gpu.common import (
    LOG2E, dims, gate_and_mask, gate_vectors, key_value_ring, launch, query_pair, slot_types,
    smem_tile)
from kernels_pallas.path_attention.tiles import boundary_offset


def far_forward(ops, kb, qb, *, scale: float, span: int, slots: int = 2):
  """-> o [B, H, n, C, D] float32 (normalised over the far keys; 0 where a row has none),
  lse [B, H, n, C] float32 (natural log; -inf where none).

  ops: the pre-pass Operands (v, and the gate's fq / fk and the segment ids sq / sk where
  present); kb [B, K, n, C, D] the keys moved to their span's end; qb [B, H, R, D] the packed
  boundary states (tiles.boundary_offset), written by the near kernel. slots: the key ring's
  depth."""
  B, H, K, G, n, C, D, dt, gate, segments = dims(ops)
  f32 = jnp.float32
  wgmma_layout = plgpu.Layout.WGMMA
  rows_layout = plgpu.Layout.WGMMA.reduce(1)
  if span % 2:   # chunks c, c + 1 (c even) must share a span, i.e. their far keys
    raise ValueError(f"span={span} must be even")
  pairs = (n + 1) // 2
  head = {}
  ring = {"k": kb, "v": ops.v}
  gate_vectors(ops, C, query_side=head, key_side=ring)
  qbc = qb.reshape(B, H, qb.shape[2] // C, C, D)
  per_query_head = {"fq", "fk"}

  def body(refs, smem, bars, consumed):
    wg, h, b, c0, kh, head_of, jc, j0 = query_pair(refs, n=n, span=span, G=G,
                                                   per_query_head=per_query_head)
    start, steps = j0 * span, jc * span   # the far key chunks walked: start .. steps - 1

    key_side = [name for name in ring if name != "v"]   # read by the logits: k's barrier

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")
      key_value_ring(refs, smem, bars, consumed, ring=ring, b=b, head_of=head_of, start=start,
                     stop=steps, slots=slots)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      c = jnp.minimum(c0 + wg, n - 1)
      state = lambda j: smem["qb"].at[wg, lax.rem(j, 2)]
      state_bar = lambda j: bars["qb"].at[2 * wg + lax.rem(j, 2)]

      def fetch_state(j):   # qb^(s_j) of chunk c into this warpgroup's state slot j % 2
        row = boundary_offset(j, n=n, span=span) + c - (j + 1) * span
        plgpu.copy_gmem_to_smem(refs["qb"].at[b, h, row], state(j), state_bar(j))

      for name in head:
        plgpu.copy_gmem_to_smem(refs[name].at[b, head_of(name), c], smem[name].at[wg],
                                bars[name].at[wg])
      for j in range(2):
        pl.when(j0 + j < jc)(lambda j=j: fetch_state(j0 + j))
      for name in head:
        plgpu.barrier_wait(bars[name].at[wg])

      rows = lambda x: lax.broadcast_in_dim(x, (C, C), [0])
      load = lambda ref, layout: plgpu.load(ref, (), layout=layout)
      fq = load(smem["fq"].at[wg], rows_layout) if gate else None
      sq = load(smem["sq"].at[wg], rows_layout) if segments else None

      def key(qt):
        def step(i, carry):
          m_i, l_i, acc = carry
          slot = lax.rem(i, jnp.array(slots, i.dtype))
          at = lambda name: smem[name].at[slot]
          for name in key_side:
            plgpu.barrier_wait(bars[name].at[slot])

          def qk(r):
            plgpu.wgmma(r, qt, plgpu.transpose_ref(at("k"), (1, 0)))
            return r[...]

          s = gate_and_mask(pl.run_scoped(qk, plgpu.ACC((C, C), f32)) * (scale * LOG2E),
                            fq=fq, fk_ref=at("fk") if gate else None, sq=sq,
                            sk_ref=at("sk") if segments else None)
          plgpu.barrier_arrive(consumed["k"].at[slot])   # k (and fk, sk) read
          m_new = jnp.maximum(m_i, s.max(axis=1))
          m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
          alpha = jnp.exp2(m_i - m_use)
          p_ = jnp.exp2(s - rows(m_use))
          l_i = l_i * alpha + p_.sum(axis=1)
          acc = acc * lax.broadcast_in_dim(alpha, (C, D), [0])
          plgpu.barrier_wait(bars["v"].at[slot])
          acc = pl.run_state(lambda r: plgpu.wgmma(r, p_.astype(dt), at("v")))(
              plgpu.ACC.init(acc))
          plgpu.barrier_arrive(consumed["v"].at[slot])
          return m_new, l_i, acc

        return step

      def far_span(J, carry):
        plgpu.barrier_wait(state_bar(J))
        carry = lax.fori_loop(J * span, (J + 1) * span, key(state(J)), carry)
        pl.when(J + 2 < jc)(lambda: fetch_state(J + 2))
        return carry

      m_i = plgpu.layout_cast(jnp.full((C,), -jnp.inf, f32), rows_layout)
      l_i = plgpu.layout_cast(jnp.zeros((C,), f32), rows_layout)
      acc = plgpu.layout_cast(jnp.zeros((C, D), f32), wgmma_layout)
      m_i, l_i, acc = lax.fori_loop(j0, jc, far_span, (m_i, l_i, acc))
      none = l_i == 0.0
      o_smem, lse_smem = smem["o"].at[wg], smem["lse"].at[wg]
      o_smem[...] = acc / lax.broadcast_in_dim(jnp.where(none, 1.0, l_i), (C, D), [0])
      lse_smem[...] = jnp.where(none, -jnp.inf,
                                m_i + jnp.log2(jnp.where(none, 1.0, l_i))) * (1.0 / LOG2E)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, refs["o"].at[b, h, c])
      plgpu.copy_smem_to_gmem(lse_smem, refs["lse"].at[b, h, c])
      plgpu.wait_smem_to_gmem(0)

  smem_types = {name: plgpu.SMEM((2, C), head[name].dtype) for name in head}
  smem_types.update(slot_types(ring, slots, C, D))
  smem_types["qb"] = smem_tile(dt, 2, 2, C, D)
  smem_types["o"] = smem_tile(f32, 2, C, D)
  smem_types["lse"] = plgpu.SMEM((2, C), f32)
  bar_types = {name: plgpu.Barrier(num_barriers=slots) for name in ring}
  bar_types["qb"] = plgpu.Barrier(num_barriers=4)
  bar_types.update({name: plgpu.Barrier(num_barriers=2) for name in head})
  consumed_types = {name: plgpu.Barrier(num_arrivals=2, num_barriers=slots)
                    for name in ("k", "v")}
  bounds = {} if ops.lo is None else {"lo": ops.lo}
  o, lse = launch(body, {**head, **ring, "qb": qbc, **bounds},
                  dict(o=jax.ShapeDtypeStruct((B, H, n, C, D), f32),
                       lse=jax.ShapeDtypeStruct((B, H, n, C), f32)),
                  smem_types=smem_types, bar_types=bar_types, consumed_types=consumed_types,
                  grid=(pairs, H, B), grid_names=("c", "heads", "batch"))
  return o, lse


def far_reference(ops, kb, qb, *, scale: float, span: int):
  """far_forward's oracle in plain jnp (float32 products of the stored bf16 states and keys):
  the same (o, lse). The interpreter runs it in far_forward's place (plgpu's wgmma does not run
  in interpret mode), so the near kernel's far=False form and the merge are tested on the CPU;
  TestGPU compares the Mosaic kernel with it on the device."""
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  f32 = jnp.float32
  qbc = qb.reshape(B, H, qb.shape[2] // C, C, D).astype(f32)
  kbh = jnp.repeat(kb, G, axis=1).astype(f32)
  vh = jnp.repeat(operands.heads_major(ops.v), G, axis=1).astype(f32)
  os_, lses = [], []
  for c in range(n):
    jc = c // span
    if jc == 0:
      os_.append(jnp.zeros((B, H, C, D), f32))
      lses.append(jnp.full((B, H, C), -jnp.inf, f32))
      continue
    keys = slice(0, jc * span)
    s = jnp.concatenate([
        scale * jnp.einsum("bhqd,bhkd->bhqk",
                           qbc[:, :, boundary_offset(J, n=n, span=span) + c
                               - (J + 1) * span],
                           kbh[:, :, J * span:(J + 1) * span].reshape(B, H, span * C, D),
                           precision=lax.Precision.HIGHEST)
        for J in range(jc)], axis=-1)
    if ops.fq is not None:
      s = s + ops.fq[:, :, c] - ops.fk[:, :, keys].reshape(B, H, 1, jc * span * C)
    if ops.sq is not None:
      same = ops.sq[:, :, c] == ops.sk[:, :, keys].reshape(B, 1, 1, jc * span * C)
      s = jnp.where(same, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse)[..., None])
    os_.append(jnp.einsum("bhqk,bhkd->bhqd", p, vh[:, :, keys].reshape(B, H, jc * span * C, D),
                          precision=lax.Precision.HIGHEST))
    lses.append(lse)
  return jnp.stack(os_, axis=2), jnp.stack(lses, axis=2)


def merge_far(o_near, lse_near, o_far, lse_far, *, dtype):
  """One softmax over the near and far keys from the two partial ones: o_near [B, n, C, H, D]
  (chunked, the near kernel's), lse_near [B, H, n, C, 1] (every row has its diagonal: finite),
  o_far [B, H, n, C, D], lse_far [B, H, n, C] (far_forward's; -inf where a row has no far key)
  -> (o [B, n, C, H, D] in `dtype`, lse [B, H, n, C, 1]). One XLA fusion: the far o's
  transpose rides in it."""
  lse_far = lse_far[..., None]
  lse = jnp.logaddexp(lse_near, lse_far)
  tm = operands.time_major
  o = o_near * tm(jnp.exp(lse_near - lse)) + tm(o_far * jnp.exp(lse_far - lse))
  return o.astype(dtype), lse
