"""posenc_jax.rotations and posenc_jax.grape_m: golden values, group laws, oracles (expm)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import grape_m
from posenc_jax import rotations
from tests.util import assert_rel_rms
from tests.util import in_float64
from tests.util import assert_trees_rel_rms
from tests.util import value_and_grads

jax.config.update("jax_default_matmul_precision", "highest")


def _logits(q_BTHD, k_BTHD):
  return jnp.einsum("bihd,bjhd->bhij", q_BTHD, k_BTHD)


def test_rotate_golden():
  x = jnp.array([1.0, 2.0, 3.0, 4.0])
  y = rotations.rotate(x, jnp.array([math.pi / 2, math.pi]))
  np.testing.assert_allclose(y, [-2.0, 1.0, -3.0, -4.0], atol=1e-6)


def test_rope_golden():
  # base 100, D = 4: omega = (1, 0.1). Position 1 turns pair 0 by 1 rad and pair 1 by 0.1 rad.
  x = jnp.array([1.0, 0.0, 0.0, 1.0]).reshape(1, 1, 1, 4)
  x = jnp.concatenate([x, x], axis=1)
  y = rotations.rope(x, jnp.array([[0, 1]]), base=100.0)
  np.testing.assert_allclose(y[0, 0, 0], [1.0, 0.0, 0.0, 1.0], atol=1e-7)
  np.testing.assert_allclose(y[0, 1, 0], [math.cos(1), math.sin(1), -math.sin(0.1), math.cos(0.1)],
                             atol=1e-6)


def test_rotate_rejects_bad_shapes():
  with pytest.raises(ValueError, match="must be even"):
    rotations.rotate(jnp.ones((2, 5)), jnp.ones((2, 2)))
  with pytest.raises(ValueError, match="angles must have shape"):
    rotations.rotate(jnp.ones((2, 6)), jnp.ones((2, 2)))
  with pytest.raises(ValueError, match="do not broadcast"):
    rotations.rotate(jnp.ones((2, 6)), jnp.ones((3, 3)))
  with pytest.raises(ValueError, match="layout"):
    rotations.rotate(jnp.ones((2, 6)), jnp.ones((2, 3)), layout="neox")


def test_rotation_preserves_norm(key):
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (3, 7, 2, 16))
  y = rotations.rotate(x, 10 * jax.random.normal(k2, (3, 7, 1, 8)))
  np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)


def test_half_layout_is_a_channel_permutation(key):
  k1, k2 = jax.random.split(key)
  D = 12
  x = jax.random.normal(k1, (2, 5, 3, D))
  a = jax.random.normal(k2, (2, 5, 1, D // 2))
  perm = np.concatenate([np.arange(0, D, 2), np.arange(1, D, 2)])   # half[m] = inter[2m] ...
  np.testing.assert_allclose(rotations.rotate(x[..., perm], a, layout="half"),
                             rotations.rotate(x, a)[..., perm], atol=1e-6)


def test_rope_relative_law(key):
  k1, k2, k3 = jax.random.split(key, 3)
  q, k = jax.random.normal(k1, (2, 9, 2, 8)), jax.random.normal(k2, (2, 9, 2, 8))
  pos = jax.random.randint(k3, (2, 9), 0, 50)
  base = _logits(rotations.rope(q, pos), rotations.rope(k, pos))
  shifted = _logits(rotations.rope(q, pos + 37), rotations.rope(k, pos + 37))
  assert_rel_rms(shifted, base, 1e-5, "rope logits after a shift")


def test_accumulated_phase_relative_law(key):
  """A constant phase offset (what a shifted start does to phi) leaves the logits unchanged."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  q, k = jax.random.normal(k1, (2, 9, 2, 8)), jax.random.normal(k2, (2, 9, 2, 8))
  steps = rotations.random_step_angles(k3, (2, 9), rotations.rope_frequencies(8))
  phi = rotations.accumulate_phases(steps)[:, :, None, :]
  c = jax.random.uniform(k4, (1, 1, 1, 4), maxval=100.0)
  base = _logits(rotations.rotate(q, phi), rotations.rotate(k, phi))
  shifted = _logits(rotations.rotate(q, phi + c), rotations.rotate(k, phi + c))
  assert_rel_rms(shifted, base, 1e-5, "accumulated-rotation logits after a phase offset")


def test_accumulate_phases_restart_at_segments(key):
  steps = jax.random.uniform(key, (2, 10, 3))
  seg = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 7, 7, 7, 7]])
  s, sid = np.asarray(steps, np.float64), np.asarray(seg)
  want_inc, want_exc = np.zeros_like(s), np.zeros_like(s)
  for b in range(2):
    acc = np.zeros(3)
    for t in range(10):
      if t == 0 or sid[b, t] != sid[b, t - 1]:
        acc = np.zeros(3)
      want_exc[b, t] = acc
      acc = acc + s[b, t]
      want_inc[b, t] = acc
  np.testing.assert_allclose(rotations.accumulate_phases(steps, seg), want_inc,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(rotations.accumulate_phases(steps, seg, exclusive=True), want_exc,
                             rtol=1e-5, atol=1e-6)


def test_random_step_angles_law(key):
  freqs = rotations.rope_frequencies(8)
  d = np.asarray(rotations.random_step_angles(key, (64, 256), freqs))
  assert (d >= 0).all() and (d <= 2 * np.asarray(freqs)).all()
  # U(0, 2w) has mean w and std w / sqrt(3); 16384 samples per plane: 6 sigma is 0.027 w.
  np.testing.assert_allclose(d.reshape(-1, 4).mean(0) / freqs, 1.0, atol=0.03)


def test_length_extension_frequencies():
  D, s = 64, 4.0
  omega = np.asarray(rotations.rope_frequencies(D))
  ntk = np.asarray(rotations.rope_frequencies(D, base=rotations.ntk_base(D, scale=s)))
  np.testing.assert_allclose([ntk[0], ntk[-1]], [omega[0], omega[-1] / s], rtol=1e-5)
  yarn = np.asarray(rotations.yarn_frequencies(D, scale=s, train_len=2048))
  turns = 2048 * omega / (2 * math.pi)
  np.testing.assert_allclose(yarn[turns > 32], omega[turns > 32], rtol=1e-6)       # extrapolated
  np.testing.assert_allclose(yarn[turns < 1], omega[turns < 1] / s, rtol=1e-6)     # interpolated
  mid = (turns > 1) & (turns < 32)
  assert mid.any() and (yarn[mid] < omega[mid]).all() and (yarn[mid] > omega[mid] / s).all()
  assert rotations.yarn_attention_factor(s) == pytest.approx(0.1 * math.log(4.0) + 1.0)
  assert rotations.yarn_attention_factor(1.0) == 1.0
  np.testing.assert_allclose(rotations.pi_positions(jnp.arange(8), train_len=2, eval_len=8),
                             np.arange(8) / 4.0)


# ----------------------------------------------------------------------------------------
# GRAPE-M


def test_rope_is_grape_m_with_canonical_basis(key):
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (2, 7, 3, 8))
  pos = jax.random.randint(k2, (2, 7), 0, 1000)
  angles = rotations.rope_angles(pos, rotations.rope_frequencies(8))
  y = grape_m.basis_rotate(x, jnp.broadcast_to(angles, (2, 7, 3, 4)),
                           jnp.broadcast_to(jnp.eye(8), (3, 8, 8)))
  np.testing.assert_allclose(y, rotations.rope(x, pos), atol=1e-5)


def _random_basis_param(key, H, D, scale=0.5):
  return scale * jax.random.normal(key, (H, D, D))


def test_grape_m_relative_law(key):
  k1, k2, k3, k4 = jax.random.split(key, 4)
  H, D = 2, 8
  q, k = jax.random.normal(k1, (2, 9, H, D)), jax.random.normal(k2, (2, 9, H, D))
  basis = grape_m.orthogonal_from_param(_random_basis_param(k3, H, D))
  # frequencies in (e^-4, 1], the range of the encoding's RoPE initialisation (base^(-2i/D)):
  # the law is exact, but float32 resolves an angle p theta only to ~|p theta| 6e-8, so with
  # exp(normal) draws (theta up to ~20, angles ~600 at p = 31) the shifted logits' relative
  # error reached 1.05e-5 for some keys, the rounding of the angles and not the law
  theta = jnp.exp(-4.0 * jax.random.uniform(k4, (H, D // 2)))
  pos = jnp.broadcast_to(jnp.arange(9.0), (2, 9))

  def logits(p):
    a = p[:, :, None, None] * theta
    return _logits(grape_m.basis_rotate(q, a, basis), grape_m.basis_rotate(k, a, basis))

  assert_rel_rms(logits(pos + 23.0), logits(pos), 1e-5, "GRAPE-M logits after a shift")


def test_learned_basis_stays_orthogonal_after_a_step(key):
  k1, k2, k3 = jax.random.split(key, 3)
  H, D = 2, 8
  q, k = jax.random.normal(k1, (1, 6, H, D)), jax.random.normal(k2, (1, 6, H, D))
  a = jnp.broadcast_to(jnp.arange(6.0)[None, :, None, None], (1, 6, H, D // 2))
  target = jax.random.normal(k3, (1, H, 6, 6))

  def loss(param):
    b = grape_m.orthogonal_from_param(param)
    return jnp.sum((_logits(grape_m.basis_rotate(q, a, b), grape_m.basis_rotate(k, a, b))
                    - target) ** 2)

  param = jnp.zeros((H, D, D))
  grad = jax.jit(jax.grad(loss))   # one compile instead of eager op-by-op dispatch (CI time)
  for _ in range(3):
    g = grad(param)
    assert float(jnp.abs(g).max()) > 0
    param = param - 0.05 * g / jnp.abs(g).max()
  b = grape_m.orthogonal_from_param(param)
  assert float(jnp.abs(b - jnp.eye(D)).max()) > 1e-2          # the basis did move
  np.testing.assert_allclose(jnp.einsum("hdi,hdj->hij", b, b),
                             jnp.broadcast_to(jnp.eye(D), (H, D, D)), atol=2e-6)
  np.testing.assert_allclose(jnp.linalg.det(b), 1.0, atol=1e-5)


def _expm_rank2(x, a, b, phase):
  L = jnp.outer(a, b) - jnp.outer(b, a)
  return jax.scipy.linalg.expm(phase * L) @ x


@pytest.mark.parametrize("norm", [1.0, 0.3, 1e-2])
def test_rodrigues_matches_expm(key, norm):
  """norm 1: the exact branch; 0.3: z^2 near the series threshold; 1e-2: the series branch.

  N independent rows, so each gradient leaf has N entries: the phase gradient of one row is a
  sum of O(1) terms that can cancel to ~1e-4 (seed 1987872255), where float32 rounding alone
  is 1e-3 relative. Over N rows the relative RMS is set by the typical row, not the luckiest.
  """
  k1, k2, k3, k4 = jax.random.split(key, 4)
  N, D = 16, 10
  x = jax.random.normal(k1, (N, D))
  a = norm * jax.random.normal(k2, (N, D)) / math.sqrt(D)
  b = norm * jax.random.normal(k3, (N, D)) / math.sqrt(D)
  phase = 1.0 + jax.random.uniform(k4, (N,))
  oracle = jax.vmap(_expm_rank2)
  assert_rel_rms(grape_m.rank2_apply(x, a, b, phase), in_float64(oracle, x, a, b, phase),
                 1e-5, "forward")
  f = lambda *args: jnp.sum(jnp.sin(grape_m.rank2_apply(*args)))
  g = lambda *args: jnp.sum(jnp.sin(oracle(*args)))
  assert_trees_rel_rms(jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(x, a, b, phase),
                       in_float64(jax.grad(g, argnums=(0, 1, 2, 3)), x, a, b, phase), 1e-5, "grads")


def test_rodrigues_is_finite_at_zero_s(key):
  x = jax.random.normal(key, (6,))
  a = jnp.arange(1.0, 7.0)
  # One program, compiled once for both b (CI time: eager dispatch was most of this test).
  both = value_and_grads(grape_m.rank2_apply, lambda y: jnp.sum(y ** 3), (0, 1, 2, 3))
  for b in (2.0 * a, jnp.zeros(6)):           # parallel vectors and a zero vector: s = 0
    y, grads = both(x, a, b, 3.0)
    np.testing.assert_allclose(y, x, atol=1e-6)  # exp(0) = I
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
  gz = jax.grad(lambda s: grape_m.rodrigues_coefficients(2.0, s)[1])(0.0)
  assert np.isfinite(gz) and gz == pytest.approx(-2.0**4 / 24.0)   # d f2 / d s^2 = -phase^4 / 24


@pytest.mark.parametrize("case", ["general", "series", "near_parallel", "zero_a", "large_phase"])
def test_rank2_rows_vjp_matches_autodiff(key, case):
  """rank2_apply_rows_vjp (the plane kernel's written-out backward: rows sharing one plane)
  against autodiff of rank2_apply, both in float64, on the branches of the Rodrigues form."""
  ks = jax.random.split(key, 5)
  R, D = 9, 12
  x = jax.random.normal(ks[0], (R, D))
  a = jax.random.normal(ks[1], (1, D)) / math.sqrt(D)
  b = jax.random.normal(ks[2], (1, D)) / math.sqrt(D)
  phase = 1.0 + jax.random.uniform(ks[3], (R,))
  if case == "series":
    phase = 1e-3 * phase
  elif case == "near_parallel":
    b = 0.7 * a + 1e-4 * b
  elif case == "zero_a":
    a = 0.0 * a
  elif case == "large_phase":
    phase = 300.0 * phase
  g = jax.random.normal(ks[4], (R, D))

  def autodiff(x, a, b, phase, g):
    return jax.vjp(grape_m.rank2_apply, x, a, b, phase)[1](g)

  got = in_float64(grape_m.rank2_apply_rows_vjp, x, a, b, phase, g)
  want = in_float64(autodiff, x, a, b, phase, g)
  for name, u, w in zip(("gx", "ga", "gb", "gphase"), got, want):
    np.testing.assert_allclose(u, w, rtol=1e-10, atol=1e-12 * max(1.0, np.abs(w).max()),
                               err_msg=name)


def test_rank2_planes_compose_like_expm_products(key):
  ks = jax.random.split(key, 4)
  H, N, D = 2, 3, 8
  x = jax.random.normal(ks[0], (1, 2, H, D))
  a, b = jax.random.normal(ks[1], (H, N, D)), jax.random.normal(ks[2], (H, N, D))
  ph = jax.random.normal(ks[3], (1, 2, H, N))
  y = grape_m.rank2_planes_apply(x, a, b, ph)
  def product(x, a, b, ph):
    want = x
    for n in range(N):
      want = _expm_rank2(want, a[n], b[n], ph[n])
    return want

  for t in range(2):
    for h in range(H):
      assert_rel_rms(y[0, t, h], in_float64(product, x[0, t, h], a[h], b[h], ph[0, t, h]), 1e-5,
                     f"t={t} h={h}")


def test_canonical_rank2_planes_are_rope(key):
  k1, k2 = jax.random.split(key)
  D = 8
  x = jax.random.normal(k1, (2, 5, 1, D))
  pos = jax.random.randint(k2, (2, 5), 0, 100)
  omega = rotations.rope_frequencies(D)
  a, b = grape_m.canonical_planes(1, D, D // 2)
  y = grape_m.rank2_planes_apply(x, a, b, pos[:, :, None, None] * omega)
  assert_rel_rms(y, rotations.rope(x, pos), 1e-5)


def test_thin_compression_matches_expm(key):
  ks = jax.random.split(key, 5)
  D, R = 8, 4
  e = 0.5 * jax.random.normal(ks[0], (D, D))
  t = 0.5 * jax.random.normal(ks[1], (R, R))
  theta = jnp.exp(jax.random.normal(ks[2], (R // 2,)))
  x = jax.random.normal(ks[3], (D,))
  n = 1.0 + 5 * jax.random.uniform(ks[4], ())

  def fast(e, t, theta, x):
    frame = grape_m.thin_frame(e[None], t[None])
    return grape_m.thin_apply(x.reshape(1, 1, 1, D), (n * theta).reshape(1, 1, 1, R // 2),
                              frame).ravel()

  def oracle(e, t, theta, x):
    # Dense and independent of thin_frame: E, T from expm of skew parts, L = E T (+)theta J T^T E^T.
    expm = jax.scipy.linalg.expm
    E, Tm = expm(e - e.T)[:, :R], expm(t - t.T)
    J = jnp.kron(jnp.diag(theta), jnp.array([[0.0, -1.0], [1.0, 0.0]], theta.dtype))
    return expm(n.astype(theta.dtype) * (E @ Tm @ J @ Tm.T @ E.T)) @ x

  # jitted: one compile instead of eager op-by-op dispatch (CI time)
  assert_rel_rms(jax.jit(fast)(e, t, theta, x), in_float64(oracle, e, t, theta, x), 1e-5,
                 "forward")
  # Gradients: the identity checked with both sides in float64. In float32 the gradient through
  # two expm's (Pade + squaring) at rotation angles n theta up to ~70 rad carries ~1e-5 rounding
  # (seed 781404662: 1.2e-5 on dt), which is float32 conditioning, not the identity under test.
  loss = lambda f: (lambda *p: jnp.sum(jnp.cos(f(*p))))
  grads = lambda f: in_float64(jax.grad(loss(f), argnums=(0, 1, 2, 3)), e, t, theta, x)
  assert_trees_rel_rms(grads(fast), grads(oracle), 1e-10, "grads")
  # The generator is skew and genuinely couples channels beyond canonical pairs.
  L = grape_m.thin_generator(e, t, theta)
  np.testing.assert_allclose(L, -L.T, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rank2_planes_reversible_gradients_match_autodiff(key, dtype):
  """The backward that rebuilds each plane's input by the inverse rotation against plain
  autodiff of the plane scan, with general (non-orthogonal, non-unit) planes: the inverse
  is exact in real arithmetic, so only float32 rounding separates the two."""
  ks = jax.random.split(key, 5)
  B, T, H, N, D = 2, 5, 3, 4, 8
  x = jax.random.normal(ks[0], (B, T, H, D)).astype(dtype)
  a, b = jax.random.normal(ks[1], (H, N, D)), jax.random.normal(ks[2], (H, N, D))
  ph = 2.0 * jax.random.normal(ks[3], (B, T, H, N))
  probe = jax.random.normal(ks[4], (B, T, H, D))

  def oracle(x, a, b, ph):
    y = grape_m.rank2_planes_scan(x.astype(jnp.float32), jnp.moveaxis(a, 1, 0),
                                  jnp.moveaxis(b, 1, 0), jnp.moveaxis(ph, -1, 0))
    return jnp.sum(jnp.sin(y.astype(dtype).astype(jnp.float32)) * probe)  # output in x's dtype

  def fast(x, a, b, ph):
    return jnp.sum(jnp.sin(grape_m.rank2_planes_apply(x, a, b, ph).astype(jnp.float32)) * probe)

  want = jax.grad(oracle, argnums=(0, 1, 2, 3))(x, a, b, ph)
  got = jax.jit(jax.grad(fast, argnums=(0, 1, 2, 3)))(x, a, b, ph)
  for name, g, w in zip(("dx", "da", "db", "dphase"), got, want):
    assert_rel_rms(g.astype(jnp.float32), w.astype(jnp.float32), 1e-5, name)
