"""Tile functions that every PaTH / FoX form's kernel bodies share: masks, the online softmax
step, the query tile's move across a chunk, the backward's per-tile gradients, and the packed
boundary-state layout of the span forms (the product and what every kernel family shares are
in kernels_pallas/common/tiles.py).

Operands come from operands.py, head-major and blocked: a [n, C, D] ref holds a whole sequence
of chunks for one (batch, head) and `ref[m]` reads chunk m (a dynamic index on a leading,
untiled dimension, which both backends lower). v and dO are time-major in HBM ([B, n, C, heads,
D]); their BlockSpecs (launch.time_major_spec) give the same [n, C, D] refs with strided rows,
and a GQA group's heads come through HeadsMinor.

Notation: chunk transport P_m = I - E_m (E_m = W_m^T U_m, D x D, from the pre-pass) acting on
row vectors; M_cm = P_{c-1} ... P_{m+1}; the logits of query chunk c against key chunk m < c are
l = scale q^_c M_cm k^_m^T and dS = p (dO V^T - Delta). DESIGN.md has the derivation.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.common.tiles import NEG_INF, dot

class HeadsMinor:
  """A time-major ref of a group's heads, [..rows, G, D] (launch.time_major_spec with `heads`),
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


def unpack_forward(refs, transport, gate, segments, bounds=False, spans=False):
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
  """Scalar entry i of a [n, 1, 1] int32 ref (operands.chunk_bounds' lo or hi): a load and a
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


def softmax_step(qt, m_i, l_i, acc, kt, vt, s_gate, s_ok, *, scale, dt, precision):
  """One online-softmax step of query tile state qt against a key/value chunk."""
  s = logits(scale * dot(qt.astype(dt), kt, tb=True, precision=precision), s_gate, s_ok)
  m_new = jnp.maximum(m_i, jnp.max(s, axis=1, keepdims=True))
  alpha = jnp.exp(m_i - m_new)
  p = jnp.exp(s - m_new)
  l_i = alpha * l_i + jnp.sum(p, axis=1, keepdims=True)
  acc = alpha * acc + dot(p.astype(dt), vt, precision=precision)
  return m_new, l_i, acc


# --- the standalone causal kernels (tapa, grape_ap, grape_a): a query tile's per-row state
# (m, l, acc) as 1-D rows, the logits computed by the kernel, the mask from distances


def move(qt, et, *, dt, precision):
  """q~ <- q~ P_m = q~ - q~ E_m: move the query tile (float32) across key chunk m."""
  return qt - dot(qt.astype(dt), et, precision=precision)


def diagonal(q, kc, vc, d_ref, fq, fk, sq, sk, *, scale, precision):
  """Diagonal chunk first: every row sees itself, so the running max is finite from here on."""
  C = q.shape[0]
  s = (d_ref[...].astype(jnp.float32) if d_ref is not None
       else scale * dot(q, kc, tb=True, precision=precision))
  s = logits(s, *tile_mask(C, causal=True, fq=fq, fk=fk, sq=sq, sk=sk))
  m_i = jnp.max(s, axis=1, keepdims=True)
  p = jnp.exp(s - m_i)
  l_i = jnp.sum(p, axis=1, keepdims=True)
  return m_i, l_i, dot(p.astype(q.dtype), vc, precision=precision)


def unpack(refs, spec):
  """Splits refs by the (name, present) list `spec`; absent names map to None."""
  refs = list(refs)
  out = {}
  for name, present in spec:
    out[name] = refs.pop(0) if present else None
  assert not refs, len(refs)
  return out



def backward_spec(transport, gate, segments, bounds):
  return [("q", True), ("k", True), ("v", True), ("e", transport),
          ("do", True), ("lse", True), ("delta", True), ("fq", gate), ("fk", gate),
          ("sq", segments), ("sk", segments), ("diag", transport), ("lo", bounds),
          ("hi", bounds)]


def eye(D):
  i = lax.broadcasted_iota(jnp.int32, (D, D), 0)
  return jnp.where(i == lax.broadcasted_iota(jnp.int32, (D, D), 1), 1.0, 0.0).astype(jnp.float32)


def tile_grads(qc, kc, s, causal, *, precision):
  """p and dS of one [R, C] tile: qc holds the query rows (do, lse, delta, fq, sq), kc the key
  chunk (v, fk, sk), s the scaled logits before gate and mask."""
  gate_, ok = tile_mask(kc["v"].shape[0], causal=causal, fq=qc["fq"], fk=kc["fk"], sq=qc["sq"],
                        sk=kc["sk"])
  p = jnp.exp(logits(s, gate_, ok) - qc["lse"])
  return p, p * (dot(qc["do"], kc["v"], tb=True, precision=precision) - qc["delta"])


def pair_state(q, e, *, precision):
  """Query chunks c, c + 1 stacked as one 2C-row tile q (kernel dtype), E_c = e -> (the float32
  state with chunk c + 1's rows moved across chunk c, the [2C, 1] mask of those rows)."""
  low = lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0) >= q.shape[0] // 2
  return q.astype(jnp.float32) - jnp.where(low, dot(q, e, precision=precision), 0.0), low


def dq_step(qc, kc, qt, adj, dfq, *, scale, transport, precision, live=None):
  """One key chunk m < c for a query tile (one chunk, or two stacked): state qt (kernel dtype),
  adj = R, the adjoint of the state after crossing chunk m -> (R P_m^T + scale dS k^_m, dfq,
  s_m^T R, the contribution to dL/dP_m (None without transport)). Rows outside `live`
  ([R, 1] bool) take no part."""
  dt = qt.dtype
  s = scale * dot(qt, kc["k"], tb=True, precision=precision)
  if live is not None:
    s = jnp.where(live, s, NEG_INF)
  _, ds = tile_grads(qc, kc, s, False, precision=precision)
  dfq = dfq + jnp.sum(ds, axis=1, keepdims=True)
  gk = scale * dot(ds.astype(dt), kc["k"], precision=precision)
  if not transport:
    return adj + gk, dfq, None
  adjc = (adj if live is None else jnp.where(live, adj, 0.0)).astype(dt)
  return (gk + adj - dot(adjc, kc["e"], tb=True, precision=precision), dfq,
          dot(qt, adjc, ta=True, precision=precision))
