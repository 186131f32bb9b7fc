"""kernels_pallas/common/special.py: the approximate PTX forms against jnp's float32
functions, inside a Triton kernel on the GPU (marked gpu), over the arguments the kernels meet
(TAPA's phases up to thousands of radians, GRAPE-AP's logits of either sign, distances up to
64K); on this host, that a kernel using every form lowers for "cuda", and that the forms the
interpreter runs (fast=False) are jnp's own.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.common import special

N = 4096


def _apply_all(fast: bool, interpret: bool):
  """x [N] -> [cos, sin, log sigmoid, log sigmoid (fused), sigmoid(-x), d^0.1] of each, from
  one Pallas kernel."""

  def kernel(x_ref, d_ref, o_ref):
    x, d = x_ref[...], d_ref[...]
    c, s = special.cos_sin(x, fast=fast)
    ls, sn = special.log_sigmoid_and_sigmoid_neg(x, fast=fast)
    outs = (c, s, special.log_sigmoid(x, fast=fast), ls, sn, special.power(d, 0.1, fast=fast),
            special.cos(x, fast=fast))
    for i, y in enumerate(outs):
      o_ref[i, :] = y

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((7, N), jnp.float32),
                        interpret=interpret,
                        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))


def _arguments(key):
  k1, k2, k3 = jax.random.split(key, 3)
  scale = jnp.exp(jax.random.uniform(k1, (N,), minval=-3.0, maxval=np.log(3000.0)))
  x = scale * jax.random.normal(k2, (N,))
  d = jnp.floor(jnp.exp(jax.random.uniform(k3, (N,), maxval=np.log(65536.0)))) + 1.0
  return x.astype(jnp.float32), d.astype(jnp.float32)


def _wanted(x, d):
  x64, d64 = np.asarray(x, np.float64), np.asarray(d, np.float64)
  ls = -np.logaddexp(0.0, -x64)
  return np.stack([np.cos(x64), np.sin(x64), ls, ls, 1.0 / (1.0 + np.exp(x64)), d64 ** 0.1,
                   np.cos(x64)])


def test_the_interpreted_forms_are_jnps(key):
  x, d = _arguments(key)
  got = np.asarray(_apply_all(False, True)(x, d), np.float64)
  np.testing.assert_allclose(got, _wanted(x, d), rtol=2e-6, atol=2e-6)


def test_the_fast_forms_lower_for_cuda():
  SD = jax.ShapeDtypeStruct
  args = (SD((N,), jnp.float32), SD((N,), jnp.float32))
  text = jax.jit(_apply_all(True, False)).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_the_fast_forms_on_the_gpu(key):
  """Absolute errors of cos, sin within 1e-6 plus three float32 ulps of the argument (the
  range reduction's rounding, the size of the argument's own), log sigmoid within 1e-6 plus
  1e-6 relative, the power within 1e-6 relative."""
  x, d = _arguments(key)
  got = np.asarray(_apply_all(True, False)(x, d), np.float64)
  want = _wanted(x, d)
  ulp3 = 3 * np.spacing(np.abs(np.asarray(x, np.float32))).astype(np.float64)
  for i in (0, 1, 6):
    assert np.all(np.abs(got[i] - want[i]) <= 1e-6 + ulp3), (i, np.max(np.abs(got[i] - want[i])))
  for i in (2, 3, 4):
    np.testing.assert_allclose(got[i], want[i], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got[5], want[5], rtol=1e-6)
