"""Forward kernel bodies and the helpers that the backward bodies (bwd_kernels.py) share.

Operands come from prepass.py, head-major and blocked: a [n, C, D] ref holds a whole sequence
of chunks for one (batch, head) and `ref[m]` reads chunk m (a dynamic index on a leading,
untiled dimension, which both backends lower). v and dO are time-major in HBM ([B, n, C, heads,
D]); on the GPU their BlockSpecs (calls.time_major_spec) give the same [n, C, D] refs with
strided rows, and a GQA group's heads come through HeadsMinor.

fwd_kernel (GPU), one program per (batch, query head, query chunk c): diagonal chunk from the
  pre-computed in-chunk logits, then key chunks m = c-1 .. 0 right to left in a loop with an
  online softmax, the query tile moving one chunk left after each key chunk:
  q~ <- q~ - q~ E_m (E_m = W_m^T U_m, D x D; the logits q~ k^T and the move read the same q~, so
  the two products are independent and the dependent chain per step is one product). Causal
  block skipping is the loop bound; with `bounds` (segments, GPU) the walk also stops at
  lo_c, the first key chunk that shares a segment with chunk c (prepass.chunk_bounds), since
  every chunk left of it is masked for every query of the tile.

fwd_kv_kernel (TPU), the same walk as a grid axis: grid (batch, head, query chunk, j), j last
  and "arbitrary"; step j reads key chunk m = c - j through the BlockSpec index map (so only
  one key/value/transport chunk sits in VMEM), the query-tile state, running max, sum and
  accumulator live in VMEM scratch across j, steps j > c are skipped with pl.when and keep the
  block index of the last useful step, so nothing is fetched for them.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

NEG_INF = -1e30


def dot(a, b, *, ta=False, tb=False, precision=None):
  """a @ b (a^T, b^T with ta, tb) with float32 accumulation."""
  dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


class HeadsMinor:
  """A time-major ref of a group's heads, [..rows, G, D] (calls.time_major_spec with `heads`),
  read as the head-major [G, ..rows, D] the kernel bodies index: x[g, i, ..] = ref[i, .., g, :].
  Only reads (v and dO are inputs)."""

  def __init__(self, ref):
    self.ref = ref

  @property
  def shape(self):
    s = tuple(self.ref.shape)
    return (s[-2],) + s[:-2] + (s[-1],)

  @property
  def dtype(self):
    return self.ref.dtype

  def __getitem__(self, idx):
    g, *rows = idx if isinstance(idx, tuple) else (idx,)
    rows += [slice(None)] * (len(self.ref.shape) - 2 - len(rows))
    return self.ref[tuple(rows) + (g,)]


def tile_mask(C, *, causal, fq=None, fk=None, sq=None, sk=None):
  """Additive gate F_i - F_j (fq [C,1], fk [1,C]) and the boolean visibility of a [C, C] tile."""
  gate = None if fq is None else fq - fk
  ok = None
  if causal:
    ok = lax.broadcasted_iota(jnp.int32, (C, C), 1) <= lax.broadcasted_iota(jnp.int32, (C, C), 0)
  if sq is not None:
    same = sq == sk
    ok = same if ok is None else ok & same
  return gate, ok


def logits(s, gate, ok):
  if gate is not None:
    s = s + gate
  if ok is not None:
    s = jnp.where(ok, s, NEG_INF)
  return s


def chunk_id(n, *, axis, reverse):
  """This program's chunk from grid axis `axis`; reverse: chunk n-1 first (the longest causal
  walks start first, so the launch's tail is short ones)."""
  i = pl.program_id(axis)
  return n - 1 - i if reverse else i


def _unpack_fwd(refs, transport, gate, segments, bounds=False, spans=False):
  refs = list(refs)
  take = lambda k, on: [refs.pop(0) for _ in range(k)] if on else [None] * k
  q, k, v = take(3, True)
  e, d = take(2, transport)
  fq, fk = take(2, gate)
  sq, sk = take(2, segments)
  (lo,) = take(1, bounds)
  kb, pi = take(2, spans)
  return q, k, v, e, d, fq, fk, sq, sk, lo, (kb, pi), refs


def chunk_bound(ref, i):
  """Scalar entry i of a [n, 1, 1] int32 ref (prepass.chunk_bounds' lo or hi): a load and a
  reduction, which both the Triton lowering and the interpreter take."""
  return jnp.min(ref[i])


def boundary_offset(j, *, n, span):
  """The packed boundary-state layout (qb, A of the span backward; qb of the dk/dv kernel's
  span): boundary j = 0 .. nb-1 sits at s_j = (j + 1) span and has states only for the query
  chunks c >= s_j, so its block holds those n - s_j chunks, the blocks one after another. ->
  the first chunk row of block j (j a Python int or a traced int32; j = nb gives the total)."""
  half = j * (j + 1) // 2 if isinstance(j, int) else lax.div(j * (j + 1), 2)
  return j * n - span * half


def boundary_array_rows(*, n, span, C):
  """Rows of a packed boundary-state array: R = boundary_offset(nb) chunks, at least two. A
  2C-row tile's read or write there is traced even in a branch that never runs (the first
  span's tiles, which have no boundary below), and its static size must fit."""
  return max(boundary_offset((n - 1) // span, n=n, span=span), 2) * C


def boundary_rows(j, c, size, *, n, span, C):
  """pl.ds of `size` rows from query chunk c (>= s_j) of boundary j in the packed layout."""
  start = (boundary_offset(j, n=n, span=span) + c - (j + 1) * span) * C
  return pl.ds(start if isinstance(start, int) else pl.multiple_of(start, C), size)


def _step(qt, m_i, l_i, acc, kt, vt, s_gate, s_ok, *, scale, dt, precision):
  """One online-softmax step of query tile state qt against a key/value chunk."""
  s = logits(scale * dot(qt.astype(dt), kt, tb=True, precision=precision), s_gate, s_ok)
  m_new = jnp.maximum(m_i, jnp.max(s, axis=1, keepdims=True))
  alpha = jnp.exp(m_i - m_new)
  p = jnp.exp(s - m_new)
  l_i = alpha * l_i + jnp.sum(p, axis=1, keepdims=True)
  acc = alpha * acc + dot(p.astype(dt), vt, precision=precision)
  return m_new, l_i, acc


def _move(qt, et, *, dt, precision):
  """q~ <- q~ P_m = q~ - q~ E_m: move the query tile (float32) across key chunk m."""
  return qt - dot(qt.astype(dt), et, precision=precision)


def _diag(q, kc, vc, d_ref, fq, fk, sq, sk, *, scale, precision):
  """Diagonal chunk first: every row sees itself, so the running max is finite from here on."""
  C = q.shape[0]
  s = (d_ref[...].astype(jnp.float32) if d_ref is not None
       else scale * dot(q, kc, tb=True, precision=precision))
  s = logits(s, *tile_mask(C, causal=True, fq=fq, fk=fk, sq=sq, sk=sk))
  m_i = jnp.max(s, axis=1, keepdims=True)
  p = jnp.exp(s - m_i)
  l_i = jnp.sum(p, axis=1, keepdims=True)
  return m_i, l_i, dot(p.astype(q.dtype), vc, precision=precision)


def fwd_kernel(*refs, scale, transport, gate, segments, precision, chunk_axis, reverse,
               bounds=False, span=0, fine=None, far=True):
  """refs: q [C,D], k, v [n,C,D], (e [n,D,D], diag [C,C]), (fq [C,1], fk [n,1,C]),
  (sq [C,1], sk [n,1,C]), (lo [n,1,1]), (kb [n,C,D], pi [nb,D,D] with `span`) -> o [C,D],
  lse [C,1], (with `span`: qb [R, D], the head's packed boundary states, scratch). The query
  chunk is grid axis chunk_axis (reversed with `reverse`, see calls.chunk_grid).

  With `span` (transport; chunks cut into spans of `span` as in bwd_span.py) the tile moves
  chunk by chunk only inside its own span. At the span's start it is the boundary state
  qb = q^_c P_{c-1} ... P_a, and every key chunk m of an earlier span J is plain attention
  against kb_m = k^_m M_bm^T (bwd_span.boundary_kernel's keys moved to their span's end b):
  q^_c M_cm = qb^(b) M_bm. Between spans the state crosses the whole span at once,
  qb^(a) = qb^(b) Pi_J (float32, precision `fine`). Far steps take two products instead of
  the walk's three (four at head_dim 128: the move is C x D x D). far=False: the far keys are
  left to another launch (fwd_far_mosaic.py), which reads the states stored here; o and lse are
  then those of the near keys alone."""
  q_ref, k_ref, v_ref, e_ref, d_ref, fq_ref, fk_ref, sq_ref, sk_ref, lo_ref, (kb_ref, pi_ref), \
      outs = _unpack_fwd(refs, transport, gate, segments, bounds, spans=bool(span))
  o_ref, lse_ref, *qb_ref = outs
  qb_ref = qb_ref[0] if span else None   # [R, D]: the packed boundary states (boundary_rows)
  c = chunk_id(k_ref.shape[0], axis=chunk_axis, reverse=reverse)
  q = q_ref[...]
  C = q.shape[0]
  dt = q.dtype
  fq = None if fq_ref is None else fq_ref[...]
  sq = None if sq_ref is None else sq_ref[...]
  fk_of = lambda m: None if fk_ref is None else fk_ref[m]
  sk_of = lambda m: None if sk_ref is None else sk_ref[m]
  m_i, l_i, acc = _diag(q, k_ref[c], v_ref[c], d_ref, fq, fk_of(c), sq, sk_of(c), scale=scale,
                        precision=precision)

  def attend(qt, m, kt, m_i, l_i, acc):
    gate_, ok = tile_mask(C, causal=False, fq=fq, fk=fk_of(m), sq=sq, sk=sk_of(m))
    return _step(qt, m_i, l_i, acc, kt, v_ref[m], gate_, ok, scale=scale, dt=dt,
                 precision=precision)

  def body(i, carry):
    qt, m_i, l_i, acc = carry
    m = c - 1 - i
    m_i, l_i, acc = attend(qt, m, k_ref[m], m_i, l_i, acc)
    if transport:
      qt = _move(qt, e_ref[m], dt=dt, precision=precision)
    return qt, m_i, l_i, acc

  lo = chunk_bound(lo_ref, c) if bounds else 0
  jc = lax.div(c, span) if span else 0   # c's span
  near = jnp.maximum(lo, jc * span) if span else lo   # the walk stops at c's span start
  qt, m_i, l_i, acc = lax.fori_loop(0, c - near, body, (q.astype(jnp.float32), m_i, l_i, acc))
  if span:
    n = k_ref.shape[0]
    j0 = jnp.minimum(lax.div(lo, span), jc)   # spans wholly left of c's document: skipped
    packed = lambda J: boundary_rows(J, c, C, n=n, span=span, C=C)

    # Two loops, as bwd_span.far_dq_kernel: the states at the boundaries s_J = (J + 1) span
    # first (qb^(s_{J-1}) = qb^(s_J) Pi_J, float32 at precision `fine`), kept in qb_ref, then
    # the far keys of each span against its state read back in the kernel dtype. H200,
    # 2026-11-26, one call, forward (fwd+bwd) ms: 25.67 (116.22) against the walk of every
    # chunk's 30.28 (122.53) at 4,16384,16,128, 6.00 (24.85) against 6.08 (24.97) at
    # 8,4096,16,128. With the crossing inside the loop over spans (its float32 state live
    # across the far keys) the kernel alone had been slower than the walk's (30.68 against
    # 29.06 ms at 4,16384,16,128, round 19). Not better: one loop over every far key reading
    # the state per key (29.00 / 7.01 ms forward at 4,16384,16,128 / 8,4096,16,128), and the
    # far keys in a launch of their own (no gain at head_dim 64; at 128 it asked XLA's Triton
    # for 384 KiB of shared memory). The crossing's products (Pi's bf16 halves) spill: 900 B a
    # thread at 8,4096,16,128 with 4 warps, none without them (resource report; 928 while the
    # loop also moved the state past the last span, a product never read: the timings above).
    def cross(i, qt):   # store the state at span J's end, move it to J's start
      J = jc - 1 - i
      qb_ref[packed(J)] = qt.astype(qb_ref.dtype)
      return dot(qt, pi_ref[J], precision=fine)

    # spans jc-1 .. j0+1 crossed (no step when j0 >= jc - 1), j0's state stored without the
    # move past it (never read)
    qt = lax.fori_loop(0, jc - j0 - 1, cross, qt)

    @pl.when(j0 < jc)
    def _():
      qb_ref[packed(j0)] = qt.astype(qb_ref.dtype)

    def far_span(J, carry):   # plain attention of qb^(s_J) against span J's moved keys
      qt = qb_ref[packed(J)]

      def key(m, carry):
        return attend(qt, m, kb_ref[m], *carry)

      return lax.fori_loop(jnp.maximum(lo, J * span), (J + 1) * span, key, carry)

    if far:
      m_i, l_i, acc = lax.fori_loop(j0, jc, far_span, (m_i, l_i, acc))
  o_ref[...] = (acc / l_i).astype(o_ref.dtype)
  lse_ref[...] = m_i + jnp.log(l_i)


def fwd_kv_kernel(*refs, scale, transport, gate, segments, precision):
  """refs (one chunk each): q [C,D] (chunk c), k, v [C,D], (e [D,D]) (chunk c - j), (diag [C,C]),
  (fq [C,1], fk [1,C]), (sq [C,1], sk [1,C]) -> o [C,D], lse [C,1]; scratch qt, m, l, acc."""
  q_ref, k_ref, v_ref, e_ref, d_ref, fq_ref, fk_ref, sq_ref, sk_ref, _, _, rest = _unpack_fwd(
      refs, transport, gate, segments)
  o_ref, lse_ref, qt_ref, m_ref, l_ref, acc_ref = rest
  c, j = pl.program_id(2), pl.program_id(3)
  C = q_ref.shape[0]
  dt = q_ref.dtype
  fq = None if fq_ref is None else fq_ref[...]
  sq = None if sq_ref is None else sq_ref[...]
  fk = None if fk_ref is None else fk_ref[...]
  sk = None if sk_ref is None else sk_ref[...]

  @pl.when(j == 0)
  def _():
    q = q_ref[...]
    m_i, l_i, acc = _diag(q, k_ref[...], v_ref[...], d_ref, fq, fk, sq, sk, scale=scale,
                          precision=precision)
    qt_ref[...] = q.astype(jnp.float32)
    m_ref[...], l_ref[...], acc_ref[...] = m_i, l_i, acc

  @pl.when((j > 0) & (j <= c))
  def _():
    qt = qt_ref[...]
    gate_, ok = tile_mask(C, causal=False, fq=fq, fk=fk, sq=sq, sk=sk)
    m_ref[...], l_ref[...], acc_ref[...] = _step(
        qt, m_ref[...], l_ref[...], acc_ref[...], k_ref[...], v_ref[...], gate_, ok, scale=scale,
        dt=dt, precision=precision)
    if transport:
      qt_ref[...] = _move(qt, e_ref[...], dt=dt, precision=precision)

  @pl.when(j == c)  # last useful step: the output block is written back when c changes
  def _():
    o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)
    lse_ref[...] = m_ref[...] + jnp.log(l_ref[...])
