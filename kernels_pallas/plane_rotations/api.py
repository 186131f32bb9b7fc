"""plane_rotations: the public function, its custom VJP and the two launches.

The wrapper pads time to whole tiles, the head dim to a power of two >= 16 and the plane count
to a power of two (zero channels and zero planes: a rotation in the plane of a = 0 is the
identity, and zero channels stay zero), and the core works on the padded arrays, so autodiff
of the pads and slices carries the cotangents back. The forward's float32 output is the
backward's only residual besides the inputs: each plane's input is rebuilt from its output by
the inverse rotation, never stored.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.common import launch
from kernels_pallas.common.launch import pad_axis
from kernels_pallas.plane_rotations import kernels

# Token tiles of the two passes when block_t is None: each pass's fastest in
# experiments/benchmarks/plane_rotations.py on an H200 (docs/benchmarks/plane_rotations.md).
# The forward holds one [bt, D] tile and gains from the widest; the backward holds three
# (y, g and the rebuilt input) and slows sharply at 128.
FORWARD_BLOCK_T = 128
BACKWARD_BLOCK_T = 32
WARPS = 4


@dataclasses.dataclass(frozen=True)
class _Config:
  apply: Callable
  apply_vjp: Callable | None
  num_planes: int
  forward_block_t: int
  backward_block_t: int
  backend: str
  dtype: str            # x's: the dtype of dx


def plane_rotations(x, a, b, positions, w, *, apply: Callable, apply_vjp: Callable | None = None,
                    block_t=None, interpret: bool = False):
  """y_t = G_{N-1} ... G_0 x_t, G_n = apply(., a_n, b_n, positions_t * w_n), per token and head.

  x [B, T, H, D]; a, b [H, N, D]; positions [B, T]; w [H, N]. `apply(y [R, D], a [1, D],
  b [1, D], phase [R]) -> [R, D]` is a rotation by `phase` in a plane that a and b span, so
  that apply at -phase inverts it (posenc_jax.grape_m.rank2_apply), and is written in jnp ops
  that Triton lowers. `apply_vjp(x [R, D], a, b [1, D], phase [R], g [R, D]) -> (gx, ga, gb,
  gphase)`, if given, is apply's VJP written out for the backward kernel (autodiff of apply
  otherwise; posenc_jax.grape_m.rank2_apply_rows_vjp). Returns y [B, T, H, D] in x's dtype,
  computed in float32; differentiable in x, a, b and w. block_t: both passes' token tile (a
  power of two >= 16); None takes each pass's own (FORWARD_BLOCK_T, BACKWARD_BLOCK_T).
  interpret=True runs the Pallas interpreter (CPU); otherwise Triton (GPU).
  """
  B, T, H, D = x.shape
  if a.ndim != 3 or a.shape[0] != H or a.shape[2] != D or b.shape != a.shape:
    raise ValueError(f"plane_rotations: a {a.shape} and b {b.shape} must both be [H, N, D] "
                     f"with x {x.shape}'s H and D")
  N = a.shape[1]
  launch.check_shapes("plane_rotations", ("w", w, (H, N)), ("positions", positions, (B, T)))
  bt_fwd = launch.tile(block_t, FORWARD_BLOCK_T, T, "plane_rotations: block_t")
  bt_bwd = launch.tile(block_t, BACKWARD_BLOCK_T, T, "plane_rotations: block_t")
  step = max(bt_fwd, bt_bwd)
  Tp, Dp, Np = -(-T // step) * step, launch.pow2(D, 16), launch.pow2(N)
  f32 = jnp.float32
  xp = pad_axis(pad_axis(x, 1, Tp), 3, Dp)
  ap = pad_axis(pad_axis(a.astype(f32), 1, Np), 2, Dp)
  bp = pad_axis(pad_axis(b.astype(f32), 1, Np), 2, Dp)
  wp = pad_axis(w.astype(f32), 1, Np)
  pos = pad_axis(positions.astype(f32), 1, Tp)
  cfg = _Config(apply=apply, apply_vjp=apply_vjp, num_planes=N, forward_block_t=bt_fwd,
                backward_block_t=bt_bwd, backend="interpret" if interpret else "gpu",
                dtype=jnp.dtype(x.dtype).name)
  return _rotate_once(cfg, xp, ap, bp, pos, wp)[:, :T, :, :D].astype(x.dtype)


def _specs(bt, x):
  B, Tp, H, Dp = x.shape
  tile = pl.BlockSpec((None, bt, None, Dp), lambda i, h, b: (b, i, h, 0))
  return dict(grid=(Tp // bt, H, B), tile=tile,
              pos=pl.BlockSpec((None, bt), lambda i, h, b: (b, i)))


def _planes(Np, Dp):
  return (pl.BlockSpec((None, Np, Dp), lambda i, h, b: (h, 0, 0)),
          pl.BlockSpec((None, Np), lambda i, h, b: (h, 0)))


def _forward(cfg, x, a, b, pos, w):
  s = _specs(cfg.forward_block_t, x)
  plane, plane_w = _planes(*a.shape[1:])
  body = functools.partial(kernels.forward_kernel, apply=cfg.apply, num_planes=cfg.num_planes)
  return launch.call(body, s["grid"], [s["tile"], plane, plane, s["pos"], plane_w], s["tile"],
                     jax.ShapeDtypeStruct(x.shape, jnp.float32), backend=cfg.backend,
                     warps=WARPS)(x, a, b, pos, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rotate(cfg, x, a, b, pos, w):
  return _forward(cfg, x, a, b, pos, w)


def _rotate_fwd(cfg, x, a, b, pos, w):
  y = _forward(cfg, x, a, b, pos, w)
  return y, (y, a, b, pos, w)


def _rotate_bwd(cfg, res, g):
  y, a, b, pos, w = res
  B, Tp, H, Dp = y.shape
  Np = a.shape[1]
  s = _specs(cfg.backward_block_t, y)
  nt = Tp // cfg.backward_block_t
  plane, plane_w = _planes(Np, Dp)
  per_tile = pl.BlockSpec((None, None, None, Np, Dp), lambda i, h, b: (b, i, h, 0, 0))
  per_tile_w = pl.BlockSpec((None, None, None, Np), lambda i, h, b: (b, i, h, 0))
  sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  body = functools.partial(kernels.backward_kernel, apply=cfg.apply, apply_vjp=cfg.apply_vjp,
                           num_planes=cfg.num_planes)
  dx, da, db, dw = launch.call(
      body, s["grid"], [s["tile"], s["tile"], plane, plane, s["pos"], plane_w],
      [s["tile"], per_tile, per_tile, per_tile_w],
      [sd(*y.shape), sd(B, nt, H, Np, Dp), sd(B, nt, H, Np, Dp), sd(B, nt, H, Np)],
      backend=cfg.backend, warps=WARPS)(y, g.astype(jnp.float32), a, b, pos, w)
  # rows of padded planes were never written: zero them before summing the tiles' parts
  live = jnp.arange(Np) < cfg.num_planes
  da = jnp.where(live[:, None], da.sum((0, 1)), 0.0)
  db = jnp.where(live[:, None], db.sum((0, 1)), 0.0)
  dw = jnp.where(live, dw.sum((0, 1)), 0.0)
  return dx.astype(cfg.dtype), da, db, None, dw


_rotate.defvjp(_rotate_fwd, _rotate_bwd)
# Called through jit keyed by the static config, so a model's layers share one traced and
# lowered copy of the kernels (see kernels_pallas/path_attention/api.py's _attend_once).
_rotate_once = jax.jit(_rotate, static_argnums=0)
