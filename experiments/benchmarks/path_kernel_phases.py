"""Where the PaTH kernel's time goes, on one GPU: each phase jitted and timed alone.

  python experiments/benchmarks/path_kernel_phases.py --cases 0,3

Phases: the pre-pass (forward), the forward kernel, the dk/dv kernel, the dq/dP kernel, the
pre-pass VJP (recompute + pullback), and the whole fwd+bwd for comparison. bf16, no gate,
median ms; one JSON line per case and a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.benchmarks.path_kernel import CASES, OUT, _inputs, _median_ms  # noqa: E402


def case_phases(ci, backend="gpu"):
  import jax
  import jax.numpy as jnp
  from kernels_pallas.path_attention import api, calls, prepass
  B, T, H, D = CASES[ci]
  q, k, v, w, beta, _, do = _inputs(B, T, H, D)
  bs = calls.BlockSizes()
  cfg = api._Config(scale=D ** -0.5, T=T, backend=backend, block_sizes=bs)
  kw = dict(scale=cfg.scale, precision=None, backend=backend, bs=bs)
  args = (q, k, v, w, beta, None)
  prep = jax.jit(lambda *a: api._prepare(cfg, *a, None))
  ops = prep(*args)
  fwd = jax.jit(lambda ops: calls.forward(ops, **kw))
  o, lse = fwd(ops)
  C, n = bs.block_q, ops.q.shape[2]
  do_b = prepass.blocked(prepass.pad_time(do, n * C), C)
  delta = jnp.sum(o.astype(jnp.float32) * do_b.astype(jnp.float32), -1, keepdims=True)
  dkv = jax.jit(lambda *a: calls.backward_dkv(*a, **kw))
  dq = jax.jit(lambda *a: calls.backward_dq(*a, **kw))
  ct = ops  # any cotangent of the right structure times the pullback

  def vjp(a, ct):
    _, pull = jax.vjp(lambda *x: api._prepare(cfg, *x, None), *a)
    return pull(ct)

  pull = jax.jit(vjp)
  whole = jax.jit(jax.grad(lambda *a: jnp.sum(api.path_attention(*a, backend=backend).astype(jnp.float32) * do),
                           argnums=(0, 1, 2, 3, 4)))
  row = dict(case=ci, B=B, T=T, H=H, D=D)
  row["prepass"] = _median_ms(prep, *args)
  row["fwd_kernel"] = _median_ms(fwd, ops)
  row["dkv_kernel"] = _median_ms(dkv, ops, do_b, lse, delta)
  row["dq_kernel"] = _median_ms(dq, ops, do_b, lse, delta)
  row["prepass_vjp"] = _median_ms(pull, args, ct)
  row["fwd_bwd"] = _median_ms(whole, *args[:5], n=5)
  row = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
  print(json.dumps(row), flush=True)
  return row


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--cases", default="0,3")
  p.add_argument("--backend", default="gpu", help="interpret: a CPU smoke run of the script")
  a = p.parse_args()
  rows = [case_phases(int(c), a.backend) for c in a.cases.split(",") if c]
  with open(os.path.join(OUT, "path_kernel_phases.json"), "w") as f:
    json.dump(rows, f, indent=1)
  keys = [k for k in rows[0] if k not in ("B", "T", "H", "D")]
  print("| " + " | ".join(keys) + " |")
  for r in rows:
    print("| " + " | ".join(str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
  main()
