"""Turns a sweep's run summaries into a results folder's data: results.json and provenance.json
(experiments/results_pages.write_results then draws README.md and the PNG plots from them).

`aggregate(experiment, summaries, config)` dispatches on the experiment name
(config.sweep.experiment). Every summary is experiments.train.run's, plus "seed" and
"axis_value" (experiments/sweeps.py adds them). Seeds are aggregated as mean, per-seed
values and spread (max - min). Also here: gathering the runs of several invocations into one
folder (merge_summaries, gather_summaries) and the README's Runs table.
"""
from __future__ import annotations

import json
import os
import platform
import time

import numpy as np

from experiments import report


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
          "machine": f"{_devices()}, {os.cpu_count()} cores ({cpu}), shared",
          "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
          "wall_time_s": round(wall_s)}


def _devices() -> str:
  """'cpu', or the accelerator's kind and count ('NVIDIA H200 x4')."""
  import jax
  d = jax.devices()[0]
  return d.platform if d.platform == "cpu" else f"{d.device_kind} x{jax.device_count()}"


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


# Aggregation: summaries -> results.json, one function per experiment. The README and plots
# are drawn from results.json alone (experiments/results_render.py), so these decide every
# number a reader sees.


def flipflop(summaries, config) -> dict:
  results = {}
  for name, runs in _by(summaries, "encoding").items():
    r = {f"{s}_error": _agg([_metric(x, s, "error") for x in runs])
         for s in ("id", "sparse", "dense")}
    results[name] = {k: v["mean"] for k, v in r.items()}
    results[name].update({f"{k}_per_seed": v["per_seed"] for k, v in r.items()})
    results[name].update({f"{k}_spread": v["spread"] for k, v in r.items()})
    results[name]["final_loss"] = float(np.mean([x["final_loss"] for x in runs]))
  return results


def length_extrapolation(summaries, config) -> dict:
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
  return results


def _accuracy_vs_axis(summaries, config, set_name: str = "test"):
  enc, table = {}, {}
  for (name, v), runs in sorted(_by(summaries, "encoding", "axis_value").items(),
                                key=lambda kv: (list(config.sweep.encodings).index(kv[0][0]),
                                                kv[0][1])):
    a = _agg([_metric(x, set_name, "accuracy") for x in runs])
    enc.setdefault(name, {})[str(v)] = a["mean"]
    table.setdefault(name, {})[str(v)] = a
  per_seed = {n: {v: t["per_seed"] for v, t in a.items()} for n, a in table.items()}
  return enc, per_seed


def word_problem(summaries, config) -> dict:
  enc, per_seed = _accuracy_vs_axis(summaries, config)
  values = [str(v) for v in config.sweep.axis_values]
  min_depth = {n: next((int(v) for v in values if a.get(v, 0) >= 0.9), None)
               for n, a in enc.items()}
  return {config.data.group: {"accuracy": enc, "min_layers_90": min_depth, "per_seed": per_seed}}


def mqrar(summaries, config) -> dict:
  enc, per_seed = _accuracy_vs_axis(summaries, config)
  return {"accuracy": enc, "per_seed": per_seed}


AGGREGATE = {"flipflop": flipflop, "length_extrapolation": length_extrapolation,
             "word_problem": word_problem, "mqrar": mqrar}


def aggregate(experiment: str, summaries: list[dict], config) -> dict:
  if experiment not in AGGREGATE:
    raise ValueError(f"config.sweep.experiment={experiment!r} must be one of {tuple(AGGREGATE)}")
  return AGGREGATE[experiment](summaries, config)


PROVENANCE = "provenance.json"


def save_results(out_dir: str, experiment: str, results: dict, config, prov: dict) -> None:
  """results.json, and provenance.json: the command, machine and date (`prov`) and the
  experiment's config as it ran, which is all the README and plots need besides the results."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(out_dir, PROVENANCE), "w") as f:
    json.dump({"experiment": experiment, **prov, "config": config.to_dict()}, f, indent=1,
              default=str)
    f.write("\n")


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
  kept = [s for s in old
          if s.get("config_fingerprint") == fingerprint and summary_key(s) not in keys]
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


def gathered_provenance(argv: list[str], summaries: list[dict],
                        module: str = "experiments.sweeps") -> dict:
  """provenance() for gathered runs: their devices and jax, the last one's finish, and the wall
  time from the first start to the last finish (runs side by side overlap)."""
  timed = [(time.mktime(time.strptime(s["finished"], "%Y-%m-%d %H:%M UTC")),
            s.get("wall_time_s", 0)) for s in summaries if s.get("finished", "").endswith("UTC")]
  join = lambda key: ", ".join(sorted({str(s.get(key, "?")) for s in summaries}))  # noqa: E731
  return {"command": f"python -m {module} " + " ".join(argv[1:]),
          "machine": f"{join('device')} ({len(summaries)} runs gathered)",
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
    rows.append([s["encoding"], str(s.get("seed", ""))]
                + ([str(s.get("axis_value"))] if axis else [])
                + [s.get("device", "?"), s.get("finished", "?"), f"{s.get('wall_time_s', 0):.0f}",
                   f"{s.get('tokens_seen', 0):,}", f"`{s['command']}`" if s.get("command") else ""])
  return ["## Runs", "", report.markdown_table(header, rows), ""]
