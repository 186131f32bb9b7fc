"""What a run leaves in its workdir for people: metrics.jsonl, TensorBoard events, report.md, plots.

metrics.jsonl holds one JSON object per line:
  {"kind": "train", "step", "loss", "accuracy", "grad_norm", "learning_rate", ...}
  {"kind": "eval", "step", "set", "length", "loss", "perplexity", "accuracy", "error", "tokens"}
report.md (per run) has the final evaluation table and two plots: the loss curve and the
headline metric against the evaluation length (one labelled bar per set when there is a single
length). A sweep writes a comparison table of its runs, whose training loss is the mean over
the last TAIL_STEPS steps (one step's loss is one batch's). Colours: experiments/plot_style.py.
"""
from __future__ import annotations

import json
import math
import os

from tensorboardX import SummaryWriter

METRICS = "metrics.jsonl"


def _pyplot():
  """matplotlib.pyplot for files only (never a window), imported when a run ends: it costs the
  command's start-up a noticeable part of its imports."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


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


TAIL_STEPS = 25  # the run tables' training loss: the mean over this many final steps


def train_loss_tail(records: list[dict], *, steps: int = TAIL_STEPS) -> tuple[float, int] | None:
  """(mean training loss over the last >= `steps` steps, how many steps it covers), from the
  logged windows: each train record holds the mean loss of the steps since the one before
  (loss_window_mean); a record without it counts as its own step. One step's loss is one
  batch's, too noisy to compare runs by. None when nothing was logged."""
  train = [r for r in records if r["kind"] == "train"]
  total, covered = 0.0, 0
  for i in range(len(train) - 1, -1, -1):
    r = train[i]
    if "loss_window_mean" in r:
      n = r["step"] - (train[i - 1]["step"] if i > 0 else 0)
      total, covered = total + r["loss_window_mean"] * n, covered + n
    else:
      total, covered = total + r["loss"], covered + 1
    if covered >= steps:
      break
  return (total / covered, covered) if covered else None


def tail_label(tails: list[tuple[float, int] | None]) -> str:
  """Column name for train_loss_tail values: says over how many steps they are means."""
  ns = sorted({t[1] for t in tails if t})
  if not ns:
    return "train loss (last logged step)"
  return f"train loss (mean of last {ns[0] if len(ns) == 1 else f'{ns[0]}-{ns[-1]}'} steps)"


def _tail_cell(tail, summary: dict) -> str:
  return f"{tail[0]:.4f}" if tail else f"{summary['final_loss']:.4f}"


def loss_figure(records: list[dict], title: str):
  """The loss-vs-step figure (train and every eval set) as (fig, ax); the caller closes it.

  Each eval set keeps its own colour and marker (plot_style); the sets' points are nudged
  sideways and drawn as hollow, shrinking markers, so sets with equal losses (several at 0)
  show side by side as rings instead of one hiding the others."""
  from experiments import plot_style

  fig, ax = _pyplot().subplots(figsize=(6, 4))
  train = [r for r in records if r["kind"] == "train"]
  ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train (one batch)",
          lw=1, **{**plot_style.eval_set("train"), "marker": ""})
  evals = [r for r in records if r["kind"] == "eval"]
  lengths = sorted({r["length"] for r in evals})
  keys = [(s, n) for s in plot_style.set_order(r["set"] for r in evals) for n in lengths
          if any((r["set"], r["length"]) == (s, n) for r in evals)]
  width = 0.03 * max([r["step"] for r in records] or [1])  # in steps
  for i, key in enumerate(keys):
    pts = [r for r in evals if (r["set"], r["length"]) == key]
    label = key[0] + (f" @{key[1]}" if len(lengths) > 1 else "")
    ax.plot([r["step"] + plot_style.dodge(i, len(keys), width=width) for r in pts],
            [r["loss"] for r in pts], label=label,
            markersize=plot_style.marker_size(i), markerfacecolor="none",
            **plot_style.eval_set(key[0]))
  ax.set(xlabel="step", ylabel="loss",
         title=title + (f" (eval at length {lengths[0]})" if len(lengths) == 1 else ""))
  log_or_symlog(ax, [r["loss"] for r in train + evals])
  ax.legend(fontsize=7)
  fig.tight_layout()
  return fig, ax


def _plot_loss(records: list[dict], path: str, title: str) -> None:
  fig, _ = loss_figure(records, title)
  fig.savefig(path, dpi=100)
  _pyplot().close(fig)


def vs_length_figure(final: list[dict], metric: str, title: str):
  """The final `metric` of every eval set against the evaluation length, as (fig, ax).

  At a single length a line plot is a column of dots; it becomes one labelled bar per set.
  Otherwise lines per set, each nudged sideways (log x) with hollow shrinking markers, so
  sets with equal values (several at 0 error) stay visible."""
  from experiments import plot_style

  sets = plot_style.set_order(r["set"] for r in final)
  lengths = sorted({r["length"] for r in final})
  scale = 100.0 if metric in ("error", "accuracy") else 1.0
  ylabel = f"{metric} (%)" if scale == 100 else metric
  fig, ax = _pyplot().subplots(figsize=(6, 4))
  if len(lengths) == 1:
    vals = [scale * next(r[metric] for r in final if r["set"] == s) for s in sets]
    bars = ax.bar(range(len(sets)), vals, color=[plot_style.eval_set(s)["color"] for s in sets])
    ax.bar_label(bars, [_fmt(metric, v / scale) for v in vals], fontsize=8)
    ax.set_xticks(range(len(sets)), sets)
    ax.set(xlabel="evaluation set", ylabel=ylabel,
           title=f"{title}: {metric} at length {lengths[0]} (the only evaluation length)")
    ax.margins(y=0.15)
  else:
    for i, name in enumerate(sets):
      pts = sorted((r["length"], r[metric]) for r in final if r["set"] == name)
      ax.plot([p[0] * 2 ** plot_style.dodge(i, len(sets)) for p in pts],
              [scale * p[1] for p in pts], label=name, markersize=plot_style.marker_size(i),
              markerfacecolor="none", **plot_style.eval_set(name))
    ax.set(xlabel="evaluation length", ylabel=ylabel, title=title, xscale="log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.legend(fontsize=7)
  fig.tight_layout()
  return fig, ax


def _plot_vs_length(final: list[dict], metric: str, path: str, title: str) -> None:
  fig, _ = vs_length_figure(final, metric, title)
  fig.savefig(path, dpi=100)
  _pyplot().close(fig)


def write_run_report(workdir: str, summary: dict) -> str:
  """Writes workdir/report.md (+ PNGs) for one finished run; returns the markdown."""
  title = f"{summary['encoding']}{' + kv_shift' if summary.get('kv_shift') else ''}"
  metric = headline_metric(summary["task"])
  records = read_metrics(workdir)
  _plot_loss(records, os.path.join(workdir, "loss.png"), title)
  final = summary["eval"]
  tail = train_loss_tail(records)
  loss = (f"training loss {tail[0]:.4f} (mean of the last {tail[1]} steps; the last step "
          f"alone, one batch: {summary['final_loss']:.4f})" if tail else
          f"training loss at the last logged step {summary['final_loss']:.4f}")
  lines = [f"# {title} on {summary['task']} (trained at length {summary['seq_len']})", "",
           f"steps {summary['step']}, {loss}, wall time {summary['wall_time_s']:.0f} s", ""]
  if final:
    _plot_vs_length(final, metric, os.path.join(workdir, "eval_vs_length.png"), title)
    rows = [[r["set"], r["length"], f"{r['loss']:.4f}", f"{r['perplexity']:.4g}",
             _fmt("accuracy", r["accuracy"]), _fmt("error", r["error"])] for r in final]
    one = len({r["length"] for r in final}) == 1
    lines += [markdown_table(["set", "length", "loss", "perplexity", "accuracy", "error"], rows),
              "", f"![{metric} by set](eval_vs_length.png)" if one else
              f"![{metric} vs length](eval_vs_length.png)", ""]
  lines += ["![loss curve](loss.png)", ""]
  text = "\n".join(lines)
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(text)
  return text


def comparison_table(summaries: list[dict], *, workdirs: list[str] | None = None) -> str:
  """One row per run: encoding, training loss, headline metric per eval set and length, time.

  With `workdirs` (one per summary) the training loss is the mean over the last TAIL_STEPS
  steps from each run's metrics.jsonl; without, the last logged step's (one batch's) loss,
  and the column says so."""
  if not summaries:
    return "(no runs)"
  metric = headline_metric(summaries[0]["task"])
  keys = []
  for s in summaries:
    keys += [(r["set"], r["length"]) for r in s["eval"] if (r["set"], r["length"]) not in keys]
  lengths = {k[1] for k in keys}
  name = lambda k: f"{k[0]} {metric}" + (f" @{k[1]}" if len(lengths) > 1 else "")
  tails = ([train_loss_tail(read_metrics(w)) for w in workdirs] if workdirs
           else [None] * len(summaries))
  rows = []
  for s, tail in zip(summaries, tails):
    by_key = {(r["set"], r["length"]): r[metric] for r in s["eval"]}
    rows.append([s["encoding"] + (" + kv_shift" if s.get("kv_shift") else ""),
                 _tail_cell(tail, s)]
                + [_fmt(metric, by_key[k]) if k in by_key else "-" for k in keys]
                + [f"{s['wall_time_s']:.0f} s"])
  return markdown_table(["encoding", tail_label(tails)] + [name(k) for k in keys] + ["wall time"],
                        rows)


def write_sweep_report(workdir: str, summaries: list[dict]) -> str:
  """Writes workdir/report.md comparing the sweep's runs; returns the table."""
  table = comparison_table(summaries, workdirs=[
      os.path.join(workdir, s["encoding"]) for s in summaries])
  s0 = summaries[0]
  text = "\n".join([f"# {s0['task']}: encodings compared (trained at length {s0['seq_len']}, "
                    f"{s0['step']} steps)", "", table, "",
                    "Per-run reports: " + ", ".join(
                        f"[{s['encoding']}]({s['encoding']}/report.md)" for s in summaries), ""])
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(text)
  return table
