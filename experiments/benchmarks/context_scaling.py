"""Context-parallel training: tokens/s per GPU, peak memory and the communication share of
the step, for one sequence sharded over `mesh.context` GPUs against one GPU at T / context.

What is timed is experiments.train.Trainer's train step (forward, backward, clipping, AdamW)
on real `text` batches, the 12-layer d_model 768 llama-style model of train_throughput.py,
bf16, on a mesh of (data 1, fsdp 1, context N) over the first N GPUs. Each row runs in its own
subprocess (peak memory per row; a crash or OOM becomes the row's error).

  # PaTH and RoPE: one GPU at 32k, two GPUs at 64k (batch 1: the same tokens per GPU)
  python -m experiments.benchmarks.context_scaling --encodings path,rope \
      --rows 32768:1,65536:2 --out workdirs/context_scaling.jsonl \
      --markdown workdirs/context_scaling.md

Per row: compile seconds; --warmup steps; --steps timed steps (median; tokens/s = B T /
median, per GPU = that / N); the loss of each of the first --loss-steps steps (finite and
falling: mean of the last 5 below the first 5); peak memory: the largest
memory_stats()["peak_bytes_in_use"] of the N GPUs, beside XLA's compile-time account of
the program (xla_temp_gib: its temporaries per device; arguments, outputs); communication
share: one more step under jax.profiler, the device time of collective ops (all-gather,
all-reduce, reduce-scatter, collective-permute, all-to-all, NCCL kernels) over all device
time. The markdown table gives each context-N row's scaling (its tokens/s per GPU over the
same encoding's one-GPU row at T / N), the ideal scaling (that row's training FLOPs per token
over this one's, throughput_common.train_flops: causal attention does more work per token at
a longer T, so perfect scaling is below 1) and memory ratio (its peak over that row's).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROW_PREFIX = "ROW "
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all",
               "allgather", "allreduce", "reducescatter", "sendrecv", "nccl", "ppermute")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--encodings", default="path,rope")
  p.add_argument("--rows", default="32768:1,65536:2", help="T:context,... per encoding")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--loss-steps", type=int, default=20)
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--d-model", type=int, default=768)
  p.add_argument("--heads", type=int, default=12)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--vocab", type=int, default=32000)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--scan-layers", action="store_true",
                 help="the layers as one lax.scan (ModelConfig.scan_layers): one layer to compile")
  p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--timeout", type=float, default=400, help="seconds per row")
  p.add_argument("--deadline", type=float, default=0, help="stop launching after this many s")
  p.add_argument("--out", default="workdirs/context_scaling.jsonl")
  p.add_argument("--markdown", default=None)
  p.add_argument("--render-only", action="store_true")
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)   # child: encoding:T:context
  return p.parse_args(argv)


# --- the child: one row --------------------------------------------------------------------


def _profile(trace_dir: str, context: int) -> tuple[float | None, list]:
  """(communication share of the device time, the 12 ops with the most device time: name,
  ms per GPU, calls per GPU) from one profiled step."""
  from experiments.benchmarks import common   # imports jax: child only (see run_row)
  ops = common.top_ops(trace_dir, steps=1, k=100000)
  total = sum(ms for _, ms, _ in ops)
  if not total:
    return None, []
  comm = sum(ms for name, ms, _ in ops if any(c in name.lower() for c in COLLECTIVES))
  top = [(name[:90], round(ms / context, 3), calls // context) for name, ms, calls in ops[:12]]
  return comm / total, top


def run_row(args, encoding: str, seq_len: int, context: int) -> dict:
  # Imported here, in the child: the parent never starts a JAX backend, which would hold GPU
  # memory while the rows run.
  import jax
  from experiments import sharding
  from experiments import train
  from experiments.benchmarks import throughput_common as shared
  from experiments.configs import base
  from posenc_jax import model as model_lib

  def progress(msg: str) -> None:
    # stderr lines the parent keeps when a row fails or times out: they say how far it got.
    print(f"[{time.perf_counter() - started:7.1f} s] {msg}", file=sys.stderr, flush=True)

  started = time.perf_counter()
  if jax.device_count() < context:
    raise ValueError(f"context={context} needs {context} devices; this machine has "
                     f"{jax.device_count()}")
  mcfg = model_lib.ModelConfig(
      vocab_size=args.vocab, encoding=encoding, num_layers=args.layers, d_model=args.d_model,
      num_heads=args.heads, head_dim=args.head_dim, block="llama", dtype=args.dtype,
      scan_layers=args.scan_layers)
  devices = jax.devices()[:context]
  mesh = sharding.make_mesh(data=1, fsdp=1, context=context, devices=devices)
  trainer = train.Trainer(mcfg, base.get_config().train, mesh)
  count = max(args.loss_steps, args.warmup + args.steps) + 1
  host, _ = shared.text_batches(seq_len=seq_len, batch=args.batch, count=count, vocab=args.vocab)
  row = {}
  with jax.set_mesh(mesh):
    state = jax.block_until_ready(trainer.init_state(0))
    total, embedding = shared.count_params(state["params"])
    batches = [trainer.put(b) for b in host]
    progress("state initialised, batches on the devices")
    t0 = time.perf_counter()
    lowered = trainer.train_step.lower(state, batches[0])
    progress(f"lowered in {time.perf_counter() - t0:.1f} s")
    step = lowered.compile()
    row["compile_s"] = time.perf_counter() - t0
    progress(f"compiled in {row['compile_s']:.1f} s")
    row.update(_xla_memory(step))
    losses, step_s = [], []
    for i in range(count - 1):
      t0 = time.perf_counter()
      state, metrics = step(state, batches[i])
      jax.block_until_ready((state, metrics))
      if args.warmup <= i < args.warmup + args.steps:
        step_s.append(time.perf_counter() - t0)
      if i < args.loss_steps:
        losses.append(float(metrics["loss"]))
      progress(f"step {i}: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    if args.profile:
      with tempfile.TemporaryDirectory() as trace:
        with jax.profiler.trace(trace, create_perfetto_trace=True):
          state, metrics = step(state, batches[-1])
          jax.block_until_ready((state, metrics))
        row["comm_share"], row["top_ops"] = _profile(trace, context)
  med = statistics.median(step_s)
  flops = shared.train_flops(family=shared.family_of(encoding), dense_params=total - embedding,
                             num_layers=args.layers, num_heads=args.heads,
                             head_dim=args.head_dim, seq_len=seq_len, batch=args.batch)
  row["flops_per_token"] = flops["total"] / (args.batch * seq_len)
  stats = [d.memory_stats() or {} for d in devices]
  peaks = [s.get("peak_bytes_in_use") for s in stats]
  row.update(step_ms=med * 1e3, step_ms_all=[round(s * 1e3, 2) for s in step_s],
             tokens_per_s=args.batch * seq_len / med,
             tokens_per_s_per_gpu=args.batch * seq_len / med / context,
             peak_gib=max(peaks) / 2**30 if all(p is not None for p in peaks) else None,
             device_kind=devices[0].device_kind, jax_version=jax.__version__,
             **shared.loss_summary(losses))
  return row


def _xla_memory(compiled) -> dict:
  """XLA's own account of the step's memory per device (GiB): the temporaries (activations
  kept for the backward, workspaces) beside the arguments and outputs it aliases. Where the
  peak grows faster than T / N, this says whether the compiled program asked for it."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  # not every backend implements it
    return {}
  if m is None:
    return {}
  gib = lambda b: round(b / 2**30, 3)  # noqa: E731
  return {"xla_temp_gib": gib(m.temp_size_in_bytes),
          "xla_argument_gib": gib(m.argument_size_in_bytes),
          "xla_output_gib": gib(m.output_size_in_bytes),
          "xla_alias_gib": gib(m.alias_size_in_bytes)}


# --- the parent ----------------------------------------------------------------------------


def _todo(args) -> list[tuple[str, int, int]]:
  rows = [tuple(int(x) for x in r.split(":")) for r in args.rows.split(",") if r]
  return [(e, t, c) for e in args.encodings.split(",") for t, c in rows]


def read_rows(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def run_all(args) -> None:
  start = time.time()
  done = {(r["encoding"], r["seq_len"], r["context"]) for r in read_rows(args.out)
          if not r.get("error")}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  for encoding, seq_len, context in _todo(args):
    if (encoding, seq_len, context) in done:
      continue
    if args.deadline and time.time() - start > args.deadline:
      print(f"deadline: not started {encoding} T={seq_len} context={context}", flush=True)
      continue
    argv = [sys.executable, "-m", "experiments.benchmarks.context_scaling",
            "--one", f"{encoding}:{seq_len}:{context}"] + sys.argv[1:]
    row = {"encoding": encoding, "seq_len": seq_len, "context": context, "batch": args.batch,
           "layers": args.layers, "d_model": args.d_model, "heads": args.heads,
           "head_dim": args.head_dim, "scan_layers": args.scan_layers,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "error": None}
    t0 = time.time()
    try:
      # faulthandler: a crash in native code (XLA, NCCL, a kernel) still prints Python's stack.
      env = dict(os.environ, PYTHONFAULTHANDLER="1")
      out = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, env=env)
      lines = [l for l in out.stdout.splitlines() if l.startswith(ROW_PREFIX)]
      if lines:
        row.update(json.loads(lines[-1][len(ROW_PREFIX):]))
      else:
        tail = (out.stderr or out.stdout).strip().splitlines()
        row["error"] = f"exit {out.returncode}: {tail[-1][:300] if tail else ''}"
        row["log_tail"] = tail[-40:]
    except subprocess.TimeoutExpired as e:
      row["error"] = f"timeout after {args.timeout:.0f} s"
      err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
      row["log_tail"] = err.strip().splitlines()[-40:]
    row["wall_s"] = time.time() - t0
    with open(args.out, "a") as f:
      f.write(json.dumps(row) + "\n")
    print(_line(row), flush=True)
    for name, ms, calls in row.get("top_ops") or []:
      print(f"    {ms:9.2f} ms {calls:5d}x  {name}", flush=True)
    if row.get("log_tail"):
      print("\n".join("    " + line for line in row["log_tail"]), flush=True)


def _line(r: dict) -> str:
  head = f"{r['encoding']:>9} T={r['seq_len']:>6} ctx={r['context']}"
  if r.get("error"):
    return f"{head} ERROR {r['error'][:150]}"
  comm = r.get("comm_share")
  return (f"{head} {r['tokens_per_s_per_gpu']:>9,.0f} tok/s/GPU  {r['step_ms']:>8.1f} ms  "
          f"{_fmt(r.get('peak_gib'), '.1f')} GiB  comm {_fmt(comm, '.1%')}  "
          f"loss {r['loss_first']:.2f}>{r['loss_last']:.2f} falling={r['loss_falling']}  "
          f"compile {r['compile_s']:.0f} s")


def _fmt(x, spec) -> str:
  return "-" if x is None else format(x, spec)


def render_markdown(rows: list[dict]) -> str:
  latest = {}
  for r in rows:
    layers = f"{r.get('layers', 12)}{' (scan)' if r.get('scan_layers') else ''}"
    latest[(r["encoding"], layers, r["seq_len"], r["context"])] = r
  ok = {k: r for k, r in latest.items() if not r.get("error")}
  devices = sorted({r["device_kind"] for r in ok.values()})
  dates = sorted(r["date"] for r in latest.values())
  lines = ["# Context-parallel training", "",
           f"- machine: {', '.join(devices) or '-'}; date: "
           f"{dates[0] if dates else '-'} .. {dates[-1] if dates else '-'}",
           "- model: llama-style, d_model 768, 12 heads of 64, vocabulary 32,000, bf16, batch 1 "
           "(the text task); command in experiments/benchmarks/context_scaling.py",
           "- scaling: tokens/s per GPU over the same encoding's one-GPU row at T / context; "
           "ideal: the best scaling the work allows, that row's training FLOPs per token over "
           "this one's (causal attention's work per token grows with T); of ideal: scaling / "
           "ideal; "
           "memory: peak GiB over that row's; XLA temp: the compiled step's temporaries per "
           "device (memory_analysis)", "",
           "| encoding | layers | T | context | tokens/s per GPU | step ms | scaling | ideal | "
           "of ideal | peak GiB | XLA temp GiB | memory ratio | comm share | loss first > last |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for (e, n, t, c), r in sorted(latest.items(), key=lambda kv: kv[0]):
    if r.get("error"):
      lines.append(f"| {e} | {n} | {t:,} | {c} | error: {r['error'][:120]} | | | | | | | | | |")
      continue
    base = ok.get((e, n, t // c, 1)) if c > 1 else None
    scale = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else None
    ideal = (base["flops_per_token"] / r["flops_per_token"]
             if base and base.get("flops_per_token") and r.get("flops_per_token") else None)
    mem = (r["peak_gib"] / base["peak_gib"]
           if base and r.get("peak_gib") and base.get("peak_gib") else None)
    lines.append(f"| {e} | {n} | {t:,} | {c} | {r['tokens_per_s_per_gpu']:,.0f} | "
                 f"{r['step_ms']:.1f} | {_fmt(scale, '.2f')} | {_fmt(ideal, '.2f')} | "
                 f"{_fmt(scale / ideal if scale and ideal else None, '.2f')} | "
                 f"{_fmt(r.get('peak_gib'), '.1f')} | "
                 f"{_fmt(r.get('xla_temp_gib'), '.1f')} | {_fmt(mem, '.2f')} | "
                 f"{_fmt(r.get('comm_share'), '.1%')} | "
                 f"{r['loss_first']:.2f} > {r['loss_last']:.2f}"
                 f"{'' if r['loss_falling'] else ' (not falling)'} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.one:
    encoding, seq_len, context = args.one.split(":")
    # Before the parent's timeout kills this row, print where every thread is.
    faulthandler.dump_traceback_later(max(args.timeout - 20, 1), exit=False)
    row = run_row(args, encoding, int(seq_len), int(context))
    print(ROW_PREFIX + json.dumps(row), flush=True)
    return
  if not args.render_only:
    run_all(args)
  rows = read_rows(args.out)
  md = render_markdown(rows)
  print(md, flush=True)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(md)


if __name__ == "__main__":
  main()
