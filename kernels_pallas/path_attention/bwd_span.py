"""The span-parallel PaTH backward (BlockSizes.bwd_spans): kernel bodies for the GPU (Triton
lowering) and the interpreter. calls_span.py launches them.

The sequential dq/dP sweep of bwd_kernels.py walks all n^2 / 2 chunk pairs of a (batch, kv head)
in one program, because dL/dP_t sums state-adjoint pairs over every query chunk c > t. Here the
chunks are cut into spans of S (a = J S .. b = (J + 1) S) and a pair (query chunk c, key chunk m)
is either near (both in one span) or far. NOTES_kernel.md round 17 has the derivation; in short,
with boundary states qb_c^(s) = q^_c P_{c-1} ... P_s, keys moved to their span's end
kb_m = k^_m M_bm^T (M_bm = P_{b-1} ... P_{m+1}) and span operators Pi_J = P_{b-1} ... P_a:

- a far tile is plain attention: l_cm = scale qb_c^(b_m) kb_m^T;
- the adjoint a query chunk's sweep carries into span J is A_c^(a) (keys left of a), and
  A_c^(b) = A_c^(a) Pi_J^T + scale sum_{m in J} dS_cm kb_m, one chain per query chunk;
- the far queries' share of dL/dP_t (t in J) factors through two per-span quantities,
  Y_J = sum_{c >= b} qb_c^(b)T A_c^(a) (D x D) and X_m = scale sum_{c >= b} qb_c^(b)T dS_cm
  (the far dk/dv walk's a_m^T): dL/dP_t += N_t^T V_t with N_t = P_{b-1} ... P_{t+1},
  V_a = Y_J, V_{t+1} = V_t P_t^T + a_t^T k^_t; and the far share of dk^_t is a_t N_t.

Four launches, every one parallel and every sum in a fixed order (deterministic, no atomics):
boundary_kernel (kb, Pi; one program per key chunk), far_dq_kernel (qb, A, far dfq; one per
query chunk and query head), a key-side kernel (one per key chunk), then Y in XLA and
span_kernel (one program per (batch, kv head, span)): the near sweeps of bwd_kernels.dq_kernel
inside the span, starting from A instead of zero, and the D x D chains above. The sequential
work per program falls from n^2 / 4 pair steps to S^2 / 4. The key side takes one of three
forms (BlockSizes.bwd_spans; routing.span_form picks 2 or 3): 2, bwd_kernels.dkv_kernel gives
dk, dv, dfk whole (its operator walk inside the span, its plain walk against qb after it) and
its far accumulator a; 1, far_dkv_kernel gives a and the far dv, dfk, and the span kernel adds
the near dk, dv, dfk from its sweep's states (dq_step's kv parts); 3, far_dkv_kernel as in 1,
and dkv_kernel walks inside the span only and adds them.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.path_attention.bwd_kernels import (_eye, _in_spec, _unpack, col_sums_init,
                                                       col_total, dkv_step, dkv_step_keys, dq_step,
                                                       pair_state, tile_grads)
from kernels_pallas.path_attention.kernels import (HeadsMinor, boundary_offset, boundary_rows,
                                                  chunk_bound, chunk_id, dot)


def per_tile(tile, first, *, n, C, pairs):
  """Run tile(size) for this program's tile from chunk `first`: one chunk (size C), or with
  `pairs` chunks first, first + 1 as one 2C-row tile, the odd last chunk of an odd n alone."""
  if not pairs:
    tile(C)
  else:
    pl.when(first + 1 < n)(lambda: tile(2 * C))
    pl.when(first + 1 >= n)(lambda: tile(C))   # the odd last chunk


def boundary_kernel(k_ref, e_ref, kb_ref, pi_ref, *, span, nb, precision, fine, chunk_axis):
  """Program (key chunk m, kv head, batch). In: k^ [n, C, D], E [n, D, D]. Out: kb [C, D] of
  chunk m (k^_m M_bm^T, b its span's end) and, from a span's first chunk, pi [D, D] float32 of
  the span (Pi_J = M_ba P_a). Chunks of the last span (no boundary at its end) write nothing.

  The walk takes kernel-dtype operands, as the dk/dv kernel's; Pi's last product takes float32
  ones at precision `fine` (calls_span.fine_precision: an aggregate operator rounded to the
  kernel dtype carries that rounding into every state or adjoint it moves)."""
  n = k_ref.shape[0]
  D = e_ref.shape[-1]
  f32 = jnp.float32
  m = chunk_id(n, axis=chunk_axis, reverse=False)
  j = lax.div(m, span)

  @pl.when(j < nb)
  def _():
    dt = k_ref.dtype
    mop = lax.fori_loop(m + 1, (j + 1) * span,
                        lambda t, mop: mop - dot(e_ref[t], mop.astype(dt), precision=precision),
                        _eye(D))
    kb_ref[...] = dot(k_ref[m], mop.astype(dt), tb=True, precision=precision).astype(dt)

    @pl.when(lax.rem(m, span) == 0)
    def _():
      pi_ref[...] = mop - dot(mop, e_ref[m].astype(f32), precision=fine)


def far_dq_kernel(*refs, scale, span, nb, gate, segments, bounds, precision, fine, chunk_axis,
                  pairs):
  """Program (query tile, query head, batch): query chunk c, or with `pairs` chunks c, c + 1
  (c even; the span is even, so both lie in one span) as one 2C-row tile, the last program of
  an odd n taking its chunk alone. In, chunks merged into time (rows c C ..): q^, dO [n*C, D],
  lse, delta, (fq) [n*C, 1], (sq [n*C, 1]) of the head; kb, v [n, C, D], E [n, D, D],
  pi [nb, D, D], (fk [n, 1, C], sk [n, 1, C]) of its kv head; (lo [n, 1, 1]). Out, this tile's
  rows in the packed layout (kernels.boundary_offset: boundary j keeps the chunks c >= s_j
  only): qb [R, D], the states at the boundaries s_j = (j + 1) S <= c; A [R, D], the adjoint at
  s_j from the keys left of it; (dfq [n*C, 1] of the far tiles). Products with Pi take `fine` (boundary_kernel). A 2C-row
  tile reads each key chunk once for two query chunks and gives the products twice the rows."""
  r = _unpack(refs, [("q", True), ("kb", True), ("v", True), ("e", True), ("pi", True),
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
  (bwd_far_mosaic.far_dq). The first span's tiles write nothing."""
  r = _unpack(refs, [("q", True), ("e", True), ("pi", True), ("qb", True)])
  n = r["e"].shape[0]
  C = r["q"].shape[0] // n
  tiles = (n + 1) // 2 if pairs else n
  c = chunk_id(tiles, axis=chunk_axis, reverse=True) * (2 if pairs else 1)

  def tile(size):
    packed = lambda j: boundary_rows(j, c, size, n=n, span=span, C=C)
    pl.when(lax.div(c, span) > 0)(lambda: boundary_states(
        r, c, size, span=span, packed=packed, precision=precision, fine=fine))

  per_tile(tile, c, n=n, C=C, pairs=pairs)


def far_dkv_kernel(*refs, scale, span, gate, segments, bounds, precision, chunk_axis, pairs,
                   rows, gate_colsum="reduce", keys_major=False):
  """Program (key tile, kv head, batch): key chunk m, or with `pairs` chunks m, m + 1 (m even;
  the span is even, so both lie in one span) as one 2C-row key tile, the last program of an odd
  n taking its chunk alone. In: qb [G, R, D] of the group's heads (packed:
  kernels.boundary_offset); kb, v [n*C, D] (chunks merged into time); dO [G, n, C, D], lse,
  delta, (fq) [G, n, C, 1]; (fk [G, 1, n*C]); (sq [n, C, 1], sk [1, n*C]); (lo, hi [n, 1, 1]).
  Out, this tile's key rows, float32: a [n*C, D] = scale sum_c dS_cm^T qb_c^(b) over the query
  chunks c >= b (b: the span's end) of every head, dv [n*C, D] = sum p^T dO over them,
  (dfk [G, 1, n*C]). Zero for the last span's chunks. A 2C-row tile reads each query chunk's
  operands once for two key chunks and gives the products twice the columns. A query chunk
  goes in `rows`-row parts (C or a divisor): the [rows, 2C] logit-sized tiles are the ones a
  step's products leave live beside the two accumulators. gate_colsum: the form of dfk's column
  sums (bwd_kernels.col_sums_init). keys_major (BlockSizes.far_dkv_keys_major): the tiles are
  [keys, queries] (bwd_kernels.dkv_step_keys); the query-side vectors then come in as rows
  (lse, delta, fq [G, n, 1, C], sq [n, 1, C]), the key-side ones as columns (fk [G, n*C, 1],
  sk [n*C, 1]) and dfk goes out as [G, n*C, 1]: the same memory as the other layout's."""
  r = _unpack(refs, [("qb", True), ("kb", True), ("v", True), ("do", True), ("lse", True),
                     ("delta", True), ("fq", gate), ("fk", gate), ("sq", segments),
                     ("sk", segments), ("lo", bounds), ("hi", bounds), ("a", True), ("dv", True),
                     ("dfk", gate)])
  r["do"] = HeadsMinor(r["do"])   # [n, C, G, D] time-major, read as [G, n, C, D]
  G, n, C, D = r["do"].shape
  f32 = jnp.float32
  walk = dkv_step_keys if keys_major else dkv_step
  tiles = (n + 1) // 2 if pairs else n
  m = chunk_id(tiles, axis=chunk_axis, reverse=False) * (2 if pairs else 1)
  j = lax.div(m, span)

  def tile(size):
    keys = pl.ds(pl.multiple_of(m * C, C), size)
    last = m + size // C - 1   # the tile's last key chunk
    # the tile's key-side vectors (fk, sk in, dfk out): a column [size, 1] (keys_major) or a row
    key_at = (keys, slice(None)) if keys_major else (slice(None), keys)
    kc = dict(k=r["kb"][keys], v=r["v"][keys],
              fk=[r["fk"][(g,) + key_at] if gate else None for g in range(G)],
              sk=r["sk"][key_at] if segments else None)

    def query(g, c, h):   # rows h R .. (h + 1) R of query chunk c
      t = pl.ds(h * rows, rows)
      # a row [1, R] (keys_major) or a column [R, 1]; `lead` the head index, if any
      vec = lambda x, *lead: x[lead + ((c, slice(None), t) if keys_major else (c, t))]
      qb = boundary_rows(j, c, C, n=n, span=span, C=C)
      return dict(q=r["qb"][g, pl.ds(pl.multiple_of(qb.start + h * rows, rows), rows)],
                  fq=vec(r["fq"], g) if gate else None, sq=vec(r["sq"]) if segments else None,
                  lse=vec(r["lse"], g), do=r["do"][g, c, t], delta=vec(r["delta"], g))

    def body(c, carry):
      def step(carry):
        for h in range(C // rows):
          carry = walk(lambda g: query(g, c, h), kc, None, *carry, scale=scale,
                       transport=False, precision=precision)
        return carry

      if not bounds:
        return step(carry)
      # every query of chunk c starts its document right of the tile's keys: masked
      return lax.cond(chunk_bound(r["lo"], c) <= last, step, lambda carry: carry, carry)

    end = n
    if bounds:
      end = jnp.maximum(chunk_bound(r["hi"], m), chunk_bound(r["hi"], last)) + 1
    if keys_major:
      sums = tuple(jnp.zeros((size, 1), f32) for _ in range(G))
    else:
      sums = tuple(col_sums_init(gate_colsum, rows, size, gate=gate, exact=r["do"].dtype == f32)
                   for _ in range(G))
    init = (jnp.zeros((size, D), f32), jnp.zeros((size, D), f32), sums)
    a, dv, dfk = lax.fori_loop((j + 1) * span, end, body, init)   # empty for the last span
    r["a"][keys] = a
    r["dv"][keys] = dv
    for g in range(G) if gate else ():
      r["dfk"][(g,) + key_at] = dfk[g] if keys_major else col_total(dfk[g])

  per_tile(tile, m, n=n, C=C, pairs=pairs)


def far_y_kernel(qb_ref, a_ref, y_ref, *, n, span, chunk, precision):
  """Y_j = sum over the far query rows of boundary j of qb^T A (calls_span.far_queries_y), one
  program per (boundary j, head, batch), read straight from the packed arrays: qb_ref, a_ref
  [R, D] of one head (kernels.boundary_offset), y_ref [D, D] float32. The rows are block j of
  qb and block j - 1 of A less its first span of chunks, the same number of chunks; boundary 0
  has no keys left of it (zero)."""
  j = pl.program_id(0)
  D = y_ref.shape[-1]
  q0 = boundary_offset(j, n=n, span=span)
  a0 = boundary_offset(j - 1, n=n, span=span) + span
  steps = jnp.where(j == 0, 0, n - (j + 1) * span)
  rows = lambda c: pl.ds(pl.multiple_of(c * chunk, chunk), chunk)

  def step(t, acc):
    return acc + dot(qb_ref[rows(q0 + t), :], a_ref[rows(a0 + t), :], ta=True,
                     precision=precision)

  y_ref[...] = lax.fori_loop(0, steps, step, jnp.zeros((D, D), jnp.float32))


def span_kernel(*refs, scale, span, nb, gate, segments, bounds, precision, fine, span_axis,
                pairs, kv=True, sweeps=True):
  """Program (span J, kv head, batch). In: as bwd_kernels.dq_kernel with transport (query-side
  operands merged into time: q, do [G, n*C, D], ...), then A [G, R, D] (far_dq_kernel's,
  packed),
  y [nb, D, D] (Y_J), afar, dvfar [n, C, D], (dfkfar [G, n, 1, C]) (far_dkv_kernel's). Out, for
  this span's chunks only: dq^ [G, n*C, D], ddiag [G, n*C, C] (kernel dtype); dP [n, D, D], dk^,
  dv [n, C, D], (dfq [G, n*C, 1] of the near tiles, dfk [G, n, 1, C]) float32; st [S, R, D]
  is this program's scratch for the sweep's states (R = 2C with `pairs`: query chunks two at a
  time as one tile, else C). Without `kv` (BlockSizes.bwd_spans = 2: the dk/dv kernel gives dk,
  dv, dfk whole) there is no dvfar, dfkfar, dk, dv or dfk, and the sweep takes no key-side
  parts. The D x D chains take `fine` (boundary_kernel). Without `sweeps` (BlockSizes.span_sweep
  "mosaic": span_mosaic.sweeps walks them after this launch, and adds to dP) there is no dq or
  st: this launch writes the far queries' dP, the diagonal tiles' ddiag and their dfq only."""
  r = _unpack(refs, _in_spec(True, gate, segments, bounds)
              + [("a", True), ("y", True), ("afar", True), ("dvfar", kv), ("dfkfar", gate and kv),
                 ("dq", sweeps), ("ddiag", True), ("dp", True), ("dk", kv), ("dv", kv),
                 ("st", sweeps), ("dfq", gate), ("dfk", gate and kv)])
  r["do"] = HeadsMinor(r["do"])   # time-major, the group's heads minor (calls._bwd_inputs)
  G = r["q"].shape[0]
  n, C, D = r["k"].shape
  dt = r["q"].dtype
  f32 = jnp.float32
  jspan = pl.program_id(span_axis)
  lo_s = jspan * span                          # this span's chunks lo_s .. hi_s - 1
  hi_s = jnp.minimum(lo_s + span, n)
  kw = dict(precision=precision)

  # Key side first: the far queries' shares of dP_t and dk^_t (the V and N chains), dv and dfk
  # from far_dkv_kernel; the near sweeps below add to them.
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
      if kv:
        r["dk"][t] = dot(r["afar"][t], nop, precision=fine)
      return nop - dot(nop, r["e"][t].astype(f32), precision=fine)

    lax.fori_loop(0, hi_s - lo_s, backward, _eye(D))

  @pl.when(jspan >= nb)
  def _():
    def zero(t, carry):
      r["dp"][t] = jnp.zeros((D, D), f32)
      if kv:
        r["dk"][t] = jnp.zeros((C, D), f32)
      return carry

    lax.fori_loop(lo_s, hi_s, zero, 0)

  def far_kv(t, carry):
    r["dv"][t] = r["dvfar"][t]
    for g in range(G) if gate else ():
      r["dfk"][g, t] = r["dfkfar"][g, t]
    return carry

  if kv:
    lax.fori_loop(lo_s, hi_s, far_kv, 0)

  def rows(c, size):
    return pl.ds(pl.multiple_of(c * C, C), size)

  def load_query(g, c, size=C):
    t = rows(c, size)
    return dict(q=r["q"][g, t], do=r["do"][g, t], lse=r["lse"][g, t], delta=r["delta"][g, t],
                fq=None if not gate else r["fq"][g, t], sq=None if not segments else r["sq"][t])

  def load_key(g, m, with_e=True):
    return dict(k=r["k"][m], v=r["v"][m], e=r["e"][m] if with_e else None,
                fk=None if not gate else r["fk"][g, m], sk=None if not segments else r["sk"][m])

  def add(g, m, dp, parts):   # key chunk m's shares, read-modify-write (this span's chunks)
    if dp is not None:
      r["dp"][m] += dp
    if not kv:
      return
    dk, dv, dfk = parts
    if dk is not None:
      r["dk"][m] += dk
    r["dv"][m] += dv
    if gate:
      r["dfk"][g, m] += dfk

  def diagonal(g, c):   # dS to ddiag (the pre-pass takes it to q, k); dfq straight to the output
    qc = load_query(g, c)
    p, ds = tile_grads(qc, load_key(g, c, with_e=False), r["diag"][g, rows(c, C)].astype(f32),
                       True, **kw)
    r["ddiag"][g, rows(c, C)] = ds.astype(r["ddiag"].dtype)
    if kv:
      add(g, c, None, (None, dot(p.astype(dt), qc["do"], ta=True, **kw),
                       -jnp.sum(ds, axis=0, keepdims=True)))
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
      adj, dfq, dp, parts = dq_step(qp, load_key(g, m), r["st"][m - lo_s, pl.ds(0, size)], adj,
                                    dfq, scale=scale, transport=True, kv=kv, **kw)
      add(g, m, dp, parts)
      return adj, dfq

    return lax.fori_loop(lo, c, key_chunk,
                         (initial_adjoint(g, c, size), jnp.zeros((size, 1), f32)))

  def finish(g, c, size, adj, dfq):
    r["dq"][g, rows(c, size)] = adj.astype(r["dq"].dtype)
    if gate:
      r["dfq"][g, rows(c, size)] += dfq

  def query_pair(g, c):   # chunks c, c + 1 as one 2C-row tile (bwd_kernels.dq_kernel's pairs)
    diagonal(g, c)
    diagonal(g, c + 1)
    qp = load_query(g, c, 2 * C)
    kc = load_key(g, c)
    qt, low = pair_state(qp["q"], kc["e"], **kw)
    adj, dfq = sweep(g, c, qp, qt, 2 * C, c + 1)
    adj, dfq, dp, parts = dq_step(qp, kc, qp["q"], adj, dfq, live=low, scale=scale,
                                  transport=True, kv=kv, **kw)   # chunk c + 1 vs key c
    add(g, c, dp, parts)
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
