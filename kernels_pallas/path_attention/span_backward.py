"""The span-parallel backward on the GPU and in the interpreter: kernels and launches.

The sequential dq/dP sweep (backward.py) walks all n^2 / 2 chunk pairs of a (batch, kv head) in
one program, because dL/dP_t sums state-adjoint pairs over every query chunk c > t. Here a chunk
pair is near (both chunks in one span) or far (spans.py has the notation); then

- a far tile is plain attention: l_cm = scale qb_c^(b_m) kb_m^T;
- the adjoint a query chunk's sweep carries into span J is A_c^(a) (keys left of a), and
  A_c^(b) = A_c^(a) Pi_J^T + scale sum_{m in J} dS_cm kb_m, one chain per query chunk;
- the far queries' share of dL/dP_t (t in J) factors through two per-span quantities,
  Y_J = sum_{c >= b} qb_c^(b)T A_c^(a) (D x D) and X_m = scale sum_{c >= b} qb_c^(b)T dS_cm
  (the far dk/dv walk's a_m^T): dL/dP_t += N_t^T V_t with N_t = P_{b-1} ... P_{t+1},
  V_a = Y_J, V_{t+1} = V_t P_t^T + a_t^T k^_t; and the far share of dk^_t is a_t N_t.

Launches, each parallel and every sum in a fixed order (deterministic, no atomics): the boundary
launch (spans.boundary, or the forward's), far dq (qb, A, far dfq; one program per query tile
and head: far_dq_kernel, or far_states_kernel and the Mosaic walk), the key side (the dk/dv
kernel's walk inside the span and, per plan.far_dkv, its far walk inside too or a far dk/dv
launch's sums added), Y (spans.far_queries_y), then span_kernel (one program per (batch, kv
head, span)): the near sweeps inside the span, starting from A instead of zero, and the D x D
chains above; or, with the Mosaic sweep, span_kernel's chains and diagonals and the sweeps in
mosaic_gpu/span_sweep.py. The sequential work per program falls from n^2 / 4 pair steps to
S^2 / 4.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.path_attention import backward as walk_backward
from kernels_pallas.common import launch
from kernels_pallas.path_attention import operands
from kernels_pallas.path_attention import spans
from kernels_pallas.path_attention.backward import dkv_step_keys
from kernels_pallas.path_attention.mosaic_gpu import backward_far
from kernels_pallas.path_attention.mosaic_gpu import span_sweep
from kernels_pallas.path_attention.tiles import (HeadsMinor, backward_spec, boundary_array_rows,
                                                 boundary_rows, chunk_bound, chunk_id, dot, dq_step,
                                                 eye, pair_state, tile_grads, unpack)


def per_tile(tile, first, *, n, C, pairs):
  """Run tile(size) for this program's tile from chunk `first`: one chunk (size C), or with
  `pairs` chunks first, first + 1 as one 2C-row tile, the odd last chunk of an odd n alone."""
  if not pairs:
    tile(C)
  else:
    pl.when(first + 1 < n)(lambda: tile(2 * C))
    pl.when(first + 1 >= n)(lambda: tile(C))   # the odd last chunk


def far_dq_kernel(*refs, scale, span, nb, gate, segments, bounds, precision, fine, chunk_axis,
                  pairs):
  """Program (query tile, query head, batch): query chunk c, or with `pairs` chunks c, c + 1
  (c even; the span is even, so both lie in one span) as one 2C-row tile, the last program of
  an odd n taking its chunk alone. In, chunks merged into time (rows c C ..): q^, dO [n*C, D],
  lse, delta, (fq) [n*C, 1], (sq [n*C, 1]) of the head; kb, v [n, C, D], E [n, D, D],
  pi [nb, D, D], (fk [n, 1, C], sk [n, 1, C]) of its kv head; (lo [n, 1, 1]). Out, this tile's
  rows in the packed layout (tiles.boundary_offset: boundary j keeps the chunks c >= s_j
  only): qb [R, D], the states at the boundaries s_j = (j + 1) S <= c; A [R, D], the adjoint at
  s_j from the keys left of it; (dfq [n*C, 1] of the far tiles).
  Products with Pi take `fine` (spans.boundary_kernel). A 2C-row tile reads each key chunk once for
  two query chunks and gives the products twice the rows."""
  r = unpack(refs, [("q", True), ("kb", True), ("v", True), ("e", True), ("pi", True),
                    ("do", True), ("lse", True), ("delta", True), ("fq", gate), ("fk", gate),
                    ("sq", segments), ("sk", segments), ("lo", bounds), ("qb", True),
                    ("a", True), ("dfq", gate)])
  n, C, D = r["kb"].shape
  dt = r["q"].dtype
  f32 = jnp.float32
  tiles = (n + 1) // 2 if pairs else n
  c = chunk_id(tiles, axis=chunk_axis, reverse=True) * (2 if pairs else 1)

  def tile(size):
    rows = pl.ds(pl.multiple_of(c * C, C), size)
    jc = lax.div(c, span)   # boundaries at or below c: s_0 .. s_{jc-1}
    packed = lambda j: boundary_rows(j, c, size, n=n, span=span, C=C)

    @pl.when(jc > 0)
    def _():
      boundary_states(r, c, size, span=span, packed=packed, precision=precision, fine=fine)
      qc = dict(do=r["do"][rows], lse=r["lse"][rows], delta=r["delta"][rows],
                fq=r["fq"][rows] if gate else None, sq=r["sq"][rows] if segments else None)
      lo = 0
      if bounds:
        lo = chunk_bound(r["lo"], c)
        if size > C:
          lo = jnp.minimum(lo, chunk_bound(r["lo"], c + 1))
      zero = jnp.zeros((size, D), f32)

      def masked_span(j, carry):   # wholly left of the tile's documents: A stays 0
        r["a"][packed(j)] = zero.astype(r["a"].dtype)
        return carry

      def far_span(j, carry):
        adj, dfq = carry
        qt = r["qb"][packed(j)]

        def key(m, carry):
          part, dfq = carry
          kc = dict(k=r["kb"][m], v=r["v"][m], fk=r["fk"][m] if gate else None,
                    sk=r["sk"][m] if segments else None)
          _, ds = tile_grads(qc, kc, scale * dot(qt, kc["k"], tb=True, precision=precision),
                             False, precision=precision)
          return (part + scale * dot(ds.astype(dt), kc["k"], precision=precision),
                  dfq + jnp.sum(ds, axis=1, keepdims=True))

        part, dfq = lax.fori_loop(jnp.maximum(lo, j * span), (j + 1) * span, key, (zero, dfq))
        adj = dot(adj, r["pi"][j], tb=True, precision=fine) + part
        r["a"][packed(j)] = adj.astype(r["a"].dtype)
        return adj, dfq

      j0 = jnp.minimum(lax.div(lo, span), jc)
      lax.fori_loop(0, j0, masked_span, 0)
      _, dfq = lax.fori_loop(j0, jc, far_span, (zero, jnp.zeros((size, 1), f32)))
      if gate:
        r["dfq"][rows] = dfq

    if gate:
      @pl.when(jc == 0)
      def _():
        r["dfq"][rows] = jnp.zeros((size, 1), f32)

  per_tile(tile, c, n=n, C=C, pairs=pairs)


def boundary_states(r, c, size, *, span, packed, precision, fine):
  """Store query tile c's (`size` rows: one chunk, or chunks c, c + 1) states at the boundaries
  below it, qb^(s_j) = q^_c P_{c-1} ... P_{s_j}, j = jc-1 .. 0 (jc = c // span > 0), into
  r["qb"] at packed(j): the walk to c's span start with the chunk operators E, then the span
  operators Pi down (products with Pi at `fine`)."""
  C = r["q"].shape[0] // r["e"].shape[0]   # q^ has its chunks merged into time
  dt = r["q"].dtype
  f32 = jnp.float32
  jc = lax.div(c, span)
  q = r["q"][pl.ds(pl.multiple_of(c * C, C), size)]
  s = pair_state(q, r["e"][c], precision=precision)[0] if size > C else q.astype(f32)
  move = lambda i, s: s - dot(s.astype(dt), r["e"][c - 1 - i], precision=precision)
  s = lax.fori_loop(0, c - jc * span, move, s)   # to c's span start
  r["qb"][packed(jc - 1)] = s.astype(dt)

  def down(i, s):   # qb^(s_j) = qb^(s_{j+1}) Pi_{j+1}, j = jc-2 .. 0
    j = jc - 2 - i
    s = dot(s, r["pi"][j + 1], precision=fine)
    r["qb"][packed(j)] = s.astype(dt)
    return s

  lax.fori_loop(0, jc - 1, down, s)


def far_states_kernel(*refs, span, precision, fine, chunk_axis, pairs):
  """Program (query tile, query head, batch), tiles as far_dq_kernel's. In: q^ [n*C, D] (chunks
  merged into time), E [n, D, D], pi [nb, D, D]. Out: qb [R, D] packed, this tile's states at
  the boundaries below it (boundary_states), for a far dq launch that takes them as an input
  (mosaic_gpu/backward_far.far_dq). The first span's tiles write nothing."""
  r = unpack(refs, [("q", True), ("e", True), ("pi", True), ("qb", True)])
  n = r["e"].shape[0]
  C = r["q"].shape[0] // n
  tiles = (n + 1) // 2 if pairs else n
  c = chunk_id(tiles, axis=chunk_axis, reverse=True) * (2 if pairs else 1)

  def tile(size):
    packed = lambda j: boundary_rows(j, c, size, n=n, span=span, C=C)
    pl.when(lax.div(c, span) > 0)(lambda: boundary_states(
        r, c, size, span=span, packed=packed, precision=precision, fine=fine))

  per_tile(tile, c, n=n, C=C, pairs=pairs)


def far_dkv_kernel(*refs, scale, span, gate, segments, bounds, precision, chunk_axis, pairs):
  """Program (key tile, kv head, batch): key chunk m, or with `pairs` chunks m, m + 1 (m even;
  the span is even, so both lie in one span) as one 2C-row key tile, the last program of an odd
  n taking its chunk alone. In: qb [G, R, D] of the group's heads (packed:
  tiles.boundary_offset); kb, v [n*C, D] (chunks merged into time); dO [G, n, C, D]; lse,
  delta, (fq) [G, n, 1, C] (rows); (fk [G, n*C, 1]) (columns); (sq [n, 1, C], sk [n*C, 1]);
  (lo, hi [n, 1, 1]). Out, this tile's key rows, float32: a [n*C, D] = scale sum_c dS_cm^T
  qb_c^(b) over the query chunks c >= b (b: the span's end) of every head, dv [n*C, D] =
  sum p^T dO over them, (dfk [G, n*C, 1]). Zero for the last span's chunks. Tiles are
  key-major (backward.dkv_step_keys). A 2C-row tile reads each query chunk's operands once for
  two key chunks and gives the products twice the rows."""
  r = unpack(refs, [("qb", True), ("kb", True), ("v", True), ("do", True), ("lse", True),
                    ("delta", True), ("fq", gate), ("fk", gate), ("sq", segments),
                    ("sk", segments), ("lo", bounds), ("hi", bounds), ("a", True), ("dv", True),
                    ("dfk", gate)])
  r["do"] = HeadsMinor(r["do"])   # [n, C, G, D] time-major, read as [G, n, C, D]
  G, n, C, D = r["do"].shape
  f32 = jnp.float32
  tiles = (n + 1) // 2 if pairs else n
  m = chunk_id(tiles, axis=chunk_axis, reverse=False) * (2 if pairs else 1)
  j = lax.div(m, span)

  def tile(size):
    keys = pl.ds(pl.multiple_of(m * C, C), size)
    last = m + size // C - 1   # the tile's last key chunk
    kc = dict(k=r["kb"][keys], v=r["v"][keys],
              fk=[r["fk"][g, keys, :] if gate else None for g in range(G)],
              sk=r["sk"][keys, :] if segments else None)

    def query(g, c):   # query chunk c's state at boundary j, its vectors as rows [1, C]
      return dict(q=r["qb"][g, boundary_rows(j, c, C, n=n, span=span, C=C)],
                  fq=r["fq"][g, c] if gate else None, sq=r["sq"][c] if segments else None,
                  lse=r["lse"][g, c], do=r["do"][g, c], delta=r["delta"][g, c])

    def body(c, carry):
      def step(carry):
        return dkv_step_keys(lambda g: query(g, c), kc, None, *carry, scale=scale,
                             transport=False, precision=precision)

      if not bounds:
        return step(carry)
      # every query of chunk c starts its document right of the tile's keys: masked
      return lax.cond(chunk_bound(r["lo"], c) <= last, step, lambda carry: carry, carry)

    end = n
    if bounds:
      end = jnp.maximum(chunk_bound(r["hi"], m), chunk_bound(r["hi"], last)) + 1
    sums = tuple(jnp.zeros((size, 1), f32) for _ in range(G))
    init = (jnp.zeros((size, D), f32), jnp.zeros((size, D), f32), sums)
    a, dv, dfk = lax.fori_loop((j + 1) * span, end, body, init)   # empty for the last span
    r["a"][keys] = a
    r["dv"][keys] = dv
    for g in range(G) if gate else ():
      r["dfk"][g, keys, :] = dfk[g]

  per_tile(tile, m, n=n, C=C, pairs=pairs)


def span_kernel(*refs, scale, span, nb, gate, segments, bounds, precision, fine, span_axis,
                pairs, sweeps=True):
  """Program (span J, kv head, batch). In: as backward.dq_kernel with transport (query-side
  operands merged into time: q, do [G, n*C, D], ...), then A [G, R, D] (far_dq_kernel's,
  packed), y [nb, D, D] (Y_J) and afar [n, C, D] (the far walk's a). Out, for this span's chunks
  only: dq^ [G, n*C, D], ddiag [G, n*C, C] (kernel dtype); dP [n, D, D], (dfq [G, n*C, 1] of
  the near tiles) float32; st [S, R, D] is this program's scratch for the sweep's states (R =
  2C with `pairs`: query chunks two at a time as one tile, else C). The D x D chains take
  `fine` (spans.boundary_kernel). Without `sweeps` (the near sweep on Mosaic GPU:
  mosaic_gpu/span_sweep.py walks them after this launch, and adds to dP) there is no dq or st:
  this launch writes the far queries' dP, the diagonal tiles' ddiag and their dfq only."""
  r = unpack(refs, backward_spec(True, gate, segments, bounds)
             + [("a", True), ("y", True), ("afar", True), ("dq", sweeps), ("ddiag", True),
                ("dp", True), ("st", sweeps), ("dfq", gate)])
  r["do"] = HeadsMinor(r["do"])   # time-major, the group's heads minor (backward.inputs)
  G = r["q"].shape[0]
  n, C, D = r["k"].shape
  dt = r["q"].dtype
  f32 = jnp.float32
  jspan = pl.program_id(span_axis)
  lo_s = jspan * span                          # this span's chunks lo_s .. hi_s - 1
  hi_s = jnp.minimum(lo_s + span, n)
  kw = dict(precision=precision)

  # The far queries' share of dP_t first (the V and N chains); the near sweeps below add to it.
  @pl.when(jspan < nb)
  def _():
    def forward(t, v):   # dp[t] <- V_t for now; V_{t+1} = V_t P_t^T + a_t^T k^_t
      r["dp"][t] = v
      return (v - dot(v, r["e"][t].astype(f32), tb=True, precision=fine)
              + dot(r["afar"][t], r["k"][t].astype(f32), ta=True, precision=fine))

    lax.fori_loop(lo_s, hi_s, forward, r["y"][jspan])

    def backward(i, nop):   # N_t = P_{b-1} ... P_{t+1}, t = b-1 .. a
      t = hi_s - 1 - i
      r["dp"][t] = dot(nop, r["dp"][t], ta=True, precision=fine)
      return nop - dot(nop, r["e"][t].astype(f32), precision=fine)

    lax.fori_loop(0, hi_s - lo_s, backward, eye(D))

  @pl.when(jspan >= nb)
  def _():
    def zero(t, carry):
      r["dp"][t] = jnp.zeros((D, D), f32)
      return carry

    lax.fori_loop(lo_s, hi_s, zero, 0)

  def rows(c, size):
    return pl.ds(pl.multiple_of(c * C, C), size)

  def load_query(g, c, size=C):
    t = rows(c, size)
    return dict(q=r["q"][g, t], do=r["do"][g, t], lse=r["lse"][g, t], delta=r["delta"][g, t],
                fq=None if not gate else r["fq"][g, t], sq=None if not segments else r["sq"][t])

  def load_key(g, m, with_e=True):
    return dict(k=r["k"][m], v=r["v"][m], e=r["e"][m] if with_e else None,
                fk=None if not gate else r["fk"][g, m], sk=None if not segments else r["sk"][m])

  def diagonal(g, c):   # dS to ddiag (the pre-pass takes it to q, k); dfq straight to the output
    qc = load_query(g, c)
    _, ds = tile_grads(qc, load_key(g, c, with_e=False), r["diag"][g, rows(c, C)].astype(f32),
                       True, **kw)
    r["ddiag"][g, rows(c, C)] = ds.astype(r["ddiag"].dtype)
    if gate:
      r["dfq"][g, rows(c, C)] = jnp.sum(ds, axis=1, keepdims=True)

  def first_key(c, last):
    lo = chunk_bound(r["lo"], c) if bounds else 0
    if bounds and last is not None:
      lo = jnp.minimum(lo, chunk_bound(r["lo"], last))
    return jnp.maximum(lo, lo_s)

  def initial_adjoint(g, c, size):   # A_c at the span's start (keys left of it); none for J = 0
    # (J = 0 has no rows in the packed A: the read must not happen there, not only be masked)
    read = lambda: r["a"][g, boundary_rows(jspan - 1, c, size, n=n, span=span, C=C)].astype(f32)
    return lax.cond(jspan > 0, read, lambda: jnp.zeros((size, D), f32))

  def sweep(g, c, qp, qt, size, last):
    """States of the query tile qp (rows of chunk c, or of c and c + 1 stacked) against key
    chunks m = c-1 .. lo, right to left into st, then the adjoint left to right from A."""
    lo = first_key(c, last)

    def store(i, qt):
      m = c - 1 - i
      r["st"][m - lo_s, pl.ds(0, size)] = qt.astype(dt)
      return qt - dot(qt.astype(dt), r["e"][m], **kw)

    lax.fori_loop(0, c - lo, store, qt)

    def key_chunk(m, carry):
      adj, dfq = carry
      adj, dfq, dp = dq_step(qp, load_key(g, m), r["st"][m - lo_s, pl.ds(0, size)], adj, dfq,
                             scale=scale, transport=True, **kw)
      r["dp"][m] += dp   # key chunk m's share (this span's chunks), read-modify-write
      return adj, dfq

    return lax.fori_loop(lo, c, key_chunk,
                         (initial_adjoint(g, c, size), jnp.zeros((size, 1), f32)))

  def finish(g, c, size, adj, dfq):
    r["dq"][g, rows(c, size)] = adj.astype(r["dq"].dtype)
    if gate:
      r["dfq"][g, rows(c, size)] += dfq

  def query_pair(g, c):   # chunks c, c + 1 as one 2C-row tile (backward.dq_kernel's pairs)
    diagonal(g, c)
    diagonal(g, c + 1)
    qp = load_query(g, c, 2 * C)
    kc = load_key(g, c)
    qt, low = pair_state(qp["q"], kc["e"], **kw)
    adj, dfq = sweep(g, c, qp, qt, 2 * C, c + 1)
    adj, dfq, dp = dq_step(qp, kc, qp["q"], adj, dfq, live=low, scale=scale, transport=True,
                           **kw)   # chunk c + 1 vs key c
    r["dp"][c] += dp
    finish(g, c, 2 * C, adj, dfq)

  def query_chunk(g, c):   # one chunk alone (with pairs: the odd last chunk of the last span)
    diagonal(g, c)
    qc = load_query(g, c)
    finish(g, c, C, *sweep(g, c, qc, qc["q"].astype(f32), C, None))

  count = hi_s - lo_s
  if not sweeps:   # the diagonal tiles only
    for g in range(G):
      def diagonal_tile(c, carry, g=g):
        diagonal(g, c)
        return carry

      lax.fori_loop(lo_s, hi_s, diagonal_tile, 0)
    return
  for g in range(G):
    def unit(i, carry, g=g):
      if pairs:
        query_pair(g, lo_s + 2 * i)
      else:
        query_chunk(g, lo_s + i)
      return carry

    lax.fori_loop(0, lax.div(count, 2) if pairs else count, unit, 0)
    if pairs:
      pl.when(lax.rem(count, 2) == 1)(lambda g=g: query_chunk(g, hi_s - 1))


def _optional_inputs(ops, bounds: bool, *, query, seg, hi: bool):
  """The operands that only some calls have, in the kernels' order, with their BlockSpecs: the
  gate sums (fq, fk; `query`'s spec), the segment ids (sq, sk) and chunk bounds (lo, and hi
  with `hi`; `seg`'s spec)."""
  args = []
  if ops.fq is not None:
    args += [(ops.fq, query), (ops.fk, query)]
  if ops.sq is not None:
    args += [(ops.sq, seg), (ops.sk, seg)]
  if bounds:
    args += [(ops.lo, seg)] + ([(ops.hi, seg)] if hi else [])
  return [x for x, _ in args], [spec(x) for x, spec in args]


def _query_tiles(ops, plan):
  """The far dq launches' tiles (far_dq_kernel, far_states_kernel): query chunks two at a time
  with plan.far_dq_pairs. -> pairs, the grid, its ids and chunk axis, and the BlockSpec makers
  of a query head's (`own`) and its kv head's (`kv`) arrays."""
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  pairs = plan.far_dq_pairs
  grid, ids, axis = launch.chunk_grid(B, H, (n + 1) // 2 if pairs else n, plan.spec.backend,
                                      reverse=True)
  own = lambda x: launch.full(x, ids, lambda h: h)
  kv = lambda x: launch.full(x, ids, lambda h: h // G)
  return pairs, grid, ids, axis, own, kv


def _far_dq(ops, do, lse, delta, kb, pi, plan):
  """-> qb, A [B, H, R, D] (kernel dtype; packed, tiles.boundary_offset), (dfq [B, H, n, C, 1]
  float32 of far tiles): far_dq_kernel."""
  backend, span = plan.spec.backend, plan.span
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  f = operands.features(ops)
  bounds = operands.skips_chunks(ops, backend)
  pairs, grid, ids, axis, own, kv = _query_tiles(ops, plan)
  seg = lambda x: launch.full(x, ids, lambda h: 0)
  m = launch.merged
  args = [m(ops.q), kb, ops.v, ops.e, pi, operands.unchunked(do), m(lse), m(delta)]
  specs = [own(args[0]), kv(kb), launch.time_major_spec(ops.v, ids, lambda h: h // G),
           kv(ops.e), kv(pi), launch.time_major_spec(args[5], ids, lambda h: h), own(args[6]),
           own(args[7])]
  more, more_specs = _optional_inputs(ops._replace(fq=m(ops.fq), sq=m(ops.sq)), bounds,
                                     query=own, seg=seg, hi=False)
  args, specs = args + more, specs + more_specs
  states = jax.ShapeDtypeStruct((B, H, boundary_array_rows(n=n, span=span, C=C), D),
                                ops.q.dtype)
  out_shape = [states, states]
  if f["gate"]:
    out_shape.append(jax.ShapeDtypeStruct((B, H, n * C, 1), jnp.float32))
  out_specs = [own(x) for x in out_shape]
  kernel = functools.partial(far_dq_kernel, scale=plan.scale, span=span, nb=plan.boundaries,
                             bounds=bounds, precision=plan.precision, chunk_axis=axis,
                             fine=plan.chain_precision, gate=f["gate"], segments=f["segments"],
                             pairs=pairs)
  outs = launch.call(kernel, grid, specs, out_specs, out_shape, backend=backend,
                     warps=plan.warps("far_dq"), stages=plan.stages("far_dq"))(*args)
  return tuple(outs[:2]) + tuple(x.reshape(B, H, n, C, 1) for x in outs[2:])


def _far_states(ops, pi, plan):
  """-> qb [B, H, R, D] (kernel dtype; packed): far_states_kernel, the far dq launch's first
  half when the walk runs on Mosaic GPU. Tiles as _far_dq's."""
  span = plan.span
  B, H, n, C, D = ops.q.shape
  pairs, grid, _, axis, own, kv = _query_tiles(ops, plan)
  args = [launch.merged(ops.q), ops.e, pi]
  states = jax.ShapeDtypeStruct((B, H, boundary_array_rows(n=n, span=span, C=C), D),
                                ops.q.dtype)
  kernel = functools.partial(far_states_kernel, span=span, precision=plan.precision,
                             fine=plan.chain_precision, chunk_axis=axis, pairs=pairs)
  return launch.call(kernel, grid, [own(args[0]), kv(ops.e), kv(pi)], [own(states)], [states],
                     backend=plan.spec.backend, warps=plan.warps("far_dq"),
                     stages=plan.stages("far_dq"))(*args)[0]


def _far_dkv(ops, do, lse, delta, kb, qb, plan):
  """-> a, dv [B, K, n, C, D] float32 (far tiles), (dfk [B, H, n, 1, C] float32): the far dk/dv
  walk as its own launch, on Mosaic GPU or far_dkv_kernel (key chunks two at a time with
  plan.far_dkv_pairs)."""
  backend, span = plan.spec.backend, plan.span
  if plan.far_dkv == "mosaic":
    walk = backward_far.far_dkv if backend == "gpu" else backward_far.far_dkv_reference
    a, dv, dfk = walk(ops, do, lse, delta, kb, qb, scale=plan.scale, span=span)
    return (a, dv) + ((dfk,) if dfk is not None else ())
  B, H, n, C, D = ops.q.shape
  K = ops.k.shape[1]
  G = H // K
  f = operands.features(ops)
  bounds = operands.skips_chunks(ops, backend)
  pairs = plan.far_dkv_pairs
  grid, ids, axis = launch.chunk_grid(B, K, (n + 1) // 2 if pairs else n, backend)
  grp = lambda x: pl.BlockSpec((None, G) + x.shape[2:],
                               lambda *p: (ids(*p)[0], ids(*p)[1]) + (0,) * (x.ndim - 2))
  kv = lambda x: launch.full(x, ids, lambda h: h)
  seg = lambda x: launch.full(x, ids, lambda h: 0)
  # key-major tiles: key-side vectors [.., n, 1, C] as one column of keys [.., n*C, 1],
  # query-side ones [.., n, C, 1] as rows [.., n, 1, C] (each the same memory: a bitcast)
  keys = lambda x: None if x is None else x.reshape(x.shape[:2] + (n * C, 1))
  rows = launch.as_rows
  kbm, vm = launch.merged(kb), operands.unchunked(ops.v)
  args = [qb, kbm, vm, do, rows(lse), rows(delta)]
  specs = [grp(qb), kv(kbm), launch.time_major_spec(vm, ids, lambda h: h),
           launch.time_major_spec(do, ids, lambda h: h, heads=G), grp(args[4]), grp(args[5])]
  more, more_specs = _optional_inputs(
      ops._replace(fq=rows(ops.fq), fk=keys(ops.fk), sq=rows(ops.sq), sk=keys(ops.sk)), bounds,
      query=grp, seg=seg, hi=True)
  args, specs = args + more, specs + more_specs
  out_shape = [jax.ShapeDtypeStruct((B, K, n * C, D), jnp.float32)] * 2
  if f["gate"]:
    out_shape.append(jax.ShapeDtypeStruct((B, H, n * C, 1), jnp.float32))
  out_specs = [kv(out_shape[0]), kv(out_shape[1])] + [grp(x) for x in out_shape[2:]]
  kernel = functools.partial(far_dkv_kernel, scale=plan.scale, span=span, bounds=bounds,
                             precision=plan.precision, chunk_axis=axis, gate=f["gate"],
                             segments=f["segments"], pairs=pairs)
  outs = launch.call(kernel, grid, specs, out_specs, out_shape, backend=backend,
                     warps=plan.warps("far_dkv"), stages=plan.stages("far_dkv"))(*args)
  a, dv = (x.reshape(B, K, n, C, D) for x in outs[:2])
  return (a, dv) + tuple(x.reshape(B, H, n, 1, C) for x in outs[2:])


def backward(ops, do, lse, delta, plan, *, boundary=None):
  """The span-parallel backward: backward.backward's gradients (q, k, v, diag, dp, fq?, fk?).
  boundary: (kb, pi) of the forward's boundary launch, where the span forward made it."""
  backend, span, scale = plan.spec.backend, plan.span, plan.scale
  B, H, n, C, D = ops.q.shape
  K = ops.k.shape[1]
  f = operands.features(ops)
  nb = plan.boundaries
  kb, pi = boundary if boundary is not None else spans.boundary(ops, plan)
  if plan.far_dq == "mosaic":
    qb = _far_states(ops, pi, plan)
    walk = backward_far.far_dq if backend == "gpu" else backward_far.far_dq_reference
    a, dfq = walk(ops, do, lse, delta, kb, qb, pi, scale=scale, span=span)
    dfq_far = [dfq] if f["gate"] else []
  else:
    qb, a, *dfq_far = _far_dq(ops, do, lse, delta, kb, pi, plan)
  if plan.far_dkv == "dkv":   # the dk/dv kernel walks the far query chunks too, and gives a
    key_side = walk_backward.dkv(ops, do, lse, delta, plan, span=span, qb=qb, far_out=True)
    afar = key_side.pop("a")
  else:   # a far dk/dv launch; the dk/dv kernel's walk inside the span adds its sums
    afar, dvfar, *dfk_far = _far_dkv(ops, do, lse, delta, kb, qb, plan)
    key_side = walk_backward.dkv(ops, do, lse, delta, plan, span=span,
                                 far_in=(afar, dvfar, dfk_far[0] if dfk_far else None))
  y = spans.far_queries_y(qb, a, plan)

  m = launch.merged
  merged = ops._replace(q=m(ops.q), diag=m(ops.diag), fq=m(ops.fq), sq=m(ops.sq))
  bounds = operands.skips_chunks(ops, backend)
  grid_kv = lambda j, kh, b: (b, kh)
  args, specs, grp = walk_backward.inputs(merged, operands.unchunked(do), m(lse), m(delta),
                                          grid_kv, bounds=bounds)
  kvh = lambda x: pl.BlockSpec((None, None) + x.shape[2:],
                               lambda *i: grid_kv(*i) + (0,) * (x.ndim - 2))
  args += [a, y, afar]
  specs += [grp(a), kvh(y), kvh(afar)]
  f32 = jnp.float32
  gdt = ops.q.dtype
  pairs = plan.sweep_pairs
  mosaic_sweep = plan.sweep == "mosaic"
  rows = 2 * C if pairs else C
  shapes = dict(q=((B, H, n * C, D), gdt), diag=((B, H, n * C, C), gdt), dp=((B, K, n, D, D), f32))
  shapes["st"] = ((B, K, nb + 1, span, rows, D), gdt)
  if mosaic_sweep:   # the sweeps' dq and states are the Mosaic launch's
    del shapes["q"], shapes["st"]
  names = list(shapes)
  out_shape = [jax.ShapeDtypeStruct(*shape) for shape in shapes.values()]
  if f["gate"]:
    names.append("fq")
    out_shape.append(jax.ShapeDtypeStruct((B, H, n * C, 1), f32))
  st_spec = pl.BlockSpec((None, None, None, span, rows, D),
                         lambda j, kh, b: (b, kh, j, 0, 0, 0))
  out_specs = [st_spec if name == "st" else grp(s) if name in ("q", "diag", "fq")
               else kvh(s) for name, s in zip(names, out_shape)]
  kernel = functools.partial(span_kernel, scale=scale, span=span, nb=nb, gate=f["gate"],
                             segments=f["segments"], bounds=bounds, precision=plan.precision,
                             span_axis=0, pairs=pairs, fine=plan.chain_precision,
                             sweeps=not mosaic_sweep)
  outs = launch.call(kernel, (nb + 1, K, B), specs, out_specs, out_shape, backend=backend,
                     warps=plan.warps("span"), stages=plan.stages("span"))(*args)
  g = dict(zip(names, outs))
  g.pop("st", None)
  if mosaic_sweep:
    walk = span_sweep.sweeps if backend == "gpu" else span_sweep.sweeps_reference
    dq, dfq, g["dp"] = walk(ops, do, lse, delta, a, g["dp"], scale=scale, span=span)
    g["q"] = dq.reshape(B, H, n * C, D)
    if f["gate"]:
      g["fq"] = g["fq"] + dfq.reshape(B, H, n * C, 1)
  for name in ("q", "diag", "fq"):   # back to [B, H, n, C, ...]
    if name in g:
      g[name] = g[name].reshape(B, H, n, C, *g[name].shape[3:])
  g.update(key_side)
  if f["gate"]:
    g["fq"] = g["fq"] + dfq_far[0]
  return g
