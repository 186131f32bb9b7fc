"""The command line's timeline per encoding: start-up stages, compile, first step, tokens/s.

What is timed is the documented command itself, `python -m experiments.main` in a fresh
process, on the 12-layer d_model 768 model (12 heads x 64, bf16) and the byte-level `text`
task at T = 2048, batch 16, 40 steps:

  python -m experiments.main --config=experiments/configs/quickstart.py:encoding=ENC,steps=40 \
      --workdir=W --config.data.task=text --config.data.seq_len=2048 \
      --config.model.num_layers=12 --config.model.d_model=768 --config.model.num_heads=12 \
      --config.model.head_dim=64 --config.model.dtype=bfloat16 --config.train.batch_size=16 \
      --config.train.log_every=10 --config.eval.num_batches=0 \
      --config.train.compile_cache_dir=CACHE

Each encoding runs twice, each time in a new workdir: `cold` with an empty compilation cache,
then `warm` with the cache the cold run filled (a rerun of the same config). A row holds the
run's own start-up marks (`experiments.startup`: seconds from the command's start to the end
of each stage, from its summary.json), the compile line it printed, every XLA compile of half
a second or more (JAX_LOG_COMPILES: a train step compiled twice shows, with JAX's reason,
JAX_EXPLAIN_CACHE_MISSES, in `train_step_retraces`), tokens/s of each
10-step window and over steps 21-40, and the process's wall time from launch to exit.

  python -m experiments.benchmarks.cli_startup --encodings rope,path,path_fox \
      --deadline 540 --out $OUT/cli_startup.jsonl --markdown $OUT/cli_startup.md

Rows already in --out are skipped (the same command continues after a time limit);
--size tiny runs a 1-layer model at T = 64 (the CPU smoke test).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from experiments import startup

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RUNS = ("cold", "warm")
SIZES = {
    "134m": {"data.task": "text", "data.seq_len": 2048, "model.num_layers": 12,
             "model.d_model": 768, "model.num_heads": 12, "model.head_dim": 64,
             "model.dtype": "bfloat16", "train.batch_size": 16, "train.log_every": 10,
             "eval.num_batches": 0},
    "tiny": {"data.task": "text", "data.seq_len": 64, "model.num_layers": 1,
             "model.d_model": 32, "model.num_heads": 2, "model.head_dim": 16,
             "train.batch_size": 2, "train.log_every": 10, "eval.num_batches": 0},
}
_COMPILE_LINE = re.compile(r"compiled the train step in ([0-9.]+) s \(([^)]*)\)")
# JAX's own line per compile, under JAX_LOG_COMPILES=1 (a recompile shows as a second one).
_XLA_COMPILE = re.compile(r"Finished XLA compilation of jit\(([^)]*)\) in ([0-9.e-]+) sec")


def command(*, encoding: str, size: str, steps: int, workdir: str, cache: str) -> list[str]:
  flags = [f"--config.{k}={v}" for k, v in SIZES[size].items()]
  return [sys.executable, "-m", "experiments.main",
          f"--config=experiments/configs/quickstart.py:encoding={encoding},steps={steps}",
          f"--workdir={workdir}", *flags, f"--config.train.compile_cache_dir={cache}"]


def retraces(stderr: str, name: str) -> list[str]:
  """JAX's explanation (JAX_EXPLAIN_CACHE_MISSES) of each time `name` was traced again.

  Each explanation is a logged line (behind absl's prefix, or behind a progress bar's carriage
  return) that holds "TRACING CACHE MISS", then its indented lines."""
  found = []
  for chunk in stderr.split("TRACING CACHE MISS")[1:]:
    first, *rest = chunk.splitlines() or [""]
    body = itertools.takewhile(lambda line: line.startswith("  "), rest)
    block = "\n".join(["TRACING CACHE MISS" + first, *body])
    if f"  for {name} defined" in block:
      found.append(block[:2000])
  return found


def windows(workdir: str) -> list[tuple[int, float]]:
  """[(step, tokens/s of the logged window ending there)] from the run's metrics.jsonl."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return [(r["step"], r["tokens_per_s"]) for r in records if r.get("kind") == "train"]


def tokens_per_s(rates: list[tuple[int, float]], *, after_step: int) -> float | None:
  """Mean tokens/s of the windows that end past `after_step`."""
  late = [rate for step, rate in rates if step > after_step]
  return sum(late) / len(late) if late else None


def run_one(*, encoding: str, run: str, size: str, steps: int, root: str,
            timeout: float) -> dict:
  """Runs the command once; returns its row (with `error` if it failed)."""
  workdir = os.path.join(root, f"{encoding}-{run}")
  cache = os.path.join(root, f"cache-{encoding}")
  if run == "cold":
    shutil.rmtree(cache, ignore_errors=True)
  shutil.rmtree(workdir, ignore_errors=True)
  row = {"encoding": encoding, "run": run, "size": size, "steps": steps}
  t0 = time.time()
  try:
    proc = subprocess.run(command(encoding=encoding, size=size, steps=steps, workdir=workdir,
                                  cache=cache),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "JAX_LOG_COMPILES": "1",
                               "JAX_EXPLAIN_CACHE_MISSES": "1"})
  except subprocess.TimeoutExpired:
    return {**row, "error": f"timeout after {timeout:.0f} s"}
  row["wall_s"] = round(time.time() - t0, 2)
  if proc.returncode:
    return {**row, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  row["startup_s"] = summary["startup_s"]
  row["device"] = summary["device"]
  found = _COMPILE_LINE.search(proc.stderr)
  row["compile_line"] = found.group(0) if found else None
  row["xla_compiles"] = [(name, round(float(sec), 2)) for name, sec in
                         _XLA_COMPILE.findall(proc.stderr) if float(sec) >= 0.5]
  row["train_step_retraces"] = retraces(proc.stderr, "_train_step")
  row["windows_tokens_per_s"] = windows(workdir)
  row["tokens_per_s"] = tokens_per_s(row["windows_tokens_per_s"], after_step=steps // 2)
  return row


def render(rows: list[dict]) -> str:
  """Markdown: one row per run, seconds per start-up stage (own time) and the totals."""
  head = ["code", "encoding", "run", *startup.STAGES, "first step at", "train-step compiles",
          "tok/s, 2nd half", "wall"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r.get('code', '')} | {r['encoding']} | {r['run']} | error: "
                   f"{r['error'][:120]} |")
      continue
    tl = startup.Timeline(origin=0.0)
    tl.marks = r["startup_s"]
    own = tl.durations()
    cells = [f"{own[s]:.1f}" if s in own else "-" for s in startup.STAGES]
    tok = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
    compiles = (sum(name == "_train_step" for name, _ in r["xla_compiles"])
                if "xla_compiles" in r else "-")
    lines.append(f"| {r.get('code', '')} | {r['encoding']} | {r['run']} | " + " | ".join(cells)
                 + f" | {r['startup_s']['first_step']:.1f} | {compiles} | {tok} "
                 f"| {r['wall_s']:.1f} |")
  return "\n".join(lines)


def read_rows(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--encodings", default="rope,path,path_fox")
  p.add_argument("--runs", default="cold,warm", help=f"comma list of {RUNS}")
  p.add_argument("--size", choices=tuple(SIZES), default="134m")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--timeout", type=float, default=400, help="seconds per run")
  p.add_argument("--deadline", type=float, default=0, help="stop launching after this many s")
  p.add_argument("--root", default=None, help="workdirs and caches (default: a temporary dir)")
  p.add_argument("--out", default="workdirs/cli_startup.jsonl")
  p.add_argument("--markdown", default=None)
  p.add_argument("--render-only", action="store_true")
  args = p.parse_args(argv)
  runs = args.runs.split(",")
  if set(runs) - set(RUNS):
    p.error(f"--runs={args.runs}: each one of {RUNS}")
  start = time.time()
  rows = read_rows(args.out)
  done = {(r["encoding"], r["run"], r["size"]) for r in rows if "error" not in r}
  root = args.root or tempfile.mkdtemp(prefix="cli_startup-")
  if not args.render_only:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for encoding in args.encodings.split(","):
      for run in runs:  # warm after cold: it reads the cache the cold run filled
        if (encoding, run, args.size) in done:
          continue
        if args.deadline and time.time() - start > args.deadline:
          print(f"deadline: not started {encoding} {run}", flush=True)
          continue
        row = run_one(encoding=encoding, run=run, size=args.size, steps=args.steps,
                      root=root, timeout=args.timeout)
        row["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
          f.write(json.dumps(row) + "\n")
        rows.append(row)
  table = render([r for r in rows if r["size"] == args.size])
  print(table)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  main()
