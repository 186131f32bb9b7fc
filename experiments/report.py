"""What a run leaves in its workdir for people: metrics.jsonl, TensorBoard events, report.md, plots.

metrics.jsonl holds one JSON object per line:
  {"kind": "train", "step", "loss", "accuracy", "grad_norm", "learning_rate", ...}
  {"kind": "eval", "step", "set", "length", "loss", "perplexity", "accuracy", "error", "tokens"}
report.md (per run) has the final evaluation table and two plots: the loss curve and each
metric against the evaluation length. A sweep writes a comparison table of its runs.
"""
from __future__ import annotations

import json
import math
import os

import matplotlib

matplotlib.use("Agg")  # files only; never open a window
import matplotlib.pyplot as plt  # noqa: E402
from tensorboardX import SummaryWriter  # noqa: E402

METRICS = "metrics.jsonl"


def read_metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, METRICS)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


class MetricsLog:
  """Appends records to metrics.jsonl and TensorBoard (primary process only)."""

  def __init__(self, workdir: str, *, enabled: bool = True):
    self._path = os.path.join(workdir, METRICS)
    self._enabled = enabled
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard")) if enabled else None

  def truncate_after(self, step: int) -> None:
    """Drops records past `step` (a resumed run rewrites them, deterministically)."""
    if not self._enabled:
      return
    kept = [r for r in read_metrics(os.path.dirname(self._path)) if r["step"] <= step]
    with open(self._path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)

  def _write(self, record: dict) -> None:
    with open(self._path, "a") as f:
      f.write(json.dumps(record) + "\n")

  def train(self, step: int, metrics: dict) -> None:
    if not self._enabled:
      return
    self._write({"kind": "train", "step": step, **metrics})
    for k, v in metrics.items():
      self._tb.add_scalar(f"train/{k}", v, step)

  def eval(self, step: int, records: list[dict]) -> None:
    if not self._enabled:
      return
    for r in records:
      self._write({"kind": "eval", "step": step, **r})
      for k in ("loss", "perplexity", "accuracy", "error"):
        self._tb.add_scalar(f"eval_{r['set']}_len{r['length']}/{k}", r[k], step)

  def last_loss(self) -> float | None:
    train = [r for r in read_metrics(os.path.dirname(self._path)) if r["kind"] == "train"]
    return train[-1]["loss"] if train else None

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def headline_metric(task: str) -> str:
  """Error for synthetic tasks (what the papers report), perplexity for text."""
  return "perplexity" if task == "text" else "error"


def _fmt(metric: str, v: float) -> str:
  return f"{100 * v:.2f}%" if metric in ("error", "accuracy") else f"{v:.4g}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
  return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                   + [line(r) for r in rows])


def log_or_symlog(ax, values, *, what: str = "loss") -> str | None:
  """A log y axis, unless some of `values` are <= 0 (a loss that reaches exactly 0 in float32).

  A log axis would drop those points without a word, so the axis becomes symlog instead: linear
  between 0 and `linthresh` (the largest power of ten <= the smallest positive value), log
  above it; 0 gets its own tick and a note in the corner says how many points it holds.
  Returns the note (None when the axis is plain log).
  """
  finite = [float(v) for v in values if math.isfinite(v)]
  nonpositive = [v for v in finite if v <= 0]
  if not nonpositive:
    ax.set_yscale("log")
    return None
  positive = [v for v in finite if v > 0]
  linthresh = 10.0 ** math.floor(math.log10(min(positive))) if positive else 1.0
  ax.set_yscale("symlog", linthresh=linthresh, linscale=0.5)
  zeros = sum(v == 0 for v in nonpositive)
  note = f"{zeros} {what} value{'s' if zeros != 1 else ''} exactly 0"
  if len(nonpositive) > zeros:
    note += f", {len(nonpositive) - zeros} < 0"
  note += f": symlog axis, linear below {linthresh:g}"
  ax.text(0.02, 0.02, note, transform=ax.transAxes, fontsize=7, color="tab:red",
          bbox=dict(facecolor="white", alpha=0.7, edgecolor="none", pad=1))
  return note


def loss_figure(records: list[dict], title: str):
  """The loss-vs-step figure (train and every eval set) as (fig, ax); the caller closes it."""
  fig, ax = plt.subplots(figsize=(6, 4))
  train = [r for r in records if r["kind"] == "train"]
  ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
  evals = [r for r in records if r["kind"] == "eval"]
  for key in sorted({(r["set"], r["length"]) for r in evals}):
    pts = [r for r in evals if (r["set"], r["length"]) == key]
    ax.plot([r["step"] for r in pts], [r["loss"] for r in pts], "o-", label=f"{key[0]} @{key[1]}")
  ax.set(xlabel="step", ylabel="loss", title=title)
  log_or_symlog(ax, [r["loss"] for r in train + evals])
  ax.legend(fontsize=7)
  fig.tight_layout()
  return fig, ax


def _plot_loss(records: list[dict], path: str, title: str) -> None:
  fig, _ = loss_figure(records, title)
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _plot_vs_length(final: list[dict], metric: str, path: str, title: str) -> None:
  fig, ax = plt.subplots(figsize=(6, 4))
  for name in sorted({r["set"] for r in final}):
    pts = sorted((r["length"], r[metric]) for r in final if r["set"] == name)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
  ax.set(xlabel="evaluation length", ylabel=metric, title=title, xscale="log")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_run_report(workdir: str, summary: dict) -> str:
  """Writes workdir/report.md (+ PNGs) for one finished run; returns the markdown."""
  title = f"{summary['encoding']}{' + kv_shift' if summary.get('kv_shift') else ''}"
  metric = headline_metric(summary["task"])
  _plot_loss(read_metrics(workdir), os.path.join(workdir, "loss.png"), title)
  final = summary["eval"]
  lines = [f"# {title} on {summary['task']} (trained at length {summary['seq_len']})", "",
           f"steps {summary['step']}, final train loss {summary['final_loss']:.4f}, "
           f"wall time {summary['wall_time_s']:.0f} s", ""]
  if final:
    _plot_vs_length(final, metric, os.path.join(workdir, "eval_vs_length.png"), title)
    rows = [[r["set"], r["length"], f"{r['loss']:.4f}", f"{r['perplexity']:.4g}",
             _fmt("accuracy", r["accuracy"]), _fmt("error", r["error"])] for r in final]
    lines += [markdown_table(["set", "length", "loss", "perplexity", "accuracy", "error"], rows),
              "", f"![{metric} vs length](eval_vs_length.png)", ""]
  lines += ["![loss curve](loss.png)", ""]
  text = "\n".join(lines)
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(text)
  return text


def comparison_table(summaries: list[dict]) -> str:
  """One row per run: encoding, final loss, headline metric per eval set and length, time."""
  if not summaries:
    return "(no runs)"
  metric = headline_metric(summaries[0]["task"])
  keys = []
  for s in summaries:
    keys += [(r["set"], r["length"]) for r in s["eval"] if (r["set"], r["length"]) not in keys]
  lengths = {k[1] for k in keys}
  name = lambda k: f"{k[0]} {metric}" + (f" @{k[1]}" if len(lengths) > 1 else "")
  rows = []
  for s in summaries:
    by_key = {(r["set"], r["length"]): r[metric] for r in s["eval"]}
    rows.append([s["encoding"] + (" + kv_shift" if s.get("kv_shift") else ""),
                 f"{s['final_loss']:.4f}"]
                + [_fmt(metric, by_key[k]) if k in by_key else "-" for k in keys]
                + [f"{s['wall_time_s']:.0f} s"])
  return markdown_table(["encoding", "final loss"] + [name(k) for k in keys] + ["wall time"], rows)


def write_sweep_report(workdir: str, summaries: list[dict]) -> str:
  """Writes workdir/report.md comparing the sweep's runs; returns the table."""
  table = comparison_table(summaries)
  s0 = summaries[0]
  text = "\n".join([f"# {s0['task']}: encodings compared (trained at length {s0['seq_len']}, "
                    f"{s0['step']} steps)", "", table, "",
                    "Per-run reports: " + ", ".join(
                        f"[{s['encoding']}]({s['encoding']}/report.md)" for s in summaries), ""])
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(text)
  return table
