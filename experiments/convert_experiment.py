r"""The conversion experiment of issue 52 (the PaTH paper's §4.3 at our scale), end to end.

  python -m experiments.convert_experiment --size=cpu --workdir=workdirs/convert \
      --results=experiments/results/convert [--students=path,path_fox]

Every run is one of configs/convert.py's, at --size (cpu: its default size, runlocal, gpu):

  teacher             a RoPE model trained on the byte-level text corpus (run=teacher)
  <s>_converted       the teacher converted to student s by the two-stage distillation
  path_converted_early
                      the teacher's halfway checkpoint converted to path, its stage 2 longer
                      by the teacher's second half, so that it ends at path_converted's
                      total tokens ("ossification": is a teacher trained longer harder to
                      convert?)
  rope_scratch, path_scratch
                      RoPE and PaTH trained from scratch for the teacher's tokens plus the
                      conversion's (run=scratch): equal total tokens
  probe_<run>         each run above fine-tuned on flip-flop in byte tokens from its
                      parameters (run=probe): a state-tracking probe

--seeds=N repeats all of it with seeds 0 .. N-1 (WORKDIR/seed<n>/, the teacher too);
--first_seed=K makes them K .. K+N-1, so that seeds can train on different machines. Runs
already finished in --workdir are not run again (each resumes where it stopped), so the
command can be repeated across device calls. --results gets results.json (held-out loss per
run and evaluation length, the probe's read errors, tokens, device and wall time per run) and
provenance.json; its README and plot are then written (experiments/convert_pages.py, through
experiments.results_pages). A --results folder that already holds seeds of the same
experiment keeps them: the new seeds are added beside them, or replace those of the same seed.

  python -m experiments.convert_experiment --size=gpu --results=experiments/results/convert_gpu \
      --gather=PARTS/seed1,PARTS/seed2

trains nothing: it adds the finished seed folders made elsewhere (WORKDIR/seed<n>/, copied
back without their checkpoints) to --results.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from experiments.configs import convert as convert_config

EXPERIMENT = "convert"
PROBE_SETS = ("id", "sparse", "dense")


def plan(size: str, workdir: str, students) -> list[tuple[str, str, str]]:
  """(run name, its configs/convert.py arg, module: "main" | "convert"), in the order they run
  (a conversion after its teacher, a probe after its run)."""
  prefix = "" if size == "cpu" else f"{size},"
  teacher = os.path.join(workdir, "teacher")
  runs = [("teacher", f"{prefix}run=teacher", "main")]
  runs += [(f"{s}_converted", f"{prefix}teacher={teacher},encoding={s}", "convert")
           for s in students]
  runs += [("path_converted_early", f"{prefix}teacher={teacher},encoding=path,teacher_step="
            f"{convert_config.SIZES[size]['teacher'][0] // 2}", "convert"),
           ("rope_scratch", f"{prefix}run=scratch,encoding=rope", "main"),
           ("path_scratch", f"{prefix}run=scratch,encoding=path", "main")]
  probes = [(f"probe_{name}", f"{prefix}run=probe,init={os.path.join(workdir, name)}", "main")
            for name, _, _ in runs]
  return runs + probes


def early_extra_steps(size: str) -> int:
  """Stage-2 steps that give the early conversion the tokens of the teacher's second half, so
  that both conversions end at the same total tokens: what the teacher trained on after its
  halfway checkpoint, in stage-2 batches."""
  z = convert_config.SIZES[size]
  (t_steps, t_batch, t_len), (_, kl_batch, kl_len) = z["teacher"], z["kl"]
  return (t_steps - t_steps // 2) * t_batch * t_len // (kl_batch * kl_len)


def run_all(size: str, workdir: str, students, *, seed: int = 0, log=print) -> dict[str, dict]:
  """Trains every run of plan() not yet finished, each with train.seed = seed; returns {run
  name: its summary}."""
  from experiments import cli_config
  from experiments import convert
  from experiments import data
  from experiments import train
  summaries = {}
  for name, arg, module in plan(size, workdir, students):
    wd = os.path.join(workdir, name)
    started = time.perf_counter()
    config = convert_config.get_config(arg)
    config.train.seed = seed
    if name == "path_converted_early":   # equal total tokens with the late conversion
      config.train.steps += early_extra_steps(size)
    runner = convert.run if module == "convert" else train.run
    # One `error:` line for a config or workdir problem, as the other command lines.
    summaries[name] = cli_config.finish_run(lambda: runner(config, wd, data_module=data), wd,
                                            config_errors=(ValueError,))
    log(f"{name}: done in {time.perf_counter() - started:.0f} s ({wd})")
  return summaries


def results(per_seed: list[dict[str, dict]], seed_ids=None) -> dict:
  """results.json from run_all's summaries of each seed (seeds `seed_ids`, default 0, 1, ...):
  per run its encoding, tokens (a conversion's include its teacher's up to the step it
  converted), and per seed the held-out loss at each evaluation length and its probe's read
  error per set and length; where and how long it trained."""
  seed_ids = range(len(per_seed)) if seed_ids is None else seed_ids
  runs = {}
  for summaries in per_seed:
    teacher = summaries["teacher"]
    for name, s in summaries.items():
      if name.startswith("probe_"):
        continue
      step = s["teacher"]["step"] if "teacher" in s else None
      tokens = s["tokens_seen"] + (teacher["tokens_seen"] * step // teacher["step"] if step else 0)
      probe = summaries.get(f"probe_{name}", {})
      r = runs.setdefault(name, {"encoding": s["encoding"], "tokens": int(tokens),
                                 "teacher_step": step, "loss": {}, "probe_error": {},
                                 "device": s.get("device"), "finished": s.get("finished"),
                                 "wall_s": 0})
      for e in s["eval"]:
        r["loss"].setdefault(str(e["length"]), []).append(float(e["loss"]))
      for e in probe.get("eval", []):
        if e["set"] in PROBE_SETS:
          r["probe_error"].setdefault(f"{e['set']}@{e['length']}", []).append(float(e["error"]))
      r["finished"] = max(r["finished"] or "", s.get("finished") or "") or None
      r["wall_s"] += round(s.get("wall_time_s", 0) + probe.get("wall_time_s", 0))
  lengths = sorted({int(n) for r in runs.values() for n in r["loss"]})
  return {"lengths": lengths, "seeds": len(per_seed), "seed_ids": list(seed_ids), "runs": runs}


def merge(old: dict, new: dict) -> dict:
  """Two results() of the same experiment as one, by seed: new's seeds replace old's of the same
  id (a repeated command re-reports its seeds), old's others are kept; seeds in id order, wall
  times summed. ValueError if they hold different runs."""
  old_ids = old.get("seed_ids", list(range(old["seeds"])))  # files written before seed_ids
  kept = [n for n, s in enumerate(old_ids) if s not in new["seed_ids"]]
  ids = [old_ids[n] for n in kept] + new["seed_ids"]
  order = sorted(range(len(ids)), key=ids.__getitem__)
  if set(old["runs"]) != set(new["runs"]):
    raise ValueError(f"the results hold runs {sorted(old['runs'])}, the new seeds "
                     f"{sorted(new['runs'])}: not the same experiment")

  def per_seed(name, a, b):   # {key: one value per seed} of old's kept seeds and new's
    if set(a) != set(b):
      raise ValueError(f"run {name}: the seeds were evaluated at different lengths or sets")
    both = {k: [a[k][n] for n in kept] + b[k] for k in a}
    return {k: [v[n] for n in order] for k, v in both.items()}

  runs = {}
  for name, a in old["runs"].items():
    b = new["runs"][name]
    if (a["encoding"], a["tokens"], a["teacher_step"]) != (b["encoding"], b["tokens"],
                                                          b["teacher_step"]):
      raise ValueError(f"run {name}: encoding, tokens or teacher step differ between seeds")
    runs[name] = dict(a, loss=per_seed(name, a["loss"], b["loss"]),
                      probe_error=per_seed(name, a["probe_error"], b["probe_error"]),
                      device=", ".join(sorted({a["device"], b["device"]} - {None})) or None,
                      finished=max(a["finished"] or "", b["finished"] or "") or None,
                      wall_s=a["wall_s"] + b["wall_s"])
  return {"lengths": sorted(set(old["lengths"]) | set(new["lengths"])), "seeds": len(ids),
          "seed_ids": sorted(ids), "runs": runs}


def finished_seed(seed_dir: str, size: str, students, config) -> tuple[int, dict[str, dict]]:
  """(seed, {run name: summary}) of a seed folder whose runs have all finished (--gather), its
  teacher trained with `config` (seeds aside); ValueError naming what is not so."""
  from experiments import sweeps
  from experiments import train
  with open(os.path.join(seed_dir, "teacher", "config.json")) as f:
    if sweeps.config_fingerprint(json.load(f)) != sweeps.config_fingerprint(config):
      raise ValueError(f"--gather: the teacher of {seed_dir} was trained with another "
                       "configuration than --size's")
  summaries, seeds = {}, set()
  for name, _, _ in plan(size, seed_dir, students):
    run_dir = os.path.join(seed_dir, name)
    path = os.path.join(run_dir, train.SUMMARY)
    if not os.path.exists(path):
      raise ValueError(f"--gather: {path} does not exist: run {name} has not finished")
    with open(path) as f:
      summaries[name] = json.load(f)
    with open(os.path.join(run_dir, "config.json")) as f:
      seeds.add(json.load(f)["train"]["seed"])
  if len(seeds) != 1:
    raise ValueError(f"--gather: the runs of {seed_dir} have different seeds {sorted(seeds)}")
  return seeds.pop(), summaries


def _merged(out_dir: str, new: dict, config, prov: dict) -> tuple[dict, dict]:
  """(results, provenance) of `new` added to the seeds already in out_dir, when it holds this
  experiment (same config, seeds aside); `new` and `prov` alone when it holds none."""
  from experiments import results_writers
  from experiments import sweeps
  path = os.path.join(out_dir, "results.json")
  if not os.path.exists(path):
    return new, prov
  with open(path) as f:
    old = json.load(f)
  with open(os.path.join(out_dir, results_writers.PROVENANCE)) as f:
    old_prov = json.load(f)
  if sweeps.config_fingerprint(old_prov["config"]) != sweeps.config_fingerprint(config):
    raise ValueError(f"{out_dir} holds another configuration of the experiment; write the new "
                     "seeds to a new --results folder")
  return merge(old, new), {
      **prov, "commands": old_prov.get("commands", [old_prov["command"]]) + [prov["command"]],
      "machine": "; ".join(dict.fromkeys([old_prov["machine"], prov["machine"]])),
      "jax": ", ".join(dict.fromkeys([old_prov["jax"], prov["jax"]])),
      "wall_time_s": old_prov["wall_time_s"] + prov["wall_time_s"]}


def main(argv=None) -> None:
  # argparse, not absl flags: importing this module (the tests do) defines no global flags.
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--size", choices=("cpu", "runlocal", "gpu"), default="cpu",
                 help="configs/convert.py's size")
  p.add_argument("--workdir", help="where the runs train (one folder each); not with --gather")
  p.add_argument("--results", required=True, help="the results folder to write")
  p.add_argument("--students", default="path,path_fox", help="encodings to convert into")
  p.add_argument("--seeds", type=int, default=1,
                 help="repeat the whole experiment with N seeds (WORKDIR/seed<n>/)")
  p.add_argument("--first_seed", type=int, default=0, help="the first of the --seeds seeds")
  p.add_argument("--gather", default="",
                 help="train nothing: add these finished seed folders (comma-separated "
                      "WORKDIR/seed<n>) to --results")
  args = p.parse_args(argv)
  if not args.gather and not args.workdir:
    p.error("--workdir is required (except with --gather)")
  from absl import logging
  from experiments import results_pages
  from experiments import results_writers
  logging.set_verbosity(logging.WARNING)   # Orbax logs every save and restore at INFO
  students = [s for s in args.students.split(",") if s]
  started = time.perf_counter()
  module = "experiments.convert_experiment"
  try:
    config = convert_config.get_config(plan(args.size, "WORKDIR", students)[0][1])
    if args.gather:
      seeds, per_seed = zip(*[finished_seed(d, args.size, students, config)
                              for d in args.gather.split(",") if d])
      prov = results_writers.gathered_provenance(
          sys.argv, [s for summaries in per_seed for s in summaries.values()], module=module)
    else:
      seeds = range(args.first_seed, args.first_seed + args.seeds)
      per_seed = [run_all(args.size, os.path.join(args.workdir, f"seed{n}"), students, seed=n)
                  for n in seeds]
      prov = results_writers.provenance(sys.argv, time.perf_counter() - started, module=module)
    out, prov = _merged(args.results, results(list(per_seed), list(seeds)), config, prov)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  results_writers.save_results(args.results, EXPERIMENT, out, config, prov)
  results_pages.write_page(args.results)
  print(f"results: {os.path.join(args.results, 'README.md')}")


if __name__ == "__main__":
  main()
