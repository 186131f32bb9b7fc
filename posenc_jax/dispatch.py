"""Which implementation `implementation=None` runs for each attention family, and why.

`auto_implementation` is one table for every family (`posenc_jax.attention` asks it for each
call; benchmarks print its `reason`):
  CPU        the dense reference up to the family's CPU_DENSE_MAX_T (measured: the faster
             exact form there), chunked beyond; PaTH chunked at every T
  GPU/TPU    the Pallas kernel for path and forgetting; for softmax on the GPU the choice of
             `softmax_gpu_path` (cuDNN, else the Pallas kernel, else XLA); the Triton kernels
             of GRAPE-A, TAPA and GRAPE-AP on the GPU; for SBA on the GPU the choice of
             `sba_gpu_path` (the dense reference below SBA_GPU_KERNEL_MIN_T, else the Triton
             kernel, else chunked); chunked for the rest at every T.

The limits below are module constants so that a test or an experiment can move one switch and
see the rule follow. `preload_kernels` imports the kernels before a model's first trace where
the rule may run one.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

from posenc_jax import _checks
from posenc_jax import grape_a

# The longest T at which `implementation=None` would hold a T x T array per head on a CPU
# (4 B H T^2 bytes in float32: 256 MiB per array at B=4, H=4, T=2048); beyond it, chunked.
AUTO_DENSE_MAX_T = 2048

# The CPU rule per family: the dense reference up to this T, chunked beyond; 0 = chunked at
# every T. Each is the faster exact form by measurement of jit(grad(sum(attention))) in
# float32 with packed documents (the table is docs/benchmarks/cpu_auto.md): PaTH's dense form
# (a lax.scan over T steps) loses at every T; the others' dense forms win or tie up to
# AUTO_DENSE_MAX_T. Beyond it (not measured) memory decides: chunked.
CPU_DENSE_MAX_T = {"softmax": 256, "grape_a": 256, "path": 0, "forgetting": AUTO_DENSE_MAX_T,
                   "path_integral": AUTO_DENSE_MAX_T, "tapa": AUTO_DENSE_MAX_T,
                   "stick_breaking": 256}

# SBA on a GPU: the Triton kernel from this T on, the dense reference below it. Timed on one
# H200 in bfloat16 (docs/benchmarks/path_kernel.md), forward+backward: from T 512 on the
# kernel beat the blockwise jnp form 5-10x and the dense form 1.2-2.2x (and held no T x T
# array); at T 64 the dense form tied or won, and its T x T array is small there.
SBA_GPU_KERNEL_MIN_T = 256
# The dtypes the SBA kernel runs in on a GPU under `implementation=None`. Its GPU runs (the
# -m gpu test, the timings) were bfloat16; float16 has the same tile bytes. float32 doubles
# them and has not run on a GPU (PaTH's float32 tiles outgrow shared memory at head dim 128),
# so it stays on the blockwise jnp form.
SBA_GPU_DTYPES = ("bfloat16", "float16")

# The GPU softmax path when segment_ids are given, which is every training step (packed
# documents). jax's public API has no segment ids for cuDNN, so cuDNN reads a dense
# [B, 1, T, T] mask, which jax turns into a bias in q's dtype: 2 B T^2 bytes per layer call
# (512 MiB at B=4, T=8192; 8 GiB per row at T=65536). The project's Pallas flash kernel masks
# segments tile by tile in O(T) memory but is slower: in the 12-layer bf16 train step cuDNN
# with the mask was the faster at the same peak memory (train_throughput.md, lease E).
# So packed documents go to cuDNN up to this length and to the Pallas kernel beyond it, where
# the mask would grow to gigabytes (0 sends them all to Pallas).
CUDNN_SEGMENT_MASK_MAX_T = 16384

CUDNN_DTYPES = ("bfloat16", "float16")
# cuDNN flash attention takes head dims that are multiples of 8 up to 128 (256 on Hopper and
# later; the rule stays device-free, so it keeps the bound every cuDNN GPU accepts).
CUDNN_MAX_HEAD_DIM = 128
PALLAS_DTYPES = ("float32", "bfloat16", "float16")
# The Pallas kernel takes power-of-two head dims >= 16; its tiles are tuned up to 128.
PALLAS_MAX_HEAD_DIM = 128

FAMILIES = ("softmax", "grape_a", "path", "forgetting", "path_integral", "tapa",
            "stick_breaking")
_KERNEL_FAMILIES = ("path", "forgetting")
# Families with a Triton kernel only (kernels_pallas.tapa_attention, grape_ap_attention): the GPU
# runs it; the TPU has no form of it and runs the blockwise jnp.
_TRITON_FAMILIES = {"tapa": "TAPA", "path_integral": "GRAPE-AP"}
# kernels_pallas.path_attention.plan.GPU_FLOAT32_BACKWARD_MAX_HEAD_DIM (the kernels are imported
# lazily; tests/kernels/test_plan.py checks the two agree)
GPU_FLOAT32_PATH_MAX_HEAD_DIM = 64


class Choice(NamedTuple):
  """An implementation name and the one-line reason it was chosen (for logs and benchmarks)."""
  implementation: str
  reason: str


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def cudnn_head_dim(D: int, Dv: int) -> int:
  """The one head dim cuDNN runs at: q, k, v zero-padded to max(D, Dv), a multiple of 8."""
  return _round_up(max(D, Dv), 8)


def pallas_head_dim(D: int, Dv: int) -> int:
  """The one head dim the Pallas kernel runs at: the next power of two >= max(D, Dv, 16)."""
  return max(16, 1 << (max(D, Dv) - 1).bit_length())


def _dtype_or_width_problem(dtype, dtypes, width: int, max_width: int, max_name: str, *,
                            joiner: str, prefix: str = "") -> str | None:
  """The dtype / padded head-dim limits both fused attention paths have (None when met)."""
  name = jnp.dtype(dtype).name
  if name not in dtypes:
    return f"dtype {name} is not {prefix}{joiner.join(dtypes)}"
  if width > max_width:
    return f"head dim {width} > {max_name}={max_width}"
  return None


def cudnn_unsupported(dtype, D: int, Dv: int, *, T: int, has_segments: bool) -> str | None:
  """Why cuDNN flash attention cannot run this call (None when it can), from shapes alone.

  The conditions are jax's (jax/_src/cudnn/fused_attention_stablehlo.py, check_layout and
  check_is_flash_attention), which raise only when the call is lowered on a GPU.
  """
  problem = _dtype_or_width_problem(dtype, CUDNN_DTYPES, cudnn_head_dim(D, Dv),
                                    CUDNN_MAX_HEAD_DIM, "CUDNN_MAX_HEAD_DIM", joiner=" or ")
  if problem:
    return problem
  if has_segments and T % 2:
    return f"odd T={T} with a segment mask: cuDNN's bias backward needs an even length"
  return None


def pallas_unsupported(dtype, D: int, Dv: int) -> str | None:
  """Why the Pallas flash kernel cannot run softmax attention (None when it can)."""
  return _dtype_or_width_problem(dtype, PALLAS_DTYPES, pallas_head_dim(D, Dv),
                                 PALLAS_MAX_HEAD_DIM, "PALLAS_MAX_HEAD_DIM", joiner=", ",
                                 prefix="one of ")


def softmax_gpu_path(dtype, D: int, Dv: int, *, has_segments: bool, T: int) -> Choice:
  """Which implementation runs causal softmax attention on a GPU, and why.

  Preference: cuDNN (bf16/fp16, supported head dim; with segment_ids only up to
  CUDNN_SEGMENT_MASK_MAX_T), else the Pallas flash kernel (segments, GQA, float32), else
  XLA's T x T form.
  """
  name = jnp.dtype(dtype).name
  no_cudnn = cudnn_unsupported(dtype, D, Dv, T=T, has_segments=has_segments)
  no_pallas = pallas_unsupported(dtype, D, Dv)
  mask_too_long = has_segments and T > CUDNN_SEGMENT_MASK_MAX_T
  if no_cudnn is None and (not mask_too_long or no_pallas is not None):
    masked = ", segments as a dense [B,1,T,T] mask" if has_segments else ""
    fallback = f" (the Pallas kernel cannot: {no_pallas})" if mask_too_long else ""
    return Choice("cudnn", f"{name}, head dim {cudnn_head_dim(D, Dv)}: cuDNN flash attention"
                           f"{masked}{fallback}")
  if no_pallas is None:
    why = (f"cuDNN cannot: {no_cudnn}" if no_cudnn else
           f"T={T} > CUDNN_SEGMENT_MASK_MAX_T={CUDNN_SEGMENT_MASK_MAX_T} (cuDNN's dense mask)")
    per_tile = " masks segments per tile" if has_segments else ""
    return Choice("pallas", f"{why}; the Pallas flash kernel{per_tile}")
  return Choice("xla", f"neither cuDNN ({no_cudnn}) nor the Pallas kernel ({no_pallas}): "
                       "XLA, which holds a T x T array")


def sba_gpu_path(dtype, D: int, Dv: int, *, T: int) -> Choice:
  """Which implementation runs stick-breaking attention on a GPU, and why.

  Below SBA_GPU_KERNEL_MIN_T the dense reference (as fast, its T x T array small); from it
  the Triton kernel where it has run (SBA_GPU_DTYPES; head dims padded up to
  PALLAS_MAX_HEAD_DIM, the widest it ran at), else the blockwise jnp form, which never holds a
  T x T array. The kernel takes segments and grouped heads itself: they set no condition.
  """
  if T < SBA_GPU_KERNEL_MIN_T:
    return Choice("reference", f"gpu: dense jnp below SBA_GPU_KERNEL_MIN_T={SBA_GPU_KERNEL_MIN_T} "
                               "(ties or beats the Triton SBA kernel there)")
  problem = _dtype_or_width_problem(dtype, SBA_GPU_DTYPES, pallas_head_dim(D, Dv),
                                    PALLAS_MAX_HEAD_DIM, "PALLAS_MAX_HEAD_DIM", joiner=" or ")
  if problem:
    return Choice("chunked", f"gpu: blockwise jnp for stick_breaking; the Triton SBA kernel "
                             f"is not used: {problem}")
  return Choice("pallas", f"gpu: the Triton SBA kernel (T={T} >= SBA_GPU_KERNEL_MIN_T="
                          f"{SBA_GPU_KERNEL_MIN_T})")


def preload_kernels(family: str, implementation: str | None, dtype, *,
                    backend: str | None = None) -> bool:
  """Imports kernels_pallas now, outside any trace, where `family`'s attention under
  `implementation` may run a Pallas kernel on `backend` (default: jax's); returns whether it
  did. Models call it when they are built.

  Why: importing the kernels loads Pallas's GPU lowerings, and under jax 0.11 these add a value
  to JAX's tracing context. Imported inside a jitted function's first trace (the lazy imports
  below), the function misses its trace cache at its second call and XLA compiles it again: a
  PaTH train step compiled twice. Imported before, the context is complete at the first call.
  """
  impl = implementation or ""
  backend = backend or jax.default_backend()
  if impl.startswith("pallas"):
    need = True
  elif impl or backend not in ("gpu", "tpu"):
    need = False
  else:   # auto: softmax runs cuDNN unless it cannot (float32 here: the Pallas flash kernel)
    need = family != "softmax" or jnp.dtype(dtype).itemsize == 4
  if need:
    importlib.import_module("kernels_pallas")   # the import is the point
  return need


def auto_implementation(family: str, *, T: int, dtype, head_dim: int, v_head_dim: int | None = None,
                        has_segments: bool = False, backend: str | None = None,
                        batch: int | None = None, heads: int | None = None,
                        kv_heads: int | None = None, gate: bool = False,
                        kernel_options=None) -> Choice:
  """What `implementation=None` runs for `family` on `backend` (default: jax's), and why.

  head_dim is q's (after any encoding lifts it, e.g. GRAPE-A); v_head_dim defaults to it. With
  batch and heads (kv_heads: default heads; gate: PaTH-FoX or FoX's gate; kernel_options: the
  kernel's BlockSizes fields), the reason for a Pallas PaTH / FoX kernel also gives the plan it
  runs (kernels_pallas.explain).
  """
  if family not in FAMILIES:
    raise ValueError(f"family={family!r} is not one of {FAMILIES}")
  backend = backend or jax.default_backend()
  Dv = head_dim if v_head_dim is None else v_head_dim
  if backend not in ("gpu", "tpu"):
    limit = min(CPU_DENSE_MAX_T[family], AUTO_DENSE_MAX_T)
    name = f"CPU_DENSE_MAX_T[{family!r}]={limit}"
    if T <= limit:
      return Choice("reference", f"{backend}: dense jnp up to {name} (faster than chunked there)")
    if limit == 0:
      return Choice("chunked", f"{backend}: blockwise jnp at every T ({name}: faster than dense)")
    return Choice("chunked", f"{backend}: T={T} > {name}, blockwise jnp")
  if (family == "path" and backend == "gpu" and jnp.dtype(dtype).itemsize == 4
      and head_dim > GPU_FLOAT32_PATH_MAX_HEAD_DIM):
    return Choice("chunked", f"gpu: blockwise jnp; the Pallas PaTH kernel has no float32 "
                  f"backward at head_dim {head_dim} > {GPU_FLOAT32_PATH_MAX_HEAD_DIM} (shared "
                  "memory); bfloat16 runs it")
  if family in _KERNEL_FAMILIES:
    reason = f"{backend}: the Pallas {family} kernel"
    if batch is not None and heads is not None:
      reason += "; its plan:\n  " + _kernel_plan(
          family, batch=batch, T=T, heads=heads, kv_heads=kv_heads or heads, D=head_dim,
          dtype=dtype, gate=gate, segments=has_segments, backend=backend,
          kernel_options=kernel_options).replace("\n", "\n  ")
    return Choice("pallas", reason)
  if family == "softmax" and backend == "gpu":
    return softmax_gpu_path(dtype, head_dim, Dv, has_segments=has_segments, T=T)
  if family == "grape_a" and backend == "gpu" and max(head_dim, Dv) <= PALLAS_MAX_HEAD_DIM:
    # faster in the training step than the lift on cuDNN, which reads packed documents as a
    # dense mask (the kernel masks by tile) at the lifted head dim
    return Choice("pallas", "gpu: the Triton GRAPE-A kernel (the bias in each tile)")
  if family == "grape_a":   # lifted into extra channels: softmax at the lifted head dim
    lifted = grape_a.augmented_head_dim(T, head_dim, dtype, q_gate=True, k_gate=True)
    inner = auto_implementation("softmax", T=T, dtype=dtype, head_dim=lifted, v_head_dim=Dv,
                                has_segments=has_segments, backend=backend)
    return Choice(inner.implementation, f"GRAPE-A lifted to head dim {lifted}; {inner.reason}")
  if family == "stick_breaking" and backend == "gpu":
    return sba_gpu_path(dtype, head_dim, Dv, T=T)
  if family in _TRITON_FAMILIES and backend == "gpu":
    return Choice("pallas", f"gpu: the Triton {_TRITON_FAMILIES[family]} kernel")
  return Choice("chunked", f"{backend}: blockwise jnp for {family}, never a T x T array per head")


def _kernel_plan(family, *, batch, T, heads, kv_heads, D, dtype, gate, segments, backend,
                 kernel_options) -> str:
  """kernels_pallas.explain's text for a call of these shapes (no arrays needed)."""
  import kernels_pallas  # imported lazily: importing the kernels costs a second or two
  sd = jax.ShapeDtypeStruct
  q = sd((batch, T, heads, D), dtype)
  kv = sd((batch, T, kv_heads, D), dtype)
  path = family == "path"
  return str(kernels_pallas.explain(
      q, kv, kv, sd(kv.shape, jnp.float32) if path else None,
      sd((batch, T, kv_heads), jnp.float32) if path else None,
      sd((batch, T, heads), jnp.float32) if gate else None,
      segment_ids=sd((batch, T), jnp.int32) if segments else None,
      block_sizes=_checks.kernel_block_sizes("pallas", kernel_options), backend=backend))
