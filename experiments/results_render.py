"""Tables and plots of one results folder, from its results.json and the config it ran with.

A folder's README is rebuilt from files alone (experiments/results_pages.py): results.json
(what the writers in results_writers.py aggregated), provenance.json (the command, machine
and the experiment's config as it ran) and summaries.json (the runs). Nothing here trains or
evaluates, so a README and its plots can be regenerated on any machine, and a test can check
that the committed README still says what the JSON says.

  section(kind, results, cfg, out_dir, ...) -> markdown lines (+ the plot written when asked)
  header(cfg, prov, seeds)                  -> the command / setting / model / training lines

Cells with several seeds read `mean ± half the spread (per-seed values)`; plots draw each
seed, never only a mean of seeds that disagree.
"""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments import plot_style  # noqa: E402
from experiments import report  # noqa: E402


# --- shared ------------------------------------------------------------------------


def seeds_cell(values: list[float], fmt: str, *, scale: float = 1.0, unit: str = "") -> str:
  """One value, or `mean ± half spread (seed values)` for several seeds."""
  v = [scale * x for x in values]
  if len(v) == 1:
    return f"{v[0]:{fmt}}{unit}"
  if len({f"{x:{fmt}}" for x in v}) == 1:
    return f"{v[0]:{fmt}}{unit} ({'both' if len(v) == 2 else f'all {len(v)}'} seeds)"
  half = (max(v) - min(v)) / 2
  return (f"{np.mean(v):{fmt}}{unit} ± {half:{fmt}} "
          f"({', '.join(f'{x:{fmt}}' for x in v)})")


def pct_cell(values: list[float]) -> str:
  return seeds_cell(values, ".2f", scale=100, unit="%")


def lr_text(x: float) -> str:
  return f"{x:.0e}".replace("e-0", "e-")


def setting(cfg) -> str:
  """What a plot title needs to say which run it shows."""
  t, d = cfg.train, cfg.data
  run = f"{t.steps:,} steps, lr {lr_text(t.learning_rate)}"
  if d.task == "word_problem":
    alphabet = ("generator alphabet" if d.get("alphabet", "group") == "generators"
                else "uniformly drawn elements")
    return f"{d.group}, {alphabet}, words of {d.seq_len}, {run}"
  if d.task == "mqrar":
    return f"MQRAR-N, {d.num_pairs} keys, length {d.seq_len}, {run}"
  if d.task == "flipflop":
    return f"flip-flop, length {d.seq_len}, {cfg.model.num_layers} layer, {run}"
  if d.task == "text":
    m = cfg.model
    return (f"code bytes, trained at {d.seq_len}, {m.num_layers} x {m.d_model} ({m.num_heads} "
            f"heads x {m.head_dim}){_encoding_options(m)}, {run}")
  return run


def _encoding_options(model) -> str:
  """The encoding options a run set (', phase_norm, alpha 0.5'), so that a title tells apart
  folders that differ only there."""
  kw = dict(model.get("encoding_kwargs", {}) or {})
  return "".join(f", {k}" if v is True else f", {k} {v}" for k, v in sorted(kw.items())
                 if v is not False and v is not None)


def seeds_text(n: int) -> str:
  return f"{n} seed{'s' if n != 1 else ''}"


def task_line(cfg) -> str:
  d = cfg.data
  if d.task == "word_problem":
    alphabet = d.get("alphabet", "group")
    what = ("PaTH's generator alphabet: the 3-cycles (0 1 2), (0 1 3), (0 1 4) and their inverses"
            if alphabet == "generators" else "every group element drawn uniformly")
    return (f"- task: {d.group} words of {d.seq_len} letters, {what}; the target at every "
            f"position is the running product ({60 if d.group == 'A5' else 120}-way)")
  if d.task == "mqrar":
    return (f"- task: MQRAR-N-back streams of {d.seq_len} tokens, {d.num_pairs} keys, "
            f"{d.num_values} values, query probability {d.query_prob}")
  if d.task == "flipflop":
    return (f"- task: flip-flop strings of {d.seq_len} tokens; train FFL(0.8), test id FFL(0.8), "
            "sparse FFL(0.98), dense FFL(0.1)")
  if d.task == "text":
    return (f"- task: byte-level held-out Python source; evaluated at "
            f"{', '.join(str(n) for n in cfg.sweep.eval_lengths)} tokens, the same "
            f"{cfg.sweep.eval_tokens:,} tokens at each")
  return f"- task: {d.task}"


def header(cfg, prov: dict, seeds) -> list[str]:
  m, t = cfg.model, cfg.train
  axis = cfg.sweep.get("axis", "") or ""
  swept = ", ".join(str(v) for v in cfg.sweep.get("axis_values", ()))
  layers = f"{swept} layers (swept)" if axis == "model.num_layers" else f"{m.num_layers} layer(s)"
  length = (f"trained at length {cfg.data.seq_len}" if axis != "data.seq_len"
            else f"lengths {swept} (swept)")
  extra = f"; N = {swept} (swept, one model each)" if axis == "data.n_back" else ""
  machine = prov.get("machine_line") or (
      f"{prov['machine']}, jax {prov['jax']}; date {prov['date']}; wall time "
      f"{prov['wall_time_s']} s (sum of training runs {prov.get('train_time_s', '?')} s)")
  return [f"- command: `{prov['command']}`",
          f"- setting: {'runlocal (smoke test only)' if t.steps < 50 else 'full'}",
          task_line(cfg),
          f"- model: {layers}, d_model {m.d_model}, {m.num_heads} heads x head_dim {m.head_dim}, "
          f"block {m.block}, {m.dtype}; {length}{extra}",
          f"- training: {t.steps} steps, batch {t.batch_size}, AdamW lr {t.learning_rate} "
          f"(warmup {t.warmup_steps}, cosine to 10%), weight decay {t.weight_decay}; "
          f"seeds {tuple(seeds)} ({len(seeds)} seed{'s' if len(seeds) != 1 else ''})",
          f"- machine: {machine}"]


def _save(fig, out_dir: str, name: str) -> None:
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, name), dpi=100)
  plt.close(fig)


# --- flip-flop -----------------------------------------------------------------------

SETS = ("id", "sparse", "dense")


def flipflop(results: dict, cfg, out_dir: str | None, img: str, notes: dict) -> list[str]:
  names = list(results)
  rows = [[n] + [pct_cell(results[n][f"{s}_error_per_seed"]) for s in SETS]
          + [f"{results[n]['final_loss']:.4f}"] for n in names]
  if out_dir:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), sharey=True)
    for ax, s in zip(axes, SETS):
      for i, n in enumerate(names):
        per = [100 * v for v in results[n][f"{s}_error_per_seed"]]
        ax.bar(i, np.mean(per), color=plot_style.encoding(n)["color"], width=0.7)
        ax.plot([i] * len(per), per, "o", color="black", markersize=3, markerfacecolor="none")
        ax.text(i, np.mean(per) + 1, f"{np.mean(per):.1f}", ha="center", fontsize=7)
      ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
      ax.set_title(f"{s} error", fontsize=10)
    axes[0].set_ylabel("read error (%): bar = mean, circles = seeds")
    n_seeds = max(len(results[n]["id_error_per_seed"]) for n in names)
    fig.suptitle(f"{setting(cfg)}, {seeds_text(n_seeds)}: read error by test set", fontsize=10)
    _save(fig, out_dir, "errors.png")
  n_test = cfg.eval.num_batches * cfg.eval.batch_size
  return [report.markdown_table(["encoding", "ID error", "sparse OOD error", "dense OOD error",
                                 "train loss, last step (one batch, mean of seeds)"], rows), "",
          "Error = fraction of read answers predicted wrongly (argmax); with several seeds, "
          f"mean ± half the spread (each seed's value); test sets of {n_test} sequences each "
          "at the training length.", "", f"![errors]({img}errors.png)", ""]


# --- length extrapolation ------------------------------------------------------------


RATIO_FACTORS = (8, 16, 32, 128)


def length_ratios(results: dict, name: str, factor: int) -> list[float] | None:
  """Per-seed perplexity at `factor` x the training length over that at 1x (None: not run)."""
  L = results["train_len"]
  per = results.get("per_seed", {}).get(name)
  if per is None:
    e = results["encodings"][name]
    return [e[str(factor * L)] / e[str(L)]] if str(factor * L) in e else None
  return ([a / b for a, b in zip(per[str(factor * L)], per[str(L)])]
          if str(factor * L) in per else None)


def _plot_lengths(results: dict, cfg, lengths: list[int], out_dir: str) -> None:
  """Perplexity and perplexity / 1x against length, and the flat encodings (within 15% of
  their 1x perplexity everywhere) again on a linear axis of their own: on the shared log
  axes they lie within a few percent and hide each other."""
  from matplotlib.ticker import ScalarFormatter

  L, enc, per = results["train_len"], results["encodings"], results.get("per_seed", {})
  flat = [n for n in enc if all(max(length_ratios(results, n, x // L)) < 1.15 for x in lengths
                                if str(x) in enc[n])]
  fig, axes = plt.subplots(1, 3 if flat else 2, figsize=(16 if flat else 11, 5))
  for n in enc:
    st = plot_style.encoding(n)
    xs = [x for x in lengths if str(x) in enc[n]]
    ratios = [length_ratios(results, n, x // L) for x in xs]
    panels = [(axes[0], xs, [enc[n][str(x)] for x in xs],
               [per[n][str(x)] for x in xs] if n in per else None),
              (axes[1], [x // L for x in xs], [np.mean(r) for r in ratios], ratios)]
    if flat and n in flat:  # nudged sideways: equal ratios stay side by side
      nudge = 2 ** plot_style.dodge(flat.index(n), len(flat), width=0.3)
      panels.append((axes[2], [x // L * nudge for x in xs], [np.mean(r) for r in ratios], ratios))
    for ax, x, y, seeds in panels:
      ax.plot(x, y, label=n if ax is axes[0] else None, markersize=5, **st)
      if seeds is not None and n in per:  # every seed inside the band
        ax.fill_between(x, [min(v) for v in seeds], [max(v) for v in seeds], color=st["color"],
                        alpha=0.15, lw=0)
  axes[0].axvline(L, color="gray", lw=0.8)
  axes[0].set(xscale="log", xlabel="evaluation length (bytes)", ylabel="perplexity per byte",
              title="perplexity" + (" (band: min-max over seeds)" if per else ""))
  report.log_or_symlog(axes[0], [v for e in enc.values() for v in e.values()], what="perplexity")
  for ax, title in zip(axes[1:], ("perplexity / perplexity at 1x",
                                  "the flat encodings, linear axis, nudged sideways")):
    ax.axhline(1, color="gray", lw=0.8)
    ax.set(xscale="log", xlabel="evaluation length / training length", title=title)
    ax.set_xticks([x // L for x in lengths], [f"{x // L}x" for x in lengths])
    ax.minorticks_off()
  axes[1].set_yscale("log")
  axes[1].set_ylabel("perplexity / perplexity at 1x")
  for ax in axes[:2]:
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.tick_params(axis="y", which="minor", labelsize=7)
  n_seeds = max(len(v[str(L)]) for v in per.values()) if per else 1
  fig.suptitle(f"{setting(cfg)}, {seeds_text(n_seeds)}", fontsize=10)
  fig.legend(loc="lower center", ncol=min(len(enc), 7), fontsize=8)
  fig.tight_layout(rect=(0, 0.1 if len(enc) > 7 else 0.06, 1, 1))
  fig.savefig(os.path.join(out_dir, "perplexity_vs_length.png"), dpi=100)
  plt.close(fig)


def _spoken(items: list[str]) -> str:
  """'a', 'a and b', 'a, b and c'."""
  return " and ".join([", ".join(items[:-1]), items[-1]]) if len(items) > 1 else items[0]


def length_extrapolation(results: dict, cfg, out_dir: str | None, img: str,
                         notes: dict) -> list[str]:
  L, enc = results["train_len"], results["encodings"]
  lengths = sorted({int(n) for e in enc.values() for n in e})
  factors = [f for f in RATIO_FACTORS if f * L in lengths]
  header = (["encoding"] + [f"ppl @{n} ({n // L}x)" for n in lengths]
            + [f"{f}x / 1x" for f in factors])
  rows = [[n + notes.get(n, "")] + [f"{enc[n][str(x)]:.3f}" for x in lengths]
          + [seeds_cell(length_ratios(results, n, f), ".2f") for f in factors] for n in enc]
  if out_dir:
    _plot_lengths(results, cfg, lengths, out_dir)
  return [report.markdown_table(header, rows), "",
          "Perplexity per byte-level token on held-out stdlib files: at every length the same "
          f"first {cfg.sweep.get('eval_tokens', 0):,} held-out tokens, packed into rows of that "
          "length (experiments/probes/length_eval.py); with several seeds the perplexity columns "
          "are means. "
          + (f"Ratio columns: perplexity at {_spoken([f'{f}x' for f in factors])} the "
             "training length over perplexity at the training length, per seed. " if factors
             else "No ratio columns: the lengths stop short of 8x. ")
          + "The accumulated-rotations paper "
          "(Table 1) trains at 512 and headlines 8K/512 and 65K/512, which are 16x and 128x; "
          "its 4096 and 16384 columns give its 8x and 32x. Our 16x column is the analog of its "
          + ("8K/512 and our 128x of its 65K/512." if 128 in factors
             else "8K/512; nothing here reaches 128x."), "",
          f"![perplexity vs length]({img}perplexity_vs_length.png)", ""]


# --- accuracy against a swept axis (word problems: layers; MQRAR: N) ----------------


def _names(cfg, acc: dict) -> list[str]:
  return ([n for n in cfg.sweep.encodings if n in acc]
          + [n for n in acc if n not in cfg.sweep.encodings])


def accuracy_figure(cfg, acc: dict, per_seed: dict, *, axis_label: str, notes: dict):
  """Accuracy against the swept axis as (fig, ax). Encodings are nudged sideways with hollow
  shrinking markers (equal values stay visible). Several seeds are never drawn as their mean:
  two seeds are two lines; three or more, a median line with min-max bars and every seed."""
  values = [str(v) for v in cfg.sweep.axis_values]
  names = _names(cfg, acc)
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for i, n in enumerate(names):
    st = plot_style.encoding(n)
    have = [v for v in values if v in acc[n]]  # a run still missing is left out, not faked
    xs = [int(v) + plot_style.dodge(i, len(names)) for v in have]
    runs = [[100 * a for a in per_seed[n][v]] for v in have]
    label = n + notes.get(n, "")
    k = min(len(r) for r in runs)
    if k <= 2:
      for j in range(k):
        ax.plot(xs, [r[j] for r in runs], markersize=plot_style.marker_size(i),
                markerfacecolor="none", label=label + (" (each seed)" if k > 1 else "")
                if j == 0 else None, **{**st, "linestyle": st["linestyle"] if j == 0 else ":"})
    else:
      ax.plot(xs, [np.median(r) for r in runs], label=f"{label} (median, min-max, seeds)",
              **{**st, "marker": ""})
      for x, r in zip(xs, runs):
        ax.vlines(x, min(r), max(r), color=st["color"], lw=1)
        ax.plot([x] * len(r), r, linestyle="", marker=st["marker"], color=st["color"],
                markerfacecolor="none", markersize=6)
  ax.axhline(90, color="gray", lw=0.8, ls="--")
  n_seeds = max(len(r) for a in per_seed.values() for r in a.values())
  ax.set(xlabel=axis_label, ylabel="accuracy (%)", ylim=(0, 102),
         title=f"{setting(cfg)}, {seeds_text(n_seeds)}")
  ax.title.set_fontsize(9)
  ax.set_xticks([int(v) for v in values])
  ax.set_xlim(int(values[0]) - 0.5, int(values[-1]) + 0.5)
  ax.legend(fontsize=7)
  return fig, ax


def _accuracy(cfg, out_dir, notes, *, axis_label: str, column, plot: str, acc: dict,
              per_seed: dict, extra_col=None) -> list[str]:
  values = [str(v) for v in cfg.sweep.axis_values]
  names = _names(cfg, acc)
  if out_dir:
    fig, _ = accuracy_figure(cfg, acc, per_seed, axis_label=axis_label, notes=notes)
    _save(fig, out_dir, plot)
  head = ["encoding"] + [column(v) for v in values]
  rows = [[n + notes.get(n, "")] + [pct_cell(per_seed[n][v]) if v in per_seed[n] else "not run"
                                    for v in values] for n in names]
  if extra_col:
    head.append(extra_col[0])
    rows = [r + [extra_col[1](n)] for r, n in zip(rows, names)]
  return [report.markdown_table(head, rows), ""]


def word_problem(results: dict, cfg, out_dir, img, notes) -> list[str]:
  g = results[cfg.data.group]
  last = str(cfg.sweep.axis_values[-1])
  lines = _accuracy(cfg, out_dir, notes, axis_label="layers", column=lambda v: f"{v} layer(s)",
                    plot="accuracy_vs_layers.png", acc=g["accuracy"], per_seed=g["per_seed"],
                    extra_col=("min layers >= 90%",
                               lambda n: str(g["min_layers_90"][n] or f"> {last}")))
  return lines + [
      "Accuracy = per-token accuracy of the running product over all positions of fresh words "
      f"({cfg.eval.num_batches * cfg.eval.batch_size} words); with several seeds, mean ± half the "
      "spread (each seed's value).", "", f"![accuracy vs layers]({img}accuracy_vs_layers.png)", ""]


def mqrar(results: dict, cfg, out_dir, img, notes) -> list[str]:
  lines = _accuracy(cfg, out_dir, notes, axis_label="N (N-back)", column=lambda v: f"N={v}",
                    plot="accuracy_vs_n.png", acc=results["accuracy"],
                    per_seed=results["per_seed"])
  d = cfg.data
  return lines + [
      "Accuracy on the answer tokens of fresh streams "
      f"({cfg.eval.num_batches * cfg.eval.batch_size} streams); {d.num_pairs} keys, "
      f"{d.num_values} values, query probability {d.query_prob}; with several seeds, mean ± half "
      "the spread (each seed's value); the plot draws each seed.", "",
      f"![accuracy vs N]({img}accuracy_vs_n.png)", ""]


SECTIONS = {"flipflop": flipflop, "length_extrapolation": length_extrapolation,
            "word_problem": word_problem, "mqrar": mqrar}


def section(kind: str, results: dict, cfg, out_dir: str | None, *, img: str = "",
            notes: dict | None = None) -> list[str]:
  """The table, its caption and plot link of one results folder (`kind` = the experiment).

  out_dir: where to write the plot (None: the markdown only); img: the plot's path prefix as
  seen from the README that shows it; notes: encoding -> text appended to its table row and
  legend label (say, why a line sits at chance)."""
  if kind not in SECTIONS:
    raise ValueError(f"provenance.json experiment={kind!r} must be one of {tuple(SECTIONS)}")
  return SECTIONS[kind](results, cfg, out_dir, img, notes or {})
