"""The sequential backward on the GPU and in the interpreter: the dq/dP sweep and the dk/dv walk,
kernels and launches. The span forms (span_backward.py) reuse the dk/dv kernel.

dkv_kernel, one program per (batch, kv head, key chunk m), fully parallel: walks query chunks
  c = m+1 .. n-1 left to right carrying the D x D operator M (M <- P_c M), so the key tile is
  k~ = k^ M^T and dk^_m = scale sum_c (dS^T q^_c) M, dv_m = sum_c p^T dO_c. The GQA group's
  query heads are a loop inside, so dk, dv are per kv head (no per-query-head copies). Tiles
  are key-major ([keys, queries]): every product's M is the key rows and no register tile is
  transposed.

dq_kernel, one program per (batch, kv head, lane), sequential over (group head, query chunk):
  for query chunk c the states s_m = q^_c M_cm are stored right to left, then a left-to-right
  sweep carries the adjoint R of the state (R <- R P_m^T + scale dS k^_m); what is left after
  the last key chunk is dq^_c, and dL/dP_m = s_m^T R accumulates in a D x D buffer per chunk
  (the pre-pass's VJP takes it to w and beta). The sum over c of state-adjoint pairs at m is
  what prevents a parallel form without per-query-chunk copies (the span forms cut it into
  spans); every accumulation has one fixed order: deterministic, no atomics.
  With transport, query chunks go in pairs (c, c + 1) as one stacked 2C-row tile: the state of
  c + 1 at m < c is (q^_{c+1} P_c) M_cm, so both walk m = c-1 .. 0 with the same E_m; per key
  chunk one load of k_m, v_m, E_m, one product per term and one dP_m read-modify-write serve
  both chunks, and the products are 2C rows tall. The pair (c + 1, m = c), state q^_{c+1}, ends
  the pair with the rows of chunk c masked out. With n odd the last chunk runs alone; lanes
  take pairs round robin, the odd chunk on lane 0.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.common import launch
from kernels_pallas.path_attention import operands
from kernels_pallas.path_attention.tiles import (HeadsMinor, backward_spec, boundary_rows,
                                                 chunk_bound, chunk_id, dot, dq_step, eye,
                                                 logits, pair_state, tile_grads, tile_mask,
                                                 unpack)


def dkv_step_keys(query, kc, mop, dk, dv, dfk, *, scale, transport, precision, causal=False,
                  diag=None):
  """Query chunk c > m of every head of the group against key chunk m, the operator mop = M_cm
  moving the keys (the caller moves it on: M <- P_c M) -> dk, dv, dfk with chunk c added; or
  with `diag`, the diagonal chunk c = m. Key-major tiles: every tile is [S keys, R queries], so
  the key rows are M in all four products (l^T = k~ q^T, dP^T = v dO^T, dv += p^T dO, dS^T q^
  with p^T, dS^T formed as they are used) and no register tile is transposed (query-major
  tiles transposed p and dS, and fell back from wgmma to mma.sync at head_dim 128).
  query(g): head g's q, dO [R, D] and lse, delta, (fq, sq) as rows [1, R]; kc: k, v
  [S, D], fk (a list over heads) and sk as columns [S, 1]; dfk: [S, 1] float32 accumulators,
  colsum(dS) taken over the queries (a reduction along a row: no cross-warp round trip).
  causal: the diagonal chunk (key <= query); its logits are diag(g), the in-chunk logits [C
  queries, C keys] with transport (transposed here, once per program), else formed from k."""
  dt = kc["k"].dtype
  S = kc["k"].shape[0]
  moved = transport and diag is None   # a step of the operator walk: keys moved by mop
  kt = kc["k"]
  if moved:
    kt = dot(kc["k"], mop.astype(dt), tb=True, precision=precision).astype(dt)
  a = jnp.zeros(dk.shape, jnp.float32) if moved else None
  dfk = list(dfk)
  for g in range(len(dfk)):
    qc = query(g)
    gate_, ok = tile_mask(S, causal=False, fq=qc["fq"], fk=kc["fk"][g], sq=qc["sq"],
                          sk=kc["sk"])
    if causal:
      seen = (lax.broadcasted_iota(jnp.int32, (S, S), 0)
              <= lax.broadcasted_iota(jnp.int32, (S, S), 1))
      ok = seen if ok is None else ok & seen
    if diag is not None:
      st = diag(g).astype(jnp.float32).T
    else:
      st = scale * dot(kt, qc["q"], tb=True, precision=precision)
    pt = jnp.exp(logits(st, gate_, ok) - qc["lse"])
    dst = pt * (dot(kc["v"], qc["do"], tb=True, precision=precision) - qc["delta"])
    dv += dot(pt.astype(dt), qc["do"], precision=precision)
    if moved:
      a += dot(dst.astype(dt), qc["q"], precision=precision)   # dS^T q^, over heads
    elif not transport:   # with transport the diagonal's dS is the pre-pass's
      dk += dot((scale * dst).astype(dt), qc["q"], precision=precision)
    if qc["fq"] is not None:
      dfk[g] = dfk[g] - jnp.sum(dst, axis=1, keepdims=True)
  if moved:
    dk += scale * dot(a.astype(dt), mop.astype(dt), precision=precision)
  return dk, dv, tuple(dfk)


def dkv_kernel(*refs, scale, transport, gate, segments, precision, chunk_axis, bounds=False,
               span=0, far_out=False, far_in=False):
  """In: q, do [G, n, C, D]; k, v [n, C, D]; (e [n, D, D]); lse, delta, (fq) [G, n, 1, C] (rows);
  (fk) [G, n, C, 1] (columns); (sq [n, 1, C], sk [n, C, 1]); (diag [G, n, C, C]); (lo, hi
  [n, 1, 1]); (qb [G, R, D] with span: the boundary states packed, tiles.boundary_offset). Out:
  dk, dv [C, D] of key chunk m, (dfk [G, C, 1]). Tiles are key-major (dkv_step_keys). With
  `bounds` the walk stops at hi_m, the last query chunk that shares a segment with chunk m
  (operands.chunk_bounds).

  With `span` (transport only) the operator walk stops at the end of key chunk m's span,
  s = (m // span + 1) span, where it is M_sm; the query chunks c >= s are then plain attention
  steps of the stored states qb^(s)_c = q^_c M_cs' (s' = s - 1) against k~ = k^ M_sm^T, since
  q^_c M_cm = (q^_c P_{c-1} ... P_s) M_sm, and their dk^ share is (scale sum_c dS^T qb_c) M_sm,
  one operator product in all. With `far_out` that sum, a [C, D] float32, is an output too
  (zero for the last span's chunks). With `far_in` another launch (span_backward.far_dkv_kernel)
  walked the far query chunks: its a, dv [C, D] and (dfk [G, C, 1]) float32 of chunk m come in
  where qb would, and only the operator walk inside the span runs here."""
  far_spec = [("qb", transport and span > 0 and not far_in), ("fa", far_in), ("fdv", far_in),
              ("fdfk", far_in and gate)]
  r = unpack(refs, backward_spec(transport, gate, segments, bounds) + far_spec
              + [("dk", True), ("dv", True), ("dfk", gate), ("a", far_out)])
  r["do"] = HeadsMinor(r["do"])   # time-major, the group's heads minor (inputs())
  G, n, C, D = r["q"].shape
  f32 = jnp.float32
  m = chunk_id(n, axis=chunk_axis, reverse=False)  # chunk 0 (the longest walk) first
  kc = dict(k=r["k"][m], v=r["v"][m], fk=[None if not gate else r["fk"][g, m] for g in range(G)],
            sk=None if not segments else r["sk"][m])

  def query(g, c, q=None):  # (load order as the products use them: fewer spills at D 128)
    return dict(q=r["q"][g, c] if q is None else q, fq=None if not gate else r["fq"][g, c],
                sq=None if not segments else r["sq"][c], lse=r["lse"][g, c], do=r["do"][g, c],
                delta=r["delta"][g, c])

  kw = dict(scale=scale, transport=transport, precision=precision)
  zeros = lambda: (jnp.zeros((C, D), f32), jnp.zeros((C, D), f32))
  dfk = tuple(jnp.zeros((C, 1), f32) for _ in range(G))
  dk, dv, dfk = dkv_step_keys(lambda g: query(g, m), kc, None, *zeros(), dfk, causal=True,
                              diag=(lambda g: r["diag"][g, m]) if transport else None, **kw)

  def body(c, carry):
    mop, dk, dv, dfk = carry
    first = query(0, c)  # head 0's loads ahead of the operator product, the others lazily
    dk, dv, dfk = dkv_step_keys(lambda g: first if g == 0 else query(g, c), kc, mop, dk, dv,
                                dfk, **kw)
    if transport:
      mop = mop - dot(r["e"][c], mop.astype(r["q"].dtype), precision=precision)  # P_c M
    return mop, dk, dv, dfk

  mop = eye(D) if transport else jnp.zeros((1, 1), f32)
  end = chunk_bound(r["hi"], m) + 1 if bounds else n
  if not (transport and span):
    _, dk, dv, dfk = lax.fori_loop(m + 1, end, body, (mop, dk, dv, tuple(dfk)))
  else:
    dt = r["q"].dtype
    j = lax.div(m, span)   # m's span; qb's boundary index for the next span's first chunk s
    s = (j + 1) * span
    mop, dk, dv, dfk = lax.fori_loop(m + 1, jnp.minimum(s, end), body, (mop, dk, dv, tuple(dfk)))
    mop = mop.astype(dt)   # M_sm (the product below takes it in the kernel dtype)

    def far_body(c, carry):
      def step(carry):
        a, dv, dfk = carry
        t = boundary_rows(j, c, C, n=n, span=span, C=C)
        return dkv_step_keys(lambda g: query(g, c, q=r["qb"][g, t]), far, None, a, dv, dfk,
                             scale=scale, transport=False, precision=precision)

      if not bounds:
        return step(carry)
      # The dq/dP sweep of chunk c starts at key chunk lo_c (its pair's: the smaller lo), so
      # when lo_c >= s it may have stored no state at s: the row can be unwritten memory. Tile
      # (c, m) is then fully masked (m < s <= lo_c), so skipping it is exact.
      return lax.cond(chunk_bound(r["lo"], c) < s, step, lambda carry: carry, carry)

    if far_in:
      a, dv = r["fa"][...], dv + r["fdv"][...]
      dfk = tuple(dfk[g] + r["fdfk"][g] for g in range(G)) if gate else dfk
    else:
      far = dict(kc, k=dot(kc["k"], mop, tb=True, precision=precision).astype(dt))
      a, dv, dfk = lax.fori_loop(s, end, far_body, (jnp.zeros((C, D), f32), dv, dfk))
    dk += dot(a.astype(dt), mop, precision=precision)   # a is already scaled
    if far_out:
      r["a"][...] = a
  r["dk"][...] = dk.astype(r["dk"].dtype)
  r["dv"][...] = dv.astype(r["dv"].dtype)
  if gate:
    for g in range(G):
      r["dfk"][g] = dfk[g]


def dq_kernel(*refs, scale, transport, gate, segments, precision, lanes, pairs, bounds=False):
  """In: as dkv_kernel, except that the query-side operands have their chunks merged into time
  (q, do [G, n*C, D]; lse, delta, (fq) [G, n*C, 1]; (sq [n*C, 1]); (diag [G, n*C, C])), so that
  one load reads the rows of one chunk or of two adjacent ones. Out: dq [G, n*C, D],
  (ddiag [G, n*C, C], dP [n, D, D] of this lane, states [n, R, D] scratch with R = C, 2C with
  pairs), (dfq [G, n*C, 1]); dP and dfq float32, the rest kernel dtype. `pairs` (transport
  only) and `lanes` come from the plan. With `bounds` (lo, hi [n, 1, 1]) a query
  chunk walks key chunks lo_c .. c-1 only (operands.chunk_bounds): left of lo_c every tile is
  masked, so the adjoint starts at zero there and no dP_m gets a contribution."""
  r = unpack(refs, backward_spec(transport, gate, segments, bounds)
             + [("dq", True), ("ddiag", transport), ("dp", transport), ("st", transport),
                ("dfq", gate)])
  r["do"] = HeadsMinor(r["do"])   # time-major, the group's heads minor (inputs())
  G = r["q"].shape[0]
  n, C, D = r["k"].shape
  dt = r["q"].dtype
  f32 = jnp.float32

  if transport:
    def zero(m, carry):
      r["dp"][m] = jnp.zeros((D, D), f32)
      return carry

    lax.fori_loop(0, n, zero, 0)

  def rows(c, size):  # (a static chunk index, e.g. the odd last chunk, needs no hint)
    start = c * C
    return pl.ds(start if isinstance(start, int) else pl.multiple_of(start, C), size)

  def load_query(g, c, size=C):  # `size` rows from the start of query chunk c
    t = rows(c, size)
    return dict(q=r["q"][g, t], do=r["do"][g, t], lse=r["lse"][g, t], delta=r["delta"][g, t],
                fq=None if not gate else r["fq"][g, t], sq=None if not segments else r["sq"][t])

  def load_key(g, m, with_e=transport):  # loaded once per key chunk, shared by every query row
    return dict(k=r["k"][m], v=r["v"][m], e=r["e"][m] if with_e else None,
                fk=None if not gate else r["fk"][g, m], sk=None if not segments else r["sk"][m])

  def diagonal(g, c, qc, kc):
    """-> initial adjoint (the diagonal's dq with FoX; with transport its dS goes to ddiag), dfq."""
    if transport:
      _, ds = tile_grads(qc, kc, r["diag"][g, rows(c, C)].astype(f32), True, precision=precision)
      r["ddiag"][g, rows(c, C)] = ds.astype(r["ddiag"].dtype)
      adj = jnp.zeros((C, D), f32)
    else:
      _, ds = tile_grads(qc, kc, scale * dot(qc["q"], kc["k"], tb=True, precision=precision),
                         True, precision=precision)
      adj = scale * dot(ds.astype(dt), kc["k"], precision=precision)
    return adj, jnp.sum(ds, axis=1, keepdims=True)

  step = functools.partial(dq_step, scale=scale, transport=transport, precision=precision)

  def move(qt, e):  # q~ <- q~ P_m = q~ - q~ E_m (float32 state)
    return qt - dot(qt.astype(dt), e, precision=precision)

  # dP_m read-modify-write. At head_dim <= 64 the read is issued before the step, so that its
  # latency hides behind the step's products; at 128 the early [D, D] float32 tile costs more
  # in register spills than it hides.
  early = D <= 64

  def early_dp(m):
    return r["dp"][m] if early else None

  def add_dp(m, acc, dp):
    r["dp"][m] = (acc if early else r["dp"][m]) + dp

  def finish(g, c, size, adj, dfq, dfq_diag_written):
    r["dq"][g, rows(c, size)] = adj.astype(r["dq"].dtype)
    if gate:
      t = rows(c, size)
      r["dfq"][g, t] = (r["dfq"][g, t] + dfq) if dfq_diag_written else dfq

  def first_key(c, last=None):
    """The first key chunk that query chunk c (and chunk `last`, with pairs) can see."""
    if not bounds:
      return 0
    lo = chunk_bound(r["lo"], c)
    return lo if last is None else jnp.minimum(lo, chunk_bound(r["lo"], last))

  def query_chunk(g, c):
    """One query chunk alone (FoX; with transport the odd last chunk): state rows [0, C)."""
    qc = load_query(g, c)
    adj, dfq = diagonal(g, c, qc, load_key(g, c, with_e=False))
    state = lambda m: r["st"][m, pl.ds(0, C)]
    lo = first_key(c)
    if transport:
      def store_state(i, qt):  # the state used against key chunk m, for m = c-1 .. lo
        m = c - 1 - i
        st = qt.astype(dt)
        r["st"][m, pl.ds(0, C)] = st
        return move(qt, r["e"][m])

      lax.fori_loop(0, c - lo, store_state, qc["q"].astype(f32))

    def key_chunk(m, carry):
      adj, dfq = carry
      acc = early_dp(m) if transport else None
      adj, dfq, dp = step(qc, load_key(g, m), state(m) if transport else qc["q"], adj, dfq)
      if transport:
        add_dp(m, acc, dp)
      return adj, dfq

    finish(g, c, C, *lax.fori_loop(lo, c, key_chunk, (adj, dfq)), False)

  def query_pair(g, c):
    """Query chunks c, c + 1 as one stacked 2C-row tile (transport): their states at key chunk
    m < c are q^_c M_cm and (q^_{c+1} P_c) M_cm, so one walk moves both with E_m, and per key
    chunk one load of k_m, v_m, E_m, one product per term (2C rows) and one dP_m
    read-modify-write serve both chunks. The diagonals run per chunk; the step of chunk c + 1
    against key chunk c (state q^_{c+1}) comes last, with the rows of chunk c masked out."""
    kc = load_key(g, c)
    for j in range(2):  # diagonals: dS to ddiag, their dfq straight to the output
      _, dfq = diagonal(g, c + j, load_query(g, c + j), load_key(g, c + j, with_e=False))
      if gate:
        r["dfq"][g, rows(c + j, C)] = dfq
    qp = load_query(g, c, 2 * C)
    qt, low = pair_state(qp["q"], kc["e"], precision=precision)

    lo = first_key(c, c + 1)

    def store_states(i, qt):  # stacked states against key chunk m = c-1 .. lo
      m = c - 1 - i
      st = qt.astype(dt)
      r["st"][m] = st
      return move(qt, r["e"][m])

    lax.fori_loop(0, c - lo, store_states, qt)

    def key_chunk(m, carry):
      adj, dfq = carry
      acc = early_dp(m)
      adj, dfq, dp = step(qp, load_key(g, m), r["st"][m], adj, dfq)
      add_dp(m, acc, dp)
      return adj, dfq

    init = (jnp.zeros((2 * C, D), f32), jnp.zeros((2 * C, 1), f32))
    adj, dfq = lax.fori_loop(lo, c, key_chunk, init)
    adj, dfq, dp = step(qp, kc, qp["q"], adj, dfq, live=low)  # chunk c + 1 vs key c
    r["dp"][c] += dp
    finish(g, c, 2 * C, adj, dfq, True)

  # Lane l takes units l, l + lanes, ... (a unit: a query pair with pairs, else a chunk);
  # static trip count (Triton), the tail skips. With pairs and n odd, the last chunk runs alone
  # on lane 0.
  lane = pl.program_id(2) if lanes > 1 else 0
  units = n // 2 if pairs else n
  for g in range(G):
    def lane_unit(i, carry, g=g):
      u = lane + i * lanes
      run = (lambda: query_pair(g, 2 * u)) if pairs else (lambda: query_chunk(g, u))
      if lanes == 1:
        run()
      else:
        pl.when(u < units)(run)
      return carry

    if units:   # (one chunk in all, n = 1: no pair to trace, whose 2C rows would not fit)
      lax.fori_loop(0, -(-units // lanes), lane_unit, 0)
    if pairs and n % 2:
      if lanes == 1:
        query_chunk(g, n - 1)
      else:
        pl.when(lane == 0)(lambda g=g: query_chunk(g, n - 1))


def inputs(ops, do, lse, delta, grid_kv, *, bounds: bool):
  """Operands and BlockSpecs of the backward kernels (tiles.backward_spec's order); grid_kv maps
  program ids to (b, kv head). bounds: append the chunk bounds (lo, hi) last. v and do are
  time-major (chunked, or do merged [B, Tp, H, D]): one kv head's v, the group's G heads of
  do. -> (args, specs, grp: the BlockSpec maker of a group's [B, H, ...] array)."""
  G = ops.q.shape[1] // ops.k.shape[1]
  f = operands.features(ops)
  grp = lambda x: pl.BlockSpec((None, G) + x.shape[2:],
                               lambda *i: (grid_kv(*i)[0], grid_kv(*i)[1]) + (0,) * (x.ndim - 2))
  kvh = lambda x: pl.BlockSpec((None, None) + x.shape[2:],
                               lambda *i: grid_kv(*i) + (0,) * (x.ndim - 2))
  seg = lambda x: pl.BlockSpec((None, None) + x.shape[2:],
                               lambda *i: (grid_kv(*i)[0], 0) + (0,) * (x.ndim - 2))
  args, specs = [ops.q, ops.k, ops.v], [grp(ops.q), kvh(ops.k),
                                        launch.time_major_spec(ops.v, grid_kv, lambda h: h)]
  if f["transport"]:
    args.append(ops.e)
    specs.append(kvh(ops.e))
  args += [do, lse, delta]
  specs += [launch.time_major_spec(do, grid_kv, lambda h: h, heads=G), grp(lse), grp(delta)]
  if f["gate"]:
    args += [ops.fq, ops.fk]
    specs += [grp(ops.fq), grp(ops.fk)]
  if f["segments"]:
    args += [ops.sq, ops.sk]
    specs += [seg(ops.sq), seg(ops.sk)]
  if f["transport"]:
    args.append(ops.diag)
    specs.append(grp(ops.diag))
  if bounds:
    args += [ops.lo, ops.hi]
    specs += [seg(ops.lo), seg(ops.hi)]
  return args, specs, grp


def dkv(ops, do, lse, delta, plan, *, span=0, qb=None, far_out=False, far_in=None):
  """dk, dv (and dfk): grid (B, K, key chunk), every program independent. -> dict(k [B, K, n, C,
  D], v (chunked, as ops.v) in the kernel dtype, fk? [B, H, n, 1, C] float32, a?).

  span (the span forms' span, else 0): the operator walk stops at each span's end. qb: the
  boundary states [B, H, R, D] (packed: tiles.boundary_offset) for the far walk after it; far_out
  (with qb): also "a" [B, K, n, C, D] float32, the far walk's scaled sum dS^T qb per key chunk.
  far_in (instead of qb): another launch's far walk, (a, dv [B, K, n, C, D], dfk [B, H, n, 1, C]
  or None) float32, which the kernel adds."""
  backend = plan.spec.backend
  B, H, n, C, D = ops.q.shape
  K = ops.k.shape[1]
  G = H // K
  f = operands.features(ops)
  f32 = jnp.float32
  grid, ids, axis = launch.chunk_grid(B, K, n, backend)
  bounds = operands.skips_chunks(ops, backend)
  # key-major tiles: query-side vectors as rows, key-side ones as columns
  ops = ops._replace(fq=launch.as_rows(ops.fq), fk=launch.as_cols(ops.fk),
                     sq=launch.as_rows(ops.sq), sk=launch.as_cols(ops.sk))
  lse, delta = launch.as_rows(lse), launch.as_rows(delta)
  vec = (C, 1)   # dfk's block: a column of the key chunk
  args, specs, grp = inputs(ops, do, lse, delta, lambda *p: ids(*p)[:2], bounds=bounds)
  chunk = lambda s: pl.BlockSpec((None, None, None) + s.shape[3:], lambda *p: ids(*p) + (0, 0))
  if span and far_in is not None:
    fa, fdv, fdfk = far_in
    args += [fa, fdv] + ([fdfk.reshape(B, H, n, *vec)] if f["gate"] else [])
    specs += [chunk(fa), chunk(fdv)]
    if f["gate"]:
      specs.append(pl.BlockSpec((None, G, None) + vec, lambda *p: ids(*p) + (0, 0)))
  elif span:
    args.append(qb)
    specs.append(grp(qb))
  gdt = ops.q.dtype  # gradients leave in the kernel dtype (accumulated in float32 on chip)
  out_shape = [jax.ShapeDtypeStruct((B, K, n, C, D), gdt), jax.ShapeDtypeStruct(ops.v.shape, gdt)]
  out_specs = [chunk(out_shape[0]), launch.time_major_chunk(out_shape[1], ids)]
  if f["gate"]:
    out_shape.append(jax.ShapeDtypeStruct((B, H, n) + vec, f32))
    out_specs.append(pl.BlockSpec((None, G, None) + vec, lambda *p: ids(*p) + (0, 0)))
  far_out = far_out and bool(span)
  if far_out:
    out_shape.append(jax.ShapeDtypeStruct((B, K, n, C, D), f32))
    out_specs.append(chunk(out_shape[-1]))
  kernel = functools.partial(dkv_kernel, scale=plan.scale, precision=plan.precision,
                             chunk_axis=axis, bounds=bounds, span=span, far_out=far_out,
                             far_in=bool(span) and far_in is not None, **f)
  outs = launch.call(kernel, grid, specs, out_specs, out_shape, backend=backend,
                     warps=plan.warps("dkv"), stages=plan.stages("dkv"))(*args)
  grads = dict(k=outs[0], v=outs[1])
  if f["gate"]:
    grads["fk"] = outs[2].reshape(B, H, n, 1, C)
  if far_out:
    grads["a"] = outs[-1]
  return grads


def dq(ops, do, lse, delta, plan):
  """dq, d diag, dfq and dL/dP: grid (B, K, lane), sequential inside. -> dict(q [B, H, n, C, D],
  diag?, dp? [B, K, n, D, D] float32, fq? [B, H, n, C, 1] float32). The query-side operands go
  in with their chunks merged into time (dq_kernel loads 2C-row pairs)."""
  backend = plan.spec.backend
  B, H, n, C, D = ops.q.shape
  K = ops.k.shape[1]
  f = operands.features(ops)
  pairs = f["transport"]
  L = plan.lanes
  f32 = jnp.float32
  gdt = ops.q.dtype
  m = launch.merged
  merged = ops._replace(q=m(ops.q), diag=m(ops.diag), fq=m(ops.fq), sq=m(ops.sq))
  bounds = operands.skips_chunks(ops, backend)
  args, specs, grp = inputs(merged, operands.unchunked(do), m(lse), m(delta),
                            lambda b, kh, l: (b, kh), bounds=bounds)
  lane = lambda s: pl.BlockSpec((None, None) + s.shape[2:],
                                lambda b, kh, l: (b, kh * L + l) + (0,) * (len(s.shape) - 2))
  names, out_shape = ["q"], [jax.ShapeDtypeStruct((B, H, n * C, D), gdt)]
  if f["transport"]:
    names += ["diag", "dp", "states"]
    out_shape += [jax.ShapeDtypeStruct((B, H, n * C, C), gdt),
                  jax.ShapeDtypeStruct((B, K * L, n, D, D), f32),
                  jax.ShapeDtypeStruct((B, K * L, n, C * (1 + pairs), D), ops.q.dtype)]
  if f["gate"]:
    names.append("fq")
    out_shape.append(jax.ShapeDtypeStruct((B, H, n * C, 1), f32))
  out_specs = [lane(s) if n_ in ("dp", "states") else grp(s) for n_, s in zip(names, out_shape)]
  kernel = functools.partial(dq_kernel, scale=plan.scale, precision=plan.precision, lanes=L,
                             pairs=pairs, bounds=bounds, **f)
  outs = launch.call(kernel, (B, K, L), specs, out_specs, out_shape, backend=backend,
                     warps=plan.warps("dq"), stages=plan.stages("dq"))(*args)
  more = dict(zip(names, outs))
  more.pop("states", None)
  for name in ("q", "diag", "fq"):  # back to [B, H, n, C, ...]
    if name in more:
      more[name] = more[name].reshape(B, H, n, C, *more[name].shape[3:])
  if L > 1 and "dp" in more:   # lanes summed in a fixed order
    more["dp"] = more["dp"].reshape(B, K, L, n, D, D).sum(2)
  return more


def backward(ops, do, lse, delta, plan):
  """The sequential backward: the operands' gradients, dict(q, k, v, diag?, dp?, fq?, fk?).
  do [B, n, C, H, D] (chunked); lse, delta [B, H, n, C, 1]."""
  grads = dq(ops, do, lse, delta, plan)
  return {**dkv(ops, do, lse, delta, plan), **grads}
