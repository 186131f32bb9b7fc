"""Turns a sweep's run summaries into results.json, README.md and PNG plots, per experiment.

`write(experiment, summaries, config, out_dir, provenance)` dispatches on the experiment
name (config.sweep.experiment). Every summary is experiments.train.run's, plus "seed" and
"axis_value" (experiments/sweeps.py adds them). Seeds are aggregated as mean, per-seed
values and spread (max - min).
"""
from __future__ import annotations

import json
import os
import platform
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments import report  # noqa: E402


def provenance(argv: list[str], wall_s: float, module: str = "experiments.sweeps") -> dict:
  """Command, machine, date and wall time, for the results README."""
  import jax

  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {"command": f"python -m {module} " + " ".join(argv[1:]),
          "machine": f"{jax.devices()[0].platform}, {os.cpu_count()} cores ({cpu}), shared",
          "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
          "wall_time_s": round(wall_s)}


def _metric(summary: dict, set_name: str, metric: str, length: int | None = None) -> float:
  for r in summary["eval"]:
    if r["set"] == set_name and (length is None or r["length"] == length):
      return float(r[metric])
  raise KeyError(f"{summary['encoding']}: no eval record for set {set_name!r} length {length}")


def _by(summaries: list[dict], *keys: str) -> dict:
  out: dict = {}
  for s in summaries:
    out.setdefault(tuple(s[k] for k in keys) if len(keys) > 1 else s[keys[0]], []).append(s)
  return out


def _agg(values: list[float]) -> dict:
  return {"mean": float(np.mean(values)), "per_seed": [float(v) for v in values],
          "spread": float(np.max(values) - np.min(values))}


def _pct(a: dict) -> str:
  s = f"{100 * a['mean']:.2f}%"
  return s + (f" ± {50 * a['spread']:.2f}" if len(a["per_seed"]) > 1 else "")


def _header(title: str, config, prov: dict, setting: str) -> list[str]:
  m, t = config.model, config.train
  return [f"# {title}", "",
          f"- command: `{prov['command']}`",
          f"- setting: {setting}",
          f"- model: {m.num_layers} layer(s), d_model {m.d_model}, {m.num_heads} heads x "
          f"head_dim {m.head_dim}, block {m.block}; trained at length {config.data.seq_len}",
          f"- training: {t.steps} steps, batch {t.batch_size}, AdamW lr {t.learning_rate} "
          f"(warmup {t.warmup_steps}, cosine to 10%), weight decay {t.weight_decay}; "
          f"seeds {tuple(config.sweep.get('seeds', ()) or (t.seed,))}",
          f"- machine: {prov['machine']}, jax {prov['jax']}; date {prov['date']}; "
          f"wall time {prov['wall_time_s']} s (sum of training runs {prov['train_time_s']} s)",
          ""]


def _save(out_dir: str, results: dict, lines: list[str]) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(out_dir, "README.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


def _setting(config) -> str:
  return "runlocal (smoke test only)" if config.train.steps < 50 else "full"


# --- flip-flop ---------------------------------------------------------------------


def flipflop(summaries, config, out_dir, prov) -> tuple[dict, list[str]]:
  results, rows = {}, []
  for name, runs in _by(summaries, "encoding").items():
    r = {f"{s}_error": _agg([_metric(x, s, "error") for x in runs])
         for s in ("id", "sparse", "dense")}
    results[name] = {k: v["mean"] for k, v in r.items()}
    results[name].update({f"{k}_per_seed": v["per_seed"] for k, v in r.items()})
    results[name].update({f"{k}_spread": v["spread"] for k, v in r.items()})
    results[name]["final_loss"] = float(np.mean([x["final_loss"] for x in runs]))
    rows.append([name, _pct(r["id_error"]), _pct(r["sparse_error"]), _pct(r["dense_error"]),
                 f"{results[name]['final_loss']:.4f}"])
  fig, ax = plt.subplots(figsize=(8, 4))
  names = list(results)
  for i, s in enumerate(("id", "sparse", "dense")):
    ax.bar(np.arange(len(names)) + 0.27 * (i - 1), [100 * results[n][f"{s}_error"] for n in names],
           width=0.27, label=s)
  ax.set_xticks(np.arange(len(names)), names, rotation=30, ha="right")
  ax.set(ylabel="read error (%)", title="flip-flop: error by test set (mean over seeds)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "errors.png"), dpi=100)
  plt.close(fig)
  lines = _header("Flip-flop language modelling (PaTH Table 1)", config, prov, _setting(config))
  lines += [report.markdown_table(["encoding", "ID error", "sparse OOD error", "dense OOD error",
                                   "final train loss"], rows), "",
            "Error = fraction of read answers predicted wrongly (argmax), mean over seeds "
            "± half the spread (max - min) across seeds; test sets of "
            f"{config.eval.num_batches * config.eval.batch_size} sequences each at the "
            "training length.", "", "![errors](errors.png)", ""]
  return results, lines


# --- length extrapolation ----------------------------------------------------------


def length_extrapolation(summaries, config, out_dir, prov) -> tuple[dict, list[str]]:
  L = int(config.data.seq_len)
  lengths = sorted({r["length"] for s in summaries for r in s["eval"]})
  enc, per_seed = {}, {}
  for name, runs in _by(summaries, "encoding").items():
    vals = {n: [_metric(x, "valid", "perplexity", n) for x in runs] for n in lengths}
    enc[name] = {str(n): float(np.mean(v)) for n, v in vals.items()}
    per_seed[name] = {str(n): v for n, v in vals.items()}
  results = {"train_len": L, "encodings": enc}
  if any(len(v[str(L)]) > 1 for v in per_seed.values()):
    results["per_seed"] = per_seed
  ratio = lambda name, f: (enc[name][str(f * L)] / enc[name][str(L)]
                           if str(f * L) in enc[name] else float("nan"))
  header = ["encoding"] + [f"ppl @{n} ({n // L}x)" for n in lengths] + ["8x / 1x", "32x / 1x"]
  rows = [[name] + [f"{enc[name][str(n)]:.3f}" for n in lengths]
          + [f"{ratio(name, 8):.2f}", f"{ratio(name, 32):.2f}"] for name in enc]
  fig, ax = plt.subplots(figsize=(7, 5))
  colors = plt.get_cmap("tab20")(np.linspace(0, 1, max(len(enc), 2)))  # 13+ distinct lines
  for color, name in zip(colors, enc):
    ax.plot(lengths, [enc[name][str(n)] for n in lengths], marker="o", label=name, color=color,
            linestyle="--" if name.endswith("_v") else "-")
  ax.axvline(L, color="gray", lw=0.8)
  ax.set(xscale="log", xlabel="evaluation length (bytes)", ylabel="perplexity",
         title=f"length extrapolation, trained at {L}")
  # Perplexity is exp(loss) >= 1, so this stays a log axis; a value <= 0 (a bug upstream)
  # would switch it to symlog with a note rather than vanish from the plot.
  report.log_or_symlog(ax, [v for e in enc.values() for v in e.values()], what="perplexity")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "perplexity_vs_length.png"), dpi=100)
  plt.close(fig)
  lines = _header("Length extrapolation on the code corpus (acc_rot Table 1, TAPA Tables 1-2)",
                  config, prov, _setting(config))
  lines += [report.markdown_table(header, rows), "",
            "Perplexity per byte-level token on held-out stdlib files: at every length the same "
            f"first {config.sweep.get('eval_tokens', 0)} held-out tokens, packed into rows of "
            "that length (experiments/probes/length_eval.py). Ratio columns: perplexity at 8x / 32x "
            "the training length over perplexity at the training length (acc_rot Table 1's "
            "8K/512 and 65K/512 columns, at our scale 8x and 32x).", "",
            "![perplexity vs length](perplexity_vs_length.png)", ""]
  return results, lines


# --- accuracy vs an axis (word problems: layers; MQRAR: N) --------------------------


def _accuracy_vs_axis(summaries, config, out_dir, *, axis_label: str, title: str, plot: str,
                      set_name: str = "test"):
  enc, table = {}, {}
  for (name, v), runs in sorted(_by(summaries, "encoding", "axis_value").items(),
                                key=lambda kv: (list(config.sweep.encodings).index(kv[0][0]),
                                                kv[0][1])):
    a = _agg([_metric(x, set_name, "accuracy") for x in runs])
    enc.setdefault(name, {})[str(v)] = a["mean"]
    table.setdefault(name, {})[str(v)] = a
  values = [str(v) for v in config.sweep.axis_values]
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, accs in enc.items():
    have = [v for v in values if v in accs]  # a run still missing is left out, not faked
    ax.plot([int(v) for v in have], [100 * accs[v] for v in have], marker="o", label=name)
  ax.axhline(90, color="gray", lw=0.8, ls="--")
  ax.set(xlabel=axis_label, ylabel="accuracy (%)", title=title, ylim=(0, 101))
  ax.set_xticks([int(v) for v in values])
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, plot), dpi=100)
  plt.close(fig)
  rows = [[name] + [_pct(table[name][v]) if v in table[name] else "not run" for v in values]
          for name in enc]
  return enc, table, values, rows


def word_problem(summaries, config, out_dir, prov):
  enc, table, values, rows = _accuracy_vs_axis(
      summaries, config, out_dir, axis_label="layers", plot="accuracy_vs_layers.png",
      title=f"{config.data.group} word problem, length {config.data.seq_len}")
  min_depth = {n: next((int(v) for v in values if a.get(v, 0) >= 0.9), None)
               for n, a in enc.items()}
  results = {config.data.group: {"accuracy": enc, "min_layers_90": min_depth,
                                 "per_seed": {n: {v: t["per_seed"] for v, t in a.items()}
                                              for n, a in table.items()}}}
  lines = _header(f"{config.data.group} word problem (PaTH Fig. 2 bottom)", config, prov,
                  _setting(config))
  lines += [report.markdown_table(["encoding"] + [f"{v} layer(s)" for v in values]
                                  + ["min layers >= 90%"],
                                  [r + [str(min_depth[r[0]] or f"> {values[-1]}")] for r in rows]),
            "", "Accuracy = per-token accuracy of the running product over all positions of "
            f"fresh words ({config.eval.num_batches * config.eval.batch_size} words).", "",
            "![accuracy vs layers](accuracy_vs_layers.png)", ""]
  return results, lines


def mqrar(summaries, config, out_dir, prov):
  enc, table, values, rows = _accuracy_vs_axis(
      summaries, config, out_dir, axis_label="N (N-back)", plot="accuracy_vs_n.png",
      title=f"MQRAR-N, {config.data.num_pairs} keys, length {config.data.seq_len}")
  results = {"accuracy": enc, "per_seed": {n: {v: t["per_seed"] for v, t in a.items()}
                                           for n, a in table.items()}}
  lines = _header("MQRAR-N-back (PaTH Fig. 2 top)", config, prov, _setting(config))
  lines += [report.markdown_table(["encoding"] + [f"N={v}" for v in values], rows), "",
            "Accuracy on the answer tokens of fresh streams "
            f"({config.eval.num_batches * config.eval.batch_size} streams); "
            f"{config.data.num_pairs} keys, {config.data.num_values} values, query "
            f"probability {config.data.query_prob}.", "",
            "![accuracy vs N](accuracy_vs_n.png)", ""]
  return results, lines


WRITERS = {"flipflop": flipflop, "length_extrapolation": length_extrapolation,
           "word_problem": word_problem, "mqrar": mqrar}


def write(experiment: str, summaries: list[dict], config, out_dir: str, prov: dict,
          extra_lines: list[str] = ()) -> dict:
  if experiment not in WRITERS:
    raise ValueError(f"config.sweep.experiment={experiment!r} must be one of {tuple(WRITERS)}")
  os.makedirs(out_dir, exist_ok=True)
  results, lines = WRITERS[experiment](summaries, config, out_dir, prov)
  save_with_notes(out_dir, results, list(lines) + runs_table(summaries) + list(extra_lines))
  return results


SUMMARIES = "summaries.json"


def summary_key(s: dict) -> tuple:
  return (s["encoding"], s.get("seed"), s.get("axis_value"))


def merge_summaries(out_dir: str, summaries: list[dict], *, fingerprint: str,
                    log=print) -> list[dict]:
  """This sweep's summaries plus those already in out_dir/summaries.json from earlier
  invocations of the same experiment config (same `fingerprint`; runs of another config are
  dropped, with a note). A run in both keeps the new summary. Writes the merged list back.

  This is what lets one results directory gather runs made in several device calls, each
  training a subset of the encodings (`encodings=A+B`)."""
  path = os.path.join(out_dir, SUMMARIES)
  old = []
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
  new = [dict(s, config_fingerprint=fingerprint) for s in summaries]
  keys = {summary_key(s) for s in new}
  kept = [s for s in old if s.get("config_fingerprint") == fingerprint and summary_key(s) not in keys]
  dropped = [s for s in old if s.get("config_fingerprint") != fingerprint]
  if dropped:
    log(f"{path}: {len(dropped)} earlier run(s) of another config dropped "
        f"({sorted({s['encoding'] for s in dropped})})")
  merged = kept + new
  os.makedirs(out_dir, exist_ok=True)
  with open(path, "w") as f:
    json.dump(merged, f, indent=1)
  return merged


def gather_summaries(dirs, *, fingerprint: str, log=print) -> list[dict]:
  """The summaries of the results directories `dirs` (each written by a sweep of this config
  with --results), for sweeps run side by side (say one per encoding on one GPU) and gathered
  afterwards. A directory's runs of another config are left out, with a note."""
  out = []
  for d in dirs:
    path = os.path.join(d, SUMMARIES)
    if not os.path.exists(path):
      raise ValueError(f"--gather: {path} does not exist (no sweep wrote results there)")
    with open(path) as f:
      runs = json.load(f)
    other = [s for s in runs if s.get("config_fingerprint") != fingerprint]
    if other:
      log(f"{path}: {len(other)} run(s) of another config left out "
          f"({sorted({s['encoding'] for s in other})})")
    out += [s for s in runs if s.get("config_fingerprint") == fingerprint]
  return out


def gathered_provenance(argv: list[str], summaries: list[dict]) -> dict:
  """provenance() for gathered runs: their devices and jax, the last one's finish, and the wall
  time from the first start to the last finish (runs side by side overlap)."""
  timed = [(time.mktime(time.strptime(s["finished"], "%Y-%m-%d %H:%M UTC")),
            s.get("wall_time_s", 0)) for s in summaries if s.get("finished", "").endswith("UTC")]
  join = lambda key: ", ".join(sorted({str(s.get(key, "?")) for s in summaries}))  # noqa: E731
  return {"command": "python -m experiments.sweeps " + " ".join(argv[1:]),
          "machine": f"{join('device')} ({len(summaries)} runs gathered from side-by-side sweeps)",
          "jax": join("jax"),
          "date": max(s.get("finished", "?") for s in summaries) if summaries else "?",
          "wall_time_s": round(max(e for e, _ in timed) - min(e - w for e, w in timed))
                         if timed else 0}


def runs_table(summaries: list[dict]) -> list[str]:
  """Where each run trained: device, date, wall time, tokens seen, command (when recorded)."""
  if not any("device" in s for s in summaries):
    return []
  axis = any(s.get("axis_value") is not None for s in summaries)
  header = ["encoding", "seed"] + (["axis"] if axis else []) + [
      "device", "finished", "wall s", "tokens seen", "command"]
  rows = []
  for s in summaries:
    rows.append([s["encoding"], str(s.get("seed", ""))] + ([str(s.get("axis_value"))] if axis else [])
                + [s.get("device", "?"), s.get("finished", "?"), f"{s.get('wall_time_s', 0):.0f}",
                   f"{s.get('tokens_seen', 0):,}", f"`{s['command']}`" if s.get("command") else ""])
  return ["## Runs", "", report.markdown_table(header, rows), ""]


def save_with_notes(out_dir: str, results: dict, lines: list[str]) -> None:
  """Writes results.json and README.md = the generated lines + the hand-written NOTES.md."""
  notes = os.path.join(out_dir, "NOTES.md")
  if os.path.exists(notes):  # hand-written discussion, kept across regenerations
    with open(notes) as f:
      lines = list(lines) + ["", f.read()]
  _save(out_dir, results, lines)
