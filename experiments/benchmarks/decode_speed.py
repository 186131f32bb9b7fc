r"""Decode speed and cache memory per encoding at long contexts (issue 13).

    python -m experiments.benchmarks.decode_speed [--encodings=rope,fox,path,grape_m_ctx] \
        [--contexts=2048,8192,32768] [--batch_size=1 --num_layers=2 --d_model=256 \
        --num_heads=4 --head_dim=64 --dtype=float32 --new_tokens=32 --runs=5] \
        [--out=FILE]

For each (encoding, context S) it builds a randomly initialised Transformer, a cache of S
slots whose rows hold S - new_tokens tokens (random contents: a decode step's work does not
depend on the values, and every step reads all S slots, masked), and times the compiled
greedy decoding loop of posenc_jax.generation (lax.while_loop, one token per row per step):
one warm-up call, then --runs rounds that time one call of every encoding in turn (so load on
a shared machine hits them alike), the median per encoding. Reported: milliseconds per step,
tokens/s (batch x new_tokens / time), the ratio of the step time to rope's at the same context, the
cache's size (every layer) and XLA's temporary buffers of the compiled loop. The prefill is
not timed (it is the training forward).

The same command runs on a CPU or a GPU; it writes the table (command, machine, date, jax
version) to --out (default: print only) and prints it. The current table is
docs/benchmarks/decode_speed.md (--out=docs/benchmarks/decode_speed.md).
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags
from flax import nnx

from posenc_jax import generation
from posenc_jax import model as model_lib

_ENCODINGS = flags.DEFINE_list(
    "encodings", ["rope", "fox", "path", "grape_m_ctx"],
    "Encodings; a trailing @xla compiles with XLA's default options "
    "instead of generation.REGION_ANALYSIS (on a CPU, rope@xla copies the cache each step).")
_CONTEXTS = flags.DEFINE_list("contexts", ["2048", "8192", "32768"], "Cache sizes (max_len).")
_BATCH = flags.DEFINE_integer("batch_size", 1, "Rows decoded together.")
_LAYERS = flags.DEFINE_integer("num_layers", 2, "Transformer layers.")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Model width.")
_HEADS = flags.DEFINE_integer("num_heads", 4, "Query heads (= kv heads).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dim.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Model compute dtype.")
_NEW = flags.DEFINE_integer("new_tokens", 32, "Tokens decoded per timed call.")
_RUNS = flags.DEFINE_integer("runs", 5, "Timed calls per case (median).")
_OUT = flags.DEFINE_string("out", None, "Write the markdown table here too.")
_BANDWIDTH = flags.DEFINE_float(
    "bandwidth_gbs", None, "Device memory bandwidth (GB/s) for the read bound; default: the "
    "device's datasheet figure where known (H100 SXM 3350, H200 4800), else no bound.")

# Datasheet HBM bandwidth, GB/s, by jax's device_kind.
_DATASHEET_GBS = {"NVIDIA H100 80GB HBM3": 3350.0, "NVIDIA H200": 4800.0}

MIB = 2**20


def _setup(name: str, S: int) -> dict:
  """Builds, compiles and warms up one case; returns its `call` (one timed decode) and sizes."""
  encoding, _, options = name.partition("@")
  if options not in ("", "xla"):
    raise ValueError(f"--encodings entry {name!r}: the only suffix is @xla")
  cfg = model_lib.ModelConfig(vocab_size=256, encoding=encoding, num_layers=_LAYERS.value,
                              d_model=_D_MODEL.value, num_heads=_HEADS.value,
                              head_dim=_HEAD_DIM.value, dtype=_DTYPE.value)
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(params=0))
  B, N = _BATCH.value, _NEW.value
  gen = generation.Generator(model, max_len=S, compiler_options={} if options else None)
  shapes = jax.eval_shape(lambda: model.init_cache(B, S))
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(shapes))))

  def fill(x):  # random contents; rows hold S - N tokens
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jax.random.normal(next(keys), x.shape, jnp.float32).astype(x.dtype)
    return jnp.zeros(x.shape, x.dtype)

  state = {"cache": {**jax.tree.map(fill, shapes), "end": jnp.full((B,), S - N, jnp.int32)}}
  end = np.asarray(state["cache"]["end"])   # a host copy: the cache (end included) is donated
  logits = jnp.zeros((B, cfg.vocab_size), jnp.float32)

  def call() -> float:
    _, _, seconds, cache = gen.decode(state["cache"], logits, max_new_tokens=N)
    state["cache"] = {**cache, "end": jnp.asarray(end)}
    return seconds

  started = time.perf_counter()
  call()                                                            # compiles, warms up
  mem = gen.memory_analysis("decode")
  params = nnx.state(model, nnx.Param)
  return dict(encoding=name, context=S, call=call, first_s=time.perf_counter() - started,
              cache_mib=sum(x.nbytes for x in jax.tree.leaves(state["cache"])) / MIB,
              param_mib=sum(x.nbytes for x in jax.tree.leaves(params)) / MIB,
              temp_mib=mem.temp_size_in_bytes / MIB if mem else None)


def _measure(cases: list[dict]) -> None:
  """Interleaved rounds (one call of every case per round), so that a burst of load on a
  shared machine hits every encoding alike; each case keeps the median of its calls."""
  times = {id(c): [] for c in cases}
  for _ in range(_RUNS.value):
    for c in cases:
      times[id(c)].append(c["call"]())
  for c in cases:
    t = times[id(c)]
    step_s = statistics.median(t) / _NEW.value
    c.update(step_ms=1e3 * step_s, tok_s=_BATCH.value / step_s,
             spread=(max(t) - min(t)) / statistics.median(t))
    del c["call"]


def _machine() -> str:
  d = jax.devices()[0]
  if d.platform == "cpu":
    return f"{os.cpu_count()}-core CPU ({platform.machine()}), jax {jax.__version__}"
  return f"{jax.device_count()} x {d.device_kind}, jax {jax.__version__}"


def _bandwidth_gbs() -> float | None:
  if _BANDWIDTH.value is not None:
    return _BANDWIDTH.value
  return _DATASHEET_GBS.get(jax.devices()[0].device_kind)


def read_bound_ms(*, cache_mib: float, param_mib: float, bandwidth_gbs: float) -> float:
  """The step's memory bound: every cache slot and every parameter read once, at the device's
  bandwidth (a step cannot be faster; PaTH also writes its keys back, which this leaves out)."""
  return (cache_mib + param_mib) * MIB / (bandwidth_gbs * 1e9) * 1e3


def _table(rows: list[dict], bandwidth_gbs: float | None) -> str:
  rope = {r["context"]: r["step_ms"] for r in rows if r["encoding"] == "rope"}
  out = ["| encoding | context | ms / step | tokens/s | step vs rope | cache (MiB) "
         "| read bound (ms) | step / bound | XLA temp (MiB) | compile+1st call (s) |",
         "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    ratio = f"{r['step_ms'] / rope[r['context']]:.2f}x" if r["context"] in rope else "-"
    temp = "-" if r["temp_mib"] is None else f"{r['temp_mib']:.1f}"
    bound, over = "-", "-"
    if bandwidth_gbs:
      b = read_bound_ms(cache_mib=r["cache_mib"], param_mib=r["param_mib"],
                        bandwidth_gbs=bandwidth_gbs)
      bound, over = f"{b:.3f}", f"{r['step_ms'] / b:.2f}x"
    out.append(f"| {r['encoding']} | {r['context']} | {r['step_ms']:.2f} | {r['tok_s']:,.0f} "
               f"| {ratio} | {r['cache_mib']:.1f} | {bound} | {over} | {temp} "
               f"| {r['first_s']:.1f} |")
  return "\n".join(out)


def fit_fixed_and_bandwidth(rows: list[dict]) -> dict[str, tuple[float, float]]:
  """Per encoding over its contexts, the least-squares line step_ms = fixed + slope * bytes
  of cache: (fixed ms, the cache's effective rate in GB/s = 1 / slope). The fixed part is
  what a step costs whatever its context (the parameters' read, launches, the layers' small
  ops); the rate says how fast the context-proportional part runs against the bandwidth."""
  out = {}
  for name in dict.fromkeys(r["encoding"] for r in rows):
    pts = [(r["cache_mib"] * MIB, r["step_ms"]) for r in rows
           if r["encoding"] == name]
    if len({x for x, _ in pts}) < 2:
      continue
    slope, fixed = np.polyfit([x for x, _ in pts], [y for _, y in pts], 1)
    out[name] = (float(fixed), 1e3 / float(slope) / 1e9 if slope > 0 else float("inf"))
  return out


def _fit_table(rows: list[dict], bandwidth_gbs: float | None) -> str:
  fits = fit_fixed_and_bandwidth(rows)
  if not fits:
    return ""
  params = {r["encoding"]: r["param_mib"] for r in rows}
  out = ["| encoding | fixed ms / step | parameters' read at the bound (ms) | cache read at "
         "(GB/s) | of the bound's bandwidth |", "|---|---|---|---|---|"]
  for name, (fixed, gbs) in fits.items():
    p_ms, share = "-", "-"
    if bandwidth_gbs:
      p_ms = (
          f"{read_bound_ms(cache_mib=0, param_mib=params[name], bandwidth_gbs=bandwidth_gbs):.3f}")
      share = f"{gbs / bandwidth_gbs:.2f}"
    out.append(f"| {name} | {fixed:.3f} | {p_ms} | {gbs:,.0f} | {share} |")
  return "\n".join(["", "Each encoding's step fitted over its contexts as fixed + cache bytes / "
                    "rate:", "", *out])


def main(argv) -> None:
  del argv
  contexts = [int(c) for c in _CONTEXTS.value]
  if _NEW.value < 1 or min(contexts) <= _NEW.value:
    print(f"error: --new_tokens={_NEW.value} must be >= 1 and below every context {contexts}",
          file=sys.stderr)
    sys.exit(2)
  started = datetime.datetime.now().isoformat(timespec="minutes")
  rows = []
  for S in contexts:
    cases = [_setup(name, S) for name in _ENCODINGS.value]
    _measure(cases)
    for r in cases:
      print(f"{r['encoding']:12s} S={S:6d}  {r['step_ms']:8.2f} ms/step  {r['tok_s']:9,.0f} "
            f"tok/s  cache {r['cache_mib']:8.1f} MiB  (spread {100 * r['spread']:.0f}%)",
            file=sys.stderr, flush=True)
    rows += cases
  rows.sort(key=lambda r: (_ENCODINGS.value.index(r["encoding"]), r["context"]))
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
  bandwidth = _bandwidth_gbs()
  bound_line = (f"- read bound: (cache + parameters) bytes / {bandwidth:,.0f} GB/s, each step "
                f"reading every cache slot and parameter once" if bandwidth else
                "- read bound: none (no bandwidth known for this device; --bandwidth_gbs)")
  text = "\n".join([
      "# Decode speed and cache memory",
      "",
      f"- command: `python -m experiments.benchmarks.decode_speed {' '.join(sys.argv[1:])}`",
      f"- machine: {_machine()}; load average {load:.1f} at the end",
      f"- date: {started}",
      f"- model: {_LAYERS.value} layers, d_model {_D_MODEL.value}, {_HEADS.value} heads x "
      f"{_HEAD_DIM.value}, {_DTYPE.value}, batch {_BATCH.value}; greedy, {_NEW.value} tokens "
      f"per call, median of {_RUNS.value} interleaved rounds after one warm-up; every step "
      f"reads all `context` slots of the cache",
      bound_line,
      "",
      _table(rows, bandwidth), _fit_table(rows, bandwidth), ""])
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(text)
  print(text)


if __name__ == "__main__":
  app.run(main)
