"""TAPA entries (docs/encodings/tapa.md#tapa): token-aware phase attention, quadratic and
linear phase.

No positional transform of q, k or v: the distance enters the logits inside
`posenc_jax.tapa` as cos(2 pi |i - j|^alpha phi(q_P, k_P)). Hyperparameters alpha = 0.1,
theta = 0.5 (the paper's), keyword-only. phase_scale (default 1, the paper's form) multiplies
phi by scaling the phase channels (q_P for the quadratic phase; q_P and k_P for the linear): not
in the paper, a diagnostic of the phase's random start (at 1 and our initialisation phi spreads
over several radians from step 0). phase_norm (default False, the paper's form) divides q_P and
k_P by their root mean square over the phase channels before that scaling, so that |phi| stays
within sqrt(P) phase_scale (2 sqrt(P) phase_scale for the linear phase) however large the
projections grow: not in the paper either; why in docs/encodings/tapa.md#tapa.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from posenc_jax import tapa
from posenc_jax.encodings import Prepared
from posenc_jax.encodings import register
from posenc_jax.encodings import resolve_hparams
from posenc_jax.encodings import split_layer_args

HPARAMS = {"alpha": 0.1, "theta": 0.5, "phase_scale": 1.0, "phase_norm": False}


def _check_dims(name, *, theta):
  def check(dims):
    A, _ = tapa.split_sizes(theta, dims.head_dim)
    if not 1 <= A <= dims.head_dim - 1:
      raise ValueError(f"theta={theta} with head_dim={dims.head_dim} leaves an empty amplitude "
                       f"or phase part for encoding {name!r}")
  return check




def _phase_channels(x_BTHD, theta, *, norm: bool, scale: float):
  """x with its phase channels (the last D - round(theta D)) divided by their root mean square
  (norm; in float32), then multiplied by scale; the amplitude channels pass through."""
  if not norm and scale == 1.0:
    return x_BTHD
  A, _ = tapa.split_sizes(theta, x_BTHD.shape[-1])
  amp, ph = x_BTHD[..., :A], x_BTHD[..., A:]
  if norm:
    ph32 = ph.astype(jnp.float32)
    ph = (ph32 * jax.lax.rsqrt(jnp.mean(ph32 * ph32, axis=-1, keepdims=True) + 1e-6)
          ).astype(x_BTHD.dtype)
  return jnp.concatenate([amp, ph * jnp.asarray(scale, x_BTHD.dtype)], axis=-1)


def _add(name: str, linear_phase: bool):
  def init(key, dims, **hp):
    del key
    _check_dims(name, theta=resolve_hparams(name, hp, HPARAMS)["theta"])(dims)
    return {}

  def prepare(params, **kw):
    del params
    layer, hp = split_layer_args(kw)
    hp = resolve_hparams(name, hp, HPARAMS)
    q, k = layer["q"], layer["k"]
    # phase_scale scales phi through q_P alone for the quadratic phase, q_P and k_P for the
    # linear one (a sum of the two).
    scale = hp["phase_scale"]
    q = _phase_channels(q, hp["theta"], norm=hp["phase_norm"], scale=scale)
    k = _phase_channels(k, hp["theta"], norm=hp["phase_norm"],
                        scale=scale if linear_phase else 1.0)
    return Prepared("tapa", q, k, layer["v"],
                    {"alpha": hp["alpha"], "theta": hp["theta"], "linear_phase": linear_phase})

  register(name, family="tapa", init=init, prepare=prepare,
           check=_check_dims(name, theta=HPARAMS["theta"]))


_add("tapa", False)
_add("tapa_linear", True)
