"""The parent process of train_throughput.py: one child process per (encoding, T), parallel
pre-compilation into a persistent cache, the rows file and the --deadline.

Each row runs in its own process so that one encoding's GPU memory, crash or compile cache
cannot touch the next; the child is `python -m experiments.benchmarks.train_throughput --one`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from experiments.benchmarks.throughput_common import REPO, ROW_PREFIX, now_utc, row_identity
from experiments.benchmarks.throughput_tables import (
    ANCHORS, MATMUL, append_row, latest_rows, progress_line, read_rows, row_key)


def child_argv(args, *, name: str, seq_len: int) -> list[str]:
  """The command of one child: this module with --one and the parent's measurement flags."""
  argv = [sys.executable, "-m", "experiments.benchmarks.train_throughput", "--one", name,
          "--seq-len", str(seq_len)]
  for flag in ("tokens_per_step", "dtype", "implementation", "steps", "warmup", "loss_steps",
               "num_batches", "layers", "d_model", "heads", "head_dim", "vocab", "peak_tflops",
               "measured_tflops", "embed"):
    value = getattr(args, flag)
    if value is not None:
      argv += ["--" + flag.replace("_", "-"), str(value)]
  argv.append("--fla-varlen" if args.fla_varlen else "--no-fla-varlen")
  if args.scan_layers:
    argv.append("--scan-layers")
  return argv


def child_env(args, *, compile_only: bool = False) -> dict:
  env = dict(os.environ)
  # JAX preallocates 75% of the GPU by default; let a large step use up to 90% before OOM.
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
  if compile_only:  # several compile at once: each takes only the memory it uses
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  if args.cache_dir:  # the timed child loads what the pre-compile child stored
    env.update(JAX_COMPILATION_CACHE_DIR=os.path.abspath(args.cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env


def start_child(args, *, name: str, seq_len: int, compile_only: bool = False):
  argv = child_argv(args, name=name, seq_len=seq_len) + (["--compile-only"] if compile_only
                                                         else [])
  return subprocess.Popen(argv, cwd=REPO, env=child_env(args, compile_only=compile_only),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)  # its own group: a kill reaches ptxas etc.


def precompile(args, todo: list[tuple[str, int]], deadline: float | None) -> None:
  """Compiles the JAX rows in --compile-workers parallel children into --cache-dir.

  Compiling a 12-layer step takes about a minute of mostly single-threaded CPU work, more than
  timing it; run one after another, compiling would take most of a device call. The timed
  children then load the executables from the persistent cache (their compile_s shows it)."""
  queue = [(n, t) for n, t in todo if n not in ANCHORS and n != MATMUL]
  running = []
  while queue or running:
    while queue and len(running) < args.compile_workers:
      name, seq_len = queue.pop(0)
      running.append((name, seq_len, time.time(),
                      start_child(args, name=name, seq_len=seq_len, compile_only=True)))
    time.sleep(1)
    for item in list(running):
      name, seq_len, t0, proc = item
      late = deadline is not None and time.time() > deadline - 60
      if proc.poll() is None and not late and time.time() - t0 < args.timeout:
        continue
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate()
      running.remove(item)
      print(f"precompiled {name} T={seq_len} in {time.time() - t0:.0f} s (exit {proc.returncode})",
            flush=True)
    if deadline is not None and time.time() > deadline - 60:
      queue.clear()


def spawn(args, *, name: str, seq_len: int, timeout_s: float) -> tuple[dict, bool]:
  """(row, killed): the child's row, or an error row when it crashed or ran past timeout_s."""
  proc = start_child(args, name=name, seq_len=seq_len)
  t0 = time.time()
  try:
    out, err = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return {"error": f"timeout after {timeout_s:.0f} s", "wall_s": time.time() - t0}, True
  for line in reversed(out.splitlines()):
    if line.startswith(ROW_PREFIX):
      return json.loads(line[len(ROW_PREFIX):]), False
  tail = " | ".join(l for l in err.strip().splitlines()[-3:])[-400:]
  return {"error": f"exit code {proc.returncode} without a row (OOM kill or crash): {tail}",
          "wall_s": time.time() - t0}, False


def measured_peak(args, rows: list[dict], deadline: float | None) -> float | None:
  """The measured bf16 matmul TFLOP/s: from --out if there, else one child measures it."""
  if args.measured_tflops is not None or not args.matmul_size:
    return args.measured_tflops
  found = latest_rows(rows).get(row_key(row_identity(args, name=MATMUL,
                                                     seq_len=args.matmul_size)))
  if found is None or args.force:
    found, _ = run_child(args, name=MATMUL, seq_len=args.matmul_size, deadline=deadline)
    if found is None:
      return None
  return None if found.get("error") else found.get("measured_tflops")


def run_child(args, *, name: str, seq_len: int, deadline: float | None) -> tuple[dict | None,
                                                                                   bool]:
  """Spawns one child and appends its row; (None, True) when the deadline cut it short."""
  timeout = args.timeout
  if deadline is not None:
    left = deadline - time.time()
    if left < 30:  # not worth starting: compile alone takes longer
      print(f"{name} T={seq_len}: not started, {left:.0f} s left before --deadline; run the "
            f"command again to continue", flush=True)
      return None, True
    timeout = min(timeout, left)
  row, killed = spawn(args, name=name, seq_len=seq_len, timeout_s=timeout)
  if killed and timeout < args.timeout:  # cut by the deadline, not by its own limit
    print(f"{name} T={seq_len}: stopped at the deadline; run the command again to continue",
          flush=True)
    return None, True
  if "encoding" not in row:  # the child produced no row: describe what it was asked to do
    row = {**row_identity(args, name=name, seq_len=seq_len), "date": now_utc(), **row}
  row["command"] = args.command
  append_row(args.out, row)
  print(progress_line(row), flush=True)
  return row, False


def run_all(args) -> list[dict]:
  """Every requested (encoding, T) not yet in --out, T-major; returns all rows of the file."""
  rows = read_rows(args.out)
  deadline = time.time() + args.deadline if args.deadline else None
  skip = {row_key(r) for r in rows if not (args.retry_errors and r.get("error"))}
  args.measured_tflops = measured_peak(args, rows, deadline)
  if args.compile_workers:
    precompile(args, [(n, t) for t in args.seq_lens for n in args.encodings if args.force
                      or row_key(row_identity(args, name=n, seq_len=t)) not in skip], deadline)
  for seq_len in args.seq_lens:
    todo = [n for n in args.encodings if args.force
            or row_key(row_identity(args, name=n, seq_len=seq_len)) not in skip]
    done = [n for n in args.encodings if n not in todo]
    if done:  # one line: the device machine returns only the output's tail
      print(f"T={seq_len}: already in {args.out}, skipped: {','.join(done)}", flush=True)
    for name in todo:
      _, stopped = run_child(args, name=name, seq_len=seq_len, deadline=deadline)
      if stopped:
        return read_rows(args.out)
  print(f"done: every requested row is in {args.out}", flush=True)
  return read_rows(args.out)
