"""kernels_pallas.common.tiles.document_bounds against a brute-force count of visible (query,
key) pairs: no tile a walk skips holds a visible pair (for any layout of the ids), and for
packed documents the bounds are tight (the first and last tiles walked hold one)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.common import tiles


def _visible_tiles(seg, bq, bk):
  """[B, nq, nk]: does query tile i hold a query that sees a key of key tile j."""
  B, T = seg.shape
  pos = np.arange(T)
  vis = (pos[:, None] >= pos[None, :]) & (seg[:, :, None] == seg[:, None, :])   # [B, T, T]
  return vis.reshape(B, T // bq, bq, T // bk, bk).any(axis=(2, 4))


@pytest.mark.parametrize("bq,bk", [(8, 8), (8, 16), (16, 8)])
@pytest.mark.parametrize("layout", ["packed", "scattered"])
def test_document_bounds_skip_only_masked_tiles(bq, bk, layout):
  B, T = 3, 64
  rng = np.random.default_rng(0)
  if layout == "packed":   # documents of random lengths, one id each, in order
    seg = np.cumsum(rng.random((B, T)) < 0.08, axis=1).astype(np.int32)
  else:                    # ids in any order: the bounds may over-count, never skip
    seg = rng.integers(0, 3, (B, T)).astype(np.int32)
  lo, hi = (np.asarray(x)[:, :, 0, 0] for x in tiles.document_bounds(jnp.asarray(seg), bq, bk))
  vis = _visible_tiles(seg, bq, bk)
  nq, nk = T // bq, T // bk
  for b in range(B):
    for i in range(nq):
      assert not vis[b, i, :lo[b, i]].any(), (b, i)
      assert vis[b, i, lo[b, i]] or layout == "scattered"
    for j in range(nk):
      assert not vis[b, hi[b, j] + 1:, j].any(), (b, j)
      assert vis[b, hi[b, j], j] or layout == "scattered"


def test_document_bounds_of_one_document_walk_everything():
  seg = jnp.zeros((2, 32), jnp.int32)
  lo, hi = tiles.document_bounds(seg, 8, 8)
  assert lo.shape == (2, 4, 1, 1) and hi.shape == (2, 4, 1, 1)
  assert not jnp.any(lo) and jnp.all(hi == 3)
