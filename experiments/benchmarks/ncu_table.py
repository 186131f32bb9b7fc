"""Short table of an Nsight Compute report: one row per profiled kernel launch.

  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --kernel-name regex:kernel \
      --metrics "$(python experiments/benchmarks/ncu_table.py --metrics)" --launch-count 12 \
      -o prof python experiments/benchmarks/path_kernel_phases.py --cases 0 --reps 0
  ncu -i prof.ncu-rep --csv --page raw > prof.csv
  python experiments/benchmarks/ncu_table.py prof.csv

Columns: time (us), DRAM bytes read+written (MB) and % of peak DRAM throughput, L2 bytes (MB),
SM throughput %, tensor-pipe activity %, registers per thread, achieved occupancy (% of the
SM's warps), local-memory bytes (register spills, MB), grid size.

Without XLA_PYTHON_CLIENT_PREALLOCATE=false, ncu backs up JAX's preallocated pool (most of the
GPU) before every replay pass and the run fails; `regex:kernel` keeps to the Pallas kernels
(their names end in `kernel`), leaving out XLA's fusions.
"""
from __future__ import annotations

import csv
import sys

COLUMNS = {  # short name -> ncu metric
    "us": "gpu__time_duration.sum",
    "dram_rd": "dram__bytes_read.sum",
    "dram_wr": "dram__bytes_write.sum",
    "dram%": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2": "lts__t_bytes.sum",
    "sm%": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "tc%": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "gmma%": "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "regs": "launch__registers_per_thread",
    "occ%": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "loc_ld": "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum",
    "loc_st": "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum",
    "smem": "launch__shared_mem_per_block",
    "grid": "launch__grid_size",
}
_SCALE = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "byte/block": 1,
          "Kbyte/block": 1e3, "us": 1, "ms": 1e3, "ns": 1e-3, "usecond": 1, "msecond": 1e3,
          "nsecond": 1e-3}  # units as ncu's raw CSV spells them


def _value(raw, unit, name):
  try:
    x = float(raw.replace(",", ""))
  except ValueError:
    return raw
  if name == "us":
    return x * _SCALE.get(unit, 1)
  if name in ("dram_rd", "dram_wr", "l2", "loc_ld", "loc_st"):
    return x * _SCALE.get(unit, 1) / 1e6  # MB
  if name == "smem":
    return x * _SCALE.get(unit, 1) / 1e3  # KB
  return x


def table(path):
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
  head, units, data = rows[start], rows[start + 1], rows[start + 2:]
  idx = {m: head.index(m) for m in COLUMNS.values() if m in head}
  name_i = head.index("Kernel Name")
  keys = [k for k, m in COLUMNS.items() if m in idx]
  print("| kernel | " + " | ".join(keys) + " |")
  for r in data:
    vals = []
    for k in keys:
      i = idx[COLUMNS[k]]
      v = _value(r[i], units[i], k)
      vals.append(f"{v:.4g}" if isinstance(v, float) else str(v))
    print(f"| {r[name_i][:40]} | " + " | ".join(vals) + " |")


def main():
  if sys.argv[1:] == ["--metrics"]:
    print(",".join(COLUMNS.values()))
    return
  table(sys.argv[1])


if __name__ == "__main__":
  main()
