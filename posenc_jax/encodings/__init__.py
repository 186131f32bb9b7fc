"""The encoding registry: name -> how to initialise parameters and prepare attention inputs.

The model never branches on encoding names; it asks this registry once:

    enc = encodings.get("path", **hparams)           # hparams from config.model.encoding_kwargs
    params = enc.init(key, dims)                      # pytree of arrays ({} when nothing is learned)
    prep = enc.prepare(params, x=x_BTC, q=q_BTHD, k=k_BTKD, v=v_BTKD, positions=pos_BT,
                       segment_ids=seg_BT, tokens=tok_BT, rng=key_or_None, train=bool)
    o_BTHD = encodings.attend(prep, segment_ids=seg_BT, implementation=None)

`prepare` is pure: it turns a layer's input and projections into the arrays one family's
attention call needs (transformed q/k/v plus family inputs such as w, beta, log_forget), and
says whether the output must be post-rotated (value transport). `kv_shift` is a modifier
that composes with any encoding (`kv_shift_init`, `kv_shift_apply`).

Shape letters: B batch, T time, C d_model, H query heads, K kv heads, D head dim.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax

from posenc_jax import attention

# Every encoding of SPEC.md, under exactly these names.
NAMES = (
    "nope", "rope", "rope_pi", "rope_ntk", "rope_yarn",
    "grape_m", "grape_m_rank2", "grape_m_noncommuting", "grape_m_ctx",
    "acc_rot_random", "acc_rot_learned",
    "rope_v", "acc_rot_random_v", "acc_rot_learned_v",
    "alibi", "fox", "grape_a_q", "grape_a_k", "grape_a_qk", "grape_ap",
    "kv_shift",
    "path", "path_fox",
    "tapa", "tapa_linear",
)
MODIFIERS = ("kv_shift",)
FAMILIES = ("softmax", "path", "forgetting", "path_integral", "tapa")


@dataclasses.dataclass(frozen=True)
class Dims:
  """Layer sizes an encoding may need to shape its parameters."""
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int = 256


class Prepared(NamedTuple):
  """What one family's attention call needs, as plain arrays.

  family: one of FAMILIES. q [B,T,H,D], k [B,T,K,D], v [B,T,K,Dv].
  inputs: family inputs by keyword: path {"w","beta","log_forget"}, forgetting
    {"log_forget"}, path_integral {"p","alpha"}, tapa {"alpha","theta","linear_phase"}.
  out_angles: [B, T, H or 1, Dv/2] angles by which to rotate the output (value transport
    o_i <- G_i o_i), or None.
  """
  family: str
  q: jax.Array
  k: jax.Array
  v: jax.Array
  inputs: dict
  out_angles: Any = None


@dataclasses.dataclass(frozen=True)
class Encoding:
  """A registered encoding bound to its hyperparameters.

  init(key, dims: Dims) -> params pytree.
  prepare(params, *, x, q, k, v, positions, segment_ids, tokens, rng, train) -> Prepared.
  """
  name: str
  family: str
  init: Callable[..., Any]
  prepare: Callable[..., Prepared]
  check: Callable[[Dims], None]   # raises ValueError for dims this encoding cannot use

  def apply(self, params, *, segment_ids=None, implementation=None, **layer):
    """prepare + attend in one call; `layer` holds x, q, k, v, positions, tokens, rng, train."""
    return attend(self.prepare(params, segment_ids=segment_ids, **layer),
                  segment_ids=segment_ids, implementation=implementation)


class _Entry(NamedTuple):
  family: str
  init: Callable
  prepare: Callable
  check: Callable


_REGISTRY: dict[str, _Entry] = {}

# The per-layer keywords of `prepare`; everything else it receives is a hyperparameter.
LAYER_ARGS = frozenset({"x", "q", "k", "v", "positions", "segment_ids", "tokens", "rng", "train"})


def resolve_hparams(name: str, hparams: dict, defaults: dict) -> dict:
  """`defaults` updated by `hparams`; an unknown hyperparameter is a ValueError naming it."""
  unknown = sorted(set(hparams) - set(defaults))
  if unknown:
    raise ValueError(f"unknown hyperparameters {unknown} for encoding {name!r}; "
                     f"expected some of {sorted(defaults)}")
  return {**defaults, **hparams}


def split_layer_args(kwargs: dict) -> tuple[dict, dict]:
  """Splits `prepare`'s keywords into (layer inputs, hyperparameters)."""
  layer = {a: v for a, v in kwargs.items() if a in LAYER_ARGS}
  return layer, {a: v for a, v in kwargs.items() if a not in LAYER_ARGS}


def _no_check(dims: Dims) -> None:
  del dims


def register(name: str, *, family: str, init: Callable, prepare: Callable,
             check: Callable = _no_check) -> None:
  """Adds an encoding. init/prepare take the encoding's hyperparameters as keywords."""
  if name not in NAMES:
    raise ValueError(f"encoding {name!r} is not in NAMES; add it to SPEC.md and NAMES first")
  if family not in FAMILIES + ("modifier",):
    raise ValueError(f"family={family!r} is not one of {FAMILIES}")
  _REGISTRY[name] = _Entry(family, init, prepare, check)


def get(name: str, **hparams) -> Encoding:
  """The encoding `name` bound to its hyperparameters (e.g. base=10000.0 for rope)."""
  if name not in NAMES:
    raise ValueError(f"unknown encoding {name!r}; expected one of {NAMES}")
  if name not in _REGISTRY:
    raise ValueError(f"encoding {name!r} is named in SPEC.md but not implemented yet")
  e = _REGISTRY[name]
  return Encoding(name, e.family, functools.partial(e.init, **hparams),
                  functools.partial(e.prepare, **hparams), e.check)


def attend(prep: Prepared, *, segment_ids=None, implementation=None, scale=None):
  """Runs the family's causal attention on prepared inputs, then any output transport."""
  from posenc_jax import rotations  # the family modules import this package's helpers

  if prep.family == "softmax":
    o = attention.softmax_attention(prep.q, prep.k, prep.v, segment_ids=segment_ids,
                                    scale=scale, implementation=implementation)
  elif prep.family == "path":
    i = prep.inputs
    o = attention.path_attention(prep.q, prep.k, prep.v, i["w"], i["beta"],
                                 log_forget=i.get("log_forget"), segment_ids=segment_ids,
                                 scale=scale, implementation=implementation)
  elif prep.family == "forgetting":
    o = attention.forgetting_attention(prep.q, prep.k, prep.v, prep.inputs["log_forget"],
                                       segment_ids=segment_ids, scale=scale,
                                       implementation=implementation)
  elif prep.family == "path_integral":
    o = attention.path_integral_attention(prep.q, prep.k, prep.v, prep.inputs["p"],
                                          prep.inputs["alpha"], segment_ids=segment_ids,
                                          scale=scale, implementation=implementation)
  elif prep.family == "tapa":
    o = attention.tapa_attention(prep.q, prep.k, prep.v, segment_ids=segment_ids,
                                 implementation=implementation, **prep.inputs)
  else:
    raise ValueError(f"Prepared.family={prep.family!r} is not one of {FAMILIES}")
  if prep.out_angles is not None:
    o = rotations.rotate(o, prep.out_angles)
  return o


def _nope_init(key, dims):
  del key, dims
  return {}


def _nope_prepare(params, *, q, k, v, **unused):
  del params, unused
  return Prepared("softmax", q, k, v, {})


register("nope", family="softmax", init=_nope_init, prepare=_nope_prepare)

# Family modules register themselves on import; a module still being written is skipped.
for _module in ("rotary", "additive", "transport", "phase"):
  try:
    __import__(f"{__name__}.{_module}")
  except ModuleNotFoundError as _e:
    if _e.name != f"{__name__}.{_module}":
      raise
