"""TAPA entries (SPEC.md "TAPA"): token-aware phase attention, quadratic and linear phase.

No positional transform of q, k or v: the distance enters the logits inside
`posenc_jax.tapa` as cos(2 pi |i - j|^alpha phi(q_P, k_P)). Hyperparameters alpha = 0.1,
theta = 0.5 (the paper's), keyword-only.
"""
from __future__ import annotations

from posenc_jax.encodings import Prepared
from posenc_jax.encodings import register

HPARAMS = {"alpha": 0.1, "theta": 0.5}
_LAYER_ARGS = frozenset({"x", "q", "k", "v", "positions", "segment_ids", "tokens", "rng", "train"})


def _check_dims(name, *, theta):
  def check(dims):
    A = int(round(theta * dims.head_dim))
    if not 1 <= A <= dims.head_dim - 1:
      raise ValueError(f"theta={theta} with head_dim={dims.head_dim} leaves an empty amplitude "
                       f"or phase part for encoding {name!r}")
  return check


def _resolve(name, hp):
  unknown = sorted(set(hp) - set(HPARAMS))
  if unknown:
    raise ValueError(f"unknown hyperparameters {unknown} for encoding {name!r}; "
                     f"expected some of {sorted(HPARAMS)}")
  return {**HPARAMS, **hp}


def _add(name: str, linear_phase: bool):
  def init(key, dims, **hp):
    del key
    _check_dims(name, theta=_resolve(name, hp)["theta"])(dims)
    return {}

  def prepare(params, **kw):
    del params
    layer = {a: kw.pop(a) for a in list(kw) if a in _LAYER_ARGS}
    hp = _resolve(name, kw)
    return Prepared("tapa", layer["q"], layer["k"], layer["v"],
                    {"alpha": hp["alpha"], "theta": hp["theta"], "linear_phase": linear_phase})

  register(name, family="tapa", init=init, prepare=prepare,
           check=_check_dims(name, theta=HPARAMS["theta"]))


_add("tapa", False)
_add("tapa_linear", True)
