"""The TPU forms of the PaTH / FoX kernels (the key-chunk-grid forward, bwd_tpu's backward) in
the TPU interpreter against the dense oracles: forward and every gradient. Their lowering for
the TPU is test_lowering.py's; the GPU and generic-interpreter forms are test_path_kernel.py's,
whose checks (PathKernelBase) these reuse on the "tpu_interpret" backend.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas as kp
from posenc_jax import householder
from posenc_jax import unipotent
from tests.kernels.test_path_kernel import PathKernelBase, _inputs
from tests.util import assert_rel_rms


# test_tpu_backward_interpret's float32 rows check this very forward (the same backend,
# shapes, gate, segments, 16-blocks and tolerance) before their gradients: CI time.
@pytest.mark.slow
@pytest.mark.parametrize("transport", [True, False])
def test_tpu_kv_grid_forward_interpret(key, transport):
  """The TPU forward (key-chunk grid axis, VMEM scratch) in the TPU interpreter vs the oracle."""
  B, T, H, K, D = 2, 37, 4, 2, 16
  q, k, v, w, beta, lf, seg, _ = _inputs(key, B, T, H, K, D, jnp.float32, gate=True, segments=True)
  bs = kp.BlockSizes(block_q=16, block_k=16)
  with jax.default_matmul_precision("highest"):
    # jitted: one compile instead of eager op-by-op dispatch
    if transport:
      out = jax.jit(lambda *a: kp.path_attention(*a, segment_ids=seg, block_sizes=bs,
                                                 backend="tpu_interpret"))(q, k, v, w, beta, lf)
      ref = jax.jit(lambda *a: householder.path_attention_reference(
          *a[:5], log_forget=a[5], segment_ids=seg, scale=D ** -0.5))(q, k, v, w, beta, lf)
    else:
      out = jax.jit(lambda *a: kp.forgetting_attention(*a, segment_ids=seg, block_sizes=bs,
                                                       backend="tpu_interpret"))(q, k, v, lf)
      ref = jax.jit(lambda *a: unipotent.forgetting_attention_reference(
          *a, segment_ids=seg, scale=D ** -0.5))(q, k, v, lf)
  assert_rel_rms(out, ref, 1e-4, "forward")


@pytest.mark.parametrize("fox,dtype", [(False, jnp.float32), (True, jnp.float32),
                                       (False, jnp.bfloat16)])
def test_tpu_backward_interpret(key, fox, dtype):
  """The TPU backward (bwd_tpu: one chunk per block, the walks as grid axes, dL/dP accumulated
  in its output block) in the TPU interpreter: forward and every gradient against the oracle,
  grouped heads, gate and packed documents, T not a multiple of the chunk; the TPU's default
  backward since 2026-11-24, so bf16 too."""
  checker = PathKernelBase()
  checker.backend = "tpu_interpret"
  checker._check(key, H=4, K=2, dtype=dtype, gate=True, segments=True, fox=fox)
