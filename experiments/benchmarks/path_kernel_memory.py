"""Where the PaTH kernel's peak memory goes, on one GPU: XLA's memory-usage report of the jitted
fwd+bwd step (largest allocations and the logical buffers live at the heap peak).

  python experiments/benchmarks/path_kernel_memory.py --case 0 [--lines 60] [--bs dkv_span=16]

Writes XLA's dump to a temporary folder and prints the head of its memory-usage report for the
step's module (bf16, no gate; BlockSizes as --bs gives them, else the defaults), after
memory_analysis's totals.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--case", type=int, default=0)
  p.add_argument("--lines", type=int, default=60)
  p.add_argument("--bs", default="", help="BlockSizes fields, e.g. dkv_span=16,bwd_spans=3")
  a = p.parse_args()
  dump = tempfile.mkdtemp()
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
  import jax
  import jax.numpy as jnp
  import kernels_pallas as kp
  from experiments.benchmarks.path_kernel import CASES, _gib, _inputs
  from experiments.benchmarks.path_kernel_phases import _block_sizes
  bs = kp.BlockSizes(**_block_sizes(a.bs))
  B, T, H, D = CASES[a.case]
  q, k, v, w, beta, _, do = _inputs(B, T, H, D)

  def path_fwd_bwd(q, k, v, w, beta):
    loss = lambda *x: jnp.sum(kp.path_attention(*x, block_sizes=bs).astype(jnp.float32) * do)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, w, beta)

  compiled = jax.jit(path_fwd_bwd).lower(q, k, v, w, beta).compile()
  m = compiled.memory_analysis()
  print(f"case {a.case} {CASES[a.case]} {a.bs or 'defaults'}: total {_gib(compiled)} GiB; "
        f"arguments {m.argument_size_in_bytes / 2**30:.2f}, outputs {m.output_size_in_bytes / 2**30:.2f}, "
        f"temporaries {m.temp_size_in_bytes / 2**30:.2f} GiB")
  reports = sorted(glob.glob(os.path.join(dump, "*path_fwd_bwd*memory-usage-report.txt")))
  if not reports:
    print("no memory-usage report in", dump, sorted(os.listdir(dump))[:20])
    return
  with open(reports[-1]) as f:
    for i, line in enumerate(f):
      if i >= a.lines:
        break
      print(line.rstrip()[:220])


if __name__ == "__main__":
  main()
