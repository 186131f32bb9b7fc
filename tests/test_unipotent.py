"""FoX/ALiBi, GRAPE-AP and GRAPE-A math: blocked vs dense, the unipotent lift, special cases."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import posenc_jax
from posenc_jax import grape_a
from posenc_jax import masking
from posenc_jax import path_integral
from posenc_jax import unipotent
from tests.util import assert_rel_rms
from tests.util import assert_trees_rel_rms
from tests.util import value_and_grads

B, T, H, K, D, P = 2, 37, 4, 2, 8, 6
BLOCK = 16
SCALE = D**-0.5
SEG = jnp.stack([(jnp.arange(T) >= 11).astype(jnp.int32) + (jnp.arange(T) >= 29),
                 (jnp.arange(T) >= 20).astype(jnp.int32)])


def _qkv(key):
  kq, kk, kv = jax.random.split(key, 3)
  return (jax.random.normal(kq, (B, T, H, D)), jax.random.normal(kk, (B, T, K, D)),
          jax.random.normal(kv, (B, T, K, D)))


def _log_forget(key):
  return jax.nn.log_sigmoid(2.0 + jax.random.normal(key, (B, T, H)))


def _probes(key):
  kp, ka = jax.random.split(key)
  return jax.random.normal(kp, (B, T, H, P)), jax.random.uniform(ka, (H,), minval=0.1, maxval=2.0)


def _fox(impl):
  if impl == "reference":
    return lambda q, k, v, g, seg: unipotent.forgetting_attention_reference(
        q, k, v, g, segment_ids=seg, scale=SCALE)
  return lambda q, k, v, g, seg: unipotent.forgetting_attention_chunked(
      q, k, v, g, segment_ids=seg, scale=SCALE, block_size=BLOCK)


def _ap(impl, parallel=None):
  if impl == "reference":
    return lambda q, k, v, p, a, seg: unipotent.path_integral_attention_reference(
        q, k, v, p, a, segment_ids=seg, scale=SCALE)
  return lambda q, k, v, p, a, seg: unipotent.path_integral_attention_chunked(
      q, k, v, p, a, segment_ids=seg, scale=SCALE, block_size=BLOCK, parallel=parallel)


def _value_and_grads(f, args, key):
  """f(*args) and the gradient of <f(*args), random cotangent> w.r.t. every arg (one jit)."""
  ct = jax.random.normal(key, jax.eval_shape(f, *args).shape)
  return value_and_grads(f, lambda out: jnp.sum(out * ct), tuple(range(len(args))))(*args)


@pytest.mark.parametrize("segmented", [False, True])
def test_forgetting_chunked_matches_reference(key, segmented):
  k1, k2, k3 = jax.random.split(key, 3)
  q, k, v = _qkv(k1)
  g = _log_forget(k2)
  seg = SEG if segmented else None
  args = (q, k, v, g)
  ref = _value_and_grads(lambda *a: _fox("reference")(*a, seg), args, k3)
  got = _value_and_grads(lambda *a: _fox("chunked")(*a, seg), args, k3)
  assert_rel_rms(got[0], ref[0], 1e-5, "forward")
  assert_trees_rel_rms(got[1], ref[1], 1e-5, "grad q,k,v,log_forget")


@pytest.mark.parametrize("segmented", [False, True])
def test_path_integral_chunked_matches_reference(key, segmented):
  """Both query-block schedules against one oracle run (its compile shared: CI time)."""
  k1, k2, k3 = jax.random.split(key, 3)
  q, k, v = _qkv(k1)
  p, alpha = _probes(k2)
  seg = SEG if segmented else None
  args = (q, k, v, p, alpha)
  ref = _value_and_grads(lambda *a: _ap("reference")(*a, seg), args, k3)
  for parallel in (False, True):
    got = _value_and_grads(lambda *a: _ap("chunked", parallel)(*a, seg), args, k3)  # noqa: B023
    assert_rel_rms(got[0], ref[0], 1e-5, f"forward (parallel={parallel})")
    assert_trees_rel_rms(got[1], ref[1], 1e-5, f"grad q,k,v,p,alpha (parallel={parallel})")


def test_public_entry_points_dispatch(key):
  k1, k2, k3 = jax.random.split(key, 3)
  q, k, v = _qkv(k1)
  g = _log_forget(k2)
  p, alpha = _probes(k3)
  # Jitted: one compile each instead of eager op-by-op dispatch (CI time); the entry points'
  # checks of concrete values are test_value_errors'.
  fox = {i: jax.jit(functools.partial(posenc_jax.forgetting_attention, implementation=i))(
      q, k, v, g, segment_ids=SEG) for i in ("reference", "chunked")}
  ap = {i: jax.jit(functools.partial(posenc_jax.path_integral_attention, implementation=i))(
      q, k, v, p, alpha, segment_ids=SEG) for i in ("reference", "chunked")}
  assert_rel_rms(fox["chunked"], fox["reference"], 1e-5, "forgetting_attention")
  assert_rel_rms(ap["chunked"], ap["reference"], 1e-5, "path_integral_attention")
  assert_rel_rms(fox["reference"], jax.jit(_fox("reference"))(q, k, v, g, SEG), 1e-6,
                 "default scale")


def test_forgetting_bias_is_the_path_sum(key):
  """Dense FoX bias against a literal double loop over (j, i]."""
  g = np.asarray(_log_forget(key), np.float64)
  b = np.asarray(unipotent.forgetting_bias(jnp.asarray(g)))
  for i in (0, 5, T - 1):
    for j in range(i + 1):
      np.testing.assert_allclose(b[:, :, i, j], g[:, j + 1:i + 1].sum(1), rtol=1e-5, atol=1e-5)


def test_alibi_equals_grape_a_lift_with_constant_gates(key):
  k1, k2 = jax.random.split(key)
  q, k, v = _qkv(k1)
  slopes = jnp.asarray(unipotent.alibi_slopes(H))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  lam = jnp.full((B, T, H), 0.7)            # any constant gate; omega absorbs it
  lift = grape_a.grape_a_lift_logits(q, k, slopes / 0.7, lam, None, pos, scale=SCALE)
  o_lift = masking.dense_attention(lift, v, masking.causal_dense_mask(T))
  o_alibi = posenc_jax.forgetting_attention(q, k, v, unipotent.alibi_log_forget(B, T, H),
                                            implementation="chunked")
  assert_rel_rms(o_alibi, o_lift, 1e-5, "ALiBi vs lift")
  i, j = np.tril_indices(T)
  bias = np.asarray(lift - masking.dot_logits(q, k, SCALE))[:, :, i, j]
  np.testing.assert_allclose(bias,
                             np.broadcast_to(-np.asarray(slopes)[:, None] * (i - j), bias.shape),
                             rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("variant", ["q", "k", "qk"])
def test_lift_equals_closed_form(key, variant):
  k1, k2, k3 = jax.random.split(key, 3)
  q, k, _ = _qkv(k1)
  vq, uk = jax.random.normal(k2, (2, H, D))
  lam_q, lam_k = grape_a.grape_a_gates(q, k, vq if "q" in variant else None,
                                       uk if "k" in variant else None)
  omega = jax.random.uniform(k3, (H,), minval=0.05, maxval=1.0)
  pos = jnp.broadcast_to(jnp.arange(T) + 5, (B, T))
  lift = grape_a.grape_a_lift_logits(q, k, omega, lam_q, lam_k, pos, scale=SCALE)
  closed = masking.dot_logits(q, k, SCALE) + grape_a.grape_a_bias(omega, lam_q, lam_k, pos)
  assert_rel_rms(lift, closed, 1e-5, f"lift vs closed form ({variant})")
  # Exact relative law: shifting every position leaves the lifted scores unchanged.
  shifted = grape_a.grape_a_lift_logits(q, k, omega, lam_q, lam_k, pos + 1000, scale=SCALE)
  assert_rel_rms(shifted, lift, 1e-5, "relative law")


def test_fox_equals_grape_ap_with_endpoint_independent_edges(key):
  """Constant probes p_t = c_h give psi(i, l) = alpha_h log_sigmoid(|c_h|^2 cos(l) / d_p): FoX."""
  k1, k2, k3 = jax.random.split(key, 3)
  q, k, v = _qkv(k1)
  c = jax.random.normal(k2, (H, P))
  alpha = jax.random.uniform(k3, (H,), minval=0.1, maxval=2.0)
  p = jnp.broadcast_to(c, (B, T, H, P))
  pos = path_integral.segment_positions(SEG, B, T).astype(jnp.float32)   # l inside its segment
  g = alpha * jax.nn.log_sigmoid(jnp.sum(c * c, -1) * jnp.cos(pos)[..., None] / P)
  # Jitted: one compile each instead of eager op-by-op dispatch (CI time).
  fox = jax.jit(_fox("reference"))(q, k, v, g, SEG)
  for impl in ("reference", "chunked"):
    assert_rel_rms(jax.jit(_ap(impl))(q, k, v, p, alpha, SEG), fox, 1e-5,
                   f"GRAPE-AP {impl} vs FoX")


def test_grape_ap_with_zero_probes_is_alibi(key):
  q, k, v = _qkv(key)
  alpha = jnp.asarray(unipotent.alibi_slopes(H)) / np.log(2.0)   # psi = -alpha log 2 = -slope
  # Jitted: one compile each instead of eager op-by-op dispatch (CI time).
  o = jax.jit(_ap("chunked"))(q, k, v, jnp.zeros((B, T, H, P)), alpha, None)
  assert_rel_rms(o, jax.jit(_fox("reference"))(q, k, v, unipotent.alibi_log_forget(B, T, H), None),
                 1e-5)


def test_relative_law_under_time_shift(key):
  """FoX/ALiBi depend on the path (j, i] only: the same document later in a packed row."""
  k1, k2, k3 = jax.random.split(key, 3)
  q, k, v = _qkv(k1)
  g = _log_forget(k2)
  s = 9
  junk = lambda x: jnp.concatenate([jax.random.normal(k3, x[:, :s].shape) - 1.0, x[:, :-s]], 1)
  seg = jnp.broadcast_to((jnp.arange(T) >= s).astype(jnp.int32), (B, T))
  fox = jax.jit(_fox("chunked"))   # one compile instead of eager op-by-op dispatch (CI time)
  for gate in (g, unipotent.alibi_log_forget(B, T, H)):
    base = fox(q, k, v, gate, None)[:, :T - s]
    moved = fox(junk(q), junk(k), junk(v), jnp.minimum(junk(gate), 0.0), seg)[:, s:]
    assert_rel_rms(moved, base, 1e-5, "shifted document")
  bias = np.asarray(unipotent.forgetting_bias(unipotent.alibi_log_forget(B, T, H)))
  np.testing.assert_allclose(bias[:, :, 3:, 3:], bias[:, :, :-3, :-3], atol=1e-4)  # Toeplitz


def test_biases_are_non_positive_in_the_causal_direction(key):
  k1, k2, k3 = jax.random.split(key, 3)
  q, k, _ = _qkv(k1)
  i, j = np.tril_indices(T)
  fox = np.asarray(unipotent.forgetting_bias(_log_forget(k2)))[:, :, i, j]
  lam_q, lam_k = grape_a.grape_a_gates(q, k, *jax.random.normal(k3, (2, H, D)))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  ga = np.asarray(grape_a.grape_a_bias(jnp.ones(H), lam_q, lam_k, pos))[:, :, i, j]
  p, alpha = _probes(k3)
  psi = path_integral.edge_potentials(p, path_integral.rotate_probes(p, pos), alpha)
  ap, _ = path_integral.path_sum_bias(psi, jnp.arange(T), jnp.arange(T))
  for name, b in (("fox", fox), ("grape_a", ga), ("grape_ap", np.asarray(ap)[:, :, i, j])):
    assert b.max() <= 0.0, f"{name} bias has positive entries in the causal direction"
    assert b.min() < -0.1, f"{name}: bias is trivially zero"


@pytest.mark.parametrize("family", ["fox", "grape_ap"])
def test_causal_and_segment_isolated_by_gradients(key, family):
  k1, k2, k3 = jax.random.split(key, 3)
  q, k, v = _qkv(k1)
  if family == "fox":
    extra = (_log_forget(k2),)
    f = lambda seg, *a: _fox("chunked")(*a, seg)
  else:
    extra = _probes(k2)[:1]
    alpha = _probes(k2)[1]
    f = lambda seg, *a: _ap("chunked")(*a, alpha, seg)
  args = (q, k, v) + extra
  t = 20
  # Jitted: one compile each instead of eager op-by-op dispatch (CI time).
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(None, *a)[:, :t + 1] ** 2),
                           argnums=(0, 1, 2, 3)))(*args)
  for gr in grads:
    gr = np.abs(np.asarray(gr))
    assert gr[:, :t + 1].max() > 0 and gr[:, t + 1:].max() == 0.0, "output depends on the future"
  seg = jnp.broadcast_to((jnp.arange(T) >= 13).astype(jnp.int32), (B, T))
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(seg, *a)[:, 13:] ** 2),
                           argnums=(0, 1, 2, 3)))(*args)
  for gr in grads:
    gr = np.abs(np.asarray(gr))
    assert gr[:, 13:].max() > 0 and gr[:, :13].max() == 0.0, "a document sees its predecessor"


def test_value_errors(key):
  q, k, v = _qkv(key)
  g = _log_forget(key)
  p, alpha = _probes(key)
  with pytest.raises(ValueError, match="log_forget must have shape"):
    posenc_jax.forgetting_attention(q, k, v, g[..., :2])
  with pytest.raises(ValueError, match="log_forget must lie in"):
    posenc_jax.forgetting_attention(q, k, v, g + 1.0)
  with pytest.raises(ValueError, match="d_p"):
    posenc_jax.path_integral_attention(q, k, v, p[..., :5], alpha)
  with pytest.raises(ValueError, match="alpha must lie in"):
    posenc_jax.path_integral_attention(q, k, v, p, -alpha)
  with pytest.raises(ValueError, match="implementation='cudnn'"):
    posenc_jax.path_integral_attention(q, k, v, p, alpha, implementation="cudnn")
  with pytest.raises(ValueError, match="implementation='xla'"):
    posenc_jax.forgetting_attention(q, k, v, g, implementation="xla")
  with pytest.raises(ValueError, match="lam_q or lam_k"):
    grape_a.grape_a_augment(q, k, v, omega=alpha, lam_q=None, lam_k=None, scale=SCALE)
