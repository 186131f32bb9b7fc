"""Where the PaTH kernel's peak memory goes, on one GPU: XLA's memory-usage report of the jitted
fwd+bwd step (largest allocations and the logical buffers live at the heap peak).

  python experiments/benchmarks/path_kernel_memory.py --case 0 [--lines 60] [--options span=16]

Writes XLA's dump to a temporary folder and prints the plan, memory_analysis's totals and the
head of the step module's memory-usage report (bf16, no gate; --options as kp.BlockSizes
fields, "" the defaults). No table is kept: the anchor table's peak column
(docs/benchmarks/path_kernel.md) is the current figure; this says what makes it up.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kernels_pallas as kp  # noqa: E402
from experiments.benchmarks import common  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--case", default="0", help="an index into common.CASES, or a shape BxTxHxD")
  p.add_argument("--lines", type=int, default=60)
  p.add_argument("--options", default="",
                 help=f"kernel options 'key=value,...' ({', '.join(common.OPTION_FIELDS)})")
  a = p.parse_args(argv)
  try:
    B, T, H, D = common.case_shape(a.case)
    bs = common.block_sizes(a.options)
  except ValueError as e:
    p.error(str(e))
  dump = tempfile.mkdtemp()
  # XLA reads its flags when the backend starts, which the first array below does
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
  q, k, v, w, beta, _, do = common.inputs(B, T, H, D)

  def path_fwd_bwd(q, k, v, w, beta, do):   # do an argument: no 2 GiB constant
    loss = lambda *x: jnp.sum(kp.path_attention(*x, block_sizes=bs).astype(jnp.float32) * do)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, w, beta)

  print(kp.explain(q, k, v, w, beta, block_sizes=bs))
  compiled = jax.jit(path_fwd_bwd).lower(q, k, v, w, beta, do).compile()
  m = compiled.memory_analysis()
  print(f"case {a.case} {(B, T, H, D)} {a.options or 'defaults'}: total "
        f"{common.compiled_gib(compiled):.2f} GiB; arguments "
        f"{m.argument_size_in_bytes / 2**30:.2f}, outputs {m.output_size_in_bytes / 2**30:.2f}, "
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
