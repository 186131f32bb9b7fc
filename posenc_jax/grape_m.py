"""Multiplicative GRAPE (GRAPE §2-3, App. D, I): orthogonal position maps beyond fixed RoPE planes.

Three parameterisations of G_t in SO(D), all applied to q and k before ordinary attention:

  learned basis    G_t = B R(t theta) B^T. B = expm(A - A^T) from a free matrix A (zero at
                   init, so B = I and G is RoPE). The matrix exponential of a skew-symmetric
                   matrix is exactly orthogonal for every A, so B stays orthogonal under any
                   optimiser step (no re-projection), and it reaches all of SO(D), unlike the
                   Cayley map (no eigenvalue -1) or a short Householder product (needs D
                   reflections applied in sequence). Its cost is one D x D expm per head per
                   step, independent of T.
  rank-2 planes    G_t = prod_p exp(t w_p L(a_p, b_p)), L(a, b) = a b^T - b a^T, applied in
                   O(D) per plane by the Rodrigues form x + f1 L x + f2 L^2 x.
  thin compression G_t = exp(t E L_r E^T) = E exp(t L_r) E^T + (I - E E^T), with
                   L_r = T (+)_k theta_k J T^T in real Schur form: exp(t L_r) = T R(t theta) T^T.

Shape letters: B batch, T time, H heads, D head dim, P = D/2 planes, R compressed rank,
N number of rank-2 planes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from posenc_jax import rotations


def _compute_dtype(x):
  """float32 at least (bf16 inputs are promoted; float64 stays float64)."""
  return jnp.promote_types(x.dtype, jnp.float32)


def skew(a):
  """A - A^T over the last two axes."""
  return a - jnp.swapaxes(a, -1, -2)


def orthogonal_from_param(a_HDD):
  """B = expm(A - A^T) in SO(D), per leading index; A = 0 gives the identity."""
  flat = a_HDD.reshape((-1,) + a_HDD.shape[-2:]).astype(_compute_dtype(a_HDD))
  b = jax.vmap(jax.scipy.linalg.expm)(skew(flat))
  return b.reshape(a_HDD.shape)


def per_query_head(p, num_heads: int):
  """Repeats per-kv-head parameters [K, ...] to the query heads [H, ...] (GQA groups)."""
  K = p.shape[0]
  return p if K == num_heads else jnp.repeat(p, num_heads // K, axis=0)


def basis_rotate(x_BTHD, angles_BTHP, basis_HDD):
  """B R(angles) B^T x per head: express x in the basis, rotate its planes, map back."""
  z = jnp.einsum("bthd,hde->bthe", x_BTHD.astype(_compute_dtype(x_BTHD)), basis_HDD)
  z = rotations.rotate(z, angles_BTHP)
  return jnp.einsum("bthe,hde->bthd", z, basis_HDD).astype(x_BTHD.dtype)


# ----------------------------------------------------------------------------------------
# Rank-2 generators and the Rodrigues form.

# Below this |z|^2 the series replace sin(z)/z: its error term z^6/5040 < 1e-10 there,
# and the exact branch above it has no cancellation.
_SERIES_Z2 = 1e-2


def _guarded(z2):
  """(small, safe z^2, z, sin(z)/z) with the series branch's z^2 < _SERIES_Z2 replaced by 1:
  the unused branch must stay finite under grad too."""
  small = z2 < _SERIES_Z2
  safe = jnp.where(small, 1.0, z2)
  z = jnp.sqrt(safe)
  return small, safe, z, jnp.sin(z) / z


def _sinc_value(z2, small, s):
  return jnp.where(small, 1.0 - z2 / 6.0 + z2 * z2 / 120.0, s)


def sinc(z2):
  """sin(z)/z as a function of z^2 (even in z, so no sqrt of 0 and finite gradients at 0)."""
  small, _, _, s = _guarded(z2)
  return _sinc_value(z2, small, s)


def rodrigues_coefficients(phase, s2):
  """f1 = sin(phase s)/s, f2 = (1 - cos(phase s))/s^2, written so both are smooth at s = 0.

  With z = phase * s: f1 = phase sinc(z) and, as 1 - cos z = 2 sin^2(z/2),
  f2 = phase^2 sinc(z/2)^2 / 2 (no cancellation for small z). Both are functions of z^2.
  """
  z2 = phase * phase * s2
  return phase * sinc(z2), 0.5 * phase * phase * sinc(z2 / 4.0) ** 2


def rank2_apply(x, a, b, phase):
  """exp(phase * L(a, b)) x for L(a, b) = a b^T - b a^T, in O(D).

  x [..., D]; a, b [..., D] broadcastable to x; phase [...] (x without its last axis).
  GRAPE App. I: L x = a (b.x) - b (a.x), L^2 x = gamma (a (b.x) + b (a.x)) - beta a (a.x)
  - alpha b (b.x), s^2 = alpha beta - gamma^2. L(a, b) = L(a, b - c a) for every c, so we first
  replace b by its part orthogonal to a (gamma = 0): s^2 = |a|^2 |b_perp|^2 then needs no
  difference of nearly equal products, and neither do L x and L^2 x when a and b are close
  to parallel (s small). a = 0 gives L = 0 with finite gradients.
  """
  alpha = (a * a).sum(-1, keepdims=True)
  safe = jnp.where(alpha > 0, alpha, 1.0)
  b = b - ((a * b).sum(-1, keepdims=True) / safe) * a
  beta = (b * b).sum(-1, keepdims=True)
  u, v = (a * x).sum(-1, keepdims=True), (b * x).sum(-1, keepdims=True)
  f1, f2 = rodrigues_coefficients(jnp.asarray(phase)[..., None], alpha * beta)
  lx = a * v - b * u
  l2x = -(beta * u) * a - (alpha * v) * b
  return x + f1 * lx + f2 * l2x


def _sinc_and_slope(z2):
  """(sinc, d sinc / d z2) as functions of z2 = z^2, with sinc's series below _SERIES_Z2."""
  small, safe, z, s = _guarded(z2)
  return (_sinc_value(z2, small, s),
          jnp.where(small, -1.0 / 6.0 + z2 / 60.0, (jnp.cos(z) - s) / (2.0 * safe)))


def rank2_apply_rows_vjp(x, a, b, phase, g):
  """The VJP of rank2_apply for rows x [R, D] sharing one plane a, b [1, D], phase [R]:
  (g x [R, D], g a [1, D], g b [1, D], g phase [R]) for the cotangent g [R, D].

  Written out so that the sums over rows are two [R, D] -> [1, D] reductions and three of
  per-row scalars, where autodiff of rank2_apply reduces each use of a and b apart (about ten
  cross-row reductions a plane: what the Pallas plane kernel's backward spends its time on).
  With P = f1 v - f2 beta u and Q = -f1 u - f2 alpha v, rank2_apply is y = x + P a + Q b_perp.
  """
  alpha = jnp.sum(a * a, axis=-1, keepdims=True)                  # [1, 1]
  safe = jnp.where(alpha > 0, alpha, 1.0)
  ab = jnp.sum(a * b, axis=-1, keepdims=True)
  c = ab / safe
  bp = b - c * a
  beta = jnp.sum(bp * bp, axis=-1, keepdims=True)
  u = jnp.sum(a * x, axis=-1, keepdims=True)                      # [R, 1]
  v = jnp.sum(bp * x, axis=-1, keepdims=True)
  ph = phase[:, None]
  s2 = alpha * beta
  z2 = ph * ph * s2
  S1, dS1 = _sinc_and_slope(z2)
  S2, dS2 = _sinc_and_slope(z2 / 4.0)
  f1, f2 = ph * S1, 0.5 * ph * ph * S2 * S2
  P = f1 * v - f2 * beta * u
  Q = -f1 * u - f2 * alpha * v
  dP = jnp.sum(g * a, axis=-1, keepdims=True)
  dQ = jnp.sum(g * bp, axis=-1, keepdims=True)
  du = -f2 * beta * dP - f1 * dQ
  dv = f1 * dP - f2 * alpha * dQ
  df1 = v * dP - u * dQ
  df2 = -beta * u * dP - alpha * v * dQ
  gphase = (df1 * (S1 + 2.0 * ph * ph * s2 * dS1)
            + df2 * (ph * S2 * S2 + 0.5 * ph * ph * ph * s2 * S2 * dS2))
  rows = lambda t: jnp.sum(t, axis=0, keepdims=True)  # noqa: E731   [R, .] -> [1, .]
  d_s2 = rows(df1 * ph * ph * ph * dS1 + df2 * 0.25 * ph * ph * ph * ph * S2 * dS2)
  d_beta = rows(-f2 * u * dP) + alpha * d_s2
  d_alpha = rows(-f2 * v * dQ) + beta * d_s2
  gx = g + du * a + dv * bp
  ga = rows(du * x + P * g)
  gbp = rows(dv * x + Q * g) + 2.0 * d_beta * bp
  # b_perp = b - c a, c = (a . b) / alpha
  dc = -jnp.sum(a * gbp, axis=-1, keepdims=True)
  d_alpha = d_alpha + jnp.where(alpha > 0, -dc * ab / (safe * safe), 0.0)
  gb = gbp + (dc / safe) * a
  ga = ga + 2.0 * d_alpha * a - c * gbp + (dc / safe) * b
  return gx, ga, gb, gphase[:, 0]


def rank2_planes_apply(x_BTHD, a_HND, b_HND, phases_BTHN):
  """G x with G = G_{N-1} ... G_0, G_n = exp(phase_n L(a_n, b_n)) (plane 0 acts first).

  Planes that are mutually orthogonal commute and the product is a one-parameter group in t
  (exact relative law); general planes compose in this fixed order.

  Gradients come from `_planes_reversible`: autodiff of the plane scan would store every
  plane's residuals (N copies of x and its projections, 261 GiB for the 125M model's training
  step at B 16, T 2048, N 32), while each G_n is a rotation whose inverse is G_n at -phase_n,
  so the backward rebuilds each plane's input from its output and keeps only x's size.
  """
  xs = (jnp.moveaxis(a_HND, 1, 0), jnp.moveaxis(b_HND, 1, 0), jnp.moveaxis(phases_BTHN, -1, 0))
  y = _planes_reversible(x_BTHD.astype(_compute_dtype(x_BTHD)), *xs)
  return y.astype(x_BTHD.dtype)


PLANES_IMPLEMENTATIONS = ("scan", "pallas")


def planes_implementation(implementation: str | None) -> str:
  """The plane product's implementation: the one asked for, else (None) the fused kernel on a
  GPU, where it takes a third of the scan's training step, and the scan elsewhere (the kernel
  has no TPU form, and the CPU would run it in the interpreter)."""
  if implementation is None:
    return "pallas" if jax.default_backend() == "gpu" else "scan"
  if implementation not in PLANES_IMPLEMENTATIONS:
    raise ValueError(f"planes={implementation!r} is not one of {PLANES_IMPLEMENTATIONS} or None")
  return implementation


def rank2_planes_at_positions(x_BTHD, a_HND, b_HND, positions_BT, w_HN, *,
                              implementation: str | None = None):
  """`rank2_planes_apply` with the phases positions_t * w_hn, the encoding's.

  implementation "scan": rank2_planes_apply (one XLA pass over x per plane); "pallas":
  kernels_pallas.plane_rotations, every plane in one pass (Triton on a GPU, the Pallas
  interpreter on a CPU; no TPU form); None: `planes_implementation`'s choice. The same map
  and gradients.
  """
  implementation = planes_implementation(implementation)
  if implementation == "pallas":
    if jax.default_backend() == "tpu":
      raise ValueError("planes='pallas' has no TPU form (Triton on a GPU, the interpreter on a "
                       "CPU): use planes='scan' or None")
    import kernels_pallas  # imported lazily: the kernels are optional on CPU
    return kernels_pallas.plane_rotations(x_BTHD, a_HND, b_HND, positions_BT, w_HN,
                                          apply=rank2_apply, apply_vjp=rank2_apply_rows_vjp,
                                          interpret=jax.default_backend() == "cpu")
  phases = positions_BT.astype(jnp.float32)[:, :, None, None] * w_HN.astype(jnp.float32)
  return rank2_planes_apply(x_BTHD, a_HND, b_HND, phases)


def rank2_planes_scan(x, a_NHD, b_NHD, phases_NBTH):
  """The plane product by plain autodiff of a scan: the oracle of `_planes_reversible`."""
  def step(y, plane):
    return rank2_apply(y, *plane), None
  return jax.lax.scan(step, x, (a_NHD, b_NHD, phases_NBTH))[0]


@jax.custom_vjp
def _planes_reversible(x, a_NHD, b_NHD, phases_NBTH):
  return rank2_planes_scan(x, a_NHD, b_NHD, phases_NBTH)


def _planes_fwd(x, a_NHD, b_NHD, phases_NBTH):
  y = rank2_planes_scan(x, a_NHD, b_NHD, phases_NBTH)
  return y, (y, a_NHD, b_NHD, phases_NBTH)


def _planes_bwd(res, g):
  y, a_NHD, b_NHD, phases_NBTH = res

  def step(carry, plane):
    y_n, g_n = carry
    a, b, ph = plane
    x_n = rank2_apply(y_n, a, b, -ph)           # G_n^-1 y: this plane's input, rebuilt
    _, vjp = jax.vjp(rank2_apply, x_n, a, b, ph)
    gx, ga, gb, gph = vjp(g_n)
    return (x_n, gx), (ga, gb, gph)

  (_, gx), (ga, gb, gph) = jax.lax.scan(step, (y, g), (a_NHD, b_NHD, phases_NBTH),
                                        reverse=True)
  return gx, ga, gb, gph


_planes_reversible.defvjp(_planes_fwd, _planes_bwd)


def canonical_planes(num_heads: int, head_dim: int, num_planes: int):
  """a_n = e_{2n+1}, b_n = e_{2n}: L(a_n, b_n) is the generator of R's n-th plane (RoPE)."""
  eye = jnp.eye(head_dim, dtype=jnp.float32)
  a = jnp.broadcast_to(eye[1:2 * num_planes:2], (num_heads, num_planes, head_dim))
  b = jnp.broadcast_to(eye[0:2 * num_planes:2], (num_heads, num_planes, head_dim))
  return a, b


# ----------------------------------------------------------------------------------------
# Non-commuting thin compression (GRAPE App. D).


def thin_frame(e_param_HDD, t_param_HRR):
  """F = E T [H, D, R]: E the first R columns of expm(skew), T = expm(skew) in SO(R).

  exp(t E L_r E^T) only ever needs the product F = E T, whose columns are orthonormal.
  """
  R = t_param_HRR.shape[-1]
  e = orthogonal_from_param(e_param_HDD)[..., :R]
  return jnp.einsum("hdr,hrs->hds", e, orthogonal_from_param(t_param_HRR))


def thin_apply(x_BTHD, angles_BTHQ, frame_HDR):
  """exp(t L) x = x + F (R(t theta) - I) F^T x, Q = R/2 planes of the Schur form."""
  x = x_BTHD.astype(_compute_dtype(x_BTHD))
  z = jnp.einsum("bthd,hdr->bthr", x, frame_HDR)
  dz = rotations.rotate(z, angles_BTHQ) - z
  return (x + jnp.einsum("bthr,hdr->bthd", dz, frame_HDR)).astype(x_BTHD.dtype)


def thin_generator(e_param_DD, t_param_RR, theta_Q):
  """Dense L = E T (+)_k theta_k J T^T E^T [D, D] (an oracle for tests, one head)."""
  j = jnp.array([[0.0, -1.0], [1.0, 0.0]], theta_Q.dtype)
  block = jnp.kron(jnp.diag(theta_Q), j)            # (+)_k theta_k J, [R, R]
  f = thin_frame(e_param_DD[None], t_param_RR[None])[0]
  return f @ block @ f.T
