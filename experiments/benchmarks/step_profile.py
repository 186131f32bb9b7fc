"""Where a training step's time goes: host data, host-to-device transfer, or the device step.

  python -m experiments.benchmarks.step_profile \
      --config=experiments/configs/flipflop.py:gpu --encoding path [--steps 50] [--trace DIR]

Builds the run's Trainer and data stream exactly as experiments/train.py does (same config
checks, mesh, model and optimizer), then times, each as a median over --steps:
  data    next(train_iter): the synthetic task's or the corpus's batch on the host
  put     trainer.put(batch) to device, blocked on
  step    trainer.train_step on one resident batch, blocked on each step (device time plus
          dispatch)
  loop    data + put + step as the training loop runs them (dispatch not blocked on, so
          device work overlaps the next batch's host work), per step over --steps
Written for the small synthetic-task models (flip-flop, MQRAR), whose training ran at
220-550k tokens/s on an H200, within 2x of the 125M model per token (issue 15). --trace
writes a jax.profiler trace of a few loop steps for TensorBoard / Perfetto.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402

from experiments import config_checks  # noqa: E402
from experiments import data  # noqa: E402
from experiments import train  # noqa: E402
from experiments.benchmarks import common  # noqa: E402
from experiments.sweeps import plan_runs  # noqa: E402


def _median_ms(fn, n: int) -> float:
  times = []
  for _ in range(n):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return 1e3 * statistics.median(times)


def profile(config, *, steps: int, trace_dir: str | None = None) -> dict:
  """-> {"data_ms", "put_ms", "step_ms", "loop_ms", "tokens_per_step", "plan"} for `config`'s
  run; plan: the attention kernel's (common.model_plan), None where the model runs none."""
  mcfg = config_checks.check(config, workdir="", data_module=data, num_devices=jax.device_count())
  t = config.train
  mesh, trainer, it = train.setup(config, mcfg, data)
  with jax.set_mesh(mesh):
    state = trainer.init_state(t.seed)
    batch = trainer.put(next(it))
    state, m = trainer.train_step(state, batch)   # compile
    jax.block_until_ready(m)
    out = {"tokens_per_step": t.batch_size * config.data.seq_len,
           "plan": common.model_plan(mcfg, batch=t.batch_size, seq_len=config.data.seq_len,
                                     segments="segment_ids" in batch,
                                     backend=jax.default_backend())}
    out["data_ms"] = _median_ms(lambda: next(it), steps)
    host = next(it)
    out["put_ms"] = _median_ms(lambda: jax.block_until_ready(trainer.put(host)), steps)

    def one_step():
      nonlocal state
      state, metrics = trainer.train_step(state, batch)
      jax.block_until_ready(metrics)
    out["step_ms"] = _median_ms(one_step, steps)

    def loop(n):
      nonlocal state
      start = time.perf_counter()
      for _ in range(n):
        state, metrics = trainer.train_step(state, trainer.put(next(it)))
      jax.block_until_ready(metrics)
      return 1e3 * (time.perf_counter() - start) / n
    out["loop_ms"] = loop(steps)
    if trace_dir:
      n = min(steps, 10)
      with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        loop(n)
      out["top_ops"] = common.top_ops(trace_dir, steps=n)
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", required=True, help="experiment config file[:arg]")
  p.add_argument("--encoding", required=True)
  p.add_argument("--steps", type=int, default=50)
  p.add_argument("--trace", default=None, help="write a jax.profiler trace here")
  a = p.parse_args(argv)
  path, _, arg = a.config.partition(":")
  spec = importlib.util.spec_from_file_location("cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  config = mod.get_config(arg or None)
  runs = [r for r in plan_runs(config, "") if r["encoding"] == a.encoding]
  if not runs:
    raise SystemExit(f"--encoding={a.encoding!r} is not in the config's sweep.encodings "
                     f"{tuple(config.sweep.encodings)}")
  r = profile(runs[0]["config"], steps=a.steps, trace_dir=a.trace)
  tok = r["tokens_per_step"]
  print(f"{a.config} {a.encoding}: tokens/step {tok:,}")
  print("attention kernel plan: " + (r["plan"] or "none (no Pallas kernel)").replace("\n", "\n  "))
  print("| data ms | put ms | step ms | loop ms | loop tokens/s |")
  print("|---|---|---|---|---|")
  print(f"| {r['data_ms']:.2f} | {r['put_ms']:.2f} | {r['step_ms']:.2f} | {r['loop_ms']:.2f} | "
        f"{tok / r['loop_ms'] * 1e3:,.0f} |")
  if r.get("top_ops"):
    print("\n| op (trace) | ms per step | calls per step |\n|---|---|---|")
    for name, ms, n in r["top_ops"]:
      print(f"| {name[:90]} | {ms:.3f} | {n} |")


if __name__ == "__main__":
  main()
