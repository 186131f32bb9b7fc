"""PaTH attention on CPU: forward time and peak memory of reference, scan and chunked.

    python -m experiments.benchmarks.path_cpu [--ts 1024,2048,...] [--impls reference,scan,chunked]

Each (implementation, T) case runs in its own subprocess so that its peak resident memory
(`getrusage(RUSAGE_SELF).ru_maxrss` read by the child at exit: the whole process, JAX runtime
included) belongs to that case alone. The child also reports XLA's compiled
`memory_analysis()` (temporary buffers + arguments + outputs) and refuses to execute when that
exceeds --max-gib. A case whose time, extrapolated from the previous length, would exceed
--max-seconds is skipped with the reason printed. Times: jit'd forward, one warm-up call,
then the median of --runs calls (a single call when one takes longer than 20 s).

Writes the markdown table to --out (default docs/benchmarks/path_cpu.md, with command, machine,
date and jax version) and prints it last. B=1, H=K=1, D=64, float32, chunk 64, no segments/gate.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from posenc_jax import householder

GIB = 2**30
IMPLS = ("reference", "scan", "chunked")
# Work grows as T^2 for all three at these lengths (scan adds a T D^3 term).
_TIME_EXPONENT = 2.0
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _child(impl: str, T: int, runs: int, max_gib: float) -> dict:
  fn = {"reference": householder.path_attention_reference, "scan": householder.path_attention_scan,
        "chunked": householder.path_attention_chunked}[impl]
  B, H, D = 1, 1, 64
  ks = jax.random.split(jax.random.key(0), 5)
  w = jax.random.normal(ks[3], (B, T, H, D))
  args = (jax.random.normal(ks[0], (B, T, H, D)), jax.random.normal(ks[1], (B, T, H, D)),
          jax.random.normal(ks[2], (B, T, H, D)), w / jnp.linalg.norm(w, axis=-1, keepdims=True),
          jax.random.uniform(ks[4], (B, T, H), maxval=2.0))
  t0 = time.perf_counter()
  compiled = jax.jit(lambda *a: fn(*a, scale=D**-0.5)).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  xla = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes) / GIB
  result = dict(impl=impl, T=T, compile_s=compile_s, xla_gib=xla)
  if xla > max_gib:
    return dict(result, skip=f"XLA buffers {xla:.1f} GiB > {max_gib} GiB")
  t0 = time.perf_counter()
  compiled(*args).block_until_ready()                          # warm-up
  times = [time.perf_counter() - t0]
  n = runs if times[0] < 20 else 1
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    compiled(*args).block_until_ready()
    times.append(time.perf_counter() - t0)
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB   # KiB on Linux
  return dict(result, median_s=statistics.median(times), runs=n, rss_gib=rss)


def _run_case(impl, T, runs, max_gib, timeout):
  cmd = [sys.executable, "-m", "experiments.benchmarks.path_cpu", "--child", f"{impl}:{T}",
         "--runs", str(runs), "--max-gib", str(max_gib)]
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return dict(impl=impl, T=T, skip=f"killed after {timeout:.0f} s")
  if p.returncode:
    tail = (p.stderr.strip().splitlines() or ["?"])[-1]
    return dict(impl=impl, T=T, skip=f"failed (rc={p.returncode}): {tail[:120]}")
  return json.loads(p.stdout.strip().splitlines()[-1])


def _table(rows, ts, impls) -> str:
  by = {(r["impl"], r["T"]): r for r in rows}
  head = "| T | " + " | ".join(f"{i} time (s) | {i} peak RSS / XLA (GiB)" for i in impls) + " |"
  lines = [head, "|" + "---|" * (1 + 2 * len(impls))]
  for T in ts:
    cells = []
    for i in impls:
      r = by.get((i, T), {})
      if "median_s" in r:
        cells += [f"{r['median_s']:.3f}", f"{r['rss_gib']:.2f} / {r['xla_gib']:.2f}"]
      else:
        cells += ["skipped", r.get("skip", "-")]
    lines.append(f"| {T} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--ts", default="1024,2048,4096,8192,16384,32768")
  ap.add_argument("--impls", default=",".join(IMPLS))
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--max-gib", type=float, default=16.0)
  ap.add_argument("--max-seconds", type=float, default=120.0)
  ap.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks", "path_cpu.md"))
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.child:
    impl, T = a.child.split(":")
    print(json.dumps(_child(impl, int(T), a.runs, a.max_gib)))
    return

  ts = [int(t) for t in a.ts.split(",")]
  impls = a.impls.split(",")
  load0 = os.getloadavg()[0]
  rows = []
  for impl in impls:
    last = None
    for T in ts:
      if last is not None:
        per_call = last["median_s"] * (T / last["T"]) ** _TIME_EXPONENT
        total = per_call * (1 + (a.runs if per_call < 20 else 1))
        if total > a.max_seconds:
          r = dict(impl=impl, T=T, skip=f"predicted {total:.0f} s > {a.max_seconds:.0f} s")
          print(f"{impl:9s} T={T:6d}  skipped: {r['skip']}", flush=True)
          rows.append(r)
          continue
      r = _run_case(impl, T, a.runs, a.max_gib, timeout=4 * a.max_seconds)
      rows.append(r)
      if "median_s" in r:
        last = r
        print(f"{impl:9s} T={T:6d}  {r['median_s']:8.3f} s  RSS {r['rss_gib']:6.2f} GiB  "
              f"XLA {r['xla_gib']:6.2f} GiB  (compile {r['compile_s']:.1f} s)", flush=True)
      else:
        print(f"{impl:9s} T={T:6d}  skipped: {r['skip']}", flush=True)
  table = _table(rows, ts, impls)
  header = "\n".join([
      "# PaTH attention on CPU: forward time and peak memory", "",
      f"- command: `python -m experiments.benchmarks.path_cpu {' '.join(argv or sys.argv[1:])}`",
      f"- machine: {os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), "
      f"shared with other jobs: load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end",
      f"- date: {datetime.datetime.now().isoformat(timespec='minutes')}; jax {jax.__version__}",
      "- shapes: B=1, H=K=1, D=64, float32, chunk 64, no segments or forget gate; jit'd forward,"
      f" median of {a.runs} calls after a warm-up (1 call when a call takes > 20 s)",
      "- memory: peak RSS of the case's own process (`ru_maxrss`, includes the JAX runtime)"
      " / XLA compiled `memory_analysis()` temp + argument + output buffers", ""])
  with open(a.out, "w") as f:
    f.write(header + "\n" + table + "\n")
  print("\n" + table)


if __name__ == "__main__":
  main()
