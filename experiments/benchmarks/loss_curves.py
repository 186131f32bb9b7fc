"""Loss curves of train_throughput.py rows: a plot, and a table of windowed means and of the
largest step-wise gap between each row and the first.

  python -m experiments.benchmarks.loss_curves docs/benchmarks/data/train_losses_h200.jsonl \
      --out docs/benchmarks/data/train_losses_h200.png \
      --labels "A: default (call 4),B: keep_inverse=false (call 4),C: default (call 5),\
D: default (call 5; beside C)"

Each row is labelled by its line number, encoding, implementation and note's first clause
(--labels overrides). Colours are the encodings' (experiments/plot_style.py); rows of one
encoding differ by line style and marker. Two runs of one code in one process are bitwise
equal; runs of one code in different device calls are not (the compiled kernels' algorithms
may differ by machine), so a comparison needs such a pair beside it to read the gap against.
"""
from __future__ import annotations

import argparse
import json
import statistics

import matplotlib

matplotlib.use("Agg")  # files only; never open a window
import matplotlib.pyplot as plt  # noqa: E402

from experiments import plot_style  # noqa: E402


def read_rows(path: str) -> list[dict]:
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  missing = [i for i, r in enumerate(rows) if not r.get("losses")]
  if missing:
    raise ValueError(f"{path}: rows {missing} have no 'losses' (run with --loss-steps > 0)")
  return rows


def label(i: int, row: dict) -> str:
  impl = row.get("implementation") or "auto"
  note = row.get("note", "").split(";")[0]
  return f"{i}: {row['encoding']} T={row['seq_len']} [{impl}]" + (f" ({note})" if note else "")


def window_means(losses: list[float], window: int) -> list[float]:
  return [statistics.mean(losses[s:s + window]) for s in range(0, len(losses), window)]


def table(rows: list[dict], labels: list[str], window: int) -> str:
  n = min(len(r["losses"]) for r in rows)
  starts = list(range(0, n, window))
  head = "| row | " + " | ".join(f"{s}-{min(s + window, n) - 1}" for s in starts)
  head += " | max step gap to row 0 |"
  lines = [head, "|" + "---|" * (len(starts) + 2)]
  base = rows[0]["losses"][:n]
  for lab, r in zip(labels, rows):
    means = window_means(r["losses"][:n], window)
    gap = max(abs(a - b) for a, b in zip(r["losses"][:n], base))
    lines.append(f"| {lab} | " + " | ".join(f"{m:.3f}" for m in means) + f" | {gap:.3f} |")
  return "\n".join(lines)


REPEAT_LINESTYLES = ("-", "--", ":", "-.")
REPEAT_MARKERS = ("o", "s", "^", "D", "v", "P")


def line_styles(rows: list[dict], *, every: int = 20) -> list[dict]:
  """plot() keywords per row: the encoding's colour (experiments/plot_style.py); rows of one
  encoding (the same code in two calls, or two options) differ by line style and by markers
  placed at staggered steps, so two bitwise-equal curves still show as two."""
  seen: dict[str, int] = {}
  out = []
  for r in rows:
    n = seen[r["encoding"]] = seen.get(r["encoding"], -1) + 1
    out.append({"color": plot_style.encoding(r["encoding"])["color"],
                "linestyle": REPEAT_LINESTYLES[n % len(REPEAT_LINESTYLES)],
                "marker": REPEAT_MARKERS[n % len(REPEAT_MARKERS)],
                "markevery": (n * every // 4 % every, every), "markersize": 5})
  return out


def plot(rows: list[dict], labels: list[str], out: str, smooth: int):
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for lab, r, kw in zip(labels, rows, line_styles(rows)):
    y = r["losses"]
    k = max(1, smooth)
    avg = [statistics.mean(y[max(0, i - k + 1):i + 1]) for i in range(len(y))]
    ax.plot(range(len(y)), avg, label=lab, linewidth=1.2, markerfacecolor="none", **kw)
  ax.set_xlabel("step")
  ax.set_ylabel(f"training loss ({smooth}-step trailing mean)" if smooth > 1 else "training loss")
  ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out, dpi=120)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("rows", help="JSON lines of train_throughput.py rows with 'losses'")
  p.add_argument("--out", help="PNG to write (none: the table only)")
  p.add_argument("--window", type=int, default=20, help="steps per windowed mean")
  p.add_argument("--smooth", type=int, default=10, help="trailing mean of the plotted curves")
  p.add_argument("--labels", help="comma list, one per row")
  args = p.parse_args(argv)
  if args.window < 1:
    raise ValueError(f"--window must be >= 1, got {args.window}")
  rows = read_rows(args.rows)
  labels = args.labels.split(",") if args.labels else [label(i, r) for i, r in enumerate(rows)]
  if len(labels) != len(rows):
    raise ValueError(f"--labels has {len(labels)} names for {len(rows)} rows")
  print(table(rows, labels, args.window))
  if args.out:
    plot(rows, labels, args.out, args.smooth)
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
