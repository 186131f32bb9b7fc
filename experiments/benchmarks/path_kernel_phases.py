"""Where the PaTH kernel's time goes, on one GPU: the four phases of a call, each jitted and timed
alone, and with --trace every device kernel of the whole call. docs/benchmarks/
path_kernel_phases.md has the current table.

  python experiments/benchmarks/path_kernel_phases.py --cases 0,3
  python experiments/benchmarks/path_kernel_phases.py --cases 3 --options "" --options span=0
  python experiments/benchmarks/path_kernel_phases.py --cases 0,3 --phases fwd_bwd --trace /tmp/tr

Phases (kp.phases, the kernels' one timing hook): the pre-pass, the forward, the backward and
the pre-pass VJP, each given the outputs of the phases before it; fwd_bwd is the whole jitted
gradient for comparison. bf16, median ms; one JSON line per (case, --options), with the plan
the call ran (also printed), and a table last. --gate adds a log forget gate (PaTH-FoX),
--kv-heads K < H runs grouped-query heads. --trace DIR also profiles three whole fwd+bwd calls
(jax.profiler) and lists every device kernel's ms per call: the split inside a phase.
--backend interpret runs the script on a CPU (tiny shapes only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402

import kernels_pallas as kp  # noqa: E402
from experiments.benchmarks import common  # noqa: E402

PHASES = ("prepass", "forward", "backward", "prepass_vjp", "fwd_bwd")


def programs(q, k, v, w, beta, log_forget=None, *, do, block_sizes, backend) -> dict:
  """{phase: (jitted function, its arguments)}: kp.phases' four (each fed what the phases
  before it returned) and "fwd_bwd", the jitted gradient of sum(path_attention(...) * do) with
  respect to every input, which the four together compute."""
  parts = kp.phases(q, k, v, w, beta, log_forget, do=do, block_sizes=block_sizes,
                        backend=backend)
  out = {name: (jax.jit(f), args) for name, (f, args) in parts.items()}
  args = (q, k, v, w, beta) + (() if log_forget is None else (log_forget,))
  attend = lambda *a: kp.path_attention(*a, block_sizes=block_sizes, backend=backend)
  out["fwd_bwd"] = (common.grad_fn(attend, len(args)), args + (do,))
  return out


def case_phases(case, *, options="", backend="gpu", kv_heads=None, gate=False, phases=PHASES,
                reps=10, trace_dir=None) -> dict:
  """One row: median ms of each phase in `phases` (reps 0: one untimed call each, for an
  external profiler), the plan, and with trace_dir every kernel of the whole call."""
  B, T, H, D = common.case_shape(case)
  label = common.case_label(case)
  q, k, v, w, beta, log_forget, do = common.inputs(B, T, H, D, kv_heads=kv_heads)
  log_forget = log_forget if gate else None   # PaTH-FoX: the gate's share of every phase
  bs = common.block_sizes(options)
  plan = kp.explain(q, k, v, w, beta, log_forget, block_sizes=bs, backend=backend)
  print(f"plan of case {label} [{options}]:\n  " + str(plan).replace("\n", "\n  "), flush=True)
  progs = programs(q, k, v, w, beta, log_forget, do=do, block_sizes=bs, backend=backend)
  row = dict(case=label, B=B, T=T, H=H, K=kv_heads or H, D=D, options=options, gate=gate)
  for name in phases:
    f, args = progs[name]
    if reps:
      row[name] = round(common.median_ms(f, *args, n=min(reps, 5) if name == "fwd_bwd"
                                         else reps), 4)
    else:
      jax.block_until_ready(f(*args))
  if trace_dir:  # every kernel of the whole fwd+bwd, by name (a phase holds several)
    whole, args = progs["fwd_bwd"]
    jax.block_until_ready(whole(*args))
    tag = (options or "default").replace(",", "_").replace("=", "-") + ("_gate" if gate else "")
    run_dir = os.path.join(trace_dir, f"case{label}_{tag}")
    with jax.profiler.trace(run_dir, create_perfetto_trace=True):
      for _ in range(3):
        jax.block_until_ready(whole(*args))
    row["kernels"] = [(name[:60], round(ms, 3), calls)
                      for name, ms, calls in common.top_ops(run_dir, steps=3, k=40)]
  row["plan"] = str(plan)
  print(json.dumps(row), flush=True)
  return row


def table(rows, phases) -> str:
  lines = ["| case | options | gate | " + " | ".join(phases) + " |",
           "|---|---|---|" + "---|" * len(phases)]
  for r in rows:
    lines.append(f"| {r['case']} | {r['options'] or 'defaults'} | {r['gate']} | "
                 + " | ".join(str(r.get(p, "-")) for p in phases) + " |")
  return "\n".join(lines)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cases", default="0,3",
                 help="comma-separated indices into common.CASES, or shapes BxTxHxD")
  p.add_argument("--backend", default="gpu", help="interpret: a CPU run of the script")
  p.add_argument("--options", action="append", default=None,
                 help="kernel options 'key=value,...' (kp.BlockSizes fields: "
                      f"{', '.join(common.OPTION_FIELDS)}); repeat to compare")
  p.add_argument("--kv-heads", type=int, default=None, help="K < H: grouped-query heads")
  p.add_argument("--gate", action="store_true", help="PaTH-FoX: a log forget gate too")
  p.add_argument("--phases", default=",".join(PHASES), help="which phases to time")
  p.add_argument("--reps", type=int, default=10,
                 help="timed calls per phase; 0: one untimed call each (under a profiler)")
  p.add_argument("--trace", default=None,
                 help="also trace 3 whole fwd+bwd calls here and list every kernel's ms per call")
  p.add_argument("--out", default=os.environ.get("OUT", "."),
                 help="folder of path_kernel_phases.json (default $OUT, else .)")
  a = p.parse_args(argv)
  a.options = a.options or [""]
  try:   # a bad entry fails here, in one line, before anything runs
    a.cases = common.parse_cases(a.cases)
    for o in a.options:
      common.block_sizes(o)
  except ValueError as e:
    p.error(str(e))
  a.phases = [x for x in a.phases.split(",") if x]
  bad = [x for x in a.phases if x not in PHASES]
  if bad:
    p.error(f"--phases {','.join(bad)}: not one of {','.join(PHASES)}")
  return a


def main(argv=None):
  a = parse_args(argv)
  rows = []
  for case in a.cases:
    for options in a.options:
      try:  # a configuration that does not build (e.g. shared memory) is reported, not fatal
        rows.append(case_phases(case, options=options, backend=a.backend, kv_heads=a.kv_heads,
                                gate=a.gate, phases=a.phases, reps=a.reps, trace_dir=a.trace))
      except Exception as e:
        print(json.dumps(dict(case=common.case_label(case), options=options, error=(
            type(e).__name__ + ": " + (str(e).splitlines() or [""])[0][:300]))), flush=True)
  with open(os.path.join(a.out, "path_kernel_phases.json"), "w") as f:
    json.dump(rows, f, indent=1)
  for r in rows:
    for name, ms, calls in r.get("kernels", []):
      print(f"case {r['case']} {r['options'] or 'defaults'}{' gate' * r['gate']}: "
            f"{ms:8.3f} ms  x{calls}  {name}")
  print(table(rows, a.phases))


if __name__ == "__main__":
  main()
