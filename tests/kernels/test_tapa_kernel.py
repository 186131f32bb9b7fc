"""kernels_pallas.tapa_attention against the dense oracle posenc_jax.tapa.tapa_attention_reference:
the output and the gradients of sum(o * ct) w.r.t. q, k and v, in one program each.

Interpreter (CPU): T 40 with 16-row query tiles and 32-row key tiles (the key tiles straddle
query tiles, and both end in padding), GQA (H 4, K 2), head_dim 24 split unevenly (the padded
channel parts), values of another width, both phases, alpha 0.1 and 0, documents that start
inside a tile. bf16 at the bf16 kernel tolerance against the oracle on the same bf16 values.
Lowering: the forward and the gradient lower through Triton for "cuda" on this host. GPU: bf16
at T 2048 (marked gpu, run by .ci/gpu).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import tapa_attention
from posenc_jax import tapa
from tests.kernels import kernel_check
from tests.kernels.kernel_check import TOL

F32, BF16 = jnp.float32, jnp.bfloat16


def _inputs(key, *, B, T, H, K, D, Dv, dtype):
  ks = jax.random.split(key, 4)
  q, k, v = kernel_check.qkv(ks[0], B=B, T=T, H=H, K=K, D=D, Dv=Dv, dtype=dtype)
  return (q, k, v), jax.random.normal(ks[3], (B, T, H, Dv))


def _documents(B, T, starts=(11, 29)):
  """Row 0: documents starting at 0 and at `starts` (inside tiles); the others one."""
  starts = jnp.zeros((B, T), jnp.int32).at[0, jnp.array(starts)].set(1)
  return jnp.cumsum(starts, axis=1)


def _compare(key, *, interpret, tol, B, T, H, K, D, Dv, dtype, hp, segments, blocks,
             starts=(11, 29)):
  args, ct = _inputs(key, B=B, T=T, H=H, K=K, D=D, Dv=Dv, dtype=dtype)
  seg = _documents(B, T, starts) if segments else None

  def kernel(q, k, v):
    return tapa_attention(q, k, v, segment_ids=seg, block_q=blocks[0], block_k=blocks[1],
                          interpret=interpret, **hp)

  def oracle(q, k, v):
    return tapa.tapa_attention_reference(q.astype(F32), k.astype(F32), v.astype(F32),
                                         segment_ids=seg, **hp)

  kernel_check.assert_matches(*kernel_check.kernel_and_oracle(kernel, oracle, args, ct), tol,
                              dtypes=(dtype,) * 4)


SMALL = dict(B=2, T=40, H=4, K=2, D=24, Dv=16, blocks=(16, 32))


# The quadratic phase in float32 with documents and GQA also runs in the default set through
# the model (test_model_on_the_kernel_matches_the_reference); here it is under -m slow.
@pytest.mark.parametrize("case", [
    pytest.param(dict(hp=dict(alpha=0.1, theta=0.5, linear_phase=False), segments=True,
                      dtype=F32), marks=pytest.mark.slow),
    dict(hp=dict(alpha=0.1, theta=0.4, linear_phase=True), segments=True, dtype=F32),
    dict(hp=dict(alpha=0.3, theta=0.4, linear_phase=False), segments=False, dtype=BF16),
    pytest.param(dict(hp=dict(alpha=0.0, theta=0.5, linear_phase=False), segments=False,
                      dtype=F32), marks=pytest.mark.slow),
    pytest.param(dict(hp=dict(alpha=0.1, theta=0.5, linear_phase=True), segments=True,
                      dtype=BF16), marks=pytest.mark.slow),
], ids=["quadratic-f32-docs", "linear-f32-docs", "quadratic-bf16", "alpha0-f32",
        "linear-bf16-docs"])
def test_tapa_kernel_matches_the_oracle(key, case):
  case = dict(SMALL, **case)
  _compare(key, interpret=True, tol=TOL[jnp.dtype(case["dtype"])], **case)


@pytest.mark.parametrize("blocks", [(16, 16), (16, 32), (32, 16)])
def test_tapa_kernel_skips_other_documents_exactly(key, blocks):
  """Documents shorter than a row (starting at 21, 40, 70 of 96): the forward and dq walks
  start past key tiles of earlier documents, the dk/dv walk stops before query tiles of later
  ones (tiles.document_bounds), and the result is the oracle's."""
  case = dict(SMALL, T=96, blocks=blocks, starts=(21, 40, 70), segments=True, dtype=F32,
              hp=dict(alpha=0.1, theta=0.5, linear_phase=False))
  _compare(key, interpret=True, tol=TOL[jnp.dtype(F32)], **case)


@pytest.mark.parametrize("linear_phase", [False, True], ids=["quadratic", "linear"])
def test_tapa_kernel_lowers_for_cuda(linear_phase):
  """Forward and gradient lower through Triton for "cuda" on this host at bf16, head_dim 64,
  T 1024, GQA and documents: the three kernels, no others."""
  SD = jax.ShapeDtypeStruct
  B, T, H, K, D = 1, 1024, 4, 2, 64
  arrays = [SD((B, T, H, D), BF16), SD((B, T, K, D), BF16), SD((B, T, K, D), BF16),
            SD((B, T), jnp.int32)]

  def f(q, k, v, seg):
    return tapa_attention(q, k, v, alpha=0.1, theta=0.5, linear_phase=linear_phase,
                          segment_ids=seg)

  assert kernel_check.cuda_kernels_with_grad(f, arrays, (0, 1, 2)) == (
      {"forward_kernel"}, {"forward_kernel", "dkv_kernel", "dq_kernel"})


def test_model_on_the_kernel_matches_the_reference(key, monkeypatch):
  """A TAPA transformer with model.implementation="pallas" (the interpreted kernel, seen to
  run) against the same parameters on the dense oracle: logits and every parameter's gradient
  of the loss, on two packed documents."""
  calls = kernel_check.recorded_calls(monkeypatch, "tapa_attention",
                                      lambda *a, **kw: kw["linear_phase"])
  kernel_check.check_model_on_the_kernel(key, "tapa")
  assert calls == [False]


def test_tapa_kernel_errors_name_the_field():
  q = jnp.zeros((1, 8, 4, 16))
  with pytest.raises(ValueError, match="multiple of kv heads"):
    tapa_attention(q, jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 3, 16)), alpha=0.1,
                   theta=0.5, interpret=True)
  with pytest.raises(ValueError, match="theta=0.01"):
    tapa_attention(q, q, q, alpha=0.1, theta=0.01, interpret=True)
  with pytest.raises(ValueError, match="alpha=-1"):
    tapa_attention(q, q, q, alpha=-1, theta=0.5, interpret=True)
  with pytest.raises(ValueError, match="block_q=24"):
    tapa_attention(q, q, q, alpha=0.1, theta=0.5, block_q=24, interpret=True)
  with pytest.raises(ValueError, match="segment_ids"):
    tapa_attention(q, q, q, alpha=0.1, theta=0.5, segment_ids=jnp.zeros((1, 9), jnp.int32),
                   interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("linear_phase", [False, True], ids=["quadratic", "linear"])
def test_tapa_kernel_on_gpu(key, linear_phase):
  """The Triton kernels at a training size (bf16, T 2048, 12 heads of 64, documents) against
  the chunked oracle in float32 on the same bf16 values, at the bf16 kernel tolerance."""
  B, T, H, D = 2, 2048, 12, 64
  args, ct = _inputs(key, B=B, T=T, H=H, K=H, D=D, Dv=D, dtype=BF16)
  starts = jnp.zeros((B, T), jnp.int32).at[:, jnp.array([300, 1100])].set(1)
  seg = jnp.cumsum(starts, axis=1)
  hp = dict(alpha=0.1, theta=0.5, linear_phase=linear_phase)

  def kernel(q, k, v):
    return tapa_attention(q, k, v, segment_ids=seg, **hp)

  def oracle(q, k, v):
    return tapa.tapa_attention_chunked(q.astype(F32), k.astype(F32), v.astype(F32),
                                       segment_ids=seg, **hp)

  kernel_check.assert_matches(*kernel_check.kernel_and_oracle(kernel, oracle, args, ct),
                              TOL[jnp.dtype(BF16)])
