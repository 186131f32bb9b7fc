"""The PaTH pre-pass: one chunk's hand-written VJP against autodiff, the in-kernel UT inverse
against float64, and the Pallas pre-pass kernels (forward and VJP) against the batched jnp one."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.kernels.transport_inputs import transport_vectors
from tests.util import assert_rel_rms


def test_chunk_operands_vjp_matches_autodiff(key):
  """The hand-written VJP of one chunk's operands against jax.vjp of the forward function."""
  import functools
  from kernels_pallas.path_attention import prepass_chunk as pk
  C, D, G = 16, 8, 2
  ks = jax.random.split(key, 6)
  qs = tuple(jax.random.normal(k_, (C, D)) for k_ in ks[:G])
  k = jax.random.normal(ks[2], (C, D))
  w = jax.random.normal(ks[3], (C, D))
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  beta_r = 2 * jax.random.uniform(ks[4], (1, C))
  hi = jax.lax.Precision.HIGHEST
  y = pk.chunk_inverse(w, beta_r.T, precision=hi)
  fn = functools.partial(pk.chunk_operands, scale=0.3, precision=hi)
  out, pull = jax.vjp(fn, qs, k, w, y, beta_r)
  leaves, tree = jax.tree.flatten(out)
  cts = jax.tree.unflatten(tree, [jax.random.normal(k_, x.shape)
                                  for k_, x in zip(jax.random.split(ks[5], len(leaves)), leaves)])
  got = pk.chunk_operands_vjp(qs, k, w, y, beta_r, cts, scale=0.3, precision=hi)
  for name, a, b in zip(("dq0", "dq1", "dk", "dw", "dy", "dbeta"), jax.tree.leaves(got),
                        jax.tree.leaves(pull(cts))):
    assert_rel_rms(a, b, 1e-5, name)


@pytest.mark.parametrize("D,G", [(8, 2), (16, 1), (32, 2)])
@pytest.mark.parametrize("hilo", [False, True])
def test_chunk_uz_vjp_matches_autodiff(key, D, G, hilo):
  """The VJP from dU, dZ (prepass_uz.py: its two kernels' chunk functions in sequence) against
  jax.vjp of the chunk's whole forward, inverse included, at head_dim below, at and above C;
  exact products, and the GPU's bf16 halves on bf16-exact q, k and cotangents (then as close
  as the "split2_*" VJP's hand-written form with the same halves)."""
  from kernels_pallas.path_attention import prepass_chunk as pk
  from kernels_pallas.path_attention import prepass_uz as uz
  C = 16
  exact = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  ks = jax.random.split(key, 6)
  qs = tuple(exact(jax.random.normal(k_, (C, D))) for k_ in jax.random.split(ks[0], G))
  k = exact(jax.random.normal(ks[1], (C, D)))
  w = jax.random.normal(ks[2], (C, D))
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  beta = 2 * jax.random.uniform(ks[3], (C,))
  hi = jax.lax.Precision.HIGHEST

  def forward(qs, k, w, beta):
    y = pk.chunk_inverse(w, beta[:, None], precision=hi)
    return pk.chunk_operands(qs, k, w, y, beta[None], scale=0.3, precision=hi)

  out, pull = jax.vjp(forward, qs, k, w, beta)
  leaves, tree = jax.tree.flatten(out)
  cts = jax.tree.unflatten(tree, [exact(jax.random.normal(k_, x.shape)) for k_, x in
                                  zip(jax.random.split(ks[4], len(leaves)), leaves)])
  dqs_ref, dk_ref, dw_ref, dbeta_ref = pull(cts)
  prec = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3 if hilo else hi
  p = pk.Products(hilo=True) if hilo else pk.Products(hi)
  y = pk.chunk_inverse(w, beta[:, None], precision=prec)
  dqs, dk, dw, t, dbeta = uz.chunk_operands_vjp_uz(uz.uz_common(k, w, y, beta[None], p), qs,
                                                   *cts, y, w, beta[:, None], scale=0.3, p=p)
  dw, dbeta = uz.chunk_t_pullback(w, y, beta[:, None], beta[None], t, dw, dbeta, precision=prec)
  # bf16 halves: the operands' error (hi(scale dd) drops the scaled cotangent's lo half),
  # ~1e-3 here for both hand-written VJPs alike (split2's form measured 1.0e-3 to 1.6e-3)
  tol = 3e-3 if hilo else 1e-5
  for g in range(G):
    assert_rel_rms(dqs[g], dqs_ref[g], tol, f"dq{g}")
  assert_rel_rms(dk, dk_ref, tol, "dk")
  assert_rel_rms(dw, dw_ref, tol, "dw")
  assert_rel_rms(dbeta[:, 0], dbeta_ref, tol, "dbeta")


@pytest.mark.parametrize("w_mode", ["random", "shared:1.0", "shared:0.1", "shared:0.01",
                                    "antiparallel"])
def test_chunk_inverse_correlated_w(key, w_mode):
  """The in-kernel UT inverse at the GPU chunk size (C = 64) against float64 numpy.

  The Neumann product it replaced was off by 1e10-1e21 (relative) on these inputs in exact
  float32; float32 rounding of the inputs alone gives up to ~1.3e-5 (worst of 20 seeds each)."""
  import numpy as np
  from kernels_pallas.path_attention import prepass_chunk as pk
  C = D = 64
  w, beta = transport_vectors(key, 1, C, 1, D, mode=w_mode)
  w, beta = w[0, :, 0], beta[0, :, 0]
  w64, b64 = np.asarray(w, np.float64), np.asarray(beta, np.float64)
  expected = np.linalg.inv(np.eye(C) + np.tril(b64[:, None] * (w64 @ w64.T), -1))
  got = pk.chunk_inverse(w, beta[:, None], precision=jax.lax.Precision.HIGHEST)
  assert_rel_rms(got, expected, 1e-4, "Y")


@pytest.mark.parametrize("w_mode", ["random", "shared:1.0", "shared:0.1", "shared:0.01",
                                    "antiparallel"])
def test_chunk_inverse_refine_correlated_w(key, w_mode):
  """chunk_inverse_refine (keep_inverse "bf16": the VJP's Y from its kept bf16 rounding by one
  Newton step) against float64 numpy at C = 64, with the bf16 halves it runs with: within twice
  the error of the inverse it replaces (chunk_inverse at the same products; over 300 seeds
  a layout the ratio's worst was 1.62, at w shared to 0.01). The rounding itself is ~200x the
  inverse's error on random w."""
  import numpy as np
  from kernels_pallas.path_attention import prepass_chunk as pk
  from tests.util import rel_rms
  C = D = 64
  w, beta = transport_vectors(key, 1, C, 1, D, mode=w_mode)
  w, beta = w[0, :, 0], beta[0, :, 0]
  w64, b64 = np.asarray(w, np.float64), np.asarray(beta, np.float64)
  expected = np.linalg.inv(np.eye(C) + np.tril(b64[:, None] * (w64 @ w64.T), -1))
  prec = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
  y = pk.chunk_inverse(w, beta[:, None], precision=prec)
  y0 = y.astype(jnp.bfloat16).astype(jnp.float32)
  got = pk.chunk_inverse_refine(w, beta[:, None], y0, precision=prec)
  bound = 2 * rel_rms(y, expected)
  assert_rel_rms(got, expected, bound, "Y")
  if w_mode == "random":
    assert rel_rms(y0, expected) > 10 * bound


@pytest.mark.parametrize("D", [16, 32])
@pytest.mark.parametrize("precision", ["highest", "bf16x3"])
def test_chunk_inverse_vjp_matches_autodiff(key, D, precision):
  """chunk_inverse_vjp's closed form against jax.vjp of chunk_inverse in float64, at head_dim
  = C (dbeta and dS W from dA W) and 2C (W W^T formed again), with exact products and with
  the GPU's bf16 halves (Products(hilo=True))."""
  from kernels_pallas.path_attention import prepass_chunk as pk
  C = 16
  kw, kb, kd = jax.random.split(key, 3)
  w = jax.random.normal(kw, (C, D))
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  beta = 2 * jax.random.uniform(kb, (C, 1))
  dy = jax.random.normal(kd, (C, C))
  with jax.enable_x64():
    f = lambda w, b: pk.chunk_inverse(w, b, precision=jax.lax.Precision.HIGHEST)
    y64, pull = jax.vjp(f, w.astype(jnp.float64), beta.astype(jnp.float64))
    dw64, db64 = pull(dy.astype(jnp.float64))
  prec = {"highest": jax.lax.Precision.HIGHEST,
          "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3}[precision]
  y = pk.chunk_inverse(w, beta, precision=prec)
  dw, db = pk.chunk_inverse_vjp(w, beta, y, dy, precision=prec)
  tol = 1e-5 if precision == "highest" else 1e-4
  assert_rel_rms(dw, dw64, tol, "dw")
  assert_rel_rms(db, db64, tol, "dbeta")


@pytest.mark.parametrize("dtype,variant,backend,keep_inverse,late_wk", [
    (dtype, variant, "interpret", False, False) for dtype in (jnp.float32, jnp.bfloat16)
    for variant in ("split", "split_bf16", "fold_bf16")] + [
    (jnp.bfloat16, "split_bf16x3", "interpret", False, False)] + [
    (dtype, "split_hilo", "interpret", False, False) for dtype in (jnp.float32, jnp.bfloat16)] + [
    (jnp.bfloat16, "split2_hilo", "interpret", False, False),
    (jnp.float32, "split2", "interpret", False, False)]
    + [(jnp.bfloat16, "split2_hilo", "interpret", True, False),
       (jnp.float32, "split", "interpret", True, False)]
    + [(jnp.bfloat16, "split2_hilo", "interpret", False, True),
       (jnp.float32, "split2", "interpret", True, True)]
    + [(jnp.bfloat16, "uz_hilo", "interpret", False, False),
       (jnp.float32, "uz", "interpret", True, False)]
    + [(jnp.bfloat16, "uz_hilo", "interpret", "bf16", False),     # Y kept in bf16, refined
       (jnp.bfloat16, "split2_hilo", "interpret", "bf16", False),
       (jnp.float32, "uz", "interpret", "bf16", False)]           # (recomputed)
    + [(jnp.float32, "fold_bf16", "tpu_interpret", False, False),   # TPU: blocked inputs
       (jnp.float32, "uz", "tpu_interpret", False, False)])
def test_prepass_kernel_matches_jnp(key, dtype, variant, backend, keep_inverse, late_wk):
  """The Pallas pre-pass (forward and its VJP) against the batched jnp pre-pass; with
  keep_inverse the VJP reads the forward's Y instead of recomputing it ("bf16": refines its
  bf16 rounding); with late_wk WK's pullback runs in the inverse-VJP kernel."""
  import functools
  from kernels_pallas.path_attention import prepass, prepass_kernel
  B, H, K, n, C, D = 2, 4, 2, 3, 16, 16
  ks = jax.random.split(key, 8)   # q, k, w time-major [B, T, heads, D]; beta blocked
  q = jax.random.normal(ks[0], (B, n * C, H, D), dtype)
  k = jax.random.normal(ks[1], (B, n * C, K, D), dtype)
  w = jax.random.normal(ks[2], (B, n * C, K, D), jnp.float32)
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  bb = 2 * jax.random.uniform(ks[3], (B, K, n, C), jnp.float32)
  ref = functools.partial(prepass.transport_jnp, scale=0.25, dtype=jnp.float32)
  fast = functools.partial(prepass_kernel.transport_pallas, scale=0.25, dtype=jnp.float32,
                           backend=backend, variant=variant, keep_inverse=keep_inverse,
                           late_wk=late_wk)
  outs = jax.eval_shape(ref, q, k, w, bb)
  cts = tuple(jax.random.normal(k_, s.shape) for k_, s in zip(ks[4:], outs))

  # Jitted: one compile instead of eager op-by-op dispatch. The cotangents are an argument,
  # not constants: the jnp pre-pass's program is then one for every row of a dtype, which the
  # session's compilation cache (tests/conftest.py) compiles once (CI time).
  def value_and_pull(fn):
    def run(a, cts):
      out, pull = jax.vjp(fn, *a)
      return out, pull(cts)
    return jax.jit(run)

  with jax.default_matmul_precision("highest"):
    o_ref, g_ref = value_and_pull(ref)((q, k, w, bb), cts)
  o_fast, g_fast = value_and_pull(fast)((q, k, w, bb), cts)
  # float32 inputs: float32 products throughout. bf16 inputs: bf16 operands in the "_bf16"
  # variants, bf16 halves where the output is insensitive in "split_hilo" (designed for <=
  # 2.5e-4 per chunk: _Products), and bf16 gradients of q, k.
  tol = 1e-5 if dtype == jnp.float32 else {"split_bf16": 1e-2, "fold_bf16": 1e-2,
                                             "split_hilo": 1e-3, "split2_hilo": 1e-3,
                                             "uz_hilo": 1e-3}.get(
                                                 variant, 1e-5)
  for name, a, b in zip(("q^", "k^", "E", "diag"), o_fast, o_ref):
    assert_rel_rms(a, b, tol, name)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  for name, a, b in zip(("dq", "dk", "dw", "dbeta"), g_fast, g_ref):
    assert_rel_rms(a, b, tol, name)
