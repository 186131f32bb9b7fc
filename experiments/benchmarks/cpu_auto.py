r"""CPU: dense reference vs blockwise (chunked) attention, forward + backward, per family.

    python -m experiments.benchmarks.cpu_auto [--families softmax,path,...] \
        [--ts 64,128,256,512,1024,2048] [--batch 8 --heads 2 --head-dim 32] [--runs 5] \
        [--path-scan] [--max-seconds 8] [--no-pin] [--out docs/benchmarks/cpu_auto.md]

Issue 15: what `implementation=None` runs on a CPU (posenc_jax.dispatch.auto_implementation,
CPU_DENSE_MAX_T) is decided by this measurement. For each family and T it times, in one
process, a jitted `jax.grad` of `sum(attention(...))` with respect to every float input (q, k,
v and the family's own: w, beta, log_forget, p, alpha), as a training step differentiates it,
through the public entry points of posenc_jax.attention with implementation="reference" and
"chunked" (and "scan" for PaTH with --path-scan). float32, segment_ids always given (two
packed documents per row, as training passes them). Every case is compiled and run once
before timing; then --runs rounds time one call of every implementation in turn (so load on a
shared machine hits them alike), and the median per implementation is reported. An
implementation whose median, scaled by (T'/T)^2 to the next length, would exceed
--max-seconds per call is skipped there and beyond (the table says so). The gradients of the
warm-up calls are compared (largest difference relative to the largest reference gradient):
both forms are exact, so a difference beyond float32 rounding means the comparison is void.

--pin (the default) runs the process on one core. Unpinned, on a 2-core machine shared with
other jobs, an XLA CPU process sometimes runs op-heavy programs (PaTH's chunked form above all)
up to 40x slower for long stretches, with user time = wall time and ~75 involuntary
context switches per call (as if a thread spun waiting for the other, busy core until
preempted); whether it does varies from process to process (jax 0.10.2: the T=64 chunked
PaTH step took 6 ms in about half of fresh processes and 270 ms in the others; pinned, 5-8 ms
every time) and, over minutes, with the other jobs' load (docs/benchmarks/cpu_auto.md, the
quickstart runs). One core gives repeatable times.

jax and numpy are imported inside the functions, not at the top: --pin must set this
process's CPU affinity before they load (importing jax already starts a thread sized by the
CPU count; numpy's BLAS sizes its thread pool when it loads).

Prints the table and writes it (command, machine, date, jax version) to --out.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

FAMILIES = ("softmax", "path", "forgetting", "path_integral", "tapa", "stick_breaking")
IMPLS = ("reference", "chunked")


def _inputs(family: str, B: int, T: int, H: int, D: int, seed: int = 0):
  """(float args for the entry point, static kwargs, segment_ids) for one family."""
  import jax
  import jax.numpy as jnp

  ks = iter(jax.random.split(jax.random.key(seed), 8))
  normal = lambda *shape: jax.random.normal(next(ks), shape, jnp.float32)  # noqa: E731
  q, k, v = normal(B, T, H, D), normal(B, T, H, D), normal(B, T, H, D)
  # Two packed documents per row, split at a row-dependent point.
  cut = (jnp.arange(B) * 7919 % (T // 2) + T // 4)[:, None]
  segment_ids = (jnp.arange(T)[None, :] >= cut).astype(jnp.int32)
  extra = {
      "softmax": (),
      "path": (normal(B, T, H, D), jax.nn.sigmoid(normal(B, T, H)) * 2,
               jax.nn.log_sigmoid(normal(B, T, H) + 3)),
      "forgetting": (jax.nn.log_sigmoid(normal(B, T, H) + 3),),
      "path_integral": (normal(B, T, H, 16), jnp.full((H,), 0.5, jnp.float32)),
      "tapa": (),
      "stick_breaking": (),
  }[family]
  return (q, k, v) + extra, segment_ids


def _grad_fn(family: str, impl: str):
  """jit(grad(sum(attention))) with respect to every float argument."""
  import jax
  import jax.numpy as jnp

  from posenc_jax import attention

  def forward(args, segment_ids):
    if family == "softmax":
      return attention.softmax_attention(*args, segment_ids=segment_ids, implementation=impl)
    if family == "path":
      q, k, v, w_raw, beta, log_forget = args
      w = w_raw / jnp.linalg.norm(w_raw, axis=-1, keepdims=True)  # as the model makes w
      return attention.path_attention(q, k, v, w, beta, log_forget=log_forget,
                                      segment_ids=segment_ids, implementation=impl)
    if family == "forgetting":
      return attention.forgetting_attention(*args, segment_ids=segment_ids, implementation=impl)
    if family == "path_integral":
      return attention.path_integral_attention(*args, segment_ids=segment_ids,
                                               implementation=impl)
    if family == "stick_breaking":
      return attention.stick_breaking_attention(*args, segment_ids=segment_ids,
                                                implementation=impl)
    return attention.tapa_attention(*args, segment_ids=segment_ids, implementation=impl)

  return jax.jit(jax.grad(lambda args, seg: jnp.sum(forward(args, seg))))


def _case(family: str, impls, *, B, T, H, D, runs) -> dict:
  """Median and fastest seconds per implementation for one (family, T), and compile times."""
  import jax

  args, seg = _inputs(family, B, T, H, D)
  fns, compile_s, grads = {}, {}, {}
  for impl in impls:
    t0 = time.perf_counter()
    fns[impl] = _grad_fn(family, impl).lower(args, seg).compile()
    grads[impl] = jax.block_until_ready(fns[impl](args, seg))   # warm-up
    compile_s[impl] = time.perf_counter() - t0
  diff = _max_rel_diff(grads)
  del grads
  times = {impl: [] for impl in impls}
  for _ in range(runs):
    for impl in impls:
      t0 = time.perf_counter()
      jax.block_until_ready(fns[impl](args, seg))
      times[impl].append(time.perf_counter() - t0)
  return ({impl: statistics.median(ts) for impl, ts in times.items()},
          {impl: min(ts) for impl, ts in times.items()}, compile_s, diff)


def _max_rel_diff(grads: dict) -> float | None:
  """Largest |g_impl - g_first| / max|g_first| over every gradient leaf and implementation:
  the forms are exact, so this is float32 rounding (None with one implementation)."""
  import jax
  import numpy as np

  impls = list(grads)
  if len(impls) < 2:
    return None
  base = jax.tree.leaves(grads[impls[0]])
  worst = 0.0
  for impl in impls[1:]:
    for a, b in zip(base, jax.tree.leaves(grads[impl])):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      worst = max(worst, float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30)))
  return worst


def _lscpu() -> str:
  """Model name, CPU count and hypervisor from lscpu (what `lscpu | head` shows)."""
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return "not available"
  keep = ("Model name", "CPU(s)", "Thread(s) per core", "Hypervisor vendor", "L2 cache",
          "L3 cache")
  fields = [" ".join(line.split()) for line in out.splitlines()
            if line.split(":")[0].strip() in keep]
  return "; ".join(fields)


def _load() -> str:
  try:
    return "%.1f" % os.getloadavg()[0]
  except OSError:
    return "?"


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--families", default=",".join(FAMILIES))
  p.add_argument("--ts", default="64,128,256,512,1024,2048")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=32)
  p.add_argument("--runs", type=int, default=5)
  p.add_argument("--path-scan", action="store_true", help="also time PaTH's scan form")
  p.add_argument("--max-seconds", type=float, default=8.0,
                 help="skip an implementation at lengths where a call would take longer")
  p.add_argument("--out", default="docs/benchmarks/cpu_auto.md")
  p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                 help="run on one core (the lowest this process may use); see the docstring")
  a = p.parse_args(argv)
  if a.pin:  # before jax starts: its thread pools are sized from the affinity mask
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

  import jax

  families = [f for f in a.families.split(",") if f]
  ts = [int(t) for t in a.ts.split(",")]
  B, H, D = a.batch, a.heads, a.head_dim
  start, load0 = time.perf_counter(), _load()
  rows, skipped = [], []
  for family in families:
    impls = IMPLS + (("scan",) if family == "path" and a.path_scan else ())
    last: dict = {}
    for T in ts:
      run = [i for i in impls
             if i not in last or last[i][1] * (T / last[i][0])**2 <= a.max_seconds]
      for i in impls:
        if i not in run:
          skipped.append((family, T, i, last[i][1] * (T / last[i][0])**2))
      if not run:
        continue
      med, fastest, comp, diff = _case(family, run, B=B, T=T, H=H, D=D, runs=a.runs)
      for i, s in med.items():
        last[i] = (T, s)
      row = dict(family=family, T=T, ms={i: 1e3 * s for i, s in med.items()},
                 min_ms={i: 1e3 * s for i, s in fastest.items()}, compile_s=comp, diff=diff)
      rows.append(row)
      print(_row_line(row, impls), flush=True)
  elapsed = time.perf_counter() - start
  cmd = "python -m experiments.benchmarks.cpu_auto " + " ".join(
      sys.argv[1:] if argv is None else argv)
  md = _markdown(rows, skipped, families, a, cmd=cmd, elapsed=elapsed, load=(load0, _load()),
                 jax_version=jax.__version__)
  if a.out:
    with open(a.out, "w") as f:
      f.write(md)
  print(md)


def _winner(ms: dict) -> tuple[str, str]:
  """(winner, reference/chunked ratio) for one row."""
  best = min(ms, key=ms.get)
  ratio = (f"{ms['reference'] / ms['chunked']:.2f}" if "reference" in ms and "chunked" in ms
           else "-")
  return best, ratio


def _row_line(row: dict, impls) -> str:
  best, ratio = _winner(row["ms"])
  cells = " ".join(f"{i}={row['ms'][i]:9.2f}ms" if i in row["ms"] else f"{i}=  skipped"
                   for i in impls)
  diff = "-" if row["diff"] is None else f"{row['diff']:.1e}"
  return (f"{row['family']:>13} T={row['T']:5d} {cells} ref/chunked={ratio} -> {best} "
          f"(grad rel diff {diff})")


def _markdown(rows, skipped, families, a, *, cmd, elapsed, load, jax_version) -> str:
  impls = list(IMPLS) + (["scan"] if a.path_scan and "path" in families else [])
  skip = {(f, T, i): s for f, T, i, s in skipped}
  head = (["family", "T"] + [f"{i} ms: median (min)" for i in impls]
          + ["reference / chunked (medians)", "winner", "grads: max rel diff"])
  lines = [
      "# CPU: dense reference vs chunked attention, forward + backward (issue 15)",
      "",
      f"- command: `{cmd}`",
      f"- machine: {os.cpu_count()}-core CPU ({platform.machine()}), shared with other jobs: "
      f"load average {load[0]} at start, {load[1]} at end",
      f"- date: {datetime.datetime.now().strftime('%Y-%m-%dT%H:%M')}; jax {jax_version}; "
      f"whole run {elapsed / 60:.1f} min",
      "- threads: " + ("one core (--pin, the default: see the module docstring)" if a.pin
                       else "every core (--no-pin)"),
      f"- shapes: B={a.batch}, H=K={a.heads}, D={a.head_dim}, float32, two packed documents per "
      "row (segment_ids); PaTH with w, beta and a forget gate (PaTH-FoX inputs), "
      "GRAPE-AP with d_p=16",
      "- measured: jit(jax.grad(sum(attention(...)))) with respect to every float input, "
      f"compiled and run once, then the median of {a.runs} rounds, each timing every "
      "implementation once in turn",
      "- ratio: reference median / chunked median (> 1: chunked is faster); the fastest of the "
      "rounds is in parentheses (less sensitive to the other jobs on the machine)",
      "- grads: max |g - g_reference| / max |g_reference| over every gradient (q, k, v and the "
      "family's own inputs), from the warm-up calls: both forms are exact, so this is float32 "
      "rounding",
      f"- lscpu: {_lscpu()}",
      "",
      "| " + " | ".join(head) + " |",
      "|" + "---|" * len(head),
  ]
  for row in rows:
    best, ratio = _winner(row["ms"])
    cells = []
    for i in impls:
      if i in row["ms"]:
        cells.append(f"{row['ms'][i]:.1f} ({row['min_ms'][i]:.1f})")
      elif (row["family"], row["T"], i) in skip:
        cells.append(f"skipped (predicted {skip[row['family'], row['T'], i]:.0f} s)")
      else:
        cells.append("-")
    diff = "-" if row["diff"] is None else f"{row['diff']:.1e}"
    lines.append("| " + " | ".join([row["family"], str(row["T"])] + cells + [ratio, best, diff])
                 + " |")
  lines.append("")
  for f in families:
    for T in sorted({T for g, T, _, _ in skipped if g == f}):
      if not any(r["family"] == f and r["T"] == T for r in rows):
        why = ", ".join(f"{i} predicted {s:.0f} s" for g, t, i, s in skipped if (g, t) == (f, T))
        lines.append(f"- {f} at T={T}: not run, every implementation over --max-seconds="
                     f"{a.max_seconds:g} per call ({why})")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
