"""kernels_pallas.grape_a_attention against the dense oracle
posenc_jax.grape_a.grape_a_attention_reference: the output and the gradients of sum(o * ct)
w.r.t. q, k, v and both rates, in one program each.

Interpreter (CPU): T 40 with 16-row query tiles and 32-row key tiles (the key tiles straddle
query tiles, and both end in padding), GQA (H 4, K 2), head_dim 24 (padded), values of another
width, documents that start inside a tile, both rates or one. float32 at the float32 kernel
tolerance; bf16 at the bf16 one against the oracle on the same bf16 values. Lowering: the
forward and the gradient lower through Triton for "cuda" on this host.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import grape_a_attention
from posenc_jax import grape_a
from tests.kernels import kernel_check
from tests.kernels.kernel_check import TOL
from tests.util import assert_rel_rms

F32, BF16 = jnp.float32, jnp.bfloat16


def _inputs(key, *, B, T, H, K, D, Dv, dtype):
  ks = jax.random.split(key, 6)
  q, k, v = kernel_check.qkv(ks[0], B=B, T=T, H=H, K=K, D=D, Dv=Dv, dtype=dtype)
  # GRAPE-A's rates are omega_h softplus(.) >= 0; spread them over ALiBi's range and beyond
  rq = jax.random.uniform(ks[3], (B, T, H), minval=0.0, maxval=0.6)
  rk = jax.random.uniform(ks[4], (B, T, H), minval=0.0, maxval=0.6)
  return (q, k, v, rq, rk), jax.random.normal(ks[5], (B, T, H, Dv))


def _documents(B, T, starts=(11, 29)):
  """Row 0: documents starting at 0 and at `starts` (inside tiles); the others one."""
  starts = jnp.zeros((B, T), jnp.int32).at[0, jnp.array(starts)].set(1)
  return jnp.cumsum(starts, axis=1)


def _compare(key, *, dtype, rates, segments, B=2, T=40, H=4, K=2, D=24, Dv=16,
             blocks=(16, 32), starts=(11, 29)):
  args, ct = _inputs(key, B=B, T=T, H=H, K=K, D=D, Dv=Dv, dtype=dtype)
  seg = _documents(B, T, starts) if segments else None
  scale = D ** -0.5
  use_q, use_k = "q" in rates, "k" in rates

  def kernel(q, k, v, rq, rk):
    return grape_a_attention(q, k, v, rq if use_q else None, rk if use_k else None,
                             scale=scale, segment_ids=seg, block_q=blocks[0],
                             block_k=blocks[1], interpret=True)

  def oracle(q, k, v, rq, rk):
    return grape_a.grape_a_attention_reference(
        q.astype(F32), k.astype(F32), v.astype(F32), omega=jnp.ones((H,)),
        lam_q=rq if use_q else None, lam_k=rk if use_k else None, segment_ids=seg,
        scale=scale)

  (o, grads), (o_want, grads_want) = kernel_check.kernel_and_oracle(kernel, oracle, args, ct)
  tol = TOL[jnp.dtype(dtype)]
  assert o.dtype == dtype
  assert_rel_rms(o, o_want, tol, "o")
  names = ("dq", "dk", "dv", "drate_q", "drate_k")
  for name, g, g_want, used in zip(names, grads, grads_want, (1, 1, 1, use_q, use_k)):
    if used:
      assert_rel_rms(g, g_want, tol, name)
    else:   # an absent rate receives no gradient
      assert not jnp.any(g), name


@pytest.mark.parametrize("case", [
    dict(dtype=F32, rates="qk", segments=True),
    dict(dtype=BF16, rates="qk", segments=False),
    pytest.param(dict(dtype=F32, rates="q", segments=True), marks=pytest.mark.slow),
    pytest.param(dict(dtype=F32, rates="k", segments=False), marks=pytest.mark.slow),
], ids=["qk-f32-docs", "qk-bf16", "q-f32-docs", "k-f32"])
def test_grape_a_kernel_matches_the_oracle(key, case):
  _compare(key, **case)


@pytest.mark.parametrize("blocks", [(16, 16), (16, 32), (32, 16)])
def test_grape_a_kernel_skips_other_documents_exactly(key, blocks):
  """Documents shorter than a row (starting at 21, 40, 70 of 96): the forward and dq walks
  start past key tiles of earlier documents, the dk/dv walk stops before query tiles of later
  ones (tiles.document_bounds), and the result is the oracle's."""
  _compare(key, dtype=F32, rates="qk", segments=True, T=96, blocks=blocks,
           starts=(21, 40, 70))


def test_grape_a_kernel_refuses_a_rate_of_another_shape():
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match=r"rate_k has shape \(1, 8, 1\), expected \(1, 8, 2\)"):
    grape_a_attention(q, q, q, None, jnp.zeros((1, 8, 1)), scale=0.25, interpret=True)


def test_grape_a_kernel_lowers_for_cuda():
  """Forward and gradient lower through Triton for "cuda" on this host at bf16, head_dim 64,
  T 1024, GQA and documents: the three kernels, no others."""
  SD = jax.ShapeDtypeStruct
  B, T, H, K, D = 1, 1024, 4, 2, 64
  arrays = [SD((B, T, H, D), BF16), SD((B, T, K, D), BF16), SD((B, T, K, D), BF16),
            SD((B, T, H), F32), SD((B, T, H), F32), SD((B, T), jnp.int32)]

  def f(q, k, v, rq, rk, seg):
    return grape_a_attention(q, k, v, rq, rk, scale=D ** -0.5, segment_ids=seg)

  assert kernel_check.cuda_kernels_with_grad(f, arrays, (0, 1, 2, 3, 4)) == (
      {"forward_kernel"}, {"forward_kernel", "dkv_kernel", "dq_kernel"})


@pytest.mark.parametrize("encoding", ["grape_a_qk", "grape_a_k"])
def test_model_on_the_kernel_matches_the_reference(key, monkeypatch, encoding):
  """A GRAPE-A transformer with model.implementation="pallas" (the interpreted kernel, seen to
  run) against the same parameters on the dense closed form: logits and every parameter's
  gradient (the gate vectors' through the kernel's rate gradients), on two packed documents
  with GQA."""
  calls = kernel_check.recorded_calls(
      monkeypatch, "grape_a_attention",
      lambda q, k, v, rate_q, rate_k, **kw: (rate_q is not None, rate_k is not None))
  kernel_check.check_model_on_the_kernel(key, encoding)
  assert calls == [(encoding == "grape_a_qk", True)]


def test_attention_needs_a_rate():
  from posenc_jax import attention
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match="needs rate_q or rate_k"):
    attention.grape_a_attention(q, q, q, None, None)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_grape_a_kernel_on_gpu(key):
  """The Triton kernels at a training size (bf16, T 2048, 12 heads of 64, three documents)
  against the dense closed form in float32 on the same bf16 values, at the bf16 tolerance."""
  B, T, H, D = 2, 2048, 12, 64
  args, ct = _inputs(key, B=B, T=T, H=H, K=H, D=D, Dv=D, dtype=BF16)
  seg = jnp.cumsum(jnp.zeros((B, T), jnp.int32).at[:, jnp.array([300, 1100])].set(1), axis=1)

  def kernel(q, k, v, rq, rk):
    return grape_a_attention(q, k, v, rq, rk, scale=D ** -0.5, segment_ids=seg)

  def oracle(q, k, v, rq, rk):
    return grape_a.grape_a_attention_reference(
        q.astype(F32), k.astype(F32), v.astype(F32), omega=jnp.ones((H,)), lam_q=rq,
        lam_k=rk, segment_ids=seg, scale=D ** -0.5)

  kernel_check.assert_matches(*kernel_check.kernel_and_oracle(kernel, oracle, args, ct),
                              TOL[jnp.dtype(BF16)],
                              names=("o", "dq", "dk", "dv", "drate_q", "drate_k"))
