r"""Paper-reproduction sweeps: encodings x seeds (x one more axis), then results files.

  python -m experiments.sweeps --config=experiments/configs/flipflop.py[:arg] \
      --workdir=DIR [--results=experiments/results/flipflop]
  python -m experiments.sweeps --config=...[:arg] --results=OUT --gather=PART1,PART2,...

Extends experiments/main.py (which sweeps encodings only) with three config fields:

  sweep.encodings   encodings to compare (required here)
  sweep.seeds       train.seed values; every encoding gets the same seeds (same data order
                    and the same initialisation key, so encodings differ only by encoding)
  sweep.axis        optional dotted config field to vary as well (e.g. "model.num_layers",
                    "data.n_back"), with sweep.axis_values
  sweep.experiment  the name of the results builder in experiments/results_writers.py
  sweep.eval_tokens optional: after training, evaluate each checkpoint at sweep.eval_lengths
                    on the same eval_tokens held-out tokens per length (batches of
                    sweep.eval_batch_tokens tokens; experiments/probes/length_eval.py);
                    these records replace the run's own final evaluation

Setting a swept field on the command line runs that value only: --config.model.encoding=path
trains path alone, --config.train.seed=3 seed 3 alone, --config.model.num_layers=2 (with
sweep.axis "model.num_layers") that layer count alone; a note on stderr says so.

Each run trains with experiments.train.run into DIR/[<axis>=<v>/]<encoding>/seed<s>/ (a
second invocation resumes or skips finished runs) and DIR/summaries.json collects every
run's summary. With --results, the experiment's writer turns the summaries into
results.json, README.md (a markdown table) and PNG plots there; the README records the
command, machine, date and total wall time, and a Runs table each run's device, date, wall
time and tokens seen. The results directory keeps its summaries.json: a later invocation of
the same config (say, other encodings in another device call) adds its runs to the same
table instead of replacing it.

Small models leave most of a GPU idle: `--side_by_side=N` trains the sweep's unfinished runs
in N processes at once (each its share, round robin; logs in DIR/side_by_side.<i>.log), then
writes --results from all of them. Sweeps run separately (other machines, other calls) can
also be merged: each with its own workdir and --results directory, `--gather=DIR,...` then
merges their runs into one --results directory without training, and its README gives the
span from the first run's start to the last one's finish as the wall time. With
sweep.eval_tokens, each run's length evaluation is kept in RUN/length_eval.json and reused by
later invocations while its lengths, token counts and checkpoint step are unchanged.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import signal
import subprocess
import sys
import time

from absl import app
from absl import flags

from experiments import cli_config


def _set(config, dotted: str, value) -> None:
  *parents, leaf = dotted.split(".")
  node = config
  for p in parents:
    if not hasattr(node, "keys") or p not in node:
      raise ValueError(f"config.sweep.axis={dotted!r} names no config field")
    node = node[p]
  if not hasattr(node, "keys") or leaf not in node:
    raise ValueError(f"config.sweep.axis={dotted!r} names no config field")
  node[leaf] = value


def swept_fields(config) -> dict[str, str]:
  """The fields this config's sweep varies -> the sweep field listing their values: set on
  the command line (--config.train.seed=3), such a field narrows its sweep to that value."""
  swept = {**cli_config.ENCODING_SWEEP, "train.seed": "sweep.seeds"}
  if config.sweep.get("axis"):
    swept[config.sweep.axis] = "sweep.axis_values"
  return swept


def plan_runs(config, workdir: str) -> list[dict]:
  """[{config, workdir, encoding, seed, axis_value}] for every run of the sweep."""
  from experiments import config_fields

  config_fields.check_fields(config)
  encodings = tuple(config.sweep.encodings)
  if not encodings:
    raise ValueError("config.sweep.encodings is empty; an experiment compares encodings")
  seeds = tuple(config.sweep.get("seeds", ()) or (config.train.seed,))
  axis = config.sweep.get("axis", "") or ""
  values = tuple(config.sweep.get("axis_values", ())) if axis else (None,)
  runs = []
  for v in values:
    for name in encodings:
      for s in seeds:
        c = copy.deepcopy(config)
        with c.unlocked():
          c.sweep.encodings = ()
          c.model.encoding = name
          c.train.seed = int(s)
          if axis:
            _set(c, axis, v)
        sub = os.path.join(*([f"{axis.split('.')[-1]}={v}"] if axis else []), name, f"seed{s}")
        runs.append({"config": c, "workdir": os.path.join(workdir, sub), "encoding": name,
                     "seed": int(s), "axis_value": v})
  return runs


# Fields that pick which runs to make (--config.train.seed=2 narrows a sweep to seed 2, as
# sweep.seeds does), or say only how a run is executed, not what it computes.
_NOT_FINGERPRINTED = {"sweep": ("encodings", "seeds", "axis_values"), "train": ("seed",
                      "compile_cache_dir", "allow_config_change"),
                      "data": ("read_threads", "prefetch_batches"), "": ("distributed", "mesh")}


def config_fingerprint(config) -> str:
  """What an experiment config computes, as a short hash: runs with equal fingerprints belong
  in one results table. `config` is a ConfigDict or its to_dict() (a results folder's stored
  provenance config). Left out: the fields of _NOT_FINGERPRINTED, and every field at the base
  config's default, so that a field added to the config later, at a default that changes
  nothing, leaves the fingerprints of the runs made before it unchanged."""
  import hashlib

  def changed(d, default):
    return {k: (changed(v, default[k]) if isinstance(v, dict) and isinstance(default.get(k), dict)
                else v) for k, v in d.items() if k not in default or v != default[k]}

  d = _plain(config.to_dict() if hasattr(config, "to_dict") else config)
  for section, names in _NOT_FINGERPRINTED.items():
    node = d.get(section, {}) if section else d
    for name in names:
      node.pop(name, None)
  d = changed(d, _base_defaults())
  return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _plain(d: dict) -> dict:
  return json.loads(json.dumps(d, default=str))   # tuples -> lists, as stored configs hold


@functools.cache
def _base_defaults() -> dict:
  """The base config's fields as plain JSON values, built once (read, never changed)."""
  from experiments.configs import base
  return _plain(base.get_config().to_dict())


def run_sweep(config, workdir: str, *, log=print, only=None) -> list[dict]:
  """Trains every run of the sweep (skipping finished ones); returns their summaries.

  only: indices into plan_runs' list, for one worker of --side_by_side: it trains (and
  evaluates) those runs and leaves DIR/summaries.json to the parent."""
  import jax

  from experiments import config_checks
  from experiments import data
  from experiments import train

  runs = plan_runs(config, workdir)
  if only is not None:
    keep = set(only)
    runs = [r for i, r in enumerate(runs) if i in keep]
  checked = [config_checks.check(r["config"], workdir=r["workdir"], data_module=data,
                                 num_devices=jax.device_count()) for r in runs]
  summaries, interrupted = [], False
  for r, mcfg in zip(runs, checked):
    done = _summary_path(r)
    if os.path.exists(done):
      with open(done) as f:
        summary = json.load(f)
    else:
      summary = train.run(r["config"], r["workdir"], data_module=data, mcfg=mcfg)
      if summary["interrupted"]:  # its checkpoint resumes it; the finished runs are kept
        log(f"{r['workdir']}: interrupted at step {summary.get('step', '?')}; "
            f"{len(summaries)} finished run(s) kept")
        interrupted = True
        break
    if config.sweep.get("eval_tokens"):  # equal-token evaluation at every length
      summary["eval"] = _length_eval(config, r, step=summary.get("step"))
    summary.update(seed=r["seed"], axis_value=r["axis_value"], workdir=r["workdir"])
    log(f"{r['workdir']}: final loss {summary['final_loss']:.4f} "
        f"({summary['wall_time_s']:.0f} s)")
    summaries.append(summary)
  if only is None:
    with open(os.path.join(workdir, "summaries.json"), "w") as f:
      json.dump(summaries, f, indent=1)
  if interrupted:
    raise Interrupted(summaries)
  return summaries


LENGTH_EVAL = "length_eval.json"


def _summary_path(run: dict) -> str:
  """RUN/summary.json, which train.run writes when the run has finished."""
  return os.path.join(run["workdir"], "summary.json")


def _length_eval(config, run: dict, *, step) -> dict:
  """The run's perplexity at every sweep.eval_lengths (experiments/probes/length_eval.py),
  kept in RUN/length_eval.json with what it was computed from, so a later invocation (a
  gather, the parent of --side_by_side, more encodings into the same results) reuses it
  unless the lengths, token counts or checkpoint step differ."""
  from experiments.probes import length_eval

  key = {"lengths": list(config.sweep.eval_lengths), "tokens": config.sweep.eval_tokens,
         "batch_tokens": config.sweep.eval_batch_tokens, "step": step}
  path = os.path.join(run["workdir"], LENGTH_EVAL)
  try:
    with open(path) as f:
      cached = json.load(f)
    if cached.get("key") == key:
      return cached["eval"]
  except (OSError, ValueError):
    pass  # missing or unreadable: evaluate again
  result = length_eval.evaluate_lengths(
      run["config"], run["workdir"], lengths=tuple(config.sweep.eval_lengths),
      tokens=config.sweep.eval_tokens, batch_tokens=config.sweep.eval_batch_tokens)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"key": key, "eval": result}, f)
  os.replace(tmp, path)
  return result


class SideBySideError(RuntimeError):
  """A --side_by_side worker exited with an error (its log names why)."""


# How long stopped workers get to save their checkpoints before they are killed. A worker
# acts on SIGTERM only between training steps; inside a compile or a long evaluation it would
# keep the whole sweep (and a `timeout` around it) waiting. A killed run resumes from its last
# intact checkpoint, as after any crash.
STOP_GRACE_S = 30.0


def stop_workers(procs, *, grace_s: float, log=print) -> None:
  """SIGTERM to every worker, then SIGKILL to those still running after grace_s seconds."""
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      log(f"worker {p.pid} still running {grace_s:.0f} s after SIGTERM: killed (its run resumes "
          "from its last checkpoint)")
      p.kill()
      p.wait()


def side_by_side(argv: list[str], runs: list[dict], workers: int, workdir: str, *,
                 log=print) -> None:
  """Trains the unfinished runs in `workers` processes at once on this machine's devices
  (small models leave most of a GPU idle), each a `python -m experiments.sweeps` with the same
  arguments and --run_indices (its share, round robin); returns when all have finished.
  Each worker's output goes to WORKDIR/side_by_side.<i>.log. Unless set already, each gets
  XLA_PYTHON_CLIENT_MEM_FRACTION = 0.9 / workers. SideBySideError naming the logs of the
  workers that failed; SIGTERM / Ctrl-C stop every worker (stop_workers: killed if still running
  STOP_GRACE_S later; their runs resume from checkpoints)."""
  pending = [i for i, r in enumerate(runs) if not os.path.exists(_summary_path(r))]
  if not pending:
    return
  groups = [pending[i::workers] for i in range(min(workers, len(pending)))]
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / len(groups):.3f}")
  base_argv = _without(argv[1:], ("side_by_side", "results"))
  os.makedirs(workdir, exist_ok=True)
  procs = []
  for i, group in enumerate(groups):
    log_path = os.path.join(workdir, f"side_by_side.{i}.log")
    cmd = [sys.executable, "-m", "experiments.sweeps", *base_argv,
           f"--run_indices={','.join(map(str, group))}"]
    with open(log_path, "w") as out:
      procs.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env),
                    log_path))
    log(f"worker {i}: runs {', '.join(runs[j]['workdir'] for j in group)} (log {log_path})")

  def stop(signum, frame):
    stop_workers([p for p, _ in procs], grace_s=STOP_GRACE_S, log=log)
    raise SystemExit(143)

  previous = signal.signal(signal.SIGTERM, stop)
  try:
    codes = [(log_path, p.wait()) for p, log_path in procs]
  except KeyboardInterrupt:
    stop(signal.SIGINT, None)
  finally:
    signal.signal(signal.SIGTERM, previous)
  failed = [(path, rc) for path, rc in codes if rc != 0]
  if failed:
    raise SideBySideError("side-by-side workers failed: " + "; ".join(
        f"{path} (exit {rc})" for path, rc in failed) + "; the same command resumes them")


def _without(args: list[str], names: tuple[str, ...]) -> list[str]:
  """args without the flags `names` (--name=value, or --name value)."""
  out, skip = [], False
  for a in args:
    if skip:
      skip = False
    elif a in tuple(f"--{n}" for n in names):
      skip = True
    elif not a.startswith(tuple(f"--{n}=" for n in names)):
      out.append(a)
  return out


class Interrupted(SystemExit):
  """A run of the sweep was interrupted (its checkpoint resumes it); `.summaries` holds the
  runs that finished before it, so their results can still be written."""

  def __init__(self, summaries: list[dict]):
    super().__init__(143)
    self.summaries = summaries


def _gather(config, dirs, results) -> None:
  """--gather: no training; the runs in `dirs` (sweeps of this config that ran side by side,
  each with its own --results) merged into `results`, and its files written."""
  from experiments import results_writers

  if not results:
    raise app.UsageError("--gather needs --results (where the gathered runs go)")
  try:
    summaries = results_writers.gather_summaries(dirs, fingerprint=config_fingerprint(config))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  prov = results_writers.gathered_provenance(sys.argv, summaries)
  _write_results(config, summaries, results, prov)


def _write_results(config, summaries, results: str, prov: dict) -> None:
  """This invocation's runs merged with those already in `results`, and its files written."""
  from experiments import results_pages
  from experiments import results_writers

  summaries = results_writers.merge_summaries(results, summaries,
                                              fingerprint=config_fingerprint(config))
  prov["train_time_s"] = round(sum(s["wall_time_s"] for s in summaries))
  results_pages.write_results(config.sweep.experiment, summaries, config, results, prov)
  print(f"results: {results} ({len(summaries)} runs)")


def main(argv) -> None:
  cli_config.start(argv)
  from experiments import results_writers

  config, workdir = _CONFIG.value, _WORKDIR.value
  if _GATHER.value:
    _gather(config, _GATHER.value, _RESULTS.value)
    return
  if not workdir:
    raise app.UsageError("--workdir is required (except with --gather)")
  from experiments import compilation
  compilation.enable_cache(config.train.get("compile_cache_dir"))
  started = time.time()
  interrupted = None
  try:
    for note in cli_config.follow_explicit(config, cli_config.explicit_fields(),
                                           swept=swept_fields(config)):
      print(note, file=sys.stderr)
    experiment = config.sweep.get("experiment")
    if _RESULTS.value and experiment not in results_writers.AGGREGATE:
      raise ValueError(f"config.sweep.experiment={experiment!r} must be one of "
                       f"{tuple(results_writers.AGGREGATE)} to write --results")
    if _SIDE_BY_SIDE.value > 1 and not _RUN_INDICES.value:
      side_by_side(sys.argv, plan_runs(config, workdir), _SIDE_BY_SIDE.value, workdir)
    only = [int(i) for i in _RUN_INDICES.value] if _RUN_INDICES.value else None
    summaries = run_sweep(config, workdir, only=only)
    if only is not None:  # a worker of --side_by_side: its parent writes the results
      return
  except (ValueError, SideBySideError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except Interrupted as e:  # write what finished, then exit as interrupted
    summaries, interrupted = e.summaries, e
  if _RESULTS.value and summaries:
    prov = results_writers.provenance(sys.argv, time.time() - started)
    for s in summaries:
      s.setdefault("command", prov["command"])
    _write_results(config, summaries, _RESULTS.value, prov)
  if interrupted is not None:
    raise interrupted


if __name__ == "__main__":
  # Flags are defined only when run as a program, so the modules import side-effect free.
  _CONFIG = cli_config.define_config_flag()
  _WORKDIR = flags.DEFINE_string("workdir", None, "Directory holding one sub-directory per run.")
  _RESULTS = flags.DEFINE_string("results", None, "Write results.json/README.md/plots here.")
  _GATHER = flags.DEFINE_list(
      "gather", [], "Results directories of sweeps of this config that ran side by side: "
      "merge their runs into --results instead of training (no --workdir needed).")
  _SIDE_BY_SIDE = flags.DEFINE_integer(
      "side_by_side", 1, "Train the sweep's unfinished runs in this many processes at once on "
      "this machine (each its share of the runs), then write --results from all of them.")
  _RUN_INDICES = flags.DEFINE_list("run_indices", [], "(internal: one side-by-side worker's "
                                   "runs, indices into the sweep's plan)")
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=cli_config.parse_flags)
