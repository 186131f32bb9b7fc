"""Planar rotations, RoPE and its length extensions (PI, NTK, YaRN, Llama 3), accumulated phases.

Conventions (docs/encodings.md#conventions): rotation planes are adjacent channel pairs
(x[2m], x[2m+1]), m = 0..D/2-1, and `R(phi) x` maps each pair to
(x0 cos - x1 sin, x0 sin + x1 cos).
`layout="half"` pairs (x[m], x[m + D/2]) instead (the Llama / GPT-NeoX checkpoint layout).

Shape letters: B batch, T time, H heads, D head dim, P = D/2 rotation planes.

The learned-basis GRAPE-M maps (orthogonal bases, rank-2 Rodrigues exponentials, thin
non-commuting compressions) live in `posenc_jax.grape_m`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from posenc_jax import _checks
from posenc_jax import masking

LAYOUTS = ("interleaved", "half")


def _check_layout(layout: str) -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")


def rotate(x, angles, *, layout: str = "interleaved"):
  """Rotates channel pairs of `x` by `angles`: G x with G = R(angles).

  Args:
    x: [..., D] with D even.
    angles: [..., D/2], broadcastable against x[..., :D/2] (e.g. [B, T, 1, P] for x
      [B, T, H, D]); angles[..., m] rotates the pair (x[2m], x[2m+1]) (or (x[m], x[m+D/2])
      for layout="half").
    layout: "interleaved" (default, adjacent pairs) or "half".

  Returns:
    Rotated x, same shape and dtype. Trigonometry runs in float32 at least.
  """
  _check_layout(layout)
  D = x.shape[-1]
  _checks.check_even("x.shape[-1] (head_dim)", D)
  if angles.shape[-1:] != (D // 2,):
    raise ValueError(f"angles must have shape [..., D/2={D // 2}] to rotate x of shape "
                     f"{tuple(x.shape)}, got {tuple(angles.shape)}")
  try:
    jnp.broadcast_shapes(x.shape[:-1] + (D // 2,), angles.shape)
  except ValueError:
    raise ValueError(f"angles of shape {tuple(angles.shape)} do not broadcast against x of "
                     f"shape {tuple(x.shape)} (expected [..., D/2={D // 2}])") from None
  ct = jnp.promote_types(x.dtype, jnp.float32)
  a = angles.astype(ct)
  c, s = jnp.cos(a), jnp.sin(a)
  xc = x.astype(ct)
  if layout == "interleaved":
    x0, x1 = xc[..., 0::2], xc[..., 1::2]
  else:
    x0, x1 = xc[..., : D // 2], xc[..., D // 2:]
  y0 = x0 * c - x1 * s
  y1 = x0 * s + x1 * c
  if layout == "interleaved":
    y = jnp.stack([y0, y1], axis=-1).reshape(y0.shape[:-1] + (D,))
  else:
    y = jnp.concatenate([y0, y1], axis=-1)
  return y.astype(x.dtype)


# ----------------------------------------------------------------------------------------
# RoPE frequencies and the length extensions used as TAPA baselines.


def rope_frequencies(head_dim: int, *, base: float = 10000.0):
  """omega_m = base**(-2m/D), m = 0..D/2-1, float32 [P]."""
  _checks.check_even("head_dim", head_dim)
  m = jnp.arange(head_dim // 2, dtype=jnp.float32)
  return base ** (-2.0 * m / head_dim)


def rope_angles(positions_BT, frequencies_P):
  """phi_t = t * omega as [B, T, 1, P], broadcastable over heads."""
  return (positions_BT.astype(jnp.float32)[..., None] * frequencies_P)[:, :, None, :]


def rope(x, positions, *, base: float = 10000.0, layout: str = "interleaved"):
  """RoPE: rotates x [B, T, H, D] by R(positions * omega), positions [B, T]."""
  _checks.check_rank("x", x, 4, "BTHD")
  _checks.check_shape("positions", positions, x.shape[:2], "BT")
  return rotate(x, rope_angles(positions, rope_frequencies(x.shape[-1], base=base)),
                layout=layout)


def length_scale(*, train_len: int, eval_len: int) -> float:
  """s = max(1, eval_len / train_len): how far the context is extended."""
  if train_len <= 0 or eval_len <= 0:
    raise ValueError(f"train_len={train_len} and eval_len={eval_len} must be positive")
  return max(1.0, eval_len / train_len)


def pi_positions(positions, *, train_len: int, eval_len: int):
  """Position interpolation (Chen et al. 2023): t -> t * L_train / L_eval when L_eval > L_train."""
  return positions.astype(jnp.float32) / length_scale(train_len=train_len, eval_len=eval_len)


def ntk_base(head_dim: int, *, base: float = 10000.0, scale: float):
  """NTK-aware raised base: base * s**(D / (D - 2)).

  Chosen so the lowest frequency omega_{D/2-1} is divided by exactly s (it interpolates like
  PI) while omega_0 = 1 is untouched (the highest frequency extrapolates).
  """
  if head_dim <= 2:
    raise ValueError(f"head_dim={head_dim} must be > 2 for the NTK base")
  return base * scale ** (head_dim / (head_dim - 2))


YARN_RAMPS = ("paper", "hf")


def yarn_frequencies(head_dim: int, *, base: float = 10000.0, scale: float, train_len: int,
                     beta_fast: float = 32.0, beta_slow: float = 1.0, ramp: str = "paper",
                     truncate: bool = True):
  """YaRN "NTK-by-parts" frequencies (Peng et al. 2023, defaults beta_fast=32, beta_slow=1).

  Every plane blends interpolation and extrapolation, omega'_m = (1 - gamma_m) omega_m / s +
  gamma_m omega_m: fast planes (gamma = 1) keep omega, slow ones are interpolated by s. The
  two ramps agree outside [beta_slow, beta_fast] turns and differ (by tens of percent in omega')
  inside it:

    ramp="paper" (default)  gamma_m = clip((r_m - beta_slow) / (beta_fast - beta_slow), 0, 1),
        r_m = train_len omega_m / (2 pi) the turns plane m makes over the training context:
        the formula of the YaRN paper (§3.2). The default because the encodings' defaults follow
        the papers (docs/encodings/rotary.md#rope_yarn), and it is continuous in train_len and the
        betas (no rounding).
    ramp="hf"  linear in the plane index m instead: gamma_m = 1 - clip((m - lo) / (hi - lo), 0, 1)
        with lo = floor(m(beta_fast)), hi = ceil(m(beta_slow)) clipped to [0, D - 1] and
        m(n) = D ln(train_len / (2 pi n)) / (2 ln base) the plane that makes n turns. This is
        what transformers' "yarn", the original YaRN code (jquesnelle/yarn) and vLLM compute,
        so checkpoints trained with YaRN expect it; `posenc_jax.encodings.from_hf_rope` picks
        it. truncate=False skips the floor/ceil (transformers' `truncate: false`).
  """
  if ramp not in YARN_RAMPS:
    raise ValueError(f"ramp={ramp!r} is not one of {YARN_RAMPS}")
  if not truncate and ramp != "hf":
    raise ValueError("truncate=False applies to ramp='hf' only (the paper's ramp has no rounding)")
  omega = rope_frequencies(head_dim, base=base)
  if ramp == "paper":
    r = train_len * omega / (2 * math.pi)
    gamma = jnp.clip((r - beta_slow) / (beta_fast - beta_slow), 0.0, 1.0)
  else:
    def plane(turns):  # the (fractional) plane index that makes `turns` turns over train_len
      return head_dim * math.log(train_len / (2 * math.pi * turns)) / (2 * math.log(base))
    lo, hi = plane(beta_fast), plane(beta_slow)
    if truncate:
      lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    hi = hi + 0.001 if hi == lo else hi          # as transformers: a step, not 0 / 0
    m = jnp.arange(head_dim // 2, dtype=jnp.float32)
    gamma = 1.0 - jnp.clip((m - lo) / (hi - lo), 0.0, 1.0)
  return (1.0 - gamma) * omega / scale + gamma * omega


def yarn_attention_factor(scale: float) -> float:
  """sqrt(1/t) = 0.1 ln(s) + 1: multiplies q and k, so logits get 1/t = (0.1 ln s + 1)^2."""
  return 1.0 if scale <= 1.0 else 0.1 * math.log(scale) + 1.0


def dynamic_ntk_base(head_dim: int, *, base: float = 10000.0, factor: float, train_len: int,
                     seq_len):
  """transformers' "dynamic" NTK base: base * (s L' / L - s + 1)^(D / (D - 2)).

  s = factor, L = train_len (transformers' max_position_embeddings), L' = max(seq_len, L) the
  current length (a Python or traced scalar). Up to L it is RoPE; at L' = s L the base has
  grown by (s^2 - s + 1)^(D/(D-2)), more than ntk_base's s^(D/(D-2)) (the two agree only at
  s = 1). transformers recomputes the base whenever a forward call's max(position_ids) + 1
  exceeds every length seen so far; the keys already in a cache keep their old rotation.
  """
  if head_dim <= 2:
    raise ValueError(f"head_dim={head_dim} must be > 2 for the NTK base")
  if train_len <= 0:
    raise ValueError(f"train_len={train_len} must be positive")
  length = jnp.maximum(jnp.asarray(seq_len, jnp.float32), float(train_len))
  return base * (factor * length / train_len - factor + 1.0) ** (head_dim / (head_dim - 2))


def llama3_frequencies(head_dim: int, *, base: float = 500000.0, factor: float = 8.0,
                       train_len: int = 8192, low_freq_factor: float = 1.0,
                       high_freq_factor: float = 4.0):
  """Llama 3.1 RoPE scaling (transformers' "llama3"), defaults as Llama 3.1 ships them.

  With the wavelength lambda_m = 2 pi / omega_m and L = train_len (the original context):
  lambda_m < L / high_freq_factor keeps omega_m; lambda_m > L / low_freq_factor interpolates,
  omega_m / factor; in between the blend is linear in L / lambda_m (the turns over L):
  g = (L / lambda_m - low) / (high - low), omega'_m = (1 - g) omega_m / factor + g omega_m.
  No attention temperature. Continuous in omega, so the boundary conventions do not matter.
  """
  if factor <= 0 or train_len <= 0:
    raise ValueError(f"factor={factor} and train_len={train_len} must be positive")
  if not 0 < low_freq_factor < high_freq_factor:
    raise ValueError(f"need 0 < low_freq_factor={low_freq_factor} < "
                     f"high_freq_factor={high_freq_factor}")
  omega = rope_frequencies(head_dim, base=base)
  turns = train_len * omega / (2 * math.pi)                         # L / lambda_m
  g = jnp.clip((turns - low_freq_factor) / (high_freq_factor - low_freq_factor), 0.0, 1.0)
  return (1.0 - g) * omega / factor + g * omega


# ----------------------------------------------------------------------------------------
# Accumulated phases: phi_t is a sum of per-token step angles, restarting at segment starts.


def accumulate_phases(steps_BT, segment_ids=None, *, exclusive: bool = False):
  """phi_t = sum_{s<=t} steps_s (or s < t if exclusive) within t's packed segment.

  steps [B, T, ...] (angles per plane, or one scalar phase per token). O(T) memory, a
  segmented associative scan over time. Then phi_i - phi_j = sum_{s=j+1}^{i} steps_s
  (inclusive) or sum_{s=j}^{i-1} steps_s (exclusive) for j <= i in one segment.
  """
  return masking.segment_cumsum(steps_BT.astype(jnp.float32), segment_ids, exclusive=exclusive)


def random_step_angles(key, shape_BT, frequencies_P, *, width: float = 2.0):
  """delta_{t,m} ~ U(0, width * omega_m) i.i.d. per position and plane: [B, T, P].

  width=2 gives mean omega_m, i.e. RoPE on average (accumulated_rotations App. C).
  """
  u = jax.random.uniform(key, tuple(shape_BT) + frequencies_P.shape, jnp.float32)
  return u * (width * frequencies_P)


def positional_step_angles(key, positions_BT, frequencies_P, *, width: float = 2.0):
  """delta_{t,m} ~ U(0, width * omega_m), one draw per position value: [B, T, P].

  The draw for position n comes from fold_in(key, n), so it does not depend on the length or
  batch of the call: a sequence decoded one token at a time draws exactly the angles of its
  full forward (random_step_angles' draws depend on the array shape). Rows share the draw.
  """
  draw = lambda n: jax.random.uniform(jax.random.fold_in(key, n), frequencies_P.shape, jnp.float32)
  u = jax.vmap(draw)(positions_BT.reshape(-1)).reshape(positions_BT.shape + frequencies_P.shape)
  return u * (width * frequencies_P)
