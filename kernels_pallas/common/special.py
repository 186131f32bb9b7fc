"""Special functions for Triton kernel bodies: the GPU's approximate instructions (one MUFU op
each) where the generic lowering would call libdevice, and plain jnp where `fast` is False (the
interpreters cannot run PTX).

Why: Pallas lowers float32 cos, sin, exp and log to libdevice's accurate routines. cos and sin
carry a large-argument reduction with a local-memory table, and each is inlined once per
element a thread holds, so a tile that needs them per logit (TAPA) spends most of its time
there. The approximate instructions have absolute errors near 2^-21 (cos, sin on [-pi, pi] after
the reduction below) and relative errors near 2^-22 (ex2, lg2), under the bf16 rounding of the
operands they meet.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

TWO_PI = 2.0 * math.pi
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


def _ptx(op: str, x):
  """One PTX instruction `op` (".f32" suffixed) applied to every element of float32 x."""
  (y,) = pltriton.elementwise_inline_asm(
      f"{op}.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return y


def _reduced(x):
  """x - 2 pi round(x / 2 pi), in [-pi, pi]: cos.approx / sin.approx's error grows outside it.
  Its rounding is that of x itself (a few ulps of |x|)."""
  return x - TWO_PI * jnp.floor(x * (1.0 / TWO_PI) + 0.5)


def cos_sin(x, *, fast: bool):
  """(cos x, sin x) of float32 x."""
  if not fast:
    return jnp.cos(x), jnp.sin(x)
  r = _reduced(x)
  return _ptx("cos.approx.ftz", r), _ptx("sin.approx.ftz", r)


def cos(x, *, fast: bool):
  """cos x of float32 x."""
  return _ptx("cos.approx.ftz", _reduced(x)) if fast else jnp.cos(x)


def power(x, alpha: float, *, fast: bool):
  """x^alpha of float32 x >= 1 (callers clamp), through exp2(alpha log2 x)."""
  if not fast:
    return jnp.exp(alpha * jnp.log(x))
  return _ptx("ex2.approx.ftz", alpha * _ptx("lg2.approx.ftz", x))


def _exp_neg_abs(x):
  """e^-|x| (in (0, 1]: no overflow on either side)."""
  return _ptx("ex2.approx.ftz", -LOG2E * jnp.abs(x))


def _log_sigmoid_from(x, e):
  """log sigmoid(x) = min(x, 0) - log(1 + e^-|x|), given e = e^-|x|."""
  return jnp.minimum(x, 0.0) - LN2 * _ptx("lg2.approx.ftz", 1.0 + e)


def log_sigmoid(x, *, fast: bool):
  """log sigmoid(x) of float32 x."""
  return _log_sigmoid_from(x, _exp_neg_abs(x)) if fast else jax.nn.log_sigmoid(x)


def log_sigmoid_and_sigmoid_neg(x, *, fast: bool):
  """(log sigmoid(x), sigmoid(-x)) of float32 x, sharing e^-|x|: the value and the derivative
  of log sigmoid (d/dx log sigmoid(x) = sigmoid(-x))."""
  if not fast:
    return jax.nn.log_sigmoid(x), jax.nn.sigmoid(-x)
  e = _exp_neg_abs(x)
  r = _ptx("rcp.approx.ftz", 1.0 + e)   # 1 / (1 + e^-|x|) = sigmoid(|x|)
  return _log_sigmoid_from(x, e), jnp.where(x >= 0, e * r, r)
