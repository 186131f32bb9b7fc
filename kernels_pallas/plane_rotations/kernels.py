"""The two kernel bodies: a token tile through all N planes (forward), and back through them in
reverse with each plane's input rebuilt by its inverse (backward).

A plane is y <- apply(y, a_n, b_n, phase) with phase = position * w_n, `apply` the caller's
per-token map (a rotation: apply at -phase undoes it). The tile [bt, D] stays in registers
across the planes, so x is read once and y written once however many planes there are.
Per-plane refs are rows of [N, D] / [N] blocks, read at a traced index.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def _plane(a_ref, b_ref, w_ref, n):
  return a_ref[pl.ds(n, 1), :], b_ref[pl.ds(n, 1), :], w_ref[pl.ds(n, 1)]


def forward_kernel(x_ref, a_ref, b_ref, pos_ref, w_ref, y_ref, *, apply, num_planes: int):
  """x [bt, D], a, b [Np, D], pos [bt], w [Np] -> y [bt, D] float32 (planes 0..N-1 in order)."""
  pos = pos_ref[...].astype(jnp.float32)

  def body(n, y):
    a, b, w = _plane(a_ref, b_ref, w_ref, n)
    return apply(y, a, b, pos * w)

  y_ref[...] = lax.fori_loop(0, num_planes, body, x_ref[...].astype(jnp.float32))


def backward_kernel(y_ref, g_ref, a_ref, b_ref, pos_ref, w_ref, dx_ref, da_ref, db_ref, dw_ref,
                    *, apply, apply_vjp, num_planes: int):
  """y [bt, D] (the forward's float32 output), g [bt, D] its cotangent -> dx [bt, D], and this
  tile's parts of da, db [Np, D] and dw [Np] (rows past N are left unwritten). apply_vjp(x, a,
  b, phase, g) -> (gx, ga, gb, gphase) is apply's VJP written out, or None for autodiff of
  apply."""
  pos = pos_ref[...].astype(jnp.float32)

  def body(i, carry):
    y, g = carry
    n = num_planes - 1 - i
    a, b, w = _plane(a_ref, b_ref, w_ref, n)
    phase = pos * w
    x = apply(y, a, b, -phase)        # the plane's input, rebuilt by the inverse rotation
    if apply_vjp is None:
      _, vjp = jax.vjp(apply, x, a, b, phase)
      gx, ga, gb, gphase = vjp(g)
    else:
      gx, ga, gb, gphase = apply_vjp(x, a, b, phase, g)
    da_ref[pl.ds(n, 1), :] = ga
    db_ref[pl.ds(n, 1), :] = gb
    dw_ref[pl.ds(n, 1)] = jnp.sum(gphase * pos, keepdims=True)
    return x, gx

  _, dx = lax.fori_loop(0, num_planes, body, (y_ref[...], g_ref[...].astype(jnp.float32)))
  dx_ref[...] = dx
