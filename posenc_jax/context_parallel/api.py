"""The context-parallel attention of each family, as posenc_jax.attention calls it.

kernel=True runs the Pallas kernels: the family's kernel (with return_lse) as each chunk's
local attention and the block kernel (kernels_pallas.block_attention) for every pair of
chunks; the blockwise jnp forms otherwise. kernel_options: the family kernel's
kernels_pallas.BlockSizes (or None).
"""
from __future__ import annotations

import functools

import jax

from posenc_jax.context_parallel import gated_ring
from posenc_jax.context_parallel import path_ring

# The cross-device tiles beside the kernel (GPU / TPU): large, so a ring step is a few big
# matmuls rather than many launches of (128 x 128) tiles; blockwise jnp (CPU) keeps its own.
ACCELERATOR_TILE = 1024


def kernel_cross(q, k, v, *, q_bias, k_bias, q_seg, k_seg):
  """A query chunk against a whole key chunk by the Pallas block kernel (q already scaled).

  The logits' operands go in the values' dtype: for a bf16 model, tensor-core products of
  bf16 inputs with float32 accumulation, as in the kernels' own tiles.
  """
  import kernels_pallas  # imported lazily: the kernels are optional on CPU
  return kernels_pallas.block_attention(q.astype(v.dtype), k.astype(v.dtype), v, scale=1.0,
                                        q_bias=q_bias, k_bias=k_bias, q_segment_ids=q_seg,
                                        k_segment_ids=k_seg,
                                        interpret=jax.default_backend() == "cpu")


def path_attention(q, k, v, w, beta, *, log_forget=None, segment_ids=None, scale: float,
                   kernel: bool = False, kernel_options=None, **kwargs):
  """PaTH / PaTH-FoX, T sharded over "context" (path_ring)."""
  local = (functools.partial(path_ring.kernel_local, block_sizes=kernel_options) if kernel
           else None)
  if kernel:
    kwargs.setdefault("block", ACCELERATOR_TILE)
    if jax.default_backend() != "tpu":   # the block kernel is Triton (GPU) only
      kwargs.setdefault("cross", kernel_cross)
  return path_ring.path_attention(q, k, v, w, beta, log_forget=log_forget,
                                  segment_ids=segment_ids, scale=scale, local=local, **kwargs)


def forgetting_attention(q, k, v, log_forget, *, segment_ids=None, scale: float,
                         kernel: bool = False, kernel_options=None, **kwargs):
  """FoX / ALiBi (log_forget None: softmax), T sharded over "context" (gated_ring)."""
  local = (functools.partial(gated_ring.kernel_local, block_sizes=kernel_options) if kernel
           else None)
  if kernel:
    kwargs.setdefault("block", ACCELERATOR_TILE)
    if jax.default_backend() != "tpu":   # the block kernel is Triton (GPU) only
      kwargs.setdefault("cross", kernel_cross)
  return gated_ring.forgetting_attention(q, k, v, log_forget, segment_ids=segment_ids,
                                         scale=scale, local=local, **kwargs)


def softmax_attention(q, k, v, *, segment_ids=None, scale: float, **kwargs):
  """Plain causal softmax attention, T sharded over "context"."""
  return forgetting_attention(q, k, v, None, segment_ids=segment_ids, scale=scale, **kwargs)
