"""kernels_pallas.grape_ap_attention against the dense oracle
posenc_jax.path_integral.path_integral_attention_reference: the output and the gradients of
sum(o * ct) w.r.t. q, k, v, p, p_query and alpha, in one program each.

Interpreter (CPU): T 40 with 16-row query tiles and 32-row key tiles (the key tiles straddle
query tiles, and both end in padding), GQA (H 4, K 2), values of another width, probes of an
unpadded width, documents that start inside a tile, with and without a separate query probe.
bf16 at the bf16 kernel tolerance against the oracle on the same bf16 values. Lowering: the
forward and the gradient lower through Triton for "cuda" on this host. Wiring:
attention.path_integral_attention(implementation="pallas"), and (slow) a one-layer model on
the kernel against the reference. GPU: bf16 at T 2048 (marked gpu).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import grape_ap_attention
from posenc_jax import path_integral
from tests.kernels import kernel_check
from tests.kernels.kernel_check import TOL
from tests.util import assert_rel_rms

F32, BF16 = jnp.float32, jnp.bfloat16
NAMES = ("dq", "dk", "dv", "dp", "dalpha", "dp_query")


def _inputs(key, *, B, T, H, K, D, Dv, P, dtype, separate_query):
  ks = jax.random.split(key, 8)
  q, k, v = kernel_check.qkv(ks[0], B=B, T=T, H=H, K=K, D=D, Dv=Dv, dtype=dtype)
  # probes of a few units, so that log_sigmoid is off its linear part and the bias matters
  p = 3.0 * jax.random.normal(ks[3], (B, T, H, P))
  alpha = jax.random.uniform(ks[4], (H,), minval=0.2, maxval=1.0)
  args = (q, k, v, p, alpha)
  if separate_query:
    args += (3.0 * jax.random.normal(ks[5], (B, T, H, P)),)
  return args, jax.random.normal(ks[6], (B, T, H, Dv))


def _documents(B, T):
  """Row 0: three documents, starting at 0, 11 and 29 (inside tiles); the others one."""
  starts = jnp.zeros((B, T), jnp.int32).at[0, jnp.array([11, 29])].set(1)
  return jnp.cumsum(starts, axis=1)


def _rotated(p, seg):
  """The key-side probes as the kernel takes them: R_l p_l at within-document positions."""
  B, T = p.shape[:2]
  return path_integral.rotate_probes(p, path_integral.segment_positions(seg, B, T))


def _check(key, *, tol, B, T, H, K, D, Dv, P, dtype, segments, separate_query, blocks=(None,
           None), oracle_fn=path_integral.path_integral_attention_reference, interpret=True):
  args, ct = _inputs(key, B=B, T=T, H=H, K=K, D=D, Dv=Dv, P=P, dtype=dtype,
                     separate_query=separate_query)
  seg = _documents(B, T) if segments else None
  scale = D ** -0.5

  def kernel(q, k, v, p, alpha, p_query=None):
    return grape_ap_attention(q, k, v, p if p_query is None else p_query, _rotated(p, seg),
                              alpha, scale=scale, segment_ids=seg, block_q=blocks[0],
                              block_k=blocks[1], interpret=interpret)

  def oracle(q, k, v, p, alpha, p_query=None):
    return oracle_fn(q.astype(F32), k.astype(F32), v.astype(F32), p, alpha, scale=scale,
                     p_query=p_query, segment_ids=seg)

  names = ("o",) + NAMES[:len(args)]   # p_query only where the query has its own probe
  kernel_check.assert_matches(
      *kernel_check.kernel_and_oracle(kernel, oracle, args, ct), tol, names=names,
      dtypes=[dtype if name in ("o", "dq", "dk", "dv") else F32 for name in names])


SMALL = dict(B=2, T=40, H=4, K=2, D=16, Dv=24, P=8, blocks=(16, 32))


@pytest.mark.parametrize("case", [
    dict(dtype=F32, segments=True, separate_query=True),
    dict(dtype=F32, segments=False, separate_query=False, blocks=(32, 16)),
    dict(dtype=BF16, segments=True, separate_query=False),
    pytest.param(dict(dtype=F32, segments=True, separate_query=False, blocks=(16, 16)),
                 marks=pytest.mark.slow),
    pytest.param(dict(dtype=BF16, segments=False, separate_query=True), marks=pytest.mark.slow),
], ids=["f32-docs-query-probe", "f32-wide-query-tiles", "bf16-docs", "f32-docs-square-tiles",
        "bf16-query-probe"])
def test_grape_ap_kernel_matches_the_oracle(key, case):
  case = dict(SMALL, **case)
  _check(key, tol=TOL[jnp.dtype(case["dtype"])], **case)


def test_grape_ap_kernel_lowers_for_cuda():
  """Forward and gradient lower through Triton for "cuda" on this host at bf16, head_dim 64,
  T 1024, GQA, documents and a query probe: the three kernels, no others."""
  SD = jax.ShapeDtypeStruct
  B, T, H, K, D, P = 1, 1024, 4, 2, 64, 16
  arrays = [SD((B, T, H, D), BF16), SD((B, T, K, D), BF16), SD((B, T, K, D), BF16),
            SD((B, T, H, P), F32), SD((H,), F32), SD((B, T, H, P), F32), SD((B, T), jnp.int32)]

  def f(q, k, v, p, alpha, pq, seg):
    return grape_ap_attention(q, k, v, pq, _rotated(p, seg), alpha, scale=0.125,
                              segment_ids=seg)

  assert kernel_check.cuda_kernels_with_grad(f, arrays, (0, 1, 2, 3, 4, 5)) == (
      {"forward_kernel"}, {"forward_kernel", "dkv_kernel", "dq_kernel"})


def test_grape_ap_kernel_errors_name_the_field():
  q = jnp.zeros((1, 8, 4, 16))
  p = jnp.zeros((1, 8, 4, 8))
  al = jnp.ones((4,))
  base = dict(q=q, k=q, v=q, pq=p, r=p, alpha=al, scale=0.25, interpret=True)
  run = lambda **kw: grape_ap_attention(**{**base, **kw})  # noqa: E731
  with pytest.raises(ValueError, match="multiple of kv heads"):
    run(k=jnp.zeros((1, 8, 3, 16)), v=jnp.zeros((1, 8, 3, 16)))
  with pytest.raises(ValueError, match="pq .* with q's B, T and H"):
    run(pq=jnp.zeros((1, 8, 3, 8)))
  with pytest.raises(ValueError, match="r .* must have pq's shape"):
    run(r=jnp.zeros((1, 8, 4, 6)))
  with pytest.raises(ValueError, match="alpha"):
    run(alpha=jnp.ones((3,)))
  with pytest.raises(ValueError, match="block_k=24"):
    run(block_k=24)
  with pytest.raises(ValueError, match="segment_ids"):
    run(segment_ids=jnp.zeros((1, 9), jnp.int32))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_grape_ap_kernel_on_gpu(key):
  """The Triton kernels at a training size (bf16, T 2048, 12 heads of 64, documents, a query
  probe) against the chunked oracle in float32 on the same bf16 values, at the bf16 tolerance."""
  _check(key, tol=TOL[jnp.dtype(BF16)], B=2, T=2048, H=12, K=12, D=64, Dv=64, P=16, dtype=BF16,
         segments=True, separate_query=True, interpret=False,
         oracle_fn=path_integral.path_integral_attention_chunked)


def test_attention_pallas_runs_the_kernel(key, monkeypatch):
  """attention.path_integral_attention(implementation="pallas") runs the kernel (seen to be
  called) and matches implementation="reference" on two packed documents with GQA."""
  import kernels_pallas
  from posenc_jax import attention

  calls = []

  def counted(*a, **kw):
    calls.append(kw["interpret"])
    return grape_ap_attention(*a, **kw)

  monkeypatch.setattr(kernels_pallas, "grape_ap_attention", counted)
  (q, k, v, p, alpha), _ = _inputs(key, B=1, T=20, H=2, K=1, D=16, Dv=16, P=4, dtype=F32,
                                   separate_query=False)
  seg = jnp.where(jnp.arange(20) < 7, 1, 2)[None]
  o = attention.path_integral_attention(q, k, v, p, alpha, segment_ids=seg,
                                        implementation="pallas")
  assert calls == [True]
  with jax.default_matmul_precision("highest"):
    o_want = attention.path_integral_attention(q, k, v, p, alpha, segment_ids=seg,
                                               implementation="reference")
  assert_rel_rms(o, o_want, TOL[jnp.dtype(F32)], "o")


# Slow (a model's compile); the default set checks the wiring through attention (above).
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["paper", "official"])
def test_model_on_the_kernel_matches_the_reference(key, monkeypatch, variant):
  """A GRAPE-AP transformer with model.implementation="pallas" (the interpreted kernel, seen to
  run) against the same parameters on the dense oracle: logits and every parameter's gradient
  of the loss (the probes' and alpha's included), on two packed documents. The official
  variant passes separate query probes (the encoding builds them; the kernel takes pq)."""
  calls = kernel_check.recorded_calls(monkeypatch, "grape_ap_attention",
                                      lambda *a, **kw: kw["interpret"])
  kernel_check.check_model_on_the_kernel(key, "grape_ap",
                                       encoding_kwargs=(("variant", variant),))
  assert calls == [True]
