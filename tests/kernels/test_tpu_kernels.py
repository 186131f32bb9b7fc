"""The TPU forms of the PaTH / FoX kernels (tpu.py: the walks as grid axes, one chunk per block)
in the TPU interpreter against the dense oracles: forward and every gradient, grouped heads,
gate and packed documents, T not a multiple of the chunk. Their lowering for the TPU is
test_lowering.py's."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from tests.kernels import kernel_check


@pytest.mark.parametrize("fox,dtype", [
    (False, jnp.float32), (True, jnp.float32),
    pytest.param(False, jnp.bfloat16, marks=pytest.mark.slow)])   # the same forms: CI time
def test_tpu_forms_against_oracle(key, fox, dtype):
  """The TPU plan has no spans and no Mosaic GPU launch; its pre-pass is the Pallas "uz" form
  on blocked inputs (PaTH), Y recomputed in its VJP at every dtype (HIGHEST products)."""
  expect = dict(forward="tpu", backward="tpu", span=0, prepass="none" if fox else "uz",
                keep_inverse=False)
  kernel_check.check(key, backend="tpu_interpret", dtype=dtype, H=4, K=2, D=16, T=37,
                     gate=True, segments=True, fox=fox, block_sizes=dict(block=16),
                     expect=expect)
