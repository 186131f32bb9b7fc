"""The Mosaic GPU launches (mosaic_gpu/: forward_far.py, backward_far.py, span_sweep.py), each
kernel against its jnp oracle on random operands. GPU only: plgpu's wgmma does not run in the
interpreter, which runs the oracles in the kernels' place (test_path_kernel.py checks those
paths end to end, mosaic=True); test_lowering.py lowers the kernels on the CPU host."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas.path_attention import operands
from kernels_pallas.path_attention.mosaic_gpu import backward_far, forward_far, span_sweep
from kernels_pallas.path_attention.tiles import boundary_array_rows
from tests.util import assert_rel_rms

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]


def _far_inputs(key, D, gate_segments):
  """Random operands of the far launches (forward_far.py, backward_far.py): n = 9 chunks
  (odd: the last program's second warpgroup repeats chunk 8), span 2 (four boundaries),
  grouped heads, bf16 boundary states, moved keys, values and dO, lse, delta and span
  operators; with a gate and packed documents (and their chunk bounds: the launches skip the
  chunk pairs outside them). -> (ops, do, lse, delta, kb, qb, pi), span."""
  B, H, K, n, C, span = 2, 4, 2, 9, 64, 2
  nb = (n - 1) // span
  ks = jax.random.split(key, 10)
  bf = jnp.bfloat16
  v = jax.random.normal(ks[0], (B, n, C, K, D), bf)   # v and dO time-major (Operands.v)
  kb = jax.random.normal(ks[1], (B, K, n, C, D), bf)
  qb = jax.random.normal(ks[2], (B, H, boundary_array_rows(n=n, span=span, C=C), D), bf)
  do = jax.random.normal(ks[5], (B, n, C, H, D), bf)
  lse = 6.0 + jax.random.normal(ks[6], (B, H, n, C, 1))
  delta = jax.random.normal(ks[7], (B, H, n, C, 1))
  pi = (jnp.eye(D) + jax.random.normal(ks[8], (B, K, nb, D, D)) * D ** -0.5) * 0.7
  ops = operands.Operands(q=jnp.zeros((B, H, n, C, D), bf), k=kb, v=v, e=None, diag=None,
                          fq=None, fk=None, sq=None, sk=None)
  if gate_segments:
    ops = _with_gate_and_documents(ops, ks[3], ks[4], documents=3)
  return (ops, do, lse, delta, kb, qb, pi), span


def _with_gate_and_documents(ops, key_gate, key_documents, *, documents):
  """ops with a random log forget gate (its sums fq, fk) and about `documents` packed documents
  (segment ids sq, sk and their chunk bounds lo, hi)."""
  B, H, n, C, _ = ops.q.shape
  f = jnp.cumsum(jax.nn.log_sigmoid(jax.random.normal(key_gate, (B, H, n * C)) + 2), -1)
  f = f.reshape(B, H, n, C)
  seg = jnp.cumsum(jax.random.uniform(key_documents, (B, n * C)) < documents / (n * C), -1)
  seg = seg.astype(jnp.int32)
  lo, hi = operands.chunk_bounds(seg, C=C)
  seg = seg.reshape(B, 1, n, C)
  return ops._replace(fq=f[..., None], fk=f[..., None, :], sq=seg[..., None],
                      sk=seg[..., None, :], lo=lo[:, None, :, None, None],
                      hi=hi[:, None, :, None, None])


@pytest.mark.parametrize("D,gate_segments", [(64, True), (128, False), (128, True)])
def test_far_mosaic_kernel_against_reference(key, D, gate_segments):
  """forward_far.far_forward (Mosaic GPU) against its jnp oracle far_reference on random
  boundary states, moved keys and values: n = 9 chunks (odd: the last program's second
  warpgroup repeats chunk 8), span 2 (four boundaries: the states' ring refills twice),
  grouped heads; with a gate and packed documents (and their chunk bounds: the walk starts at
  the first span the pair's documents reach), output and lse."""
  (ops, _, _, _, kb, qb, _), span = _far_inputs(key, D, gate_segments)
  got = jax.jit(lambda *a: forward_far.far_forward(*a, scale=D ** -0.5, span=span))(
      ops, kb, qb)
  ref = forward_far.far_reference(ops, kb, qb, scale=D ** -0.5, span=span)
  for name, a, b in zip(("o", "lse"), got, ref):
    none = jnp.isneginf(b)
    assert bool(jnp.array_equal(jnp.isneginf(a), none)), f"{name}: -inf rows differ"
    assert_rel_rms(jnp.where(none, 0.0, a), jnp.where(none, 0.0, b), 1e-2, name)

@pytest.mark.parametrize("D,gate_segments", [(64, False), (64, True), (128, False),
                                             (128, True)])
def test_far_dq_mosaic_kernel_against_reference(key, D, gate_segments):
  """backward_far.far_dq (Mosaic GPU) against its jnp oracle far_dq_reference
  (_far_inputs: the state buffer and the Pi halves refill three times); A at every
  boundary and dfq."""
  args, span = _far_inputs(key, D, gate_segments)
  got = jax.jit(lambda *a: backward_far.far_dq(*a, scale=D ** -0.5, span=span))(*args)
  ref = backward_far.far_dq_reference(*args, scale=D ** -0.5, span=span)
  assert_rel_rms(got[0].astype(jnp.float32), ref[0].astype(jnp.float32), 1e-2, "A")
  if gate_segments:
    assert_rel_rms(got[1], ref[1], 1e-2, "dfq")

@pytest.mark.parametrize("D,gate_segments", [(64, True), (128, False), (128, True)])
def test_far_dkv_mosaic_kernel_against_reference(key, D, gate_segments):
  """backward_far.far_dkv (Mosaic GPU) against its jnp oracle far_dkv_reference
  (_far_inputs: two query heads a kv head, so each far query chunk is two ring
  items); a, dv and dfk of every key chunk (zero in the last span)."""
  args, span = _far_inputs(key, D, gate_segments)
  args = args[:6]
  got = jax.jit(lambda *a: backward_far.far_dkv(*a, scale=D ** -0.5, span=span))(*args)
  ref = backward_far.far_dkv_reference(*args, scale=D ** -0.5, span=span)
  for name, x, y in zip(("a", "dv", "dfk"), got, ref):
    if y is not None:
      assert_rel_rms(x, y, 1e-2, name)


@pytest.mark.parametrize("gate_segments", [False, True])
def test_span_sweep_mosaic_kernel_against_reference(key, gate_segments):
  """span_sweep.sweeps (Mosaic GPU) against its jnp oracle sweeps_reference on random
  operands: n = 8 chunks at span 4 (two spans; the tiles of chunks 2, 3 and 6, 7 sweep two key
  chunks), grouped heads, small random transports E, the initial adjoints A; with a gate and
  packed documents (sweeps that start inside the span). dq^, dfq and the increment of dL/dP
  (the launch adds to it in place), and dL/dP bitwise the same over two runs."""
  B, H, K, n, C, D, span = 2, 4, 2, 8, 64, 64, 4
  ks = jax.random.split(key, 12)
  bf = jnp.bfloat16
  nrm = lambda k, shape, s=1.0: (s * jax.random.normal(k, shape)).astype(bf)
  ops = operands.Operands(q=nrm(ks[0], (B, H, n, C, D)), k=nrm(ks[1], (B, K, n, C, D)),
                          v=nrm(ks[2], (B, n, C, K, D)), e=nrm(ks[3], (B, K, n, D, D), 0.3 / D),
                          diag=None, fq=None, fk=None, sq=None, sk=None)
  do = nrm(ks[4], (B, n, C, H, D))   # time-major, as v
  lse = 6.0 + jax.random.normal(ks[5], (B, H, n, C, 1))
  delta = jax.random.normal(ks[6], (B, H, n, C, 1))
  a = nrm(ks[7], (B, H, boundary_array_rows(n=n, span=span, C=C), D), 0.3)
  dp = 0.1 * jax.random.normal(ks[8], (B, K, n, D, D))
  if gate_segments:
    ops = _with_gate_and_documents(ops, ks[9], ks[10], documents=4)
  run = jax.jit(lambda *x: span_sweep.sweeps(*x, scale=D ** -0.5, span=span))
  got = run(ops, do, lse, delta, a, dp)
  ref = span_sweep.sweeps_reference(ops, do, lse, delta, a, dp, scale=D ** -0.5, span=span)
  assert_rel_rms(got[0].astype(jnp.float32), ref[0].astype(jnp.float32), 1e-2, "dq")
  if gate_segments:
    assert_rel_rms(got[1], ref[1], 1e-2, "dfq")
  assert_rel_rms(got[2] - dp, ref[2] - dp, 1e-2, "dP increment")
  assert bool(jnp.array_equal(got[2], run(ops, do, lse, delta, a, dp)[2])), "dP not bitwise"
