"""What train_throughput.py's rows share between the parent, the JAX child and the PyTorch
anchor (fla_anchor_model.py): the model's sizes and the step schedule, the batches, the FLOP
count, the timing and loss fields of a row, and the fields that identify a row. Imports no
other benchmark module but throughput_tables.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import statistics

from experiments import data
from experiments.benchmarks.throughput_tables import ANCHORS, MATMUL
from experiments.configs import base
from posenc_jax import encodings

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ROW_PREFIX = "ROW "  # the child's result line on stdout

PATH_CHUNK = 64
# --embed -> ModelConfig.embed_one_hot
EMBED = {"auto": None, "gather": False, "one_hot": True}


@dataclasses.dataclass(frozen=True)
class Size:
  """The model's sizes (the benchmark's are the defaults; the smoke test shrinks them)."""
  num_layers: int = 12
  d_model: int = 768
  num_heads: int = 12
  head_dim: int = 64
  vocab_size: int = 32000


@dataclasses.dataclass(frozen=True)
class Schedule:
  """How many steps of each kind one row runs."""
  steps: int = 10        # timed
  warmup: int = 3        # run before timing, after compiling
  loss_steps: int = 30   # losses recorded from the first step on (timed steps included)
  num_batches: int = 13  # put on the device before timing (warm-up + timed steps: all distinct);
                         # loss steps past them read fresh batches, untimed, so the loss check
                         # measures learning, not memorising a few batches


# --- names ---------------------------------------------------------------------------------


def split_name(name: str) -> tuple[str, bool]:
  """'rope+kv_shift' -> ('rope', True); 'path' -> ('path', False)."""
  base, plus, modifier = name.partition("+")
  if plus and modifier != "kv_shift":
    raise ValueError(f"{name!r}: the only modifier is kv_shift")
  return base, bool(plus)


def family_of(name: str) -> str:
  if name in ANCHORS:
    return "path"
  return encodings.get(split_name(name)[0]).family


def batch_for(*, tokens_per_step: int, seq_len: int) -> int:
  if tokens_per_step % seq_len:
    raise ValueError(f"--tokens-per-step {tokens_per_step} is not a multiple of T={seq_len}")
  return tokens_per_step // seq_len


# --- FLOPs ---------------------------------------------------------------------------------


def train_flops(*, family: str, dense_params: int, num_layers: int, num_heads: int,
                head_dim: int, seq_len: int, batch: int, chunk: int = PATH_CHUNK) -> dict:
  """FLOPs of one training step (forward + backward), by part; train_throughput.py's docstring
  gives the formula."""
  H, D, T, C = num_heads, head_dim, seq_len, chunk
  per_seq_fwd = {"attention": 2 * H * D * T * T, "transport": 0.0, "prepass": 0.0}
  if family == "path":
    n = math.ceil(T / C)
    per_seq_fwd["transport"] = H * (n * (n - 1) / 2) * 2 * C * D * D
    per_seq_fwd["prepass"] = H * n * (12 * C * C * D + 2 * C * D * D + 2 * C**3 / 3)
  out = {"dense": 6.0 * dense_params * batch * T}
  out.update({k: 3.0 * num_layers * batch * v for k, v in per_seq_fwd.items()})
  out["total"] = sum(out.values())
  return out


def count_params(params) -> tuple[int, int]:
  """(all parameters, the embedding table's) of the Trainer's params dict."""
  import jax  # here, not at the top: the benchmarks' parents never import jax
  total = sum(int(x.size) for x in jax.tree.leaves(params))
  return total, int(params["embed"]["embedding"].size)


def mfu(flops: float, step_s: float, peak_tflops: float | None) -> float | None:
  return None if not peak_tflops or not step_s else flops / step_s / (peak_tflops * 1e12)


# --- batches and shared row fields ---------------------------------------------------------


def text_batches(*, seq_len: int, batch: int, count: int,
                 vocab: int | None = None) -> tuple[list[dict], object]:
  """(`count` host batches of the `text` task, the iterator that continues after them), as
  experiments/train.py draws them. vocab: the model's, checked against the task's (token ids
  past a model's vocabulary give no error, only NaN losses)."""
  cfg = base.get_config().data
  cfg.task, cfg.seq_len = "text", seq_len
  if vocab is not None and vocab < data.vocab_size(cfg):
    raise ValueError(f"--vocab={vocab} is smaller than the text task's vocabulary "
                     f"({data.vocab_size(cfg)}); use at least that")
  it = data.make_train_iter(cfg, batch_size=batch, seed=0)
  return [next(it) for _ in range(count)], it


def loss_summary(losses: list[float]) -> dict:
  k = max(1, min(5, len(losses) // 2))
  finite = all(math.isfinite(x) for x in losses)
  return {"losses": [round(x, 4) for x in losses], "loss_first": losses[0],
          "loss_last": losses[-1], "loss_finite": finite,
          "loss_falling": finite and statistics.mean(losses[-k:]) < statistics.mean(losses[:k])}


def timing_fields(step_s: list[float], *, tokens: int, flops: dict, peak_tflops,
                  measured_tflops) -> dict:
  med = statistics.median(step_s)
  return {"step_ms": med * 1e3, "step_ms_all": [round(s * 1e3, 3) for s in step_s],
          "tokens_per_s": tokens / med, "flops": flops, "peak_tflops": peak_tflops,
          "measured_tflops": measured_tflops, "mfu": mfu(flops["total"], med, peak_tflops),
          "mfu_measured": mfu(flops["total"], med, measured_tflops)}


def now_utc() -> str:
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def steps_to_run(schedule: Schedule) -> int:
  return max(schedule.loss_steps, schedule.warmup + schedule.steps)


def row_identity(args, *, name: str, seq_len: int) -> dict:
  """The fields that identify a row (KEY_FIELDS): what was asked, known before running."""
  if name == MATMUL:
    return {"encoding": name, "seq_len": seq_len, "batch": 1, "dtype": "bfloat16",
            "implementation": "xla"}
  impl = args.implementation
  if name in ANCHORS:  # the document masking changes the anchor's work
    impl = "fla" if args.fla_varlen else "fla_no_doc_mask"
  return {"encoding": name, "seq_len": seq_len,
          "batch": batch_for(tokens_per_step=args.tokens_per_step, seq_len=seq_len),
          "dtype": args.dtype, "implementation": impl,
          # None, not False, unscanned: the key of the rows from before the flag
          "scan_layers": True if args.scan_layers and name not in ANCHORS else None,
          # None: the gather, which every row from before the flag used
          "embed": None if args.embed == "gather" or name in ANCHORS else args.embed}
