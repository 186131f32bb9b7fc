"""The span backward's near sweep as a Mosaic GPU launch (TMA, wgmma): plan.sweep "mosaic".

Inside span J (chunks lo_s .. hi_s - 1) span_backward.span_kernel walks, for each query tile of
chunks c, c + 1 (c - lo_s even), the key chunks m = lo .. c - 1 of the span in order, carrying
the adjoint of the tile's state from the span's start (A, the far dq launch's) to the tile's own
chunks:
  states (right to left): s_{c-1} = [q^_c; q^_{c+1} P_c], s_{m-1} = s_m P_m, P = I - E;
  step m: l = scale s_m k^_m^T, p = exp(l - lse), dS = p (dO v_m^T - delta),
          R <- R P_m^T + scale dS k^_m, dL/dP_m += s_m^T R_before (R_before: R before step m),
then chunk c + 1 alone against key chunk c (its state there is q^_{c+1}), and dq^ = R. In Triton
that sweep is the span backward's largest kernel (a float32 read-modify-write of dL/dP through
HBM at every step, six small dependent products). Here it is a launch of its own, after
span_kernel(sweeps=False) has written the far queries' share of dL/dP (the V and N chains), the
diagonal tiles and their dfq.

Structure: one program per (span, kv head, batch), the group's heads one after another, as
span_kernel. Compute warpgroup w holds the rows of chunk c + w (64 rows); the third copies each
step's key chunk (k^, v, E, the gate's fk, the segment ids sk) and the stored states s_m into a
ring of `slots` buffers.
- States: each compute warpgroup walks its rows' states right to left (its own E loads, two
  buffers), storing each s_m (kernel dtype) to a GMEM scratch; once both have, the copying
  warpgroup may read them back into the ring (consumed["states"]).
- Steps: the logits' and dP's products are issued together; the adjoint's update adds scale dS
  k^ (dS from registers) and (-R)E^T, -R in the kernel dtype from shared memory (so that B,
  E^T, is read transposed with A from shared memory: the operand pattern the logits use). The
  product dL/dP_m += s_m^T R contracts over both chunks' rows: both warpgroups store their -R
  to one double-buffered tile and meet at a barrier (adj), then warpgroup 0 forms the D x D
  product (A = s^T, read transposed) and adds it to dL/dP_m in GMEM with a TMA reduction
  (cp.reduce.async.bulk .add). dL/dP is the span kernel's output, updated in place
  (common.launch's `mutable`). Every reduction into one dL/dP_m comes from this program, one
  tile after another, and each tile waits for its reductions to complete before the next
  starts: a fixed order, so the sums are bitwise deterministic.
- With packed documents the sweep starts at the first key chunk either chunk's documents reach
  (operands.chunk_bounds' lo, scalars from GMEM), as span_kernel's first_key.

Scope (plan.sweep_takes): bf16 or f16, chunk 64, head_dim 64 (the D x D product is one 64-row
wgmma; at 128 this layout's shared memory would not fit), an even number of chunks (every tile a
pair). sweeps_reference is its oracle, which the interpreter runs in its place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.path_attention import operands
from kernels_pallas.path_attention.mosaic_gpu.common import (
    LOG2E, as_vector, chunk_of, dims, gate_and_mask, gate_vectors, launch, slot_types, smem_tile,
    two_products)
from kernels_pallas.path_attention.tiles import boundary_offset


def sweeps(ops, do, lse, delta, a, dp, *, scale: float, span: int, slots: int = 2):
  """-> dq^ [B, H, n, C, D] (kernel dtype), dfq [B, H, n, C, 1] float32 (the sweeps' share;
  None without a gate), dp + the sweeps' share of dL/dP [B, K, n, D, D] float32.

  ops: the pre-pass Operands; do [B, n, C, H, D] (chunked); lse, delta [B, H, n, C, 1] float32
  (natural log); a [B, H, R, D] the far dq launch's packed adjoints (tiles.boundary_offset); dp the
  span kernel's dL/dP (updated in place). sweeps_reference is the oracle."""
  B, H, K, G, n, C, D, dt, gate, segments = dims(ops)
  f32 = jnp.float32
  nsp = (n - 1) // span + 1
  wl = plgpu.Layout.WGMMA
  rows_layout = plgpu.Layout.WGMMA.reduce(1)
  head = {"q": ops.q, "do": do, "a": a.reshape(B, H, a.shape[2] // C, C, D),
          "lse": as_vector(lse, C), "delta": as_vector(delta, C)}
  ring = {"k": ops.k, "v": ops.v, "e": ops.e}
  gate_vectors(ops, C, query_side=head, key_side=ring)
  per_query_head = {"q", "do", "a", "lse", "delta", "fq", "fk"}
  tiled = ("q", "do", "a")

  def body(refs, smem, bars, consumed):
    J, kh, b = lax.axis_index("span"), lax.axis_index("kvh"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    lo_s = J * span
    tiles = lax.div(jnp.minimum(lo_s + span, n) - lo_s, 2)
    head_of = lambda name, h: h if name in per_query_head else 0 if name in ("sq", "sk") else kh

    def first_key(c):   # span_kernel's first_key for the pair c, c + 1
      if "lo" not in refs:
        return lo_s
      lo = jnp.minimum(refs["lo"][b, 0, c, 0, 0], refs["lo"][b, 0, c + 1, 0, 0])
      return jnp.maximum(lo, lo_s)

    def units(fn, carry):   # fn(g, c, carry) for every head of the group and tile of the span
      for g in range(G):
        carry = lax.fori_loop(0, tiles, lambda i, cr, g=g: fn(g, lo_s + 2 * i, cr), carry)
      return carry

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      def tile(g, c, t):
        h = kh * G + g
        lo = first_key(c)

        def step(m, t):
          slot = lax.rem(t, jnp.array(slots, t.dtype))
          pl.when(t >= slots)(lambda: plgpu.barrier_wait(consumed["ring"].at[slot]))
          for name in ring:
            plgpu.copy_gmem_to_smem(chunk_of(refs, name, b, head_of(name, h), m),
                                    smem[name].at[slot], bars[name].at[slot])

          @pl.when(m < c)
          def _():   # the stored state; the tile's first waits until both warpgroups stored
            pl.when(m == lo)(lambda: plgpu.barrier_wait(consumed["states"]))
            plgpu.copy_gmem_to_smem(refs["st"].at[b, kh, J, m - lo_s], smem["st"].at[slot],
                                    bars["st"].at[slot])
          return t + 1

        return lax.fori_loop(lo, c + 1, step, t)

      units(tile, lo_s - lo_s)   # (a traced zero: a literal carry does not lower in jax 0.11)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      load = lambda ref, layout: plgpu.load(ref, (), layout=layout)
      zeros = lambda *shape: plgpu.layout_cast(jnp.zeros(shape, f32), wl)
      rows = lambda x: lax.broadcast_in_dim(x, (C, C), [0])
      live = (wg == 1).astype(f32)   # the rows that meet key chunk c: chunk c + 1's

      def own_e(m, u):   # E_m into this warpgroup's buffer u % 2
        slot = wg * 2 + lax.rem(u, jnp.array(2, u.dtype))
        plgpu.copy_gmem_to_smem(refs["e"].at[b, kh, m], smem["own_e"].at[slot],
                                bars["own_e"].at[slot])

      def own_e_ready(u):
        slot = wg * 2 + lax.rem(u, jnp.array(2, u.dtype))
        plgpu.barrier_wait(bars["own_e"].at[slot])
        return smem["own_e"].at[slot]

      def moved(qt, e_ref):   # qt P = qt - qt E (E from shared memory, -qt from registers)
        return pl.run_state(lambda r: plgpu.wgmma(r, (-qt).astype(dt), e_ref))(
            plgpu.ACC.init(qt))

      def dp_add(m, pairs_):   # dL/dP_m += s_m^T R over both chunks' rows (warpgroup 0)
        @pl.when(wg == 0)
        def _():
          def product(r):
            for st_ref, nadj_ref in pairs_:
              plgpu.wgmma(r, plgpu.transpose_ref(st_ref, (1, 0)), nadj_ref)

          part = pl.run_state(product)(plgpu.ACC.init(zeros(D, D)))
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous step's has left
          smem["dp"][...] = -part
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(smem["dp"], refs["dp"].at[b, kh, m], reduction_op="add")

      def tile(g, c, carry):
        t, u, r = carry   # ring steps, own E loads, adjoint tiles so far
        h = kh * G + g
        cw = c + wg
        lo = first_key(c)
        qs = smem["q"].at[wg]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last tile's dq has left `a`
        # the adjoint at the span's start (none in the first span: row 0, zeroed below)
        arow = boundary_offset(jnp.maximum(J - 1, 0), n=n, span=span) + cw - lo_s
        arow = jnp.where(J > 0, arow, 0)
        for name in head:
          dst = qs if name == "q" else smem[name].at[wg]
          at = arow if name == "a" else cw
          plgpu.copy_gmem_to_smem(chunk_of(refs, name, b, head_of(name, h), at), dst,
                                  bars[name].at[wg])
        own_e(c, u)
        for name in head:
          plgpu.barrier_wait(bars[name].at[wg])
        lse2 = load(smem["lse"].at[wg], rows_layout) * LOG2E
        delta_ = load(smem["delta"].at[wg], rows_layout)
        fq = load(smem["fq"].at[wg], rows_layout) if gate else None
        sq = load(smem["sq"].at[wg], rows_layout) if segments else None

        # States, right to left: chunk c + 1's rows cross E_c first
        q32 = load(qs, wl).astype(f32)
        pl.when(c - 1 >= lo)(lambda: own_e(c - 1, u + 1))
        e_c = own_e_ready(u)
        qt = moved(q32 * live, e_c) + q32 * (1.0 - live)   # chunk c's rows stay

        def state(i, carry):
          qt, u = carry   # u: the load of E_m (m = c - 1 - i), already issued
          m = c - 1 - i
          stage = smem["adj"].at[lax.rem(i, jnp.array(2, i.dtype)), wg]
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # the tile stored two states ago
          stage[...] = qt.astype(dt)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(stage, refs["st"].at[b, kh, J, m - lo_s, wg])
          pl.when(m - 1 >= lo)(lambda: own_e(m - 1, u + 1))
          return moved(qt, own_e_ready(u)), u + 1

        _, u = lax.fori_loop(0, c - lo, state, (qt, u + 1))

        @pl.when(lo < c)
        def _():
          plgpu.wait_smem_to_gmem(0)   # the states are in GMEM before the ring reads them
          plgpu.barrier_arrive(consumed["states"])

        # (the first span's row 0 is some boundary's, written by the far dq launch: finite)
        adj = load(smem["a"].at[wg], wl).astype(f32) * (J > 0).astype(f32)
        dfq = plgpu.layout_cast(jnp.zeros((C,), f32), rows_layout)

        def step(st_ref, slot, adj, dfq, r, ok):
          at = lambda name: smem[name].at[slot]

          s, dpt = two_products(st_ref, at("k"), smem["do"].at[wg], at("v"), rows=C, cols=C)
          s = gate_and_mask(s * (scale * LOG2E), fq=fq, fk_ref=at("fk") if gate else None,
                            sq=sq, sk_ref=at("sk") if segments else None, ok=ok)
          ds = jnp.exp2(s - rows(lse2)) * (dpt - rows(delta_))
          if gate:
            dfq = dfq + ds.sum(axis=1)
          nadj = smem["adj"].at[lax.rem(r, jnp.array(2, r.dtype)), wg]
          nadj[...] = (-adj if ok is None else -adj * live).astype(dt)
          plgpu.commit_smem()

          def update(acc):
            plgpu.wgmma(acc, (ds * scale).astype(dt), at("k"))
            plgpu.wgmma(acc, nadj, plgpu.transpose_ref(at("e"), (1, 0)))

          adj = pl.run_state(update)(plgpu.ACC.init(adj))
          adj_bar = consumed["adj"].at[lax.rem(r, jnp.array(2, r.dtype))]
          plgpu.barrier_arrive(adj_bar)
          plgpu.barrier_wait(adj_bar)
          return adj, dfq

        def sweep(m, carry):
          adj, dfq, t, r = carry
          slot = lax.rem(t, jnp.array(slots, t.dtype))
          for name in list(ring) + ["st"]:
            plgpu.barrier_wait(bars[name].at[slot])
          st_pair = smem["st"].at[slot]
          adj, dfq = step(st_pair.at[wg], slot, adj, dfq, r, None)
          rr = lax.rem(r, jnp.array(2, r.dtype))
          dp_add(m, [(st_pair.at[w], smem["adj"].at[rr, w]) for w in (wg - wg, wg - wg + 1)])
          plgpu.barrier_arrive(consumed["ring"].at[slot])
          return adj, dfq, t + 1, r + 1

        adj, dfq, t, r = lax.fori_loop(lo, c, sweep, (adj, dfq, t, r))

        # chunk c + 1 against key chunk c (chunk c's rows masked: their adjoint stays)
        slot = lax.rem(t, jnp.array(slots, t.dtype))
        for name in ring:
          plgpu.barrier_wait(bars[name].at[slot])
        # (an array predicate: a scalar one reaches select_n unbroadcast, which jax 0.11's Mosaic
        # GPU lowering refuses)
        live_rows = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=wl) >= (1 - wg) * C
        adj, dfq = step(qs, slot, adj, dfq, r, live_rows)
        rr = lax.rem(r, jnp.array(2, r.dtype))
        one = wg - wg + 1   # traced: a literal index does not lower in jax 0.11's wgmma
        dp_add(c, [(smem["q"].at[one], smem["adj"].at[rr, one])])
        plgpu.barrier_arrive(consumed["ring"].at[slot])
        # warpgroup 0 has read chunk c + 1's q and -R: the next tile may overwrite them
        plgpu.barrier_arrive(consumed["tile"])
        plgpu.barrier_wait(consumed["tile"])

        out = smem["a"].at[wg]   # dq^ leaves through the initial adjoint's buffer
        plgpu.wait_smem_to_gmem(0)   # every reduction of this tile is done: a fixed order
        out[...] = adj.astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out, refs["dq"].at[b, h, cw])
        if gate:
          smem["dfq"].at[wg][...] = dfq
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(smem["dfq"].at[wg], refs["dfq"].at[b, h, cw])
        return t + 1, u, r + 1

      zero = lo_s - lo_s
      units(tile, (zero, zero, zero))
      plgpu.wait_smem_to_gmem(0)

  smem_types = {name: plgpu.SMEM((2, C), x.dtype) for name, x in head.items() if x.ndim == 4}
  smem_types.update({name: smem_tile(dt, 2, C, D) for name in tiled})
  smem_types.update(slot_types({k: x for k, x in ring.items() if k != "e"}, slots, C, D))
  smem_types["e"] = smem_tile(dt, slots, D, D)
  smem_types["st"] = smem_tile(dt, slots, 2, C, D)
  smem_types["own_e"] = smem_tile(dt, 4, D, D)     # [warpgroup * 2 + buffer]
  smem_types["adj"] = smem_tile(dt, 2, 2, C, D)    # [buffer, warpgroup]: -R, or a state
  smem_types["dp"] = smem_tile(f32, D, D)
  if gate:
    smem_types["dfq"] = plgpu.SMEM((2, C), f32)
  bar_types = {name: plgpu.Barrier(num_barriers=slots) for name in list(ring) + ["st"]}
  bar_types.update({name: plgpu.Barrier(num_barriers=2) for name in head})
  bar_types["own_e"] = plgpu.Barrier(num_barriers=4)
  consumed_types = {"ring": plgpu.Barrier(num_arrivals=2, num_barriers=slots),
                    "states": plgpu.Barrier(num_arrivals=2, num_barriers=1),
                    "adj": plgpu.Barrier(num_arrivals=2, num_barriers=2),
                    "tile": plgpu.Barrier(num_arrivals=2, num_barriers=1)}
  arrays = {**head, **ring, "dp": dp, **({} if ops.lo is None else {"lo": ops.lo})}
  out_type = dict(dq=jax.ShapeDtypeStruct((B, H, n, C, D), dt),
                  st=jax.ShapeDtypeStruct((B, K, nsp, span, 2, C, D), dt))
  if gate:
    out_type["dfq"] = jax.ShapeDtypeStruct((B, H, n, C), f32)
  outs = launch(body, arrays, out_type, smem_types=smem_types, bar_types=bar_types,
                consumed_types=consumed_types, grid=(nsp, K, B),
                grid_names=("span", "kvh", "batch"), mutable=("dp",))
  dq, dfq, dp = outs[0], (outs[2][..., None] if gate else None), outs[-1]
  return dq, dfq, dp


def sweeps_reference(ops, do, lse, delta, a, dp, *, scale: float, span: int):
  """sweeps' oracle in plain jnp, float32 products of the stored 16-bit operands (the states
  and adjoints unrounded): the same (dq^, dfq, dp + the sweeps' dL/dP). The interpreter runs it
  in sweeps' place; TestGPU compares the kernel with it."""
  B, H, n, C, D = ops.q.shape
  K = ops.k.shape[1]
  G = H // K
  f32 = jnp.float32
  hp = lax.Precision.HIGHEST
  mm = lambda spec, *x: jnp.einsum(spec, *x, precision=hp)
  rep = lambda x: jnp.repeat(x, G, axis=1).astype(f32)
  q, k, v, e = ops.q.astype(f32), rep(ops.k), rep(operands.heads_major(ops.v)), rep(ops.e)
  do32 = operands.heads_major(do).astype(f32)
  a32 = a.reshape(B, H, a.shape[2] // C, C, D).astype(f32)
  dq = jnp.zeros((B, H, n, C, D), f32)
  dfq = jnp.zeros((B, H, n, C), f32)
  dpq = jnp.zeros((B, H, n, D, D), f32)   # per query head, summed over the group at the end
  lo = None if ops.lo is None else ops.lo[:, 0, :, 0, 0]   # [B, n]

  def grads(st, m, qrows):   # dS of query chunk qrows (its state st) against key chunk m
    s = scale * mm("bhqd,bhkd->bhqk", st, k[:, :, m])
    if ops.fq is not None:
      s = s + ops.fq[:, :, qrows] - ops.fk[:, :, m]
    if ops.sq is not None:
      s = jnp.where(ops.sq[:, :, qrows] == ops.sk[:, :, m], s, -jnp.inf)
    p = jnp.exp(s - lse[:, :, qrows])
    return p * (mm("bhqd,bhkd->bhqk", do32[:, :, qrows], v[:, :, m]) - delta[:, :, qrows])

  for J in range((n - 1) // span + 1):
    lo_s, hi_s = J * span, min(J * span + span, n)
    for c in range(lo_s, hi_s, 2):
      first = jnp.full((B,), lo_s) if lo is None else jnp.maximum(
          jnp.minimum(lo[:, c], lo[:, c + 1]), lo_s)
      on = lambda m: (m >= first)[:, None, None, None]   # [B, 1, 1, 1]
      st = {c - 1: jnp.stack([q[:, :, c], q[:, :, c + 1]
                              - mm("bhqd,bhde->bhqe", q[:, :, c + 1], e[:, :, c])], 2)}
      for m in range(c - 1, lo_s, -1):
        st[m - 1] = st[m] - mm("bhrqd,bhde->bhrqe", st[m], e[:, :, m])
      adj = jnp.zeros((B, H, 2, C, D), f32)
      if J:
        row = boundary_offset(J - 1, n=n, span=span) + c - lo_s
        adj = a32[:, :, row:row + 2]
      for m in range(lo_s, c):
        ds = jnp.stack([grads(st[m][:, :, w], m, c + w) for w in range(2)], 2)
        dfq = dfq.at[:, :, c:c + 2].add(jnp.where(on(m), ds.sum(-1), 0.0))
        dpq = dpq.at[:, :, m].add(jnp.where(on(m), mm("bhrqd,bhrqe->bhde", st[m], adj), 0.0))
        new = (adj - mm("bhrqd,bhed->bhrqe", adj, e[:, :, m])
               + scale * mm("bhrqk,bhkd->bhrqd", ds, k[:, :, m]))
        adj = jnp.where(on(m)[..., None], new, adj)
      ds = grads(q[:, :, c + 1], c, c + 1)   # chunk c + 1 against key chunk c
      dfq = dfq.at[:, :, c + 1].add(ds.sum(-1))
      dpq = dpq.at[:, :, c].add(mm("bhqd,bhqe->bhde", q[:, :, c + 1], adj[:, :, 1]))
      adj = adj.at[:, :, 1].set(adj[:, :, 1] - mm("bhqd,bhed->bhqe", adj[:, :, 1], e[:, :, c])
                                + scale * mm("bhqk,bhkd->bhqd", ds, k[:, :, c]))
      dq = dq.at[:, :, c:c + 2].set(adj)
  dp = dp + dpq.reshape(B, K, G, n, D, D).sum(2)
  return (dq.astype(ops.q.dtype), dfq[..., None] if ops.fq is not None else None, dp)
