"""kernels_pallas.block_attention against its oracle, the ring's plain-jnp step
posenc_jax.context_parallel.tiles.attend (non-causal: no positions): o, lse, and the gradients
of sum(o * ct_o) + sum(lse * ct_lse) w.r.t. q, k, v and both biases, in one program each.

Interpreter (CPU): Tq 48 / Tk 80 with 16 x 16 tiles (several tiles, a ragged tail on both
sides), GQA (H 4, K 2). Segment ids leave one query row with no key of its segment: o 0,
lse NEG_INF, finite gradients. Lowering: the forward and the gradient lower for "cuda" on this
host. GPU: bf16 at T 4096 (marked gpu, run by .ci/gpu).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import block_attention
from posenc_jax.context_parallel import tiles
from posenc_jax.masking import NEG_INF
from tests.kernels import kernel_check
from tests.kernels.kernel_check import TOL
from tests.util import assert_rel_rms, value_and_grads

F32, BF16 = jnp.float32, jnp.bfloat16
NAMES = ("dq", "dk", "dv", "dq_bias", "dk_bias")


def _segments(key, B, Tq, Tk, *, docs):
  """Random document ids in [0, docs) (interleaved: every tile is partly masked); query row
  (0, 5) gets id `docs`, which no key has."""
  kq, kk = jax.random.split(key)
  sq = jax.random.randint(kq, (B, Tq), 0, docs).at[0, 5].set(docs)
  return sq, jax.random.randint(kk, (B, Tk), 0, docs)


def _inputs(key, *, B, Tq, Tk, H, K, D, q_dtype, kv_dtype, bias, segments):
  ks = jax.random.split(key, 8)
  q = jax.random.normal(ks[0], (B, Tq, H, D), q_dtype)
  k = jax.random.normal(ks[1], (B, Tk, K, D), kv_dtype)
  v = jax.random.normal(ks[2], (B, Tk, K, D), kv_dtype)
  qb = jax.random.normal(ks[3], (B, Tq, H)) if bias else None
  kb = jax.random.normal(ks[4], (B, Tk, H)) if bias else None
  sq, sk = _segments(ks[5], B, Tq, Tk, docs=3) if segments else (None, None)
  ct_o = jax.random.normal(ks[6], (B, Tq, H, D))
  ct_lse = jax.random.normal(ks[7], (B, Tq, H))
  return (q, k, v, qb, kb), (sq, sk), (ct_o, ct_lse)


def _compare(key, *, interpret, tol, B, Tq, Tk, H, K, D, q_dtype=F32, kv_dtype=F32, bias=True,
             segments=True, blocks=(None, None)):
  args, (sq, sk), (ct_o, ct_lse) = _inputs(key, B=B, Tq=Tq, Tk=Tk, H=H, K=K, D=D,
                                           q_dtype=q_dtype, kv_dtype=kv_dtype, bias=bias,
                                           segments=segments)
  scale = D ** -0.5
  argnums = tuple(i for i, a in enumerate(args) if a is not None)

  def kernel(q, k, v, qb, kb):
    return block_attention(q, k, v, scale=scale, q_bias=qb, k_bias=kb, q_segment_ids=sq,
                           k_segment_ids=sk, block_q=blocks[0], block_k=blocks[1],
                           interpret=interpret)

  def oracle(q, k, v, qb, kb):
    f32 = lambda x: None if x is None else x.astype(F32)  # noqa: E731
    return tiles.attend(f32(q) * scale, f32(k), f32(v), q_bias=f32(qb), k_bias=f32(kb),
                        q_seg=sq, k_seg=sk)

  loss = lambda out: jnp.sum(out[0] * ct_o) + jnp.sum(out[1] * ct_lse)  # noqa: E731
  (o, lse), grads = value_and_grads(kernel, loss, argnums)(*args)
  with jax.default_matmul_precision("highest"):
    (o_want, lse_want), grads_want = value_and_grads(oracle, loss, argnums)(*args)
  seen = np.asarray(lse_want) > NEG_INF / 2
  assert_rel_rms(o, o_want, tol, "o")
  assert_rel_rms(np.asarray(lse)[seen], np.asarray(lse_want)[seen], tol, "lse")
  if segments:   # the row whose segment has no key
    assert not seen[0, 5].any()
    np.testing.assert_array_equal(np.asarray(lse)[~seen], np.float32(NEG_INF))
    np.testing.assert_array_equal(np.asarray(o)[~seen], 0.0)
  for i, g, want in zip(argnums, grads, grads_want):
    assert g.dtype == args[i].dtype, (NAMES[i], g.dtype)
    assert_rel_rms(g, want, tol, NAMES[i])


SMALL = dict(B=2, Tq=48, Tk=80, H=4, K=2, D=16, blocks=(16, 16))


@pytest.mark.parametrize("case", [
    dict(bias=True, segments=True),
    dict(q_dtype=F32, kv_dtype=BF16, bias=False, segments=False),
    pytest.param(dict(bias=False, segments=False), marks=pytest.mark.slow),
    pytest.param(dict(bias=True, segments=False), marks=pytest.mark.slow),
    pytest.param(dict(q_dtype=F32, kv_dtype=BF16, bias=True, segments=True),
                 marks=pytest.mark.slow),
    pytest.param(dict(q_dtype=BF16, kv_dtype=BF16, bias=True, segments=True, H=3, K=3, D=24),
                 marks=pytest.mark.slow),
], ids=["f32-bias-seg", "bf16kv-f32q", "f32-plain", "f32-bias", "bf16kv-bias-seg",
        "bf16-mha-d24"])
def test_block_attention_matches_tiles_attend(key, case):
  """Several tiles and a ragged tail on both sides; bf16 cases at the bf16 kernel tolerance
  (q rounded to k's dtype, p and dS rounded before their products)."""
  case = dict(SMALL, **case)
  tol = TOL[jnp.dtype(case.get("kv_dtype", F32))]
  _compare(key, interpret=True, tol=tol, **case)


@pytest.mark.slow
def test_block_attention_default_tiles_one_tile_each_side(key):
  """Default tiles on short sequences: each side one tile (clipped to the sequence), padded."""
  _compare(key, interpret=True, tol=TOL[jnp.dtype(F32)], B=1, Tq=20, Tk=33, H=2, K=1, D=16)


def test_block_attention_lowers_for_cuda():
  """Forward and gradient (q, k, v, both biases) lower through Triton for "cuda" on this host
  at bf16, head_dim 64, T 1024, with biases and segment ids: the three kernels, no others."""
  SD = jax.ShapeDtypeStruct
  B, T, H, K, D = 1, 1024, 4, 2, 64
  arrays = [SD((B, T, H, D), BF16), SD((B, T, K, D), BF16), SD((B, T, K, D), BF16),
            SD((B, T, H), F32), SD((B, T, H), F32), SD((B, T), jnp.int32),
            SD((B, T), jnp.int32)]

  def f(q, k, v, qb, kb, sq, sk):
    return block_attention(q, k, v, scale=D ** -0.5, q_bias=qb, k_bias=kb, q_segment_ids=sq,
                           k_segment_ids=sk)

  grad = jax.grad(lambda *a: sum(jnp.sum(x) for x in f(*a)), argnums=(0, 1, 2, 3, 4))
  for fn, want in ((f, {"forward_kernel"}),
                   (grad, {"forward_kernel", "dkv_kernel", "dq_kernel"})):
    assert kernel_check.cuda_kernels(fn, arrays) == want


def test_block_attention_errors_name_the_field():
  q = jnp.zeros((1, 8, 4, 16))
  k = jnp.zeros((1, 8, 3, 16))
  with pytest.raises(ValueError, match="multiple of kv heads"):
    block_attention(q, k, k, scale=1.0, interpret=True)
  k = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match="both or neither"):
    block_attention(q, k, k, scale=1.0, q_segment_ids=jnp.zeros((1, 8), jnp.int32),
                    interpret=True)
  with pytest.raises(ValueError, match="k_bias"):
    block_attention(q, k, k, scale=1.0, k_bias=jnp.zeros((1, 8, 2)), interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_block_attention_on_gpu(key):
  """The Triton kernels at a ring step's size: bf16 q, k, v, T 4096, 12 heads, head_dim 64,
  biases and documents (queries' documents shifted against the keys': the first has no key)
  against tiles.attend in float32 on the same bf16 values, at the bf16 kernel tolerance."""
  B, T, H, D = 1, 4096, 12, 64
  args, _, (ct_o, ct_lse) = _inputs(key, B=B, Tq=T, Tk=T, H=H, K=H, D=D, q_dtype=BF16,
                                    kv_dtype=BF16, bias=True, segments=False)
  starts = jnp.zeros((B, T), jnp.int32).at[:, jnp.array([700, 1900, 3100])].set(1)
  sq = jnp.cumsum(starts, axis=1)   # query documents 0..3; key documents 1..4: query
  sk = sq + 1                       # document 0 sees no key, document d the keys of d - 1's span
  scale = D ** -0.5

  def kernel(q, k, v, qb, kb):
    return block_attention(q, k, v, scale=scale, q_bias=qb, k_bias=kb, q_segment_ids=sq,
                           k_segment_ids=sk)

  def oracle(q, k, v, qb, kb):
    return tiles.attend(q.astype(F32) * scale, k.astype(F32), v.astype(F32), q_bias=qb,
                        k_bias=kb, q_seg=sq, k_seg=sk)

  loss = lambda out: jnp.sum(out[0] * ct_o) + jnp.sum(out[1] * ct_lse)  # noqa: E731
  argnums = (0, 1, 2, 3, 4)
  (o, lse), grads = value_and_grads(kernel, loss, argnums)(*args)
  with jax.default_matmul_precision("highest"):
    (o_want, lse_want), grads_want = value_and_grads(oracle, loss, argnums)(*args)
  seen = np.asarray(lse_want) > NEG_INF / 2
  assert not seen[:, :700].any() and seen[:, 700:].all()
  tol = TOL[jnp.dtype(BF16)]
  assert_rel_rms(o, o_want, tol, "o")
  assert_rel_rms(np.asarray(lse)[seen], np.asarray(lse_want)[seen], tol, "lse")
  np.testing.assert_array_equal(np.asarray(lse)[~seen], np.float32(NEG_INF))
  for name, g, want in zip(NAMES, grads, grads_want):
    assert_rel_rms(g, want, tol, name)
