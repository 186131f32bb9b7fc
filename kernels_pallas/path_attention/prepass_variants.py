"""Which pre-pass form runs (BlockSizes.prepass, prepass_keep_inverse, the kernels' warps),
resolved for the inputs' dtype, head_dim, grouped heads and backend from what was measured to
build and to be accurate: the pre-pass counterpart of routing.py. prepass_kernel.py runs the
form these choose.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.path_attention.block_sizes import KEEP_INVERSE


def auto_warps(head_dim: int):
  """Each pre-pass kernel's warps at head_dim: ((kernel name, warps), ...).

  Measured per kernel on the H200 (2026-11-25, jax.profiler, fwd+bwd, 4 against 8 warps for
  every pre-pass kernel; ms): at 32,2048,32,64 4 warps won everywhere (operands VJP q part 4.30
  / 6.68, its kv part 2.08 / 3.58, operands 1.61 / 3.56, inverse 1.60 / 3.83); at 8,4096,16,128
  the operands kernel (1.50 / 1.32) and the VJP's q part (2.79 / 2.53) take 8 (they spill at 4:
  2.2 and 2.3 KB a thread in the resource report), the inverse (0.47 / 1.08), its VJP
  (0.39 / 0.79) and the VJP's kv part (1.09 / 1.74) keep 4."""
  wide = 8 if head_dim >= 128 else 4
  return (("_inv_kernel", 4), ("_refine_kernel", 4), ("_inv_bwd_kernel", 4),
          ("_ops_kernel", wide), ("_ops_bwd_kernel", 4), ("_ops_bwd_kv_kernel", 4),
          ("_ops_bwd_q_kernel", wide), ("_ops_bwd_uz_kernel", 4), ("_t_pullback_kernel", 4))


VARIANTS = ("split", "fold", "split_bf16", "fold_bf16", "split_bf16x3", "split_hilo",
            "split2", "split2_bf16x3", "split2_hilo", "uz", "uz_bf16x3", "uz_hilo")


def variant_for_dtype(requested: str, dtype) -> str:
  """float32 inputs keep float32 accuracy: a variant of bf16 halves ("*_bf16x3", "*_hilo")
  becomes its three-pass TF32 form ("split" / "split2")."""
  if jnp.dtype(dtype).itemsize == 4 and requested.endswith(("_bf16x3", "_hilo")):
    return requested.split("_")[0]
  return requested


def usable_variant(requested: str, *, backend: str, dtype, heads_per_kv: int = 1,
                   head_dim: int = 64) -> str:
  """The pre-pass to run: `requested`, or the nearest one known to build and to be accurate.

  - "split_bf16x3" / "split_hilo" with float32 inputs -> "split": float32 users get
    three-pass TF32 (~21 mantissa bits per product) rather than bf16 halves (~16).
  - On the GPU (227 KiB of shared memory per block on the H100 and H200): the operands kernels
    hold float32 tiles, and three-pass TF32 products need the hi / lo halves of their operands.
    Its operands VJP (every query head of a kv head in one program) asked for 272 KiB at G = 2,
    D = 64 (float32 inputs) and a pre-pass kernel for 288 KiB (294,912 bytes) at G = 1,
    D = 128 (bf16 inputs), both on the H100 (2026-11-23). So grouped heads (G > 1) and
    head_dim >= 128 take the batched jnp pre-pass (exact, slower, more memory), except:
    "*_bf16" with bf16 inputs, which built at G = 2, D = 128 (H200, round 4), and
    "split_bf16x3" and "split_hilo" with bf16 inputs at head_dim < 128, which built and
    passed the correlated-w tests at G = 2, D = 64 (H100, 2026-11-24). Their operands VJP
    estimates 240 KiB at D = 128 (triton_resources.py, which reads low): D = 128 takes the jnp
    pre-pass there. The "split2_*" forms (the operands VJP as two kernels) built at G = 1,
    D = 128 with bf16 inputs (H200, 2026-11-25: split2_hilo 44.95 ms fwd+bwd at
    8,4096,16,128 against 48.96 through jnp, peak 2.38 against 4.38 GiB), so they keep
    head_dim 128 at G = 1; grouped heads at D = 128 stay on jnp until seen to build.
  - "uz_*" (the VJP from dU, dZ: prepass_uz.py) runs on the GPU with 16-bit inputs at
    head_dim <= 64, where it was measured faster (H200, 2026-11-26: its two VJP kernels 6.05
    against split2's three 6.36 ms at 32,2048,32,64; 12.05 against 12.80 at 32,4096,32,64).
    At head_dim 128 its first kernel spills (6.13 against 3.66 ms at 8,4096,16,128), and with
    float32 inputs it has not run on a GPU: both take the "split2_*" form instead.
  """
  f32 = jnp.dtype(dtype).itemsize == 4
  if backend == "gpu" and requested.startswith("uz") and (f32 or head_dim > 64):
    requested = "split2" + requested[2:]
  bf16_halves = requested.endswith(("_bf16x3", "_hilo"))
  two_vjp_kernels = requested.startswith("split2")
  requested = variant_for_dtype(requested, dtype)
  if backend != "gpu" or requested == "jnp" or (heads_per_kv == 1 and head_dim < 128):
    return requested
  fits = head_dim < 128 or (two_vjp_kernels and heads_per_kv == 1 and head_dim == 128)
  if not f32 and (requested.endswith("_bf16") or (bf16_halves and fits)):
    return requested
  return "jnp"


def kept_inverse(keep_inverse, inv_precision):
  """What the VJP keeps of Y for keep_inverse (False, True or "bf16") when the inverse's
  products run at inv_precision: "bf16" only with the bf16 halves (BF16_BF16_F32_X3), whose
  own error the refining step matches (prepass_chunk.chunk_inverse_refine). Finer products
  (float32 inputs, the TPU) recompute Y (False): the step would make it coarser, and a float32
  Y kept by default would add a [B, K, T, C] float32 array to every layer the user did not ask
  for (True asks)."""
  if keep_inverse not in KEEP_INVERSE:
    raise ValueError(f"keep_inverse={keep_inverse!r} must be one of {KEEP_INVERSE}")
  if keep_inverse == "bf16" and inv_precision != jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3:
    return False
  return keep_inverse
