"""What the span forms share: the boundary launch (keys moved to their span's end, span
operators) that the span forward and the span backward read, and Y_J, the far queries' share of
dL/dP per span.

The chunks are cut into spans of S chunks (a = J S .. b = (J + 1) S) and a chunk pair (query
chunk c, key chunk m) is near (both in one span) or far. With the boundary states
qb_c^(s) = q^_c P_{c-1} ... P_s, the keys moved to their span's end kb_m = k^_m M_bm^T
(M_bm = P_{b-1} ... P_{m+1}) and the span operators Pi_J = P_{b-1} ... P_a, a far tile is plain
attention: l_cm = scale qb_c^(b_m) kb_m^T. The packed layout of the boundary states is
tiles.boundary_offset's. DESIGN.md has the derivation.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.common import launch
from kernels_pallas.common.tiles import dot
from kernels_pallas.path_attention.tiles import boundary_offset, chunk_id, eye


def boundary_kernel(k_ref, e_ref, kb_ref, pi_ref, *, span, nb, precision, fine, chunk_axis):
  """Program (key chunk m, kv head, batch). In: k^ [n, C, D], E [n, D, D]. Out: kb [C, D] of
  chunk m (k^_m M_bm^T, b its span's end) and, from a span's first chunk, pi [D, D] float32 of
  the span (Pi_J = M_ba P_a). Chunks of the last span (no boundary at its end) write nothing.

  The walk takes kernel-dtype operands, as the dk/dv kernel's; Pi's last product takes float32
  ones at precision `fine` (an aggregate operator rounded to the kernel dtype carries that
  rounding into every state or adjoint it moves)."""
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
                        eye(D))
    kb_ref[...] = dot(k_ref[m], mop.astype(dt), tb=True, precision=precision).astype(dt)

    @pl.when(lax.rem(m, span) == 0)
    def _():
      pi_ref[...] = mop - dot(mop, e_ref[m].astype(f32), precision=fine)


def boundary(ops, plan):
  """-> kb [B, K, n, C, D] (kernel dtype), pi [B, K, nb, D, D] float32: boundary_kernel."""
  backend, span = plan.spec.backend, plan.span
  nb = plan.boundaries
  B, K, n, C, D = ops.k.shape
  grid, ids, axis = launch.chunk_grid(B, K, n, backend)
  full = lambda x: launch.full(x, ids, lambda h: h)
  kb = jax.ShapeDtypeStruct(ops.k.shape, ops.k.dtype)
  pi = jax.ShapeDtypeStruct((B, K, nb, D, D), jnp.float32)
  out_specs = [pl.BlockSpec((None, None, None, C, D), lambda *p: ids(*p) + (0, 0)),
               # the span's block; the last span's chunks write nothing and map to block nb-1
               pl.BlockSpec((None, None, None, D, D), lambda *p: (
                   ids(*p)[0], ids(*p)[1], jnp.minimum(ids(*p)[2] // span, nb - 1), 0, 0))]
  kernel = functools.partial(boundary_kernel, span=span, nb=nb, chunk_axis=axis,
                             precision=plan.precision, fine=plan.chain_precision)
  return launch.call(kernel, grid, [full(ops.k), full(ops.e)], out_specs, [kb, pi],
                     backend=backend, warps=plan.warps("boundary"),
                     stages=plan.stages("boundary"))(ops.k, ops.e)


def far_y_kernel(qb_ref, a_ref, y_ref, *, n, span, chunk, precision):
  """Y_j = sum over the far query rows of boundary j of qb^T A (far_queries_y), one
  program per (boundary j, head, batch), read straight from the packed arrays: qb_ref, a_ref
  [R, D] of one head (boundary_offset), y_ref [D, D] float32. The rows are block j of
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


def far_queries_y(qb, a, plan):
  """Y_J = sum over the group's heads and the query chunks c >= b_J of qb_c^(b_J)T A_c^(a_J)
  -> [B, K, nb, D, D] float32 (zero for J = 0: no keys left of the first span). qb, A: packed
  [B, H, R, D] (boundary_offset). A launch (far_y_kernel) that reads each boundary's rows where
  they lie; XLA's einsums over slices of the packed arrays (far_queries_y_reference, its
  oracle) copy every slice first."""
  B, H, R, D = qb.shape
  K, n, chunk, span = plan.spec.kv_heads, plan.chunks, plan.block, plan.span
  nb = (n - 1) // span
  whole = pl.BlockSpec((None, None, R, D), lambda j, h, b: (b, h, 0, 0))
  out = jax.ShapeDtypeStruct((B, H, nb, D, D), jnp.float32)
  kernel = functools.partial(far_y_kernel, n=n, span=span, chunk=chunk,
                             precision=plan.precision)
  y = launch.call(kernel, (nb, H, B), [whole, whole],
                  pl.BlockSpec((None, None, None, D, D), lambda j, h, b: (b, h, j, 0, 0)), out,
                  backend=plan.spec.backend, warps=plan.warps("far_y"),
                  stages=plan.stages("far_y"))(qb, a)
  return y.reshape(B, K, H // K, nb, D, D).sum(2)


def far_queries_y_reference(qb, a, *, K: int, n: int, chunk: int, span: int, precision):
  """far_queries_y in jnp: an einsum over each boundary's slices of qb and A."""
  B, H, _, D = qb.shape
  nb = (n - 1) // span
  block = lambda j: boundary_offset(j, n=n, span=span) * chunk   # block j's first row
  ys = [jnp.zeros((B, K, D, D), jnp.float32)]
  for j in range(1, nb):
    # b_J = (j + 1) span: the queries at and right of it are the far ones, the whole block j
    # of qb and block j - 1 of A less its first span of chunks
    q_ = qb[:, :, block(j):block(j + 1)]
    a_ = a[:, :, block(j - 1) + span * chunk:block(j)]   # (qb's dtype: far_dq writes both)
    y = jnp.einsum("bhtd,bhte->bhde", q_, a_, preferred_element_type=jnp.float32,
                   precision=precision)
    ys.append(y.reshape(B, K, H // K, D, D).sum(2))
  return jnp.stack(ys, axis=2)
