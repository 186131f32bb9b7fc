"""Which pre-pass products need float32 accuracy? The measurement behind `split_hilo`.

  JAX_ENABLE_X64=1 python experiments/benchmarks/prepass_precision_study.py [--chunk 64]

One chunk of the operands math (prepass_chunk.chunk_operands and its hand-written VJP), on the
inputs that make the transport ill-conditioned: w shared to eps 1 / 0.01, antiparallel
neighbours, random w; beta 2 and uniform in (0, 2); q, k and the cotangents bf16 values, as
in bf16 training. Each product's operands are formed as the GPU forms bf16 hi / lo halves: a
product keeps hi*hi and, per operand, its lo*hi term or not. Against float64:
1. every product with both lo terms (what BF16_BF16_F32_X3 computes): the baseline;
2. each product alone with one lo term dropped, then both;
3. the drops that keep every output's worst relative RMS error <= --tol (or 1.5x the
   baseline), added greedily, smallest error first, and checked together.
CPU only (seconds). Prints the kept terms per product and the bf16 passes they cost.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas.path_attention import prepass_chunk as pk  # noqa: E402

BF = jnp.bfloat16
PASSES = {"both": 3, "a": 2, "b": 2, "none": 1}   # lo terms kept -> bf16 passes


class Products:
  """A stand-in for prepass_chunk.dot that numbers the products of one call and forms each
  from bf16 halves as `modes[i]` says ("both", "a": a's lo only, "b", "none")."""

  def __init__(self):
    self.modes, self.count, self.exact = {}, 0, {}

  def __call__(self, a, b, *, ta=False, tb=False, precision=None):
    dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    if jnp.float64 in (a.dtype, b.dtype):   # the reference stays float64 throughout
      return jax.lax.dot_general(a.astype(jnp.float64), b.astype(jnp.float64), dims,
                                 preferred_element_type=jnp.float64)
    i, self.count = self.count, self.count + 1
    f32 = lambda x: x.astype(jnp.float32)
    ah, bh = f32(a.astype(BF)), f32(b.astype(BF))
    al, bl = f32((a - ah).astype(BF)), f32((b - bh).astype(BF))
    self.exact.setdefault(i, (bool(jnp.all(al == 0)), bool(jnp.all(bl == 0))))
    mode = self.modes.get(i, "both")
    hp = jax.lax.Precision.HIGHEST
    dg = lambda x, y: jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.float32,
                                          precision=hp)
    out = dg(ah, bh)
    if mode in ("both", "a"):
      out = out + dg(al, bh)
    if mode in ("both", "b"):
      out = out + dg(ah, bl)
    return out


def make_case(seed, w_mode, beta_mode, C, D):
  r = np.random.default_rng(seed)
  a = r.standard_normal(D)
  if w_mode == "random":
    w = r.standard_normal((C, D))
  elif w_mode == "antiparallel":
    w = a * (-1.0) ** np.arange(C)[:, None] + 0.01 * r.standard_normal((C, D))
  else:   # "shared:eps"
    w = a + float(w_mode.split(":")[1]) * r.standard_normal((C, D))
  w = w / np.linalg.norm(w, axis=-1, keepdims=True)
  beta = np.full((1, C), 2.0) if beta_mode == "2" else 2 * r.random((1, C))
  bf = lambda *s: np.asarray(jnp.asarray(r.standard_normal(s), jnp.float32).astype(BF),
                             np.float64)
  cts = ((bf(C, D),), bf(C, D), bf(D, D), (bf(C, C),))
  return (bf(C, D),), bf(C, D), w, beta, cts


def errors(prod, vjp, cases):
  """[case, output] relative RMS error of the float32 run against float64."""
  out = []
  for qs, k, w, beta, cts in cases:
    runs = []
    for dtype in (jnp.float64, jnp.float32):
      cast = lambda x: jax.tree.map(lambda t: jnp.asarray(t, dtype), x)
      y = pk.chunk_inverse(jnp.asarray(w, jnp.float64), jnp.asarray(beta.T, jnp.float64),
                           precision=None).astype(dtype)
      prod.count = 0
      args = (cast(qs), cast(k), cast(w), y, cast(beta)) + ((cast(cts),) if vjp else ())
      fn = pk.chunk_operands_vjp if vjp else pk.chunk_operands
      runs.append([np.asarray(x, np.float64) for x in jax.tree.leaves(fn(*args, scale=0.125))])
    out.append([np.sqrt(np.mean((g - r) ** 2)) / np.sqrt(np.mean(r ** 2))
                for r, g in zip(*runs)])
  return np.array(out)


def study(prod, vjp, cases, tol):
  prod.modes, prod.exact = {}, {}
  base = errors(prod, vjp, cases).max(0)
  n = prod.count
  ok = lambda e: bool(np.all(e.max(0) <= np.maximum(tol, 1.5 * base)))
  single = {}
  for i in range(n):
    ea, eb = prod.exact[i]
    for mode in ("none", "a", "b"):
      if (mode == "a" and ea) or (mode == "b" and eb):
        continue   # dropping the lo of an exact operand loses nothing; counted below
      prod.modes = {i: mode}
      e = errors(prod, vjp, cases)
      if ok(e):
        single[i] = (e.max(), mode)
        break
  chosen = {}
  for _, i, mode in sorted((err, i, mode) for i, (err, mode) in single.items()):
    prod.modes = {**chosen, i: mode}
    if ok(errors(prod, vjp, cases)):
      chosen[i] = mode
  prod.modes = chosen
  final = errors(prod, vjp, cases).max(0)
  passes = 0
  print(f"{'VJP' if vjp else 'forward'}: {n} products; baseline worst error per output "
        f"{np.array2string(base, precision=1)}")
  for i in range(n):
    ea, eb = prod.exact[i]
    mode = chosen.get(i, "both")
    keep_a = mode in ("both", "a") and not ea
    keep_b = mode in ("both", "b") and not eb
    passes += 1 + keep_a + keep_b
    print(f"  product {i:2d}: a {'exact' if ea else 'keeps lo' if keep_a else 'hi only'}, "
          f"b {'exact' if eb else 'keeps lo' if keep_b else 'hi only'}")
  print(f"  together: worst error per output {np.array2string(final, precision=1)}; "
        f"{passes} bf16 passes against {3 * n} for three per product")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--chunk", type=int, default=64, help="C = D")
  p.add_argument("--tol", type=float, default=2.5e-4)
  a = p.parse_args()
  if not jax.config.jax_enable_x64:
    sys.exit("set JAX_ENABLE_X64=1 (the reference is float64)")
  prod = Products()
  pk.dot = prod   # the chunk functions' products (the inverse's too: float64 there)
  cases = [make_case(s, wm, bm, a.chunk, a.chunk) for s, (wm, bm) in enumerate(
      itertools.product(["random", "shared:1.0", "shared:0.01", "antiparallel"], ["2", "u"]))]
  for vjp in (False, True):
    study(prod, vjp, cases, a.tol)


if __name__ == "__main__":
  main()
