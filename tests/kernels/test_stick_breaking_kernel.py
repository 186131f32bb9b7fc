"""kernels_pallas.stick_breaking_attention against the dense oracle
posenc_jax.stick_breaking.stick_breaking_attention_reference: the output and the gradients of
sum(o * ct) w.r.t. q, k and v.

Interpreter (CPU): T 40 with 16-row query tiles and 32-row key tiles (the key tiles straddle
query tiles, and both end in padding), GQA (H 4, K 2), head_dim 24 and values of width 20 (both
padded), documents that start inside a tile, keys j < i and j <= i, the remainder kept and
dropped; bf16 at the bf16 kernel tolerance against the oracle on the same bf16 values;
saturated logits. Through
the model: an SBA transformer on the kernel against the oracle. Lowering: the forward and the
gradient lower through Triton for "cuda" on this host. GPU: bf16 at MQRAR's and the language
models' sizes (marked gpu).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import stick_breaking_attention
from posenc_jax import stick_breaking
from tests.kernels import kernel_check
from tests.kernels.kernel_check import TOL
from tests.util import assert_rel_rms

F32, BF16 = jnp.float32, jnp.bfloat16


def _documents(B, T):
  """Row 0: three documents, starting at 0, 11 and 29 (inside tiles); the others one."""
  starts = jnp.zeros((B, T), jnp.int32).at[0, jnp.array([11, 29])].set(1)
  return jnp.cumsum(starts, axis=1)


def _compare(key, *, interpret, tol, B, T, H, K, D, Dv, dtype, segments, blocks=(None, None),
             oracle=stick_breaking.stick_breaking_attention_reference, **hp):
  ks = jax.random.split(key, 2)
  args = kernel_check.qkv(ks[0], B=B, T=T, H=H, K=K, D=D, Dv=Dv, dtype=dtype)
  ct = jax.random.normal(ks[1], (B, T, H, Dv))
  seg = _documents(B, T) if segments else None

  def kernel(q, k, v):
    return stick_breaking_attention(q, k, v, segment_ids=seg, block_q=blocks[0],
                                    block_k=blocks[1], interpret=interpret, **hp)

  def exact(q, k, v):
    return oracle(q.astype(F32), k.astype(F32), v.astype(F32), segment_ids=seg, **hp)

  kernel_check.assert_matches(*kernel_check.kernel_and_oracle(kernel, exact, args, ct), tol,
                              dtypes=(dtype,) * 4)


SMALL = dict(B=2, T=40, H=4, K=2, D=24, Dv=20, blocks=(16, 32))


@pytest.mark.parametrize("case", [
    dict(segments=True, dtype=F32, attend_current=False, remainder="current"),
    dict(segments=True, dtype=F32, attend_current=True, remainder="none"),
    dict(segments=False, dtype=BF16, attend_current=False, remainder="current"),
    pytest.param(dict(segments=False, dtype=F32, attend_current=True, remainder="current",
                      blocks=(32, 16)), marks=pytest.mark.slow),
], ids=["docs-f32", "current-key-no-remainder-f32", "bf16", "tiles-32-16-f32"])
def test_sba_kernel_matches_the_oracle(key, case):
  case = dict(SMALL, **case)
  _compare(key, interpret=True, tol=TOL[jnp.dtype(case["dtype"])], **case)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_sba_kernel_saturated_logits_stay_finite_and_exact(key, dtype):
  """q scaled by 40 (logits in the hundreds: every sigmoid saturated, sticks used up within a
  key or two, log-sticks in the thousands): forward and gradients finite and equal to the
  oracle's at the dtype's tolerance."""
  ks = jax.random.split(key, 2)
  q, k, v = kernel_check.qkv(ks[0], B=1, T=48, H=2, K=2, D=16, Dv=16, dtype=F32)
  args = [x.astype(dtype) for x in (40.0 * q, k, v)]
  ct = jax.random.normal(ks[1], (1, 48, 2, 16))
  oracle = stick_breaking.stick_breaking_attention_reference
  (o, grads), (o_want, grads_want) = kernel_check.kernel_and_oracle(
      lambda *a: stick_breaking_attention(*a, block_q=16, block_k=16, interpret=True),
      lambda *a: oracle(*(x.astype(F32) for x in a)), args, ct)
  for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_want, *grads_want)):
    assert bool(jnp.isfinite(got.astype(F32)).all()), name
    assert_rel_rms(got, want, TOL[jnp.dtype(dtype)], name)


def test_sba_kernel_lowers_for_cuda():
  """Forward and gradient lower through Triton for "cuda" on this host at bf16, MQRAR's
  head_dim 128, T 768, GQA and documents: the three kernels, no others."""
  SD = jax.ShapeDtypeStruct
  B, T, H, K, D = 1, 768, 4, 2, 128
  arrays = [SD((B, T, H, D), BF16), SD((B, T, K, D), BF16), SD((B, T, K, D), BF16),
            SD((B, T), jnp.int32)]

  def f(q, k, v, seg):
    return stick_breaking_attention(q, k, v, segment_ids=seg)

  assert kernel_check.cuda_kernels_with_grad(f, arrays, (0, 1, 2)) == (
      {"forward_kernel"}, {"forward_kernel", "dkv_kernel", "dq_kernel"})


def test_model_on_the_kernel_matches_the_reference(key, monkeypatch):
  """An SBA transformer with model.implementation="pallas" (the interpreted kernel, seen to
  run) against the same parameters on the dense oracle: logits and every parameter's gradient
  of the loss, on two packed documents."""
  calls = kernel_check.recorded_calls(monkeypatch, "stick_breaking_attention",
                                      lambda *a, **kw: kw["remainder"])
  kernel_check.check_model_on_the_kernel(key, "sba")
  assert calls == ["current"]


def test_sba_kernel_errors_name_the_field():
  q = jnp.zeros((1, 8, 4, 16))
  with pytest.raises(ValueError, match="multiple of kv heads"):
    stick_breaking_attention(q, jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 3, 16)),
                             interpret=True)
  with pytest.raises(ValueError, match="remainder='all'"):
    stick_breaking_attention(q, q, q, remainder="all", interpret=True)
  with pytest.raises(ValueError, match="block_k=24"):
    stick_breaking_attention(q, q, q, block_k=24, interpret=True)
  with pytest.raises(ValueError, match="segment_ids"):
    stick_breaking_attention(q, q, q, segment_ids=jnp.zeros((1, 9), jnp.int32), interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("shape", [(64, 768, 2, 128), (2, 2048, 12, 64)],
                         ids=["mqrar", "lm"])
def test_sba_kernel_on_gpu(key, shape):
  """The Triton kernels at MQRAR's size and a language model's (bf16, documents) against the
  chunked oracle in float32 on the same bf16 values, at the bf16 kernel tolerance."""
  B, T, H, D = shape
  _compare(key, interpret=False, tol=TOL[jnp.dtype(BF16)], B=B, T=T, H=H, K=H, D=D, Dv=D,
           dtype=BF16, segments=True, oracle=stick_breaking.stick_breaking_attention_chunked)
