"""kernels_pallas.plane_rotations with GRAPE-M's rank-2 planes against plain autodiff of the
plane scan (posenc_jax.grape_m.rank2_planes_scan): the output and the gradients of a nonlinear
probe w.r.t. x, a, b and the frequencies w.

Interpreter (CPU): general planes (not orthogonal, not unit: the inverse rotation still undoes
each one), T 37 over 16-token tiles (a padded tail), head_dim 24 and 5 planes (both padded),
float32 and bf16 x, the backward's VJP by autodiff and written out. Through the model:
grape_m_rank2 with planes="pallas" against "scan", the logits and every gradient. Lowering:
forward and gradient lower through Triton for "cuda". GPU (-m gpu): the Triton kernels at the
125M model's sizes. planes=None: the kernel on a GPU only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import plane_rotations
from kernels_pallas.plane_rotations.api import BACKWARD_BLOCK_T
from kernels_pallas.plane_rotations.api import FORWARD_BLOCK_T
from posenc_jax import grape_m
from tests.kernels import kernel_check
from tests.util import assert_rel_rms, assert_trees_rel_rms, model_logits_and_grads

F32, BF16 = jnp.float32, jnp.bfloat16


def _inputs(key, *, B=2, T=37, H=3, N=5, D=24, dtype=F32):
  ks = jax.random.split(key, 5)
  x = jax.random.normal(ks[0], (B, T, H, D)).astype(dtype)
  # general planes of about unit norm, as the encoding's (canonical at init). With norms of
  # sqrt(D) the angles phase |a| |b| reach 10^4 rad, where the interpreted kernel's sin and cos
  # under the suite's XLA:CPU flags (conftest: -O1, the older fusion emitters) round worse:
  # dx 2.0e-5 from the oracle there, 1.9e-7 under XLA's default flags (one seed, measured)
  a = jax.random.normal(ks[1], (H, N, D)) / D ** 0.5
  b = jax.random.normal(ks[2], (H, N, D)) / D ** 0.5
  w = jnp.exp(jax.random.normal(ks[3], (H, N)) - 2.0)
  probe = jax.random.normal(ks[4], (B, T, H, D))
  # Positions 0..T-1. Where they reach 136 (angles to ~600 rad) the kernel's gradients are
  # within 7.6e-7 of the scan's under XLA's default flags but up to 1.0e-5 under the suite's
  # (conftest: -O1, the older fusion emitters round the interpreter's sin and cos worse at
  # large arguments); 12 seeds each, measured.
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  return (x, a, b, w), pos, probe


def _kernel_and_scan(args, pos, probe, **kernel_kw):
  """((y, grads), (y, grads)) of the kernel and of the float32 plane scan (in x's dtype): y and
  the gradients of sum(sin(y) * probe) w.r.t. x, a, b and w."""
  dtype = args[0].dtype

  def oracle(x, a, b, w):
    phases = pos[:, :, None, None].astype(F32) * w
    y = grape_m.rank2_planes_scan(x.astype(F32), jnp.moveaxis(a, 1, 0), jnp.moveaxis(b, 1, 0),
                                  jnp.moveaxis(phases, -1, 0)).astype(dtype)
    return jnp.sum(jnp.sin(y.astype(F32)) * probe), y

  def kernel(x, a, b, w):
    y = plane_rotations(x, a, b, pos, w, apply=grape_m.rank2_apply, **kernel_kw)
    return jnp.sum(jnp.sin(y.astype(F32)) * probe), y

  grads = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))  # noqa
  (_, y), got = grads(kernel)(*args)
  (_, y_want), want = grads(oracle)(*args)
  return (y, got), (y_want, want)


@pytest.mark.parametrize("vjp", [None, grape_m.rank2_apply_rows_vjp], ids=["autodiff", "written"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_kernel_matches_the_plane_scan(key, dtype, vjp):
  (x, a, b, w), pos, probe = _inputs(key, dtype=dtype)
  (y, got), (y_want, want) = _kernel_and_scan(
      (x, a, b, w), pos, probe, apply_vjp=vjp, block_t=16, interpret=True)
  assert y.dtype == dtype
  # bf16: the outputs are one rounding of the same float32 values (differences of an ulp where
  # the float32 values straddle a rounding boundary); the gradients are float32 through x's cast
  tol = 1e-5 if dtype == F32 else 1e-2
  assert_rel_rms(y.astype(F32), y_want.astype(F32), tol, "y")
  for name, g, g_want in zip(("dx", "da", "db", "dw"), got, want):
    assert_rel_rms(g.astype(F32), g_want.astype(F32), tol, name)


def test_default_tiles_differ_per_pass_and_match_the_scan(key):
  """block_t=None: the forward's tile (64 here: FORWARD_BLOCK_T capped at T 37's padded 64)
  and the backward's (BACKWARD_BLOCK_T, 32) differ; time is padded to the wider, and both
  passes still match the scan."""
  assert (FORWARD_BLOCK_T, BACKWARD_BLOCK_T) == (128, 32)
  (x, a, b, w), pos, probe = _inputs(key)
  (y, got), (y_want, want) = _kernel_and_scan(
      (x, a, b, w), pos, probe, apply_vjp=grape_m.rank2_apply_rows_vjp, interpret=True)
  assert_rel_rms(y, y_want, 1e-5, "y")
  for name, g, g_want in zip(("dx", "da", "db", "dw"), got, want):
    assert_rel_rms(g, g_want, 1e-5, name)


def test_model_on_the_kernel_matches_the_scan(key):
  """grape_m_rank2 with planes="pallas" against planes="scan" on the same parameters (one
  layer, GQA): logits and every parameter's gradient."""
  from flax import nnx
  from posenc_jax import model as model_lib

  V, B, T = 40, 2, 19
  kp, kt = jax.random.split(key)
  tokens = jax.random.randint(kt, (B, T + 1), 0, V)

  def run(planes):
    cfg = model_lib.ModelConfig(vocab_size=V, encoding="grape_m_rank2", num_layers=1,
                                d_model=32, num_heads=4, num_kv_heads=2, head_dim=16,
                                encoding_kwargs=(("planes", planes), ("num_planes", 6)))
    model = model_lib.Transformer(cfg, rngs=nnx.Rngs(params=kp))
    # non-canonical planes and frequencies, so the test is not RoPE's special case
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    state = jax.tree.unflatten(treedef, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
                                         for x, k in zip(leaves, keys)])
    nnx.update(model, state)
    return model_logits_and_grads(model, tokens)

  logits, grads = run("pallas")
  logits_want, grads_want = run("scan")
  assert_rel_rms(logits, logits_want, 1e-5, "logits")
  assert_trees_rel_rms(grads, grads_want, 1e-5, "gradient")


def test_kernel_lowers_for_cuda():
  """Forward and gradient lower through Triton for "cuda" on this host at the 125M model's
  shapes (bf16 x, 12 heads of 64, 32 planes, T 2048): the two kernels, no others."""
  SD = jax.ShapeDtypeStruct
  B, T, H, N, D = 2, 2048, 12, 32, 64
  arrays = [SD((B, T, H, D), BF16), SD((H, N, D), F32), SD((H, N, D), F32),
            SD((B, T), jnp.int32), SD((H, N), F32)]

  def f(x, a, b, pos, w):
    return plane_rotations(x, a, b, pos, w, apply=grape_m.rank2_apply,
                           apply_vjp=grape_m.rank2_apply_rows_vjp)

  assert kernel_check.cuda_kernels_with_grad(f, arrays, (0, 1, 2, 4)) == (
      {"forward_kernel"}, {"forward_kernel", "backward_kernel"})


def test_errors_name_the_field():
  x = jnp.zeros((1, 8, 2, 16))
  a = jnp.zeros((2, 3, 16))
  pos = jnp.zeros((1, 8), jnp.int32)
  kw = dict(apply=grape_m.rank2_apply, interpret=True)
  with pytest.raises(ValueError, match=r"w has shape \(2, 4\)"):
    plane_rotations(x, a, a, pos, jnp.zeros((2, 4)), **kw)
  with pytest.raises(ValueError, match="positions has shape"):
    plane_rotations(x, a, a, jnp.zeros((1, 9)), jnp.zeros((2, 3)), **kw)
  with pytest.raises(ValueError, match="block_t=24"):
    plane_rotations(x, a, a, pos, jnp.zeros((2, 3)), block_t=24, **kw)
  with pytest.raises(ValueError, match="planes='fused' is not one of"):
    grape_m.rank2_planes_at_positions(x, a, a, pos, jnp.zeros((2, 3)), implementation="fused")


def test_planes_none_is_the_kernel_on_gpu_only(monkeypatch):
  """planes=None picks the fused kernel on a GPU and the scan on the CPU and TPU."""
  for backend, want in (("gpu", "pallas"), ("cpu", "scan"), ("tpu", "scan")):
    monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
    assert grape_m.planes_implementation(None) == want
  assert grape_m.planes_implementation("scan") == "scan"


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_kernel_on_gpu(key):
  """The Triton kernels at the 125M model's sizes (bf16 x, T 2048, 12 heads of 64, 32 planes,
  three documents' positions) against the float32 plane scan on the same bf16 values."""
  (x, a, b, w), _, probe = _inputs(key, B=2, T=2048, H=12, N=32, D=64, dtype=BF16)
  pos = jnp.concatenate([jnp.arange(300), jnp.arange(800), jnp.arange(948)]).astype(jnp.int32)
  pos = jnp.broadcast_to(pos, (2, 2048))
  with jax.default_matmul_precision("highest"):
    (y, got), (y_want, want) = _kernel_and_scan(
        (x, a, b, w), pos, probe, apply_vjp=grape_m.rank2_apply_rows_vjp)
  assert_rel_rms(y.astype(F32), y_want.astype(F32), 1e-2, "y")
  for name, g, g_want in zip(("dx", "da", "db", "dw"), got, want):
    assert_rel_rms(g.astype(F32), g_want.astype(F32), 1e-2, name)
