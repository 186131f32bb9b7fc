"""TAPA entries (docs/encodings/tapa.md#tapa): token-aware phase attention, quadratic and linear phase.

No positional transform of q, k or v: the distance enters the logits inside
`posenc_jax.tapa` as cos(2 pi |i - j|^alpha phi(q_P, k_P)). Hyperparameters alpha = 0.1,
theta = 0.5 (the paper's), keyword-only.
"""
from __future__ import annotations

from posenc_jax.encodings import Prepared
from posenc_jax.encodings import register
from posenc_jax.encodings import resolve_hparams
from posenc_jax.encodings import split_layer_args

HPARAMS = {"alpha": 0.1, "theta": 0.5}


def _check_dims(name, *, theta):
  def check(dims):
    A = int(round(theta * dims.head_dim))
    if not 1 <= A <= dims.head_dim - 1:
      raise ValueError(f"theta={theta} with head_dim={dims.head_dim} leaves an empty amplitude "
                       f"or phase part for encoding {name!r}")
  return check




def _add(name: str, linear_phase: bool):
  def init(key, dims, **hp):
    del key
    _check_dims(name, theta=resolve_hparams(name, hp, HPARAMS)["theta"])(dims)
    return {}

  def prepare(params, **kw):
    del params
    layer, hp = split_layer_args(kw)
    hp = resolve_hparams(name, hp, HPARAMS)
    return Prepared("tapa", layer["q"], layer["k"], layer["v"],
                    {"alpha": hp["alpha"], "theta": hp["theta"], "linear_phase": linear_phase})

  register(name, family="tapa", init=init, prepare=prepare,
           check=_check_dims(name, theta=HPARAMS["theta"]))


_add("tapa", False)
_add("tapa_linear", True)
