"""The context-parallel attention of each family, as posenc_jax.attention calls it.

kernel=True runs the Pallas kernel as each device's local attention (with return_lse), the
blockwise jnp form otherwise; kernel_options: its kernels_pallas.BlockSizes (or None).
"""
from __future__ import annotations

import functools

from posenc_jax.context_parallel import gated_ring
from posenc_jax.context_parallel import path_ring

# The cross-device tiles beside the kernel (GPU / TPU): large, so a ring step is a few big
# matmuls rather than many launches of (128 x 128) tiles; blockwise jnp (CPU) keeps its own.
ACCELERATOR_TILE = 1024


def path_attention(q, k, v, w, beta, *, log_forget=None, segment_ids=None, scale: float,
                   kernel: bool = False, kernel_options=None, **kwargs):
  """PaTH / PaTH-FoX, T sharded over "context" (path_ring)."""
  local = (functools.partial(path_ring.kernel_local, block_sizes=kernel_options) if kernel
           else None)
  if kernel:
    kwargs.setdefault("block", ACCELERATOR_TILE)
  return path_ring.path_attention(q, k, v, w, beta, log_forget=log_forget,
                                  segment_ids=segment_ids, scale=scale, local=local, **kwargs)


def forgetting_attention(q, k, v, log_forget, *, segment_ids=None, scale: float,
                         kernel: bool = False, kernel_options=None, **kwargs):
  """FoX / ALiBi (log_forget None: softmax), T sharded over "context" (gated_ring)."""
  local = (functools.partial(gated_ring.kernel_local, block_sizes=kernel_options) if kernel
           else None)
  if kernel:
    kwargs.setdefault("block", ACCELERATOR_TILE)
  return gated_ring.forgetting_attention(q, k, v, log_forget, segment_ids=segment_ids,
                                         scale=scale, local=local, **kwargs)


def softmax_attention(q, k, v, *, segment_ids=None, scale: float, **kwargs):
  """Plain causal softmax attention, T sharded over "context"."""
  return forgetting_attention(q, k, v, None, segment_ids=segment_ids, scale=scale, **kwargs)
