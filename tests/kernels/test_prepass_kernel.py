"""The PaTH pre-pass: each VJP form's chunk functions against autodiff, the in-kernel UT inverse
(and its Newton refinement and closed-form VJP) against float64, and the Pallas pre-pass kernels
(forward and VJP) against the batched jnp one (prepass/reference.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.kernels.transport_inputs import transport_vectors
from tests.util import assert_rel_rms


@pytest.mark.parametrize("form", ["uz", "split"])
@pytest.mark.parametrize("D,G", [(8, 2), (16, 1), (32, 2)])
@pytest.mark.parametrize("hilo", [False, True])
def test_chunk_vjp_matches_autodiff(key, form, D, G, hilo):
  """Each pre-pass VJP form's chunk functions in the sequence its kernels run them against
  jax.vjp of the chunk's whole forward, inverse included, at head_dim below, at and above C;
  exact products, and the GPU's bf16 halves on bf16-exact q, k and cotangents. "uz": from dU
  and dZ (uz.py), then T's pullback; "split": the E and k^ terms, the query heads' terms, then
  the inverse's closed-form VJP (chunk.py)."""
  from kernels_pallas.path_attention.prepass import chunk as pk
  from kernels_pallas.path_attention.prepass import uz
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
  if form == "uz":
    dqs, dk, dw, t, dbeta = uz.chunk_operands_vjp_uz(uz.uz_common(k, w, y, beta[None], p), qs,
                                                     *cts, y, w, beta[:, None], scale=0.3, p=p)
    dw, dbeta = uz.chunk_t_pullback(w, y, beta[:, None], beta[None], t, dw, dbeta,
                                    precision=prec)
  else:
    dqhs, dkh, de, dds = cts
    common = pk.vjp_common(k, w, y, beta[None], p)
    partial = pk.chunk_operands_vjp_kv(common, dkh, de, p)
    dqs, dk, dw, dy, dbeta_r = pk.chunk_operands_vjp_q(common, qs, dqhs, dkh, dds, partial,
                                                       scale=0.3, p=p)
    dw_y, dbeta_c = pk.chunk_inverse_vjp(w, beta[:, None], y, dy, precision=prec)
    dw, dbeta = dw + dw_y, dbeta_c + dbeta_r.T
  # bf16 halves: the operands' error (hi(scale dd) drops the scaled cotangent's lo half),
  # ~1e-3 here for both hand-written VJPs alike (the split form measured 1.0e-3 to 1.6e-3)
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
  from kernels_pallas.path_attention.prepass import chunk as pk
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
  from kernels_pallas.path_attention.prepass import chunk as pk
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
  from kernels_pallas.path_attention.prepass import chunk as pk
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


# 16-bit inputs take the bf16 halves, float32 ones exact products; "bf16" applies only with
# the halves (the plan resolves it to False elsewhere). The TPU reads blocked inputs.
@pytest.mark.parametrize("dtype,form,backend,keep_inverse", [
    (jnp.bfloat16, "uz", "interpret", "bf16"),     # the GPU's default at head_dim 64
    (jnp.bfloat16, "split", "interpret", "bf16"),  # ... at head_dim 128
    (jnp.bfloat16, "uz", "interpret", False),
    (jnp.bfloat16, "split", "interpret", True),
    (jnp.float32, "uz", "interpret", True),
    (jnp.float32, "split", "interpret", False),
    (jnp.float32, "uz", "tpu_interpret", False),   # the TPU's default
    pytest.param(jnp.bfloat16, "uz", "interpret", True, marks=pytest.mark.slow),
    pytest.param(jnp.bfloat16, "split", "interpret", False, marks=pytest.mark.slow),
    pytest.param(jnp.float32, "uz", "interpret", False, marks=pytest.mark.slow),
    pytest.param(jnp.float32, "split", "interpret", True, marks=pytest.mark.slow),
    pytest.param(jnp.float32, "split", "tpu_interpret", False, marks=pytest.mark.slow)])
def test_prepass_kernel_matches_jnp(key, dtype, form, backend, keep_inverse):
  """The Pallas pre-pass (forward and its VJP, form "uz" or "split") against the batched jnp
  pre-pass; with keep_inverse the VJP reads the forward's Y instead of recomputing it ("bf16":
  refines its bf16 rounding)."""
  import functools
  from kernels_pallas.path_attention.plan import prepass_warps
  from kernels_pallas.path_attention.prepass import kernels, reference
  B, H, K, n, C, D = 2, 4, 2, 3, 16, 16
  ks = jax.random.split(key, 8)   # q, k, w time-major [B, T, heads, D]; beta blocked
  q = jax.random.normal(ks[0], (B, n * C, H, D), dtype)
  k = jax.random.normal(ks[1], (B, n * C, K, D), dtype)
  w = jax.random.normal(ks[2], (B, n * C, K, D), jnp.float32)
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  bb = 2 * jax.random.uniform(ks[3], (B, K, n, C), jnp.float32)
  ref = functools.partial(reference.transport_jnp, scale=0.25, dtype=jnp.float32)
  fast = functools.partial(kernels.transport_pallas, scale=0.25, dtype=jnp.float32,
                           backend=backend, form=form, warps=prepass_warps(D),
                           keep_inverse=keep_inverse)
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
  # float32 inputs: float32 products throughout. bf16 inputs: bf16 halves where the output is
  # insensitive (chunk.Products: designed for <= 2.5e-4 per chunk), bf16 gradients of q, k.
  tol = 1e-5 if dtype == jnp.float32 else 1e-3
  for name, a, b in zip(("q^", "k^", "E", "diag"), o_fast, o_ref):
    assert_rel_rms(a, b, tol, name)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  for name, a, b in zip(("dq", "dk", "dw", "dbeta"), g_fast, g_ref):
    assert_rel_rms(a, b, tol, name)
