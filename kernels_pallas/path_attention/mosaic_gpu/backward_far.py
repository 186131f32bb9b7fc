"""The span backward's far walks as Mosaic GPU launches (TMA, wgmma): plan.far_dq and
plan.far_dkv "mosaic".

far_dq. In the span-parallel backward a query chunk c meets the key chunks of every earlier span
J as plain attention: its boundary state qb_c^(J) against the keys moved to that span's end,
kb_m. Its adjoint at the boundaries obeys the chain
A_c^(J) = A_c^(J-1) Pi_J^T + scale sum_{m in J} dS_cm kb_m (A_c^(-1) = 0), and the gate's query
side takes dfq_c = sum of dS_cm over the far keys. span_backward.far_dq_kernel (Triton) does the
states, the chain and the walk in one program; here the states come from
span_backward.far_states_kernel first and this launch does the walk and the chain. Structure as
forward_far's: one program per (two query chunks c, c + 1, query head, batch); two compute
warpgroups, one query chunk each, and a third that copies the key ring (kb, v, and the gate's
fk / segment ids sk) and the span operators Pi_J, which both compute warpgroups share. A step is
flash attention's dq step in log2 units: s = qb kb^T and dP = dO v^T issued together, p =
exp2(s - lse), dS = p (dP - delta), acc += scale dS kb. At span J's start the accumulator
becomes acc Pi_J^T in three bf16 passes (hi hi + lo hi + hi lo of bf16 halves of acc and of
Pi^T); at the span's end it is A^(J), stored to the packed A (tiles.boundary_offset) in the
kernel dtype. dO enters the products from registers at head_dim 128 (shared memory at 64, see
do_smem), the state from a one-slot shared-memory buffer per warpgroup, refilled with the next
span's state as soon as the span's last logits have been read.

far_dkv. The far query chunks' shares of each key chunk's gradients (span_backward's far dk/dv
walk): programs over key chunks m, m + 1 on the two compute warpgroups, the far query items
(query chunk, head of the group) streamed by the third; key-major tiles.

With packed documents the walks skip the chunk pairs wholly outside them, as the Triton kernels
do (operands.chunk_bounds, read as scalars from GMEM): far dq starts at the span of the earliest
key its pair's documents reach (common.first_span) and stores A^(J) = 0 for the spans before
it; far dk/dv stops after the last query chunk its pair's documents reach. A masked tile inside
a walk has p = exp2(-inf) = 0 and adds nothing. An odd n's last program runs chunk n - 1 on
both compute warpgroups (the same values written twice).

Scope: bf16 or f16, chunk 64, head_dim a multiple of 64 (plan.mosaic_takes). far_dq_reference
and far_dkv_reference are the oracles, which the interpreter runs in their place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.path_attention import operands
from kernels_pallas.path_attention.mosaic_gpu.common import (
    LOG2E, as_vector, chunk_of, copy_ring, dims, gate_and_mask, gate_vectors, key_value_ring,
    launch, query_pair, slot_types, smem_tile, two_products)
from kernels_pallas.path_attention.tiles import boundary_offset

HALVES = ("pi_hi", "pi_lo")   # the span operators' bf16 halves (pi_halves)


def pi_halves(pi, dtype):
  """pi [B, K, nb, D, D] float32 -> its hi and lo halves in `dtype` (pi ~ hi + lo to ~16
  mantissa bits with bf16), two arrays: a TMA copy of [2, D, D] tiles strides over more
  dimensions than it can at head_dim 128."""
  hi = pi.astype(dtype)
  return hi, (pi - hi.astype(jnp.float32)).astype(dtype)


def far_dq(ops, do, lse, delta, kb, qb, pi, *, scale: float, span: int, slots: int = 2):
  """-> A [B, H, R, D] (kernel dtype; packed as qb), dfq [B, H, n, C, 1] float32 (None without
  a gate): far_dq_reference's.

  ops: the pre-pass Operands (v, and the gate's fq / fk and the segment ids sq / sk where
  present); do [B, n, C, H, D] (chunked); lse, delta [B, H, n, C, 1] float32 (natural log); kb
  [B, K, n, C, D] the keys moved to their span's end; qb [B, H, R, D] the packed boundary states;
  pi [B, K, nb, D, D] float32 the span operators. slots: the key ring's depth."""
  B, H, K, G, n, C, D, dt, gate, segments = dims(ops)
  f32 = jnp.float32
  wgmma_layout = plgpu.Layout.WGMMA
  rows_layout = plgpu.Layout.WGMMA.reduce(1)
  if span % 2:   # chunks c, c + 1 (c even) must share a span, i.e. their far keys
    raise ValueError(f"span={span} must be even")
  pairs = (n + 1) // 2
  head = {"do": do, "lse": as_vector(lse, C), "delta": as_vector(delta, C)}
  ring = {"k": kb, "v": ops.v}
  gate_vectors(ops, C, query_side=head, key_side=ring)
  nrows = qb.shape[2] // C
  qbc = qb.reshape(B, H, nrows, C, D)
  per_query_head = {"do", "lse", "delta", "fq", "fk"}
  # dO as the dP product's A operand: from shared memory at head_dim 64 (as the logits' state;
  # from registers with B transposed the products came out wrong there); from
  # registers at 128, where its own buffer would not fit beside the rest (224 KiB + vectors)
  do_smem = D <= 64

  def body(refs, smem, bars, consumed):
    wg, h, b, c0, kh, head_of, jc, j0 = query_pair(refs, n=n, span=span, G=G,
                                                   per_query_head=per_query_head)
    start, steps = j0 * span, jc * span   # the far key chunks walked: start .. steps - 1

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      def fetch_pi(J):
        for name in HALVES:
          plgpu.copy_gmem_to_smem(refs[name].at[b, kh, J], smem[name], bars[name])

      def next_pi(t):   # Pi_J (J >= 1) goes in halfway through span J - 1, once Pi_{J-1} is used
        J = lax.div(t, jnp.array(span, t.dtype)) + 1

        @pl.when((lax.rem(t, jnp.array(span, t.dtype)) == span // 2) & (J < jc))
        def _():
          plgpu.barrier_wait(consumed["pi"])
          fetch_pi(J)

      pl.when(j0 < jc)(lambda: fetch_pi(j0))

      key_value_ring(refs, smem, bars, consumed, ring=ring, b=b, head_of=head_of, start=start,
                     stop=steps, slots=slots, before=next_pi)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      c = jnp.minimum(c0 + wg, n - 1)
      state, state_bar = smem["qb"].at[wg], bars["qb"].at[wg]
      out = smem["out"].at[wg]   # each A^(J) on its way out (and dO first, if it goes to registers)
      do_at = smem["do"].at[wg] if do_smem else out

      def row_of(J):   # chunk c's row of boundary J in the packed layout
        return boundary_offset(J, n=n, span=span) + c - (J + 1) * span

      def fetch_state(J):
        plgpu.copy_gmem_to_smem(refs["qb"].at[b, h, row_of(J)], state, state_bar)

      plgpu.copy_gmem_to_smem(chunk_of(refs, "do", b, h, c), do_at, bars["do"].at[wg])
      vectors = [name for name in head if name != "do"]
      for name in vectors:
        plgpu.copy_gmem_to_smem(refs[name].at[b, head_of(name), c], smem[name].at[wg],
                                bars[name].at[wg])
      pl.when(j0 < jc)(lambda: fetch_state(j0))
      for name in head:
        plgpu.barrier_wait(bars[name].at[wg])
      load = lambda ref, layout: plgpu.load(ref, (), layout=layout)
      do16 = do_at if do_smem else load(out, wgmma_layout)
      lse2 = load(smem["lse"].at[wg], rows_layout) * LOG2E
      delta_ = load(smem["delta"].at[wg], rows_layout)
      fq = load(smem["fq"].at[wg], rows_layout) if gate else None
      sq = load(smem["sq"].at[wg], rows_layout) if segments else None
      rows = lambda x: lax.broadcast_in_dim(x, (C, C), [0])
      zeros = lambda *shape: plgpu.layout_cast(jnp.zeros(shape, f32), wgmma_layout)

      def step(J):
        last = (J + 1) * span - 1

        def run(i, carry):
          acc, dfq = carry
          slot = lax.rem(i, jnp.array(slots, i.dtype))
          at = lambda name: smem[name].at[slot]
          for name in ring:
            plgpu.barrier_wait(bars[name].at[slot])

          s, dp = two_products(state, at("k"), do16, at("v"), rows=C, cols=C)
          plgpu.barrier_arrive(consumed["v"].at[slot])
          # the span's last logits are read: the state buffer takes the next span's
          pl.when((i == last) & (J + 1 < jc))(lambda: fetch_state(J + 1))
          s = gate_and_mask(s * (scale * LOG2E), fq=fq, fk_ref=at("fk") if gate else None,
                            sq=sq, sk_ref=at("sk") if segments else None)
          ds = jnp.exp2(s - rows(lse2)) * (dp - rows(delta_))
          if gate:
            dfq = dfq + ds.sum(axis=1)
          acc = pl.run_state(lambda r: plgpu.wgmma(r, (ds * scale).astype(dt), at("k")))(
              plgpu.ACC.init(acc))
          plgpu.barrier_arrive(consumed["k"].at[slot])
          return acc, dfq

        return run

      def far_span(J, carry):
        acc, dfq = carry
        # A^(J-1) Pi_J^T, three bf16 passes (Pi_0 meets a zero accumulator: no branch)
        for name in HALVES:
          plgpu.barrier_wait(bars[name])
        hi = acc.astype(dt)
        lo = (acc - hi.astype(f32)).astype(dt)
        pi_hi, pi_lo = (smem[name] for name in HALVES)   # Pi_J^T's halves, as stored

        def chain(r):
          plgpu.wgmma(r, lo, pi_hi)
          plgpu.wgmma(r, hi, pi_lo)
          plgpu.wgmma(r, hi, pi_hi)

        acc = pl.run_state(chain)(plgpu.ACC.init(zeros(C, D)))
        plgpu.barrier_arrive(consumed["pi"])
        plgpu.barrier_wait(state_bar)
        acc, dfq = lax.fori_loop(J * span, (J + 1) * span, step(J), (acc, dfq))
        plgpu.wait_smem_to_gmem(0)   # the previous A^(J-1) has left the staging tile
        out[...] = acc.astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out, refs["a"].at[b, h, row_of(J)])
        return acc, dfq

      # The spans before j0 hold only masked keys for both chunks: A^(J) = 0 there
      @pl.when(j0 > 0)
      def _():
        out[...] = zeros(C, D).astype(dt)   # (dO has left `out` for registers by now)
        plgpu.commit_smem()
        @pl.loop(0, j0)
        def _(J):
          plgpu.copy_smem_to_gmem(out, refs["a"].at[b, h, row_of(J)])

      dfq = plgpu.layout_cast(jnp.zeros((C,), f32), rows_layout)
      _, dfq = lax.fori_loop(j0, jc, far_span, (zeros(C, D), dfq))
      if gate:
        smem["dfq"].at[wg][...] = dfq
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem["dfq"].at[wg], refs["dfq"].at[b, h, c])
      plgpu.wait_smem_to_gmem(0)

  smem_types = {name: plgpu.SMEM((2, C), x.dtype) for name, x in head.items() if name != "do"}
  smem_types.update(slot_types(ring, slots, C, D))
  smem_types["qb"] = smem_tile(dt, 2, C, D)
  smem_types["out"] = smem_tile(dt, 2, C, D)
  if do_smem:
    smem_types["do"] = smem_tile(dt, 2, C, D)
  smem_types.update({name: smem_tile(dt, D, D) for name in HALVES})
  if gate:
    smem_types["dfq"] = plgpu.SMEM((2, C), f32)
  bar_types = {name: plgpu.Barrier(num_barriers=slots) for name in ring}
  bar_types.update({name: plgpu.Barrier(num_barriers=2) for name in head})
  bar_types["qb"] = plgpu.Barrier(num_barriers=2)
  bar_types.update({name: plgpu.Barrier(num_barriers=1) for name in HALVES})
  consumed_types = {name: plgpu.Barrier(num_arrivals=2, num_barriers=slots)
                    for name in ("k", "v")}
  consumed_types["pi"] = plgpu.Barrier(num_arrivals=2, num_barriers=1)
  # Pi^T, so that the chain's B operand is read as stored: with B transposed and A from
  # registers the products came out wrong at head_dim 64
  arrays = {**head, **ring, "qb": qbc,
            **dict(zip(HALVES, pi_halves(jnp.swapaxes(pi, -1, -2), dt))),
            **({} if ops.lo is None else {"lo": ops.lo})}
  out_type = dict(a=jax.ShapeDtypeStruct((B, H, nrows, C, D), dt))
  if gate:
    out_type["dfq"] = jax.ShapeDtypeStruct((B, H, n, C), f32)
  outs = launch(body, arrays, out_type, smem_types=smem_types, bar_types=bar_types,
                consumed_types=consumed_types, grid=(pairs, H, B),
                grid_names=("c", "heads", "batch"))
  a = outs[0].reshape(qb.shape)
  return a, (outs[1][..., None] if gate else None)


def far_dq_reference(ops, do, lse, delta, kb, qb, pi, *, scale: float, span: int):
  """far_dq's oracle in plain jnp (float32 products of the stored 16-bit states, keys and dO):
  the same (A, dfq). Rows of A that no chunk writes (none: every block's rows are some c >= s_J)
  stay zero. The interpreter runs it in far_dq's place; TestGPU compares the kernel with it."""
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  f32 = jnp.float32
  hp = lax.Precision.HIGHEST
  rep = lambda x: jnp.repeat(x, G, axis=1).astype(f32)
  kbh, vh, pih = rep(kb), rep(operands.heads_major(ops.v)), rep(pi)
  qbc = qb.reshape(B, H, qb.shape[2] // C, C, D).astype(f32)
  do32 = operands.heads_major(do).astype(f32)
  a = jnp.zeros(qbc.shape, f32)
  dfqs = []
  for c in range(n):
    adj = jnp.zeros((B, H, C, D), f32)
    dfq = jnp.zeros((B, H, C), f32)
    for J in range(c // span):
      keys = slice(J * span, (J + 1) * span)
      row = boundary_offset(J, n=n, span=span) + c - (J + 1) * span
      kj = kbh[:, :, keys].reshape(B, H, span * C, D)
      s = scale * jnp.einsum("bhqd,bhkd->bhqk", qbc[:, :, row], kj, precision=hp)
      if ops.fq is not None:
        s = s + ops.fq[:, :, c] - ops.fk[:, :, keys].reshape(B, H, 1, span * C)
      if ops.sq is not None:
        same = ops.sq[:, :, c] == ops.sk[:, :, keys].reshape(B, 1, 1, span * C)
        s = jnp.where(same, s, -jnp.inf)
      p = jnp.exp(s - lse[:, :, c])
      dp = jnp.einsum("bhqd,bhkd->bhqk", do32[:, :, c], vh[:, :, keys].reshape(B, H, span * C, D),
                      precision=hp)
      ds = p * (dp - delta[:, :, c])
      dfq = dfq + ds.sum(-1)
      adj = (jnp.einsum("bhqd,bhed->bhqe", adj, pih[:, :, J], precision=hp)
             + scale * jnp.einsum("bhqk,bhkd->bhqd", ds, kj, precision=hp))
      a = a.at[:, :, row].set(adj)
    dfqs.append(dfq)
  dfq = jnp.stack(dfqs, axis=2)[..., None] if ops.fq is not None else None
  return a.reshape(qb.shape).astype(qb.dtype), dfq


def far_dkv(ops, do, lse, delta, kb, qb, *, scale: float, span: int, slots: int = 2):
  """-> a, dv [B, K, n, C, D] float32, dfk [B, H, n, 1, C] float32 (None without a gate):
  span_backward.far_dkv_kernel's, the far query chunks' shares of each key chunk's gradients:
  a_m = scale sum dS_cm^T qb_c^(b), dv_m = sum p_cm^T dO_c, dfk_m = -colsum dS_cm over the
  query chunks c >= b (b the end of m's span) and the group's heads; zero for the last span's
  chunks. far_dkv_reference is the oracle.

  One program per (two key chunks m, m + 1 of one span, kv head, batch), the far dq's
  structure mirrored: each compute warpgroup keeps its key chunk's kb, v (and fk of every head
  of the group, sk) in shared memory, and the copying warpgroup streams the far query items
  (c, head) through a `slots`-deep ring: qb_c^(b), dO, lse, delta (fq, sq). Tiles are key-major
  ([keys, queries], as span_backward.far_dkv_kernel's): l^T = kb qb^T and dP^T = v dO^T
  issued together, then dv += p^T dO and a += scale dS^T qb issued together; dfk's sums run
  along a tile's rows. Shared memory at head_dim 128, bf16: ~193 KiB (keys 64, ring 64, the
  float32 output tile 64)."""
  B, H, K, G, n, C, D, dt, gate, segments = dims(ops)
  f32 = jnp.float32
  wgmma_layout = plgpu.Layout.WGMMA
  rows_layout, cols_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
  if span % 2:   # key chunks m, m + 1 (m even) must share a span, i.e. their far queries
    raise ValueError(f"span={span} must be even")
  pairs = (n + 1) // 2
  ring = {"qb": qb.reshape(B, H, qb.shape[2] // C, C, D), "do": do, "lse": as_vector(lse, C),
          "delta": as_vector(delta, C)}
  keys = {"k": kb, "v": ops.v}
  gate_vectors(ops, C, query_side=ring, key_side=keys)

  def body(refs, smem, bars, consumed):
    p, kh, b = lax.axis_index("m"), lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    m0 = 2 * p   # the earliest key chunks (the most far queries) first
    j = lax.div(m0, jnp.array(span, m0.dtype))
    first = (j + 1) * span   # the first far query chunk
    end = n   # past the last: with packed documents, past the last the pair's documents reach
    if "hi" in refs:
      end = jnp.minimum(jnp.maximum(refs["hi"][b, 0, m0, 0, 0],
                                    refs["hi"][b, 0, jnp.minimum(m0 + 1, n - 1), 0, 0]) + 1, n)
    chunks = jnp.maximum(end - first, 0)

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      def fetch(t):   # item t: query chunk first + t // G of head kh G + t % G
        slot = lax.rem(t, jnp.array(slots, t.dtype))
        i, g = lax.div(t, jnp.array(G, t.dtype)), lax.rem(t, jnp.array(G, t.dtype))
        h = kh * G + g
        for name in ring:
          src = (refs[name].at[b, h, boundary_offset(j, n=n, span=span) + i]
                 if name == "qb" else chunk_of(refs, name, b, 0 if name == "sq" else h, first + i))
          plgpu.copy_gmem_to_smem(src, smem[name].at[slot], bars[name].at[slot])

      def refill(t, slot):
        plgpu.barrier_wait(consumed["ring"].at[slot])
        fetch(t)

      copy_ring(start=0, stop=chunks * G, slots=slots, fill=fetch, refill=refill)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      m = jnp.minimum(m0 + wg, n - 1)
      for name in keys:
        if name == "fk":   # every head of the group
          for g in range(G):
            plgpu.copy_gmem_to_smem(refs[name].at[b, kh * G + g, m], smem[name].at[wg, g],
                                    bars[name].at[wg * G + g])
        else:
          plgpu.copy_gmem_to_smem(chunk_of(refs, name, b, 0 if name == "sk" else kh, m),
                                  smem[name].at[wg], bars[name].at[wg])
      for name in keys:
        if name == "fk":
          for g in range(G):
            plgpu.barrier_wait(bars[name].at[wg * G + g])
        else:
          plgpu.barrier_wait(bars[name].at[wg])
      k_at, v_at = smem["k"].at[wg], smem["v"].at[wg]
      load = lambda ref, layout: plgpu.load(ref, (), layout=layout)
      fk = [load(smem["fk"].at[wg, g], rows_layout) for g in range(G)] if gate else None
      sk = load(smem["sk"].at[wg], rows_layout) if segments else None
      rows = lambda x: lax.broadcast_in_dim(x, (C, C), [0])
      cols = lambda x: lax.broadcast_in_dim(x, (C, C), [1])
      zeros = lambda *shape: plgpu.layout_cast(jnp.zeros(shape, f32), wgmma_layout)

      def query_chunk(i, carry):
        a, dv, dfk = carry
        dfk = list(dfk)
        for g in range(G):
          t = i * G + g
          slot = lax.rem(t, jnp.array(slots, t.dtype))
          at = lambda name: smem[name].at[slot]
          for name in ring:
            plgpu.barrier_wait(bars[name].at[slot])

          st, dpt = two_products(k_at, at("qb"), v_at, at("do"), rows=C, cols=C)
          st = st * (scale * LOG2E)
          if gate:
            st = st + (cols(load(at("fq"), cols_layout)) - rows(fk[g])) * LOG2E
          if segments:
            st = jnp.where(rows(sk) == cols(load(at("sq"), cols_layout)), st, -jnp.inf)
          pt = jnp.exp2(st - cols(load(at("lse"), cols_layout) * LOG2E))
          dst = pt * (dpt - cols(load(at("delta"), cols_layout)))
          if gate:
            dfk[g] = dfk[g] - dst.sum(axis=1)

          def grads(refs_):
            rv, ra = refs_
            plgpu.wgmma(rv, pt.astype(dt), at("do"))
            plgpu.wgmma(ra, (dst * scale).astype(dt), at("qb"))

          dv, a = pl.run_state(grads)((plgpu.ACC.init(dv), plgpu.ACC.init(a)))
          plgpu.barrier_arrive(consumed["ring"].at[slot])
        return a, dv, tuple(dfk)

      dfk = tuple(plgpu.layout_cast(jnp.zeros((C,), f32), rows_layout)
                  for _ in range(G if gate else 0))
      a, dv, dfk = lax.fori_loop(0, chunks, query_chunk, (zeros(C, D), zeros(C, D), dfk))
      out = smem["out"].at[wg]
      for name, x in (("a", a), ("dv", dv)):
        out[...] = x
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out, refs[name].at[b, kh, m])
        plgpu.wait_smem_to_gmem(0)
      for g in range(G if gate else 0):
        smem["dfk"].at[wg, g][...] = dfk[g]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem["dfk"].at[wg, g], refs["dfk"].at[b, kh * G + g, m])
      plgpu.wait_smem_to_gmem(0)

  smem_types = slot_types(ring, slots, C, D)
  for name, x in keys.items():
    smem_types[name] = (plgpu.SMEM((2, G, C), x.dtype) if name == "fk" else
                        plgpu.SMEM((2, C), x.dtype) if x.ndim == 4 else smem_tile(dt, 2, C, D))
  smem_types["out"] = smem_tile(f32, 2, C, D)
  if gate:
    smem_types["dfk"] = plgpu.SMEM((2, G, C), f32)
  bar_types = {name: plgpu.Barrier(num_barriers=slots) for name in ring}
  bar_types.update({name: plgpu.Barrier(num_barriers=2 * G if name == "fk" else 2)
                    for name in keys})
  consumed_types = {"ring": plgpu.Barrier(num_arrivals=2, num_barriers=slots)}
  out_type = dict(a=jax.ShapeDtypeStruct((B, K, n, C, D), f32),
                  dv=jax.ShapeDtypeStruct((B, K, n, C, D), f32))
  if gate:
    out_type["dfk"] = jax.ShapeDtypeStruct((B, H, n, C), f32)
  bounds = {} if ops.lo is None else {"hi": ops.hi}
  outs = launch(body, {**ring, **keys, **bounds}, out_type, smem_types=smem_types,
                bar_types=bar_types, consumed_types=consumed_types, grid=(pairs, K, B),
                grid_names=("m", "heads", "batch"))
  return outs[0], outs[1], (outs[2].reshape(B, H, n, 1, C) if gate else None)


def far_dkv_reference(ops, do, lse, delta, kb, qb, *, scale: float, span: int):
  """far_dkv's oracle in plain jnp (float32 products of the stored 16-bit operands): the same
  (a, dv, dfk). The interpreter runs it in far_dkv's place; TestGPU compares the kernel with
  it."""
  B, H, n, C, D = ops.q.shape
  K = ops.k.shape[1]
  G = H // K
  f32 = jnp.float32
  hp = lax.Precision.HIGHEST
  a = jnp.zeros((B, K, n, C, D), f32)
  dv = jnp.zeros((B, K, n, C, D), f32)
  dfk = jnp.zeros((B, H, n, C), f32)
  heads = lambda x: x.reshape(B, K, G, *x.shape[2:])   # [B, H, ..] -> [B, K, G, ..]
  for j in range((n - 1) // span):
    first = (j + 1) * span
    rows = slice(boundary_offset(j, n=n, span=span) * C,
                 boundary_offset(j + 1, n=n, span=span) * C)
    ks = slice(j * span, first)
    kj = kb[:, :, ks].reshape(B, K, span * C, D).astype(f32)
    vj = operands.heads_major(ops.v)[:, :, ks].reshape(B, K, span * C, D).astype(f32)
    qj = heads(qb[:, :, rows]).astype(f32)                       # [B, K, G, Q, D]
    doj = heads(operands.heads_major(do)[:, :, first:].reshape(B, H, -1, D)).astype(f32)
    col = lambda x: heads(x[:, :, first:].reshape(B, H, 1, -1))   # a query-side row vector
    st = scale * jnp.einsum("bkmd,bkgqd->bkgmq", kj, qj, precision=hp)
    if ops.fq is not None:
      st = st + col(ops.fq) - heads(ops.fk[:, :, ks].reshape(B, H, -1, 1))
    if ops.sq is not None:
      same = (ops.sk[:, :, ks].reshape(B, 1, 1, -1, 1)
              == ops.sq[:, :, first:].reshape(B, 1, 1, 1, -1))
      st = jnp.where(same, st, -jnp.inf)
    pt = jnp.exp(st - col(lse))
    dst = pt * (jnp.einsum("bkmd,bkgqd->bkgmq", vj, doj, precision=hp) - col(delta))
    dv = dv.at[:, :, ks].set(jnp.einsum("bkgmq,bkgqd->bkmd", pt, doj, precision=hp)
                             .reshape(B, K, span, C, D))
    a = a.at[:, :, ks].set(scale * jnp.einsum("bkgmq,bkgqd->bkmd", dst, qj, precision=hp)
                           .reshape(B, K, span, C, D))
    dfk = dfk.at[:, :, ks].set(-dst.sum(-1).reshape(B, H, span, C))
  return a, dv, (dfk.reshape(B, H, n, 1, C) if ops.fq is not None else None)
