"""The README section and plot of a conversion experiment's results folder
(experiments/convert_experiment.py writes results.json; experiments/results_pages.py calls
`section`)."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import numpy as np  # noqa: E402

from experiments import plot_style  # noqa: E402
from experiments import report  # noqa: E402
from experiments import results_render  # noqa: E402

PLOT = "loss_vs_length.png"
# How each kind of run is drawn (the colour is its encoding's).
LINES = {"teacher": ":", "converted": "-", "converted_early": "-.", "scratch": "--"}
SETS = ("id", "sparse", "dense")


def kind(name: str) -> str:
  """teacher | converted | converted_early | scratch, from a run's name."""
  if name == "teacher":
    return "teacher"
  for k in ("converted_early", "converted", "scratch"):
    if name.endswith(k):
      return k
  raise ValueError(f"run {name!r} is none of {tuple(LINES)}")


def header(cfg, prov: dict) -> list[str]:
  m, t, d = cfg.model, cfg.train, cfg.data
  commands = prov.get("commands", [prov["command"]])  # one per invocation that added seeds
  return [f"- command{'s' if len(commands) > 1 else ''}: "
          + "; then ".join(f"`{c}`" for c in commands),
          f"- teacher: {m.num_layers} layers, d_model {m.d_model}, {m.num_heads} heads x "
          f"{m.head_dim}, block {m.block}, {m.dtype}; {t.steps} steps of {t.batch_size} x "
          f"{d.seq_len} byte-level Python source tokens, AdamW lr {t.learning_rate}",
          f"- machine: {prov['machine']}, jax {prov['jax']}; date {prov['date']}; wall time "
          f"{prov['wall_time_s']} s"]


def section(cfg, results: dict, prov: dict, out_dir: str | None, *, img: str = "") -> list[str]:
  lengths = results["lengths"]
  runs = results["runs"]
  probe_cols = sorted({c for r in runs.values() for c in r["probe_error"]},
                      key=lambda c: (int(c.split("@")[1]), SETS.index(c.split("@")[0])))
  head = (["run", "encoding", "tokens"] + [f"loss @{n}" for n in lengths]
          + [f"probe {c} error" for c in probe_cols])
  rows = []
  for name, r in runs.items():
    rows.append([name, r["encoding"], f"{r['tokens']:,}"]
                + [results_render.seeds_cell(r["loss"][str(n)], ".4f") if str(n) in r["loss"]
                   else "-" for n in lengths]
                + [results_render.seeds_cell(r["probe_error"][c], ".1f", scale=100, unit="%")
                   if c in r["probe_error"] else "-" for c in probe_cols])
  n = results.get("seeds", 1)
  e = cfg.eval
  per_length = ", ".join(f"{e.num_batches * e.batch_size * L:,} at {L}" for L in lengths)
  lines = header(cfg, prov) + [
      f"- seeds: {n} (the whole experiment, teacher included, once per seed)", "",
      "Held-out loss (nats per byte) at each evaluation length, and the read error of the "
      "flip-flop probe (each run fine-tuned on flip-flop in byte tokens from its parameters) "
      "at the probe's training length and 4x it; with several seeds, mean ± half the spread "
      "(each seed's value). `tokens`: what the run trained on, a conversion's teacher "
      f"included. Each length is scored on its own held-out rows ({e.num_batches} batches of "
      f"{e.batch_size} rows: {per_length} tokens), the same rows for every run: compare runs "
      "within a column; a run's columns are not the same tokens (a longer row also gives "
      "each token more context, which lowers the loss of source code).", "",
      report.markdown_table(head, rows), ""]
  if out_dir is not None:
    _plot(runs, lengths, os.path.join(out_dir, PLOT), cfg)
  lines += [f"![held-out loss against evaluation length]({img}{PLOT})", ""]
  lines += ["Where each run trained:", "", report.markdown_table(
      ["run", "device", "finished", "wall s (with its probe)"],
      [[n, r.get("device") or "?", r.get("finished") or "?", str(r.get("wall_s", "?"))]
       for n, r in runs.items()]), ""]
  return lines


def _plot(runs: dict, lengths: list[int], path: str, cfg) -> None:
  fig, ax = plt.subplots(figsize=(7, 4.2))
  names = list(runs)
  for i, (name, r) in enumerate(runs.items()):
    xs = [n for n in lengths if str(n) in r["loss"]]
    per = [r["loss"][str(n)] for n in xs]
    st = plot_style.encoding(r["encoding"])
    # Wider than the later runs of its kind (same line style): PaTH-FoX converted, drawn over
    # PaTH converted with the same losses, must not hide it.
    later = sum(kind(n) == kind(name) for n in names[i + 1:])
    ax.plot(xs, [np.mean(v) for v in per], linestyle=LINES[kind(name)],
            marker=st["marker"], markersize=4, color=st["color"], label=name, lw=1.5 + later)
    if max(len(v) for v in per) > 1:   # every seed inside the band
      ax.fill_between(xs, [min(v) for v in per], [max(v) for v in per], color=st["color"],
                      alpha=0.12, lw=0)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("evaluation length (tokens; each length scores its own held-out rows)")
  ax.set_ylabel("held-out loss (nats / byte)")
  m = cfg.model
  several = any(len(v) > 1 for r in runs.values() for v in r["loss"].values())
  ax.set_title(f"RoPE -> PaTH conversion: {m.num_layers} x {m.d_model}, trained at "
               f"{cfg.data.seq_len}" + ("\n(band: min-max over seeds)" if several else ""),
               fontsize=10)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
