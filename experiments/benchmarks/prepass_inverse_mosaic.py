"""Is the pre-pass bound by Triton's code generation? Its UT inverse as a Mosaic GPU kernel
(TMA, wgmma) against the Triton kernel the pre-pass runs (prepass_kernel._inverse).

  python experiments/benchmarks/prepass_inverse_mosaic.py [--shapes 2,512,2,64;32,2048,32,64]

Y = (I + strictLower(diag(beta) W W^T))^{-1} per chunk of 64, float32 w (time-major [B, T, K, D],
read in place by TMA), the recursion of prepass_chunk.chunk_inverse: the Gram product, then five
levels of P = A21 Y and Y <- Y + Y (-P). Every product is three bf16 wgmmas (hi*hi, lo*hi, hi*lo)
with A from registers and B from the bf16 halves stored in shared memory. Variants:
- mosaic_wg{1,2}_per{1,2}_p{3,1}: one or two warpgroups a CTA (one chunk each), one or two
  chunks a warpgroup in lockstep (their wgmmas issued together), three bf16 passes a product or
  one (hi*hi only: inaccurate, a diagnostic of the MMA's share of the time);
- triton: the pre-pass's own inverse kernel; triton_per{P}_w{W}: P chunks a program (independent
  chains in one body), W warps.
Prints, per variant, the worst relative RMS error against float64 numpy on four chunks (random w,
and w shared to eps 0.01 with beta 2) and the launch's median wall-clock ms (random w). Head_dim
64 only (the Mosaic kernel reuses the Gram halves' buffers for P). Needs a Hopper GPU.

Measured (H200, 2026-11-26, RESULTS.md round 25): at 32,2048,32,64 Triton 1.87-1.97 ms, Mosaic
1.91-1.93 (one warpgroup) and 2.14 (two), two chunks in lockstep 2.60, Triton with 2 or 4
chunks a program 2.56-5.18, Mosaic with one pass 1.32: the MMA is about half of the time, the
splits, masks and shared-memory stores between the dependent products the rest. Not adopted.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.benchmarks.path_kernel import _median_ms  # noqa: E402

OUT = os.environ.get("OUT", ".")
C = 64


def inverse_mosaic(w, beta, *, wgs=1, per=1, passes=3):
  """w [B, T, K, 64] float32 (time-major), beta [B, K, n, 64] float32 -> Y [B, K, n, 64, 64]
  float32. wgs warpgroups a CTA, `per` chunks a warpgroup, `passes` 3 (accurate) or 1."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from kernels_pallas.path_attention.fwd_mosaic import smem_tile
  B, T, K, D = w.shape
  n = T // C
  if D != C or n % (wgs * per):
    raise ValueError(f"head_dim {D} (needs {C}) or {n} chunks (needs a multiple of {wgs * per})")
  f32, bf = jnp.float32, jnp.bfloat16
  wl = plgpu.Layout.WGMMA
  S = wgs * per   # shared-memory slots: one a chunk in flight

  def split(x):
    hi = x.astype(bf)
    return hi, (x - hi.astype(f32)).astype(bf)

  def terms(a_hi, a_lo, b_hi, b_lo):
    return [(a_hi, b_hi)] + ([(a_lo, b_hi), (a_hi, b_lo)] if passes == 3 else [])

  def issue(accs, products):   # products[j]: chunk j's (A, B) pairs, all issued, then awaited
    def run(refs):
      for r, pairs in zip(refs, products):
        for a, b in pairs:
          plgpu.wgmma(r, a, b)
    return pl.run_state(run)(tuple(plgpu.ACC.init(x) for x in accs))

  def body(w_ref, b_ref, y_ref, s_w, s_b, s_h, s_l, s_yh, s_yl, bar_w, bar_b):
    wg = lax.axis_index("wg")
    kh, b = lax.axis_index("k"), lax.axis_index("batch")
    slots = [wg * per + j for j in range(per)]
    cs = [lax.axis_index("c") * S + sl for sl in slots]
    for c, sl in zip(cs, slots):
      plgpu.copy_gmem_to_smem(w_ref.at[b, pl.ds(c * C, C), kh], s_w.at[sl], bar_w.at[sl])
      plgpu.copy_gmem_to_smem(b_ref.at[b, kh, c], s_b.at[sl], bar_b.at[sl])
    zeros = plgpu.layout_cast(jnp.zeros((C, C), f32), wl)
    halves = []
    for sl in slots:
      plgpu.barrier_wait(bar_w.at[sl])
      plgpu.barrier_wait(bar_b.at[sl])
      hl = split(plgpu.load(s_w.at[sl], (), layout=wl))
      s_h.at[sl][...], s_l.at[sl][...] = hl
      halves.append(hl)
    plgpu.commit_smem()
    tr = lambda ref: plgpu.transpose_ref(ref, (1, 0))
    grams = issue([zeros] * per, [terms(*hl, tr(s_h.at[sl]), tr(s_l.at[sl]))
                                  for hl, sl in zip(halves, slots)])
    row = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=wl)
    col = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=wl)
    lower, bits = row > col, row ^ col
    eye = jnp.where(row == col, zeros + 1.0, zeros)
    a_s, y_s = [], []
    for g, sl in zip(grams, slots):
      beta_r = plgpu.load(s_b.at[sl], (), layout=wl.reduce(1))
      a = jnp.where(lower, lax.broadcast_in_dim(beta_r, (C, C), [0]) * g, zeros)
      a_s.append(a)
      y_s.append(eye - jnp.where(lower & (bits == 1), a, zeros))
    half = 2
    while half < C:
      quad = lower & (bits >= half) & (bits < 2 * half)
      p_terms, y_halves = [], []
      for a, y, sl in zip(a_s, y_s, slots):
        yh = split(y)
        s_yh.at[sl][...], s_yl.at[sl][...] = yh
        y_halves.append(yh)
        p_terms.append(terms(*split(jnp.where(quad, a, zeros)), s_yh.at[sl], s_yl.at[sl]))
      plgpu.commit_smem()
      ps = issue([zeros] * per, p_terms)
      y_terms = []
      for p, yh, sl in zip(ps, y_halves, slots):
        s_h.at[sl][...], s_l.at[sl][...] = split(-p)   # w's halves are dead after the Gram
        y_terms.append(terms(*yh, s_h.at[sl], s_l.at[sl]))
      plgpu.commit_smem()
      y_s = list(issue(y_s, y_terms))
      half *= 2
    for y, sl in zip(y_s, slots):
      s_w.at[sl][...] = y
    plgpu.commit_smem()
    for c, sl in zip(cs, slots):
      plgpu.copy_smem_to_gmem(s_w.at[sl], y_ref.at[b, kh, c])
    plgpu.wait_smem_to_gmem(0)

  scratch = [smem_tile(f32, S, C, D), plgpu.SMEM((S, C), f32), smem_tile(bf, S, C, D),
             smem_tile(bf, S, C, D), smem_tile(bf, S, C, C), smem_tile(bf, S, C, C),
             plgpu.Barrier(num_barriers=S), plgpu.Barrier(num_barriers=S)]

  def entry(w_ref, b_ref, y_ref):
    pl.run_scoped(lambda *s: body(w_ref, b_ref, y_ref, *s), *scratch, collective_axes="wg")

  return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((B, K, n, C, C), f32),
                      grid=(n // S, K, B), grid_names=("c", "k", "batch"), num_threads=wgs,
                      thread_name="wg")(w, beta)


def inverse_triton(w, beta):
  """The pre-pass's own inverse launch (prepass_kernel._inverse, split2_hilo's configuration)."""
  import jax.numpy as jnp
  from kernels_pallas.path_attention import calls
  from kernels_pallas.path_attention import prepass_kernel as pk
  from kernels_pallas.path_attention import prepass_variants
  x3 = calls.bf16x3_precision("gpu")
  cfg = pk._Cfg(scale=1.0, dtype=jnp.dtype(jnp.bfloat16), backend="gpu", precision=x3,
                inv_precision=x3, hilo=True, time_major=True, vjp2=True,
                num_warps=prepass_variants.auto_warps(w.shape[-1]))
  _, spec_w = pk._input_specs(cfg, 1, C, w.shape[-1])
  return pk._inverse(cfg, w, beta[..., None], spec_w)


def inverse_triton_multi(w, beta, *, per=2, warps=4):
  """The Triton inverse with `per` chunks a program (independent chains in one body)."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from kernels_pallas.path_attention import calls
  from kernels_pallas.path_attention.prepass_chunk import chunk_inverse
  B, T, K, D = w.shape
  x3 = calls.bf16x3_precision("gpu")

  def kernel(w_ref, b_ref, y_ref):
    for j in range(per):
      y_ref[j] = chunk_inverse(w_ref[pl.ds(j * C, C), :], b_ref[j], precision=x3)

  return pl.pallas_call(
      kernel, grid=(B, K, T // C // per),
      in_specs=[pl.BlockSpec((None, per * C, None, D), lambda b, k, c: (b, c, k, 0)),
                pl.BlockSpec((None, None, per, C, 1), lambda b, k, c: (b, k, c, 0, 0))],
      out_specs=pl.BlockSpec((None, None, per, C, C), lambda b, k, c: (b, k, c, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((B, K, T // C, C, C), jnp.float32),
      compiler_params=calls.prepass_compiler_params("gpu", 3, warps))(w, beta[..., None])


def inputs(B, T, K, D, kind, key=0):
  """float32 unit w [B, T, K, D] and beta [B, K, n, C]: "random" (beta uniform in (0, 2)) or
  "correlated" (w_t = normalize(a + 0.01 n_t), beta 2: the transport's ill-conditioned case)."""
  import jax
  import jax.numpy as jnp
  ka, kn, kb = jax.random.split(jax.random.key(key), 3)
  if kind == "random":
    w = jax.random.normal(ka, (B, T, K, D))
    beta = 2 * jax.random.uniform(kb, (B, T, K))
  else:
    w = jax.random.normal(ka, (B, 1, K, D)) + 0.01 * jax.random.normal(kn, (B, T, K, D))
    beta = jnp.full((B, T, K), 2.0)
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  return w, jnp.moveaxis(beta.reshape(B, T // C, C, K), 3, 1)


def worst_error(y, w, beta):
  """Worst relative RMS of Y against float64 numpy over four chunks."""
  w, beta, y = (np.asarray(x, np.float64) for x in (w, beta, y))
  B, T, K, _ = w.shape
  n = T // C
  errs = []
  for b, kh, c in [(0, 0, 0), (0, K - 1, min(3, n - 1)), (B - 1, 0, n - 1), (B - 1, K - 1, n // 2)]:
    wc = w[b, c * C:(c + 1) * C, kh]
    ref = np.linalg.inv(np.eye(C) + np.tril(beta[b, kh, c][:, None] * (wc @ wc.T), -1))
    errs.append(np.sqrt(np.mean((y[b, kh, c] - ref) ** 2) / np.mean(ref ** 2)))
  return float(max(errs))


def variants():
  out = {"triton": inverse_triton}
  for per, warps in ((1, 4), (2, 4), (2, 8), (4, 4)):
    out[f"triton_per{per}_w{warps}"] = functools.partial(inverse_triton_multi, per=per,
                                                         warps=warps)
  for wgs, per, passes in ((1, 1, 3), (2, 1, 3), (1, 2, 3), (2, 2, 3), (1, 1, 1), (1, 2, 1)):
    out[f"mosaic_wg{wgs}_per{per}_p{passes}"] = functools.partial(inverse_mosaic, wgs=wgs,
                                                                  per=per, passes=passes)
  return out


def main():
  import jax
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="2,512,2,64;32,2048,32,64", help="B,T,K,D;...")
  p.add_argument("--reps", type=int, default=20)
  a = p.parse_args()
  rows = []
  for spec in a.shapes.split(";"):
    B, T, K, D = (int(x) for x in spec.split(","))
    for kind in ("random", "correlated"):
      w, beta = inputs(B, T, K, D, kind)
      for name, f in variants().items():
        row = dict(shape=(B, T, K, D), kind=kind, variant=name)
        try:   # a variant that does not build is reported, not fatal
          fj = jax.jit(f)
          row["err"] = worst_error(fj(w, beta), w, beta)
          if kind == "random":
            row["ms"] = round(_median_ms(fj, w, beta, n=a.reps), 3)
        except Exception as e:   # noqa: BLE001
          row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
  with open(os.path.join(OUT, "prepass_inverse_mosaic.json"), "w") as f:
    json.dump(rows, f, indent=1)
  print("| B, T, K, D | w | variant | rel RMS vs float64 | ms |\n|---|---|---|---|---|")
  for r in rows:
    err = f"{r['err']:.2e}" if "err" in r else r["error"][:80]
    print(f"| {r['shape']} | {r['kind']} | {r['variant']} | {err} | {r.get('ms', '')} |")


if __name__ == "__main__":
  main()
