"""Whole-training-step throughput of one ~125M llama-style model per encoding, on one GPU.

What is timed is what users run: experiments.train.Trainer's jitted, donating train_step
(forward, backward, global-norm clipping, AdamW) on real `text` batches (byte-level Python
stdlib source, packed rows with segment_ids / positions), inside `jax.set_mesh` of a 1 x 1 mesh.
Model: ModelConfig(vocab_size=32000, num_layers=12, d_model=768, num_heads=12, head_dim=64,
block="llama", dtype="bfloat16"), 134M parameters with the untied head (each row has the exact
count). Tokens per step are constant: B = tokens_per_step / T (16 x 2048, 4 x 8192).

  # all encodings at T = 2048; restartable: rows already in --out are skipped, so under a
  # 10-minute limit per command the same command is repeated until it reports nothing to do.
  # --out under workdirs/ (git-ignored) survives between calls; copy it to $OUT to keep it.
  python -m experiments.benchmarks.train_throughput --seq-lens 2048 --deadline 540 \
      --out workdirs/train_throughput.jsonl
  # a subset at T = 8192
  python -m experiments.benchmarks.train_throughput --seq-lens 8192 --deadline 540 \
      --encodings rope,path,path_fox,fox,alibi --out workdirs/train_throughput.jsonl
  # the PyTorch anchors (flash-linear-attention's PaTH kernel), both lengths
  python -m experiments.benchmarks.train_throughput --encodings fla_path,fla_path_fox \
      --deadline 540 --out workdirs/train_throughput.jsonl
  # render the table of everything in --out
  python -m experiments.benchmarks.train_throughput --render-only \
      --out workdirs/train_throughput.jsonl --markdown workdirs/train_throughput.md

docs/benchmarks/train_throughput.md has the current table; its rows are in
docs/benchmarks/data/train_throughput_*.jsonl (render one with --render-only --out FILE).

Each (encoding, T) runs in a fresh subprocess (`--one NAME --seq-len T ...`), so peak memory is
per encoding and an OOM, crash or timeout becomes a row with its error. The parent never
initialises a GPU backend. Each finished row is appended at once to --out (JSON lines);
rows already there (same encoding, T, B, dtype, implementation, scan_layers) are skipped unless
--force (--retry-errors re-runs only the failed ones); --deadline stops launching (and kills a child
cut short by it, writing no row) before the caller's wall-clock limit, so the same command run
again continues where it stopped.

Per row: compile seconds (lower + compile of the train step, separately), --warmup steps, then
--steps timed steps (wall clock around each step, jax.block_until_ready on its outputs; the
MEDIAN is reported, tokens/s = B T / median), each step on a new batch as in training: the
first --num-batches are put on the device before timing, later ones (loss steps only) as they
come, untimed. Loss check: the loss of each of the first --loss-steps steps (the timed ones
included); `falling` = mean of the last k < mean of the first k, k = min(5,
half the steps). Peak memory: memory_stats()["peak_bytes_in_use"] (None on CPU). The attention
implementation: `implementation` is the one requested (auto = ModelConfig.implementation None);
`attention_impl` says what ran: cudnn or pallas when the compiled step holds their custom calls
(listed in `kernels`), otherwise the jnp path the auto rule of posenc_jax/attention.py takes
(xla = jax.nn.dot_product_attention's XLA path, which its implementation=None picks; reference
up to the family's CPU_DENSE_MAX_T, chunked beyond; PaTH chunked at every T).

FLOPs per training step (model FLOPs: what the maths needs, not what a kernel recomputes;
backward = 2 x forward, so every forward count is multiplied by 3). N = B T tokens, L layers,
H heads, D head dim, C = 64 the PaTH chunk:

  dense      6 P N, P = all parameters but the embedding table (the lookup is no matmul); P
             holds the head, the encoding's projections (PaTH's w / beta / gate maps, ...) and
             also the norm scales and other vectors (< 0.1% of P, counted as if matmuls)
  attention  3 L B 2 H D T^2: causal softmax attention, QK^T and PV over half the T x T square
             (forward 2 * 2 H D T^2 / 2 per sequence and layer). The same for every encoding
             whose extra work is elementwise: rotations (RoPE family, GRAPE-M, accumulated
             rotations), additive biases (ALiBi, FoX, GRAPE-A), GRAPE-AP's path-integral bias
             and TAPA's phase modulation are not counted as matmul FLOPs.
  PaTH       (path, path_fox, fla_path*) adds to the attention:
             transport  3 L B H (n(n-1)/2) 2 C D^2, n = ceil(T / C): per query chunk and each
                        earlier key chunk one C x D x D product moves the query tile
                        (forward ~ 2 H D^2 T^2 / (2 C))
             pre-pass   3 L B H n (12 C^2 D + 2 C D^2 + 2 C^3 / 3): per chunk W W^T (2 C^2 D),
                        the triangular inverse (~2 C^3 / 3), U = T^-1 (beta W) (2 C^2 D),
                        E = W^T U (2 C D^2), and the intra-chunk q and k transforms
                        (2 x 4 C^2 D)

MFU = FLOPs / median step time / peak, against --peak-tflops (989 = H100 / H200 SXM dense bf16)
and against a measured peak: the median of 10 bf16 matmuls of --matmul-size (8192^3) in JAX,
measured once per --out file in its own subprocess (a JAX client in the parent would hold GPU
memory while the encodings run) and passed to every row.

The anchor (rows fla_path, fla_path_fox; experiments/benchmarks/fla_anchor_model.py): the same
model in PyTorch with flash-linear-attention's PaTH kernel (fla-core 0.6.0), bf16 autocast,
fused AdamW, clipping 1.0, the same batches; packed documents are masked through FLA's
cu_seqlens (--no-fla-varlen: plain [B, T] rows). compile_s is its first step (Triton JIT and
autotuning), peak memory torch.cuda.max_memory_allocated, steps timed with
torch.cuda.synchronize around each.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)  # also runnable as a file, like the other benchmarks

import jax  # noqa: E402 (after the path insert)
import jax.numpy as jnp  # noqa: E402

from experiments import sharding  # noqa: E402
from experiments import train  # noqa: E402
from experiments.benchmarks import common  # noqa: E402
from experiments.benchmarks import fla_anchor_model  # noqa: E402 (torch only inside it)
from experiments.benchmarks import throughput_parent  # noqa: E402
from experiments.benchmarks.throughput_common import (  # noqa: E402
    EMBED, ROW_PREFIX, Schedule, Size, count_params, family_of, now_utc, row_identity, split_name,
    steps_to_run, text_batches, timing_fields, train_flops, loss_summary)
from experiments.benchmarks.throughput_tables import (  # noqa: E402
    ANCHORS, MATMUL, print_table, read_rows, render_markdown, runnable_encodings)
from experiments.configs import base  # noqa: E402
from posenc_jax import dispatch  # noqa: E402
from posenc_jax import model as model_lib  # noqa: E402

# --- one JAX row ---------------------------------------------------------------------------


_KERNEL_PATTERNS = {"cudnn": re.compile(r"cudnn\$fmha|cudnn.*attention", re.I),
                    "pallas": re.compile(r"triton|mosaic", re.I)}


def attention_kernels(hlo_text: str) -> list[str]:
  """Custom-call targets of the compiled step that are attention kernels (cuDNN, Pallas)."""
  targets = set(re.findall(r'custom_call_target="([^"]+)"', hlo_text))
  return sorted(t for t in targets if any(p.search(t) for p in _KERNEL_PATTERNS.values()))


def attention_label(*, kernels: list[str], implementation: str, family: str, seq_len: int,
                    dtype: str, head_dim: int, backend: str) -> str:
  """Which attention ran: a kernel seen in the compiled step, else what the auto rule picks
  (posenc_jax.dispatch.auto_implementation; the training step always passes segment_ids)."""
  for label, pattern in _KERNEL_PATTERNS.items():
    if any(pattern.search(k) for k in kernels):
      return label
  if implementation != "auto":
    return implementation
  return dispatch.auto_implementation(family, T=seq_len, dtype=dtype, head_dim=head_dim,
                                       has_segments=True, backend=backend).implementation


def jax_peak_gib() -> float | None:
  stats = jax.local_devices()[0].memory_stats()  # None on CPU
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return stats["peak_bytes_in_use"] / 2**30


def run_jax(*, name: str, seq_len: int, batch: int, size: Size, dtype: str,
            implementation: str, schedule: Schedule, peak_tflops: float | None,
            measured_tflops: float | None, scan_layers: bool = False,
            embed: str = "auto", compile_only: bool = False) -> dict:
  """Compiles and times the project's train step for one encoding; returns the row.

  compile_only: stop after compiling (the pre-compile phase fills the persistent cache)."""
  encoding, kv_shift = split_name(name)
  mcfg = model_lib.ModelConfig(
      vocab_size=size.vocab_size, encoding=encoding, kv_shift=kv_shift,
      num_layers=size.num_layers, d_model=size.d_model, num_heads=size.num_heads,
      head_dim=size.head_dim, block="llama", dtype=dtype,
      implementation=None if implementation == "auto" else implementation,
      scan_layers=scan_layers, embed_one_hot=EMBED[embed])
  train_cfg = base.get_config().train
  mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  trainer = train.Trainer(mcfg, train_cfg, mesh)
  host_batches, more = text_batches(seq_len=seq_len, batch=batch, count=schedule.num_batches,
                                    vocab=mcfg.vocab_size)
  row = {}
  with jax.set_mesh(mesh):
    batches = jax.block_until_ready([trainer.put(b) for b in host_batches])
    state = jax.block_until_ready(trainer.init_state(0))
    total, embedding = count_params(state["params"])
    t0 = time.perf_counter()
    # The compiled executable itself is called below, so the step is not compiled twice.
    step = trainer.train_step.lower(state, batches[0]).compile()
    row["compile_s"] = time.perf_counter() - t0
    if compile_only:
      return row
    kernels = attention_kernels(step.as_text())
    row["compiled_gib"] = common.compiled_gib(step)
    losses, step_s = [], []
    for i in range(steps_to_run(schedule)):
      b = batches[i] if i < len(batches) else trainer.put(next(more))
      t0 = time.perf_counter()  # a fresh batch's transfer is not timed (nor needed: untimed)
      state, metrics = step(state, b)
      jax.block_until_ready((state, metrics))
      dt = time.perf_counter() - t0
      if schedule.warmup <= i < schedule.warmup + schedule.steps:
        step_s.append(dt)
      if i < schedule.loss_steps:
        losses.append(float(metrics["loss"]))
  flops = train_flops(family=family_of(name), dense_params=total - embedding,
                      num_layers=size.num_layers, num_heads=size.num_heads,
                      head_dim=size.head_dim, seq_len=seq_len, batch=batch)
  device = jax.devices()[0]
  impl = attention_label(kernels=kernels, implementation=implementation, family=family_of(name),
                         seq_len=seq_len, dtype=dtype, head_dim=size.head_dim,
                         backend=jax.default_backend())
  row.update(
      params=total, params_dense=total - embedding, kernels=kernels, attention_impl=impl,
      # the Pallas kernel's plan in every layer (the text task's rows carry segment ids)
      plan=common.model_plan(mcfg, batch=batch, seq_len=seq_len, segments=True,
                             backend=jax.default_backend()) if impl == "pallas" else None,
      peak_gib=jax_peak_gib(), device_kind=device.device_kind, jax_version=jax.__version__,
      **timing_fields(step_s, tokens=batch * seq_len, flops=flops, peak_tflops=peak_tflops,
                      measured_tflops=measured_tflops),
      **loss_summary(losses))
  return row


# --- the measured matmul peak --------------------------------------------------------------


def run_matmul_peak(*, n: int, repeats: int = 10) -> dict:
  """bf16 [n, n] @ [n, n] in JAX: median seconds of `repeats` runs -> TFLOP/s."""
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.bfloat16)
  b = jax.random.normal(kb, (n, n), jnp.bfloat16)
  f = jax.jit(jnp.matmul)
  jax.block_until_ready(f(a, b))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(a, b))
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  device = jax.devices()[0]
  return {"step_ms": med * 1e3, "measured_tflops": 2 * n**3 / med / 1e12,
          "device_kind": device.device_kind, "jax_version": jax.__version__}


# --- the child: one row --------------------------------------------------------------------


def one_row(args, *, name: str, seq_len: int) -> dict:
  """Runs one (encoding, T) and returns its row; any exception becomes the row's error."""
  row = {**row_identity(args, name=name, seq_len=seq_len), "date": now_utc(), "error": None}
  t0 = time.time()
  shared = dict(seq_len=seq_len, batch=row["batch"], size=size_of(args), dtype=args.dtype,
                schedule=schedule_of(args), peak_tflops=args.peak_tflops,
                measured_tflops=args.measured_tflops)
  try:
    if name == MATMUL:
      row.update(run_matmul_peak(n=seq_len))
    elif name in ANCHORS:
      row.update(fla_anchor_model.run_row(name=name, varlen=args.fla_varlen, **shared))
    else:
      row.update(run_jax(name=name, implementation=args.implementation,
                         scan_layers=args.scan_layers, embed=args.embed,
                         compile_only=args.compile_only,
                         **shared))
  except Exception as e:  # one row's failure is data, not the end of the run
    row["error"] = f"{type(e).__name__}: {_first_line(str(e))}"
  row["wall_s"] = time.time() - t0
  return row


def _first_line(text: str, limit: int = 300) -> str:
  lines = [l for l in text.strip().splitlines() if l.strip()]
  return (lines[0] if lines else "")[:limit]


def size_of(args) -> Size:
  return Size(num_layers=args.layers, d_model=args.d_model, num_heads=args.heads,
              head_dim=args.head_dim, vocab_size=args.vocab)


def schedule_of(args) -> Schedule:
  return Schedule(steps=args.steps, warmup=args.warmup, loss_steps=args.loss_steps,
                  num_batches=args.num_batches)


def default_out() -> str:
  return os.path.join(os.environ["OUT"], "train_throughput.jsonl") if os.environ.get("OUT") \
      else "/tmp/train_throughput.jsonl"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--encodings", default="all",
                 help="comma list; 'all' = every runnable encoding + rope+kv_shift (the FLA "
                      f"anchors {','.join(ANCHORS)} only when named)")
  p.add_argument("--seq-lens", default="2048,8192")
  p.add_argument("--tokens-per-step", type=int, default=32768)
  p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
  p.add_argument("--implementation", default="auto",
                 help="auto (ModelConfig.implementation=None) or a forced one for every layer")
  p.add_argument("--embed", choices=tuple(EMBED), default="auto",
                 help="the token embedding's gradient: ModelConfig.embed_one_hot None (auto: "
                      "one-hot matmuls on a GPU), False (the gather's scatter-add) or True")
  p.add_argument("--scan-layers", action="store_true",
                 help="ModelConfig.scan_layers: the blocks as one lax.scan (compiles one layer; "
                      "rows labelled [scan], their ratio taken to rope [cudnn, scan])")
  p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--loss-steps", type=int, default=30)
  p.add_argument("--num-batches", type=int, default=Schedule.num_batches,
                 help="batches put on the device before timing (the rest are read as they come)")
  p.add_argument("--layers", type=int, default=Size.num_layers)
  p.add_argument("--d-model", type=int, default=Size.d_model)
  p.add_argument("--heads", type=int, default=Size.num_heads)
  p.add_argument("--head-dim", type=int, default=Size.head_dim)
  p.add_argument("--vocab", type=int, default=Size.vocab_size)
  p.add_argument("--peak-tflops", type=float, default=989.0,
                 help="dense bf16 peak for MFU (989: H100 / H200 SXM)")
  p.add_argument("--matmul-size", type=int, default=8192,
                 help="n of the measured-peak n^3 bf16 matmul; 0 skips it")
  p.add_argument("--measured-tflops", type=float, default=None,
                 help="use this measured peak instead of measuring it")
  p.add_argument("--timeout", type=float, default=420, help="seconds per subprocess")
  p.add_argument("--deadline", type=float, default=0,
                 help="stop after this many seconds of the whole run (0: none); a child cut "
                      "short by it writes no row, so the same command continues later")
  p.add_argument("--out", default=None, help="JSON lines file (default $OUT/train_throughput."
                                             "jsonl, else /tmp/train_throughput.jsonl)")
  p.add_argument("--force", action="store_true", help="re-run rows already in --out")
  p.add_argument("--retry-errors", action="store_true", help="re-run rows that failed")
  p.add_argument("--markdown", default=None, help="write the markdown table of --out here")
  p.add_argument("--render-only", action="store_true", help="only render --out (no runs)")
  p.add_argument("--fla-varlen", action=argparse.BooleanOptionalAction, default=True,
                 help="anchor: mask packed documents through FLA's cu_seqlens")
  p.add_argument("--compile-workers", type=int, default=0,
                 help="first compile the JAX rows in this many parallel children into "
                      "--cache-dir (0: compile in each timed child)")
  p.add_argument("--cache-dir", default="workdirs/jax_cache",
                 help="JAX persistent compilation cache shared by the children ('' = none)")
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child mode
  p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.out = args.out or default_out()
  if args.implementation.lower() in ("none", "auto"):  # ModelConfig.implementation=None
    args.implementation = "auto"
  args.seq_lens = [int(t) for t in args.seq_lens.split(",") if t]
  args.encodings = (runnable_encodings() if args.encodings == "all"
                    else [e for e in args.encodings.split(",") if e])
  args.command = "python -m experiments.benchmarks.train_throughput " + " ".join(
      shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
  return args


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.one:
    row = one_row(args, name=args.one, seq_len=args.seq_len)
    print(ROW_PREFIX + json.dumps(row), flush=True)
    return
  if not args.render_only:
    unknown = [n for n in args.encodings if n not in runnable_encodings() + list(ANCHORS)]
    if unknown:
      raise SystemExit(f"unknown encodings {unknown}; expected some of "
                       f"{runnable_encodings() + list(ANCHORS)}")
    print(f"rows -> {args.out}", flush=True)
    throughput_parent.run_all(args)
  rows = read_rows(args.out)
  print_table(rows)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(render_markdown(rows))
    print(f"markdown -> {args.markdown}", flush=True)


if __name__ == "__main__":
  main()
