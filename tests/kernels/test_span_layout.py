"""The span backward's and the document skipping's bookkeeping: the packed boundary-state
layout, the far queries' Y launch against its oracle, and the chunk bounds that let the kernels
skip chunk pairs outside a query's documents. The kernels that read them are checked against
the dense oracles in test_path_kernel.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas as kp
from kernels_pallas.path_attention import operands
from kernels_pallas.path_attention import spans
from kernels_pallas.path_attention.tiles import boundary_array_rows, boundary_offset
from tests.kernels.transport_inputs import segment_ids
from tests.util import assert_rel_rms


@pytest.mark.parametrize("n,span", [(7, 2), (9, 4), (16, 4), (5, 4), (64, 8)])
def test_boundary_layout_packs_each_state_once(n, span):
  """The packed boundary-state layout (tiles.boundary_offset): boundary j's chunks
  c = (j + 1) span .. n-1 take the rows 0 .. R-1 once each, in (j, c) order, and the traced
  offset (the kernels' j is an int32 scalar) agrees with the Python one."""
  nb = (n - 1) // span
  rows = [boundary_offset(j, n=n, span=span) + c - (j + 1) * span
          for j in range(nb) for c in range((j + 1) * span, n)]
  assert rows == list(range(boundary_offset(nb, n=n, span=span)))
  traced = jax.jit(lambda j: boundary_offset(j, n=n, span=span))
  assert [int(traced(jnp.int32(j))) for j in range(nb + 1)] == [
      boundary_offset(j, n=n, span=span) for j in range(nb + 1)]


@pytest.mark.parametrize("n,span,H,K", [(7, 2, 2, 1), (16, 4, 2, 2), (9, 4, 1, 1), (5, 4, 1, 1)])
def test_far_queries_y_kernel(key, n, span, H, K):
  """The span backward's Y_J = sum qb^T A (spans.far_queries_y, a launch reading the packed
  states where they lie) against its jnp oracle (einsums over slices), with grouped heads and
  an odd chunk count; boundary 0 (and a single boundary) is zero. A mutation check: reading
  A from block j instead of j - 1 fails it (relative RMS ~1.4)."""
  C, D, B = 16, 16, 2
  x, kv = jax.ShapeDtypeStruct((B, n * C, H, D), jnp.float32), jax.ShapeDtypeStruct(
      (B, n * C, K, D), jnp.float32)
  plan = kp.explain(x, kv, kv, kv, jax.ShapeDtypeStruct((B, n * C, K), jnp.float32),
                    block_sizes=dict(block=C, span=span), interpret=True)
  assert (plan.span, plan.chunks, plan.precision) == (span, n, jax.lax.Precision.HIGHEST)
  R = boundary_array_rows(n=n, span=span, C=C)
  kq, ka = jax.random.split(key)
  qb = jax.random.normal(kq, (B, H, R, D), jnp.float32)
  a = jax.random.normal(ka, (B, H, R, D), jnp.float32)
  got = spans.far_queries_y(qb, a, plan)
  want = spans.far_queries_y_reference(qb, a, K=K, n=n, chunk=C, span=span,
                                       precision=plan.precision)
  assert got.shape == want.shape == (B, K, (n - 1) // span, D, D)
  assert float(jnp.abs(got[:, :, 0]).max()) == 0.0
  if (n - 1) // span > 1:
    assert_rel_rms(got, want, 1e-5, "Y")


@pytest.mark.parametrize("mode", ["few", "short", "interleaved"])
def test_chunk_bounds_cover_every_visible_pair(key, mode):
  """lo_c <= m and hi_m >= c for every chunk pair (c >= m) holding a same-segment (query, key)
  pair; for packed documents the bounds are tight (the first / last such chunk)."""
  B, T, C = 3, 101, 8
  seg = segment_ids(key, B, T, mode)
  lo, hi = operands.chunk_bounds(seg, C=C)
  n = -(-T // C)
  chunk = jnp.arange(T) // C
  same = (seg[:, :, None] == seg[:, None, :]) & (jnp.arange(T)[:, None] >= jnp.arange(T)[None])
  # visible[b, c, m]: some query of chunk c sees some key of chunk m
  onehot = jax.nn.one_hot(chunk, n, dtype=jnp.int32)
  visible = jnp.einsum("tc,bts,sm->bcm", onehot, same.astype(jnp.int32), onehot) > 0
  c_idx, m_idx = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
  assert bool(jnp.all(~visible | (lo[:, :, None] <= m_idx)))
  assert bool(jnp.all(~visible | (hi[:, None, :] >= c_idx)))
  if mode != "interleaved":
    assert bool(jnp.all(lo == jnp.argmax(visible, axis=2)))
    assert bool(jnp.all(hi == n - 1 - jnp.argmax(visible[:, ::-1, :], axis=1)))
  if mode == "short":  # the case the skipping is for: most pairs below the diagonal go
    assert int(jnp.sum(c_idx - lo[:, :, None] >= 0)) > 0 and bool(jnp.any(lo > 0))
