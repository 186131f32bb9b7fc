"""PaTH paper Fig. 1 here: kernel time (forward + backward) of PaTH, PaTH-FoX, FoX and RoPE's
flash attention against the sequence length, at the paper's batch 32, 32 heads, head_dim 64.

Each length is one case of `path_kernel.py --part jax` (the same inputs, timing and variants:
cudnn is RoPE's flash attention, fox our kernel without the transport, path and path_fox our
PaTH kernel); the rows go to OUT/kernel_lengths.json, then a table (kernel_lengths.md) and the
figure (kernel_lengths.png), time on a log scale against log2 T:

  python -m experiments.benchmarks.kernel_lengths --lengths 1024,2048,4096,8192,16384 \
      --out $OUT
  python -m experiments.benchmarks.kernel_lengths --render-only --out DIR   # from its json

Each length's row is written to the json as it finishes, and a run adds its lengths to the rows
already there (replacing those of the same T), so a long sweep can be split across calls.

Its current table and figure: docs/benchmarks/kernel_lengths.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from experiments import plot_style

# Our kernel variants stand for these encodings in the figure; cudnn for RoPE.
VARIANTS = {"cudnn": "rope", "fox": "fox", "path": "path", "path_fox": "path_fox"}
ROWS = "kernel_lengths.json"


def run(lengths, *, batch: int, heads: int, head_dim: int, variants) -> list[dict]:
  from experiments.benchmarks import path_kernel  # GPU work: imported only to measure
  cases = [f"{batch}x{t}x{heads}x{head_dim}" for t in lengths]
  return path_kernel.part_jax(cases, list(variants), options=("",), dtype="bfloat16")


def series(rows: list[dict], *, phase: str = "fwdbwd_ms") -> dict[str, list[tuple[int, float]]]:
  """{variant: [(T, ms)]} of the rows that measured it (errors and missing cells left out)."""
  out: dict[str, list[tuple[int, float]]] = {}
  for r in sorted(rows, key=lambda r: r["T"]):
    for name in VARIANTS:
      cell = r.get(name)
      if isinstance(cell, dict) and cell.get(phase) is not None:
        out.setdefault(name, []).append((r["T"], float(cell[phase])))
  return out


def table(rows: list[dict]) -> str:
  names = [n for n in VARIANTS if any(n in r for r in rows)]
  lines = ["| T | " + " | ".join(f"{n} ms fwd / fwd+bwd" for n in names)
           + " | path ÷ rope | path ÷ fox |", "|---|" + "---|" * (len(names) + 2)]
  for r in sorted(rows, key=lambda r: r["T"]):
    cells = []
    for n in names:
      c = r.get(n)
      cells.append(f"{c['fwd_ms']} / {c.get('fwdbwd_ms', '-')}" if isinstance(c, dict)
                   else (str(c)[:60] if c else "-"))
    ratio = lambda a, b: (f"{r[a]['fwdbwd_ms'] / r[b]['fwdbwd_ms']:.2f}"  # noqa: E731
                          if all(isinstance(r.get(x), dict) and r[x].get("fwdbwd_ms")
                                 for x in (a, b)) else "-")
    lines.append(f"| {r['T']} | " + " | ".join(cells)
                 + f" | {ratio('path', 'cudnn')} | {ratio('path', 'fox')} |")
  return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  shape = rows[0]
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, points in series(rows).items():
    ts, ms = zip(*points)
    ax.plot(ts, ms, label=f"{VARIANTS[name]} ({name})", **plot_style.encoding(VARIANTS[name]))
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sequence length T")
  ax.set_ylabel("forward + backward, ms")
  ax.set_title(f"Attention kernels, bf16, causal: B {shape['B']}, {shape['H']} heads x "
               f"{shape['D']}")
  ax.grid(True, which="both", alpha=0.3)
  if ax.lines:
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def render(rows: list[dict], out: str) -> None:
  with open(os.path.join(out, "kernel_lengths.md"), "w") as f:
    f.write(table(rows) + "\n")
  plot(rows, os.path.join(out, "kernel_lengths.png"))


def _row_of(rows: list[dict], t: int) -> dict:
  return next((r for r in rows if r["T"] == t), {})


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  p.add_argument("--render-only", action="store_true")
  a = p.parse_args(argv)
  variants = [v for v in a.variants.split(",") if v]
  bad = [v for v in variants if v not in VARIANTS]
  if bad:
    p.error(f"--variants {','.join(bad)}: not one of {','.join(VARIANTS)}")
  rows_path = os.path.join(a.out, ROWS)
  rows = []
  if os.path.exists(rows_path):
    with open(rows_path) as f:
      rows = json.load(f)
  if not a.render_only:
    os.makedirs(a.out, exist_ok=True)
    # One variant of one length at a time, each written as it finishes, so a run cut short
    # by the caller's time limit keeps every cell it measured. A length already in the file
    # keeps the cells of the variants not measured again (--variants path completes a row).
    for t in (int(t) for t in a.lengths.split(",")):
      kept = {k: c for k, c in _row_of(rows, t).items() if k not in variants}
      rows = [r for r in rows if r["T"] != t] + ([kept] if kept else [])
      for v in variants:
        (new,) = run([t], batch=a.batch, heads=a.heads, head_dim=a.head_dim, variants=[v])
        rows = [r for r in rows if r["T"] != t] + [{**_row_of(rows, t), **new}]
        with open(rows_path, "w") as f:
          json.dump(sorted(rows, key=lambda r: r["T"]), f, indent=1)
  render(rows, a.out)
  print(table(rows), file=sys.stdout)


if __name__ == "__main__":
  main()
