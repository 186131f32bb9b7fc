"""What the benchmarks share: the kernel anchors' shapes and inputs, kernel options from the
command line, timers, the device kernels of a profiler trace, and the plan a model's attention
layer runs.

The kernels are reached only through kernels_pallas's public functions (path_attention,
forgetting_attention, explain, phases, BlockSizes). Every other benchmark module imports this
one; it imports none of them.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas as kp
from posenc_jax import dispatch
from posenc_jax import model as model_lib

# The anchor shapes (B, T, H, D) of the kernel benchmarks; 5 is one layer of the 125M model
# that train_throughput.py times.
CASES = [(32, 2048, 32, 64), (32, 4096, 32, 64), (8, 8192, 32, 64), (8, 4096, 16, 128),
         (4, 16384, 16, 128), (16, 2048, 12, 64)]
OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(kp.BlockSizes))
# The encoding families whose attention may run a Pallas kernel (path_attention;
# forgetting_attention, which also runs softmax attention as FoX without a gate).
KERNEL_FAMILIES = ("path", "forgetting", "softmax")


# --- command-line values -------------------------------------------------------------------


def case_shape(case) -> tuple[int, int, int, int]:
  """A --cases entry -> (B, T, H, D): an index into CASES, or a shape "BxTxHxD" (e.g.
  8x8192x16x128, beside the anchors)."""
  token = str(case)
  if "x" in token:
    try:
      shape = tuple(int(v) for v in token.split("x"))
    except ValueError:
      shape = ()
    if len(shape) != 4 or min(shape) < 1:
      raise ValueError(f"--cases entry {token!r}: a shape is BxTxHxD, four positive integers")
    return shape
  if not token.isdigit() or int(token) >= len(CASES):
    raise ValueError(f"--cases entry {token!r}: an index below {len(CASES)} or BxTxHxD")
  return CASES[int(token)]


def case_label(case):
  """The JSON rows' "case": the index as an int, a shape as its string."""
  return int(case) if str(case).isdigit() else str(case)


def parse_cases(text: str) -> list[str]:
  """"0,3,8x8192x16x128" -> its entries, each checked (a bad one raises before anything runs)."""
  cases = [c.strip() for c in text.split(",") if c.strip()]
  if not cases:
    raise ValueError("--cases is empty: give indices into CASES or shapes BxTxHxD")
  for c in cases:
    case_shape(c)
  return cases


def block_sizes(options: str) -> kp.BlockSizes:
  """A --options string ("span=8,mosaic=false"; "" for the defaults) -> kp.BlockSizes. A bad
  string raises one line that names the valid options."""
  try:
    return kp.BlockSizes.of(options or None)
  except (ValueError, TypeError) as e:
    why = str(e) if "the options are" in str(e) else (
        f"{e}; the options are {', '.join(OPTION_FIELDS)}")
    raise ValueError(f"--options {options!r}: {why}") from None


def variant_label(name: str, options: str) -> str:
  """A row's variant key: "path", or "path[span=8,mosaic=false]" with kernel options."""
  return f"{name}[{options}]" if options else name


# --- inputs --------------------------------------------------------------------------------


def inputs(B, T, H, D, *, kv_heads=None, key=0, dtype=jnp.bfloat16):
  """(q, k, v, w, beta, log_forget, do) as the anchors draw them: q, k, v, do normal in `dtype`;
  w unit rows, beta in (0, 2) and log f = log U(0.95, 1) in float32; k, v, w, beta with
  kv_heads heads (default H)."""
  K = kv_heads or H
  ks = jax.random.split(jax.random.key(key), 7)
  q, k, v = (jax.random.normal(x, (B, T, H, D), dtype) for x in ks[:3])
  w = jax.random.normal(ks[3], (B, T, H, D), jnp.float32)
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  beta = 2 * jax.random.uniform(ks[4], (B, T, H), jnp.float32)
  log_forget = jnp.log(jax.random.uniform(ks[5], (B, T, H), jnp.float32, 0.95, 1.0))
  do = jax.random.normal(ks[6], (B, T, H, D), dtype)
  return q, k[:, :, :K], v[:, :, :K], w[:, :, :K], beta[:, :, :K], log_forget, do


def fla_gate(log_forget, scale):
  """FLA's `g` for our log forget gate. fla-core 0.6.0's parallel_path_attn scales the gate's
  cumulative sum G = cumsum(g) with the logits: l_ij = scale (q_i^T P k_j + G_i - G_j) (its
  parallel_path_fwd.py and its reference naive.py, which adds the gate before
  `(A * scale).softmax`). Ours adds sum_{s=j+1}^{i} log_forget_s unscaled, with the same index
  convention and the natural log, so the same function needs g = log_forget / scale (and the
  gradient of our log f is FLA's dg / scale). Passing raw log f puts FLA ~0.7 relative RMS off
  the dense oracle."""
  return log_forget / scale


def rel_rms(a, b) -> float:
  """Relative RMS error of a against b, in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


# --- timing and memory ---------------------------------------------------------------------


def grad_fn(fn, n: int):
  """jit of the gradient of sum(fn(*a) * do) with respect to fn's first n arguments, called
  as g(*a, do). The cotangent do is an argument, not a closed-over array: captured, it would
  be baked into the program as a constant (2 GiB at B 32, T 16384, 32 heads x 64), which the
  compiler then parses and holds."""
  return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a[:-1]).astype(jnp.float32) * a[-1]),
                          argnums=tuple(range(n))))


def median_ms(f, *args, n=10) -> float:
  """Median wall-clock ms of f(*args) over n calls after one warm-up, each waited for
  (jax.block_until_ready): the kernel anchors' measure."""
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append((time.perf_counter() - t) * 1e3)
  return sorted(ts)[len(ts) // 2]


def pipelined_ms(f, *args, n=10) -> float:
  """Device ms a call: n calls dispatched back to back and one wait at the end, so the host's
  dispatch and wait overlap the device's work, as in a training loop (and as
  triton.testing.do_bench's CUDA events time FLA). median_ms's wall clock adds that latency to
  each call (~0.7 ms at 32,4096,32,64 on an H200)."""
  jax.block_until_ready(f(*args))
  t = time.perf_counter()
  for _ in range(n):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t) * 1e3 / n


def compiled_gib(compiled) -> float | None:
  """XLA's estimate of a compiled program's memory (arguments + outputs + temporaries), GiB;
  None where the backend does not report it."""
  try:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes) / 2**30
  except Exception:  # not every backend reports it
    return None


def top_ops(trace_dir: str, *, steps: int, k: int = 12) -> list[tuple[str, float, int]]:
  """The k device ops with the most time in a jax.profiler trace: (name, ms per step, calls per
  step). Device ops are the events of processes whose name mentions a GPU or TPU; a CPU run has
  none, so its host events are ranked instead."""
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                           recursive=True))
  if not files:
    return []
  with gzip.open(files[-1]) as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  names = {e["pid"]: e["args"].get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  device = {pid for pid, n in names.items() if "GPU" in n or "TPU" in n or "/device:" in n}
  total, calls = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and (not device or e["pid"] in device):
      total[e["name"]] += e.get("dur", 0) / 1e3
      calls[e["name"]] += 1
  return [(n, t / steps, calls[n] // steps) for n, t in total.most_common(k)]


# --- the plan of a model's attention -------------------------------------------------------


def _model_block_sizes(mcfg) -> kp.BlockSizes:
  """The kernel options a model passes: "pallas:key=value,..." and then kernel_options."""
  impl = mcfg.implementation or ""
  text = impl.partition(":")[2] if impl.startswith("pallas") else ""
  fields = dataclasses.asdict(kp.BlockSizes.of(text or None))
  return kp.BlockSizes.of({**fields, **dict(mcfg.kernel_options)})


def model_plan(mcfg, *, batch: int, seq_len: int, segments: bool, backend: str) -> str | None:
  """The plan (kp.explain) of the kernel one attention layer of model config `mcfg` runs on
  `backend` at [batch, seq_len], or None where that layer runs no kernel (its encoding's family
  has none, or its implementation is not "pallas"). The kernel's inputs come from the
  encoding's own prepare, traced abstractly; the softmax family runs the FoX kernel without a
  gate at the padded head dim, as posenc_jax.attention does."""
  enc = mcfg.encoding_fn()
  if enc.family not in KERNEL_FAMILIES:
    return None
  sd = jax.ShapeDtypeStruct
  dtype = model_lib.DTYPES[mcfg.dtype]
  B, T, H, K, D = batch, seq_len, mcfg.num_heads, mcfg.kv_heads, mcfg.head_dim
  seg = sd((B, T), jnp.int32) if segments else None
  layer = dict(x=sd((B, T, mcfg.d_model), dtype), q=sd((B, T, H, D), dtype),
               k=sd((B, T, K, D), dtype), v=sd((B, T, K, D), dtype),
               positions=sd((B, T), jnp.int32), tokens=sd((B, T), jnp.int32), segment_ids=seg)
  params = jax.eval_shape(lambda: enc.init(jax.random.key(0), mcfg.dims))
  # train=False: the shapes are the training step's, and no encoding needs an rng key for them
  kernel_args = lambda p, l: (lambda r: (r.q, r.k, r.v, r.inputs))(
      enc.prepare(p, rng=None, train=False, **l))
  q, k, v, x = jax.eval_shape(kernel_args, params, layer)
  impl = mcfg.implementation or dispatch.auto_implementation(
      enc.family, T=T, dtype=dtype, head_dim=q.shape[-1], v_head_dim=v.shape[-1],
      has_segments=segments, backend=backend).implementation
  if impl.partition(":")[0] != "pallas":
    return None
  if enc.family == "softmax":
    width = dispatch.pallas_head_dim(q.shape[-1], v.shape[-1])
    q, k, v = (sd(a.shape[:-1] + (width,), a.dtype) for a in (q, k, v))
  return str(kp.explain(q, k, v, x.get("w"), x.get("beta"), x.get("log_forget"),
                        segment_ids=seg, block_sizes=_model_block_sizes(mcfg),
                        backend=backend if backend in ("gpu", "tpu") else "interpret"))
