"""prepass.kernels.transport_pallas_vjp: the Pallas pre-pass's VJP reading the E cotangent as the
attention backward leaves it, dL/dP in float32 (P = I - E), and negating and rounding it in its
kernels. Checked against the batched jnp pre-pass (the oracle) and, bitwise, against jax.vjp of
transport_pallas fed dL/dE = (-dL/dP).astype(E's dtype), the form it replaces."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.util import assert_rel_rms


@pytest.mark.parametrize("dtype,form,backend,keep_inverse", [
    (jnp.bfloat16, "uz", "interpret", "bf16"),     # the GPU's default at head_dim 64
    (jnp.bfloat16, "split", "interpret", "bf16"),  # ... at head_dim 128
    (jnp.float32, "uz", "tpu_interpret", False)])  # the TPU's: blocked inputs, dq, dk, dw
                                                   # unblocked after
def test_vjp_from_dp_matches_jnp_and_vjp(key, dtype, form, backend, keep_inverse):
  from kernels_pallas.path_attention.plan import prepass_warps
  from kernels_pallas.path_attention.prepass import kernels, reference
  B, H, K, n, C, D = 2, 4, 2, 3, 16, 16
  ks = jax.random.split(key, 8)
  q = jax.random.normal(ks[0], (B, n * C, H, D), dtype)
  k = jax.random.normal(ks[1], (B, n * C, K, D), dtype)
  w = jax.random.normal(ks[2], (B, n * C, K, D), jnp.float32)
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  bb = 2 * jax.random.uniform(ks[3], (B, K, n, C), jnp.float32)
  kw = dict(scale=0.25, dtype=dtype, backend=backend, form=form, warps=prepass_warps(D),
            keep_inverse=keep_inverse)
  outs = jax.eval_shape(functools.partial(kernels.transport_pallas, **kw), q, k, w, bb)
  dqh, dkh, dp, dd = (jax.random.normal(k_, s.shape, jnp.float32) for k_, s in zip(ks[4:], outs))
  dqh, dkh, dd = (x.astype(dtype) for x in (dqh, dkh, dd))   # as the backward kernels give them

  @jax.jit
  def from_dp(q, k, w, bb, cts):
    out, pull = kernels.transport_pallas_vjp(q, k, w, bb, **kw)
    return out, pull(cts)

  @jax.jit
  def from_de(q, k, w, bb, cts):
    out, pull = jax.vjp(functools.partial(kernels.transport_pallas, **kw), q, k, w, bb)
    dqh, dkh, dp, dd = cts
    return out, pull((dqh, dkh, (-dp).astype(out[2].dtype), dd))

  @jax.jit
  def oracle(q, k, w, bb, cts):
    out, pull = jax.vjp(functools.partial(reference.transport_jnp, scale=0.25, dtype=jnp.float32),
                        q, k, w, bb)
    dqh, dkh, dp, dd = cts
    # the oracle's E cotangent: -dP at E's rounding, as the kernels read it
    return out, pull(tuple(x.astype(jnp.float32) for x in
                           (dqh, dkh, (-dp).astype(dtype), dd)))

  cts = (dqh, dkh, dp, dd)
  o_dp, g_dp = from_dp(q, k, w, bb, cts)
  o_de, g_de = from_de(q, k, w, bb, cts)
  with jax.default_matmul_precision("highest"):
    _, g_ref = oracle(q, k, w, bb, cts)
  for name, a, b in zip(("q^", "k^", "E", "diag", "dq", "dk", "dw", "dbeta"),
                        (*o_dp, *g_dp), (*o_de, *g_de)):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), name)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2   # test_prepass_kernel_matches_jnp's
  for name, a, b in zip(("dq", "dk", "dw", "dbeta"), g_dp, g_ref):
    assert_rel_rms(a, b, tol, name)
