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

--seeds=N repeats all of it with seeds 0 .. N-1 (WORKDIR/seed<n>/, the teacher too). Runs
already finished in --workdir are not run again (each resumes where it stopped), so the
command can be repeated across device calls. --results gets results.json (held-out loss per
run and evaluation length, the probe's read errors, tokens, device and wall time per run) and
provenance.json; its README and plot are then written (experiments/convert_pages.py, through
experiments.results_pages).
"""
from __future__ import annotations

import argparse
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


def results(per_seed: list[dict[str, dict]]) -> dict:
  """results.json from run_all's summaries of each seed: per run its encoding, tokens (a
  conversion's include its teacher's up to the step it converted), and per seed the held-out
  loss at each evaluation length and its probe's read error per set and length; where and how
  long it trained."""
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
  return {"lengths": lengths, "seeds": len(per_seed), "runs": runs}


def main(argv=None) -> None:
  # argparse, not absl flags: importing this module (the tests do) defines no global flags.
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--size", choices=("cpu", "runlocal", "gpu"), default="cpu",
                 help="configs/convert.py's size")
  p.add_argument("--workdir", required=True, help="where the runs train (one folder each)")
  p.add_argument("--results", required=True, help="the results folder to write")
  p.add_argument("--students", default="path,path_fox", help="encodings to convert into")
  p.add_argument("--seeds", type=int, default=1,
                 help="repeat the whole experiment with seeds 0 .. N-1 (WORKDIR/seed<n>/)")
  args = p.parse_args(argv)
  from absl import logging
  from experiments import results_pages
  from experiments import results_writers
  logging.set_verbosity(logging.WARNING)   # Orbax logs every save and restore at INFO
  students = [s for s in args.students.split(",") if s]
  started = time.perf_counter()
  per_seed = [run_all(args.size, os.path.join(args.workdir, f"seed{n}"), students, seed=n)
              for n in range(args.seeds)]
  teacher_arg = plan(args.size, args.workdir, students)[0][1]
  prov = results_writers.provenance(sys.argv, time.perf_counter() - started,
                                    module="experiments.convert_experiment")
  results_writers.save_results(args.results, EXPERIMENT, results(per_seed),
                               convert_config.get_config(teacher_arg), prov)
  results_pages.write_page(args.results)
  print(f"results: {os.path.join(args.results, 'README.md')}")


if __name__ == "__main__":
  main()
