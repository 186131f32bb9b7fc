"""GRAPE-M rank-2's plane product alone: the fused plane kernel (kernels_pallas.plane_rotations)
at several token tiles against the XLA plane scan, forward and forward + backward, at one of
the model's q shapes. Each row also gives the bytes the call must at least move (x in, y out;
the gradients' x-sized arrays for the backward), so the table says how far from the memory
bound each variant runs.

  python -m experiments.benchmarks.plane_rotations [--shape 16x2048x12x64] [--planes 32] \
      [--block-t 16,32,64,128] [--out FILE]

The 125M model's training step applies the product to q and to k in each of its 12 layers
(docs/benchmarks/train_throughput.md has the step). --interpret runs the kernel in the Pallas
interpreter at a small shape (a CPU smoke run; its times mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments.benchmarks import common  # noqa: E402
from kernels_pallas import plane_rotations as plane_kernel  # noqa: E402
from posenc_jax import grape_m  # noqa: E402


def inputs(B, T, H, D, N, *, key=0):
  """x [B, T, H, D] bf16, planes a, b [H, N, D] near RoPE's, w [H, N], positions of three
  documents, and a probe for the backward's cotangent."""
  ks = jax.random.split(jax.random.key(key), 5)
  a0, b0 = grape_m.canonical_planes(H, D, N)
  a = a0 + 0.1 * jax.random.normal(ks[1], a0.shape)
  b = b0 + 0.1 * jax.random.normal(ks[2], b0.shape)
  w = jnp.exp(-jnp.linspace(0.0, 9.0, N))[None] * jnp.ones((H, 1))
  third = T // 3
  pos = jnp.concatenate([jnp.arange(third), jnp.arange(third), jnp.arange(T - 2 * third)])
  pos = jnp.broadcast_to(pos.astype(jnp.int32), (B, T))
  x = jax.random.normal(ks[0], (B, T, H, D)).astype(jnp.bfloat16)
  probe = jax.random.normal(ks[3], (B, T, H, D))
  return x, a, b, pos, w, probe


def variants(block_ts, *, interpret: bool) -> dict:
  """{label: f(x, a, b, pos, w) -> y}: the scan, the kernel at its default tiles (each pass
  its own) and at each token tile for both passes."""
  out = {"scan": lambda x, a, b, pos, w: grape_m.rank2_planes_at_positions(
      x, a, b, pos, w, implementation="scan")}

  def kernel(bt):
    return lambda x, a, b, pos, w: plane_kernel(
        x, a, b, pos, w, apply=grape_m.rank2_apply, apply_vjp=grape_m.rank2_apply_rows_vjp,
        block_t=bt, interpret=interpret)

  for bt in [None, *block_ts]:
    out["kernel default" if bt is None else f"kernel bt={bt}"] = kernel(bt)
  return out


def measure(shape, *, planes: int, block_ts, interpret: bool = False, reps: int = 10) -> list:
  B, T, H, D = shape
  x, a, b, pos, w, probe = inputs(B, T, H, D, planes)
  elems = B * T * H * D
  # forward: x (bf16) in, y (bf16) out; backward adds y's cotangent in and dx out (float32 at
  # least once each), and the forward's float32 output kept for it
  min_bytes = {"fwd": elems * (2 + 2), "fwdbwd": elems * (2 + 2 + 4 + 4 + 4)}
  rows, reference = [], None
  for label, f in variants(block_ts, interpret=interpret).items():
    at_pos = lambda x, a, b, w, f=f: f(x, a, b, pos, w)  # noqa: E731
    fwd = jax.jit(at_pos)
    fwdbwd = common.grad_fn(at_pos, 4)    # called with the probe as the cotangent
    y, grads = fwd(x, a, b, w), fwdbwd(x, a, b, w, probe)
    if reference is None:
      reference = (y, grads)
    row = {"variant": label, "shape": [B, T, H, D], "planes": planes,
           "y_rel_rms": common.rel_rms(y.astype(jnp.float32), reference[0].astype(jnp.float32)),
           "grad_rel_rms": max(common.rel_rms(g, r) for g, r in zip(grads, reference[1]))}
    for phase, fn, args in (("fwd", fwd, (x, a, b, w)), ("fwdbwd", fwdbwd, (x, a, b, w, probe))):
      ms = common.pipelined_ms(fn, *args, n=reps)
      row[f"{phase}_ms"] = ms
      row[f"{phase}_gbs"] = min_bytes[phase] / ms / 1e6
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def table(rows) -> str:
  lines = ["| variant | fwd ms | fwd GB/s (min bytes) | fwd+bwd ms | fwd+bwd GB/s | rel. RMS vs "
           "scan: y / worst gradient |", "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['variant']} | {r['fwd_ms']:.2f} | {r['fwd_gbs']:.0f} | "
                 f"{r['fwdbwd_ms']:.2f} | {r['fwdbwd_gbs']:.0f} | "
                 f"{r['y_rel_rms']:.1e} / {r['grad_rel_rms']:.1e} |")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shape", default="16x2048x12x64", help="B x T x H x D of q")
  p.add_argument("--planes", type=int, default=32)
  p.add_argument("--block-t", default="16,32,64,128", help="the kernel's token tiles")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU smoke run)")
  p.add_argument("--out", default=None, help="also write the rows here (JSON)")
  a = p.parse_args(argv)
  shape = tuple(int(s) for s in a.shape.split("x"))
  if len(shape) != 4:
    p.error(f"--shape={a.shape!r} must be B x T x H x D")
  rows = measure(shape, planes=a.planes, block_ts=[int(t) for t in a.block_t.split(",")],
                 interpret=a.interpret, reps=a.reps)
  print(table(rows))
  if a.out:
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "rows": rows}, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
