"""return_lse: the kernels' (o, lse) against a dense oracle, forward and gradients with a
cotangent on both outputs (lse merges partial attentions, e.g. the context-parallel ring, so
its gradient must be right too). Interpreter: float32, the walk backward of PaTH and FoX (the
lse cotangent enters through Delta, which every backward form reads alike). GPU: the default
plans (span backward, Mosaic launches) in bf16 at both head_dims."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas as kp
from posenc_jax import householder
from posenc_jax import masking
from tests.kernels import kernel_check
from tests.util import assert_rel_rms


def _dense(q, k, v, w, beta, lf, seg, *, scale):
  """(o, lse [B, T, H]) from the dense T x T logits (PaTH's walk; none with w None: FoX)."""
  B, T, H, D = q.shape
  K = k.shape[2]
  if w is None:
    logits = masking.dot_logits(q, k, scale)
  else:
    qg = (scale * q).reshape(B, 1, T, K, H // K, D)
    logits = householder._walk_logits(qg, k[:, None], w[:, None], beta[:, None])
    logits = logits.reshape(B, H, T, T)
  if lf is not None:
    c = jnp.moveaxis(masking.segment_cumsum(lf, seg), 2, 1)
    logits = logits + c[..., :, None] - c[..., None, :]
  mask = masking.causal_dense_mask(T, seg)
  lse = jax.nn.logsumexp(jnp.where(mask, logits, -jnp.inf), axis=-1)
  return masking.dense_attention(logits, v, mask), jnp.moveaxis(lse, 1, 2)


def _check(key, *, backend, dtype, B, T, H, K, D, fox, block_sizes=None, expect=None):
  q, k, v, w, beta, lf, seg, do = kernel_check.inputs(key, B, T, H, K, D, dtype,
                                                      gate=True, segments=True)
  dl = jax.random.normal(jax.random.fold_in(key, 1), (B, T, H))
  if fox:
    w = beta = None

  def kernel(q, k, v, w, beta, lf):
    if fox:
      return kp.forgetting_attention(q, k, v, lf, segment_ids=seg, backend=backend,
                                     return_lse=True)
    return kp.path_attention(q, k, v, w, beta, lf, segment_ids=seg, backend=backend,
                             block_sizes=block_sizes, return_lse=True)

  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  oracle = lambda *a: _dense(*map(f32, a), f32(seg), scale=D ** -0.5)
  loss = lambda f: lambda *a: sum(jnp.sum(x.astype(jnp.float32) * c)
                                  for x, c in zip(f(*a), (do.astype(jnp.float32), dl)))
  args = (q, k, v, w, beta, lf)
  argnums = tuple(i for i, x in enumerate(args) if x is not None)
  got = jax.jit(lambda *a: (kernel(*a), jax.grad(loss(kernel), argnums)(*a)))(*args)
  with jax.default_matmul_precision("highest"):
    want = jax.jit(lambda *a: (oracle(*a), jax.grad(loss(oracle), argnums)(*a)))(*args)
  names = ["o", "lse"] + [f"d{'q k v w beta log_forget'.split()[i]}" for i in argnums]
  for name, a, b in zip(names, [*got[0], *got[1]], [*want[0], *want[1]]):
    assert_rel_rms(a, b, kernel_check.TOL[jnp.dtype(dtype)], name)
  plan = kp.explain(q, k, v, w, beta, lf, segment_ids=seg, backend=backend,
                    block_sizes=block_sizes)
  for field, value in (expect or {}).items():
    assert getattr(plan, field) == value, plan


@pytest.mark.parametrize("fox", [False, True])
def test_return_lse_matches_dense_with_gradients(key, fox):
  _check(key, backend="interpret", dtype=jnp.float32, B=2, T=100, H=2, K=1, D=16, fox=fox,
         block_sizes=None if fox else dict(span=0), expect=dict(backward="walk"))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("D", [64, 128])
def test_return_lse_on_gpu_default_plan(key, D):
  _check(key, backend="gpu", dtype=jnp.bfloat16, B=2, T=1100, H=4, K=2, D=D, fox=False,
         expect=dict(backward="span"))
