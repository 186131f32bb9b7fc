"""The encoding registry: name -> how to initialise parameters and prepare attention inputs.

The model never branches on encoding names; it asks this registry once:

    enc = encodings.get("path", **hparams)           # hparams from config.model.encoding_kwargs
    params = enc.init(key, dims)                      # pytree of arrays ({} when nothing is
                                                      # learned)
    prep = enc.prepare(params, x=x_BTC, q=q_BTHD, k=k_BTKD, v=v_BTKD, positions=pos_BT,
                       segment_ids=seg_BT, tokens=tok_BT, rng=key_or_None, train=bool)
    o_BTHD = encodings.attend(prep, segment_ids=seg_BT, implementation=None)

`prepare` is pure: it turns a layer's input and projections into the arrays one family's
attention call needs (transformed q/k/v plus family inputs such as w, beta, log_forget), and
says whether the output must be post-rotated (value transport). `kv_shift` is a modifier
that composes with any encoding (`kv_shift_init`, `kv_shift_apply`).

Decoding with a fixed-size cache (posenc_jax.kv_cache.Slots says where each row lives):

    cache = enc.init_cache(dims, batch_size=B, max_len=S, dtype=jnp.float32)
    o_BPHD, cache = enc.prefill(params, cache, slots=slots, x=..., q=..., ...)   # the prompt
    o_B1HD, cache = enc.decode(params, cache, slots=slots, x=x_B1C, q=q_B1HD, ...)  # one token

The decoders live beside each family (rotary_decode, additive_decode, transport_decode,
phase_decode, stick_breaking_decode) and register per name (`register_decoder`) or per
family: a family's default decoder serves every encoding of that family whose `prepare` is
pointwise in time (token t's outputs depend on token t and positions[t] only), so e.g. a new
RoPE variant decodes with nothing registered. tests/test_generation.py holds every name to
prefill + decode == forward.

From a transformers checkpoint (hf_rope.py): `from_hf_rope(config_dict)` -> (name, kwargs) of
the encoding that rotates as the config says; `half_to_interleaved` / `interleaved_to_half`
permute q/k projection weights between transformers' rotate_half layout and adjacent pairs.

Shape letters: B batch, T time, C d_model, H query heads, K kv heads, D head dim.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from posenc_jax import attention

# Every encoding, under exactly these names (docs/encodings.md says what each computes).
NAMES = (
    "nope", "rope", "rope_pi", "rope_ntk", "rope_yarn", "rope_llama3",
    "grape_m", "grape_m_rank2", "grape_m_noncommuting", "grape_m_ctx",
    "acc_rot_random", "acc_rot_learned",
    "rope_v", "acc_rot_random_v", "acc_rot_learned_v",
    "alibi", "fox", "grape_a_q", "grape_a_k", "grape_a_qk", "grape_ap",
    "kv_shift",
    "path", "path_fox",
    "tapa", "tapa_linear",
    "sba",
)
MODIFIERS = ("kv_shift",)
FAMILIES = ("softmax", "grape_a", "path", "forgetting", "path_integral", "tapa",
            "stick_breaking")


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
  inputs: family inputs by keyword: grape_a {"rate_q","rate_k"} (either may be None), path
    {"w","beta","log_forget"}, forgetting {"log_forget"}, path_integral
    {"p","alpha"[,"p_query"]}, tapa {"alpha","theta","linear_phase"}, stick_breaking
    {"attend_current","remainder"}.
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
  decoder: Any = None             # _Decoder bound to the hyperparameters, or None

  def apply(self, params, *, segment_ids=None, implementation=None, kernel_options=None,
            **layer):
    """prepare + attend in one call; `layer` holds x, q, k, v, positions, tokens, rng, train."""
    return attend(self.prepare(params, segment_ids=segment_ids, **layer),
                  segment_ids=segment_ids, implementation=implementation,
                  kernel_options=kernel_options)

  def _decoding(self):
    if self.decoder is None:
      raise ValueError(f"encoding {self.name!r} (family {self.family!r}) has no decoder")
    return self.decoder

  def init_cache(self, dims: Dims, *, batch_size: int, max_len: int, dtype) -> dict:
    """An empty cache of max_len slots per row: a dict of per-slot arrays [B, heads, S, ...]
    (posenc_jax.kv_cache) plus per-row states."""
    return self._decoding().init_cache(dims, batch_size=batch_size, max_len=max_len, dtype=dtype)

  def prefill(self, params, cache, *, slots, segment_ids=None, implementation=None,
              kernel_options=None, **layer):
    """The full-sequence forward of a prompt [B, P] (`apply`), and the cache it leaves.

    slots: kv_cache.Slots of the prompt (its tokens are slots [start, end) of time 0..P-1);
    segment_ids must mark the padding as its own segment. Returns (o [B, P, H, Dv], cache).
    """
    prep = self.prepare(params, segment_ids=segment_ids, **layer)
    o = attend(prep, segment_ids=segment_ids, implementation=implementation,
               kernel_options=kernel_options)
    cache = self._decoding().fill(params, cache, prep, layer={**layer, "segment_ids": segment_ids},
                                  slots=slots)
    return o, cache

  def decode(self, params, cache, *, slots, **layer):
    """One new token per row (x [B,1,C], q [B,1,H,D], k, v [B,1,K,D], tokens [B,1]) at slot
    slots.end: returns (o [B, 1, H, Dv], cache with the token added)."""
    return self._decoding().step(params, cache, prepare=self.prepare, layer=layer, slots=slots)


class _Entry(NamedTuple):
  family: str
  init: Callable
  prepare: Callable
  check: Callable


_REGISTRY: dict[str, _Entry] = {}


class _Decoder(NamedTuple):
  """How an encoding decodes (each takes name= and hparams= keywords besides these):

  init_cache(dims, *, batch_size, max_len, dtype) -> cache
  fill(params, cache, prep: Prepared, *, layer, slots) -> cache after the prompt
  step(params, cache, *, prepare, layer, slots) -> (o [B, 1, H, Dv], cache)
  """
  init_cache: Callable
  fill: Callable
  step: Callable


_DECODERS: dict[str, _Decoder] = {}
_FAMILY_DECODERS: dict[str, _Decoder] = {}

# The per-layer keywords of `prepare`; everything else it receives is a hyperparameter.
LAYER_ARGS = frozenset({"x", "q", "k", "v", "positions", "segment_ids", "tokens", "rng", "train",
                        "layer_index"})


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


def prepare_token(prepare: Callable, params, layer: dict, positions_B, **override) -> Prepared:
  """`prepare` on the tokens layer holds (x [B, T', C], ...) at evaluation, no segments, the
  last at positions_B: how the decoders run an encoding's own prepare on a new token."""
  T = layer["x"].shape[1]
  pos = positions_B[:, None] - jnp.arange(T - 1, -1, -1, dtype=positions_B.dtype)[None]
  kw = {**layer, "positions": pos, "segment_ids": None, "rng": None, "train": False, **override}
  return prepare(params, **kw)


def _no_check(dims: Dims) -> None:
  del dims


def register(name: str, *, family: str, init: Callable, prepare: Callable,
             check: Callable = _no_check) -> None:
  """Adds an encoding. init/prepare take the encoding's hyperparameters as keywords."""
  if name not in NAMES:
    raise ValueError(f"encoding {name!r} is not in NAMES; add it to NAMES and docs/encodings.md "
                     "first")
  if family not in FAMILIES + ("modifier",):
    raise ValueError(f"family={family!r} is not one of {FAMILIES}")
  _REGISTRY[name] = _Entry(family, init, prepare, check)


def register_decoder(name: str | None = None, *, family: str | None = None, init_cache: Callable,
                     fill: Callable, step: Callable) -> None:
  """Adds the decoder of encoding `name`, or the default of `family` (pointwise encodings)."""
  if (name is None) == (family is None):
    raise ValueError("register_decoder needs exactly one of name= and family=")
  if name is not None and name not in NAMES:
    raise ValueError(f"encoding {name!r} is not in NAMES")
  if family is not None and family not in FAMILIES:
    raise ValueError(f"family={family!r} is not one of {FAMILIES}")
  entry = _Decoder(init_cache, fill, step)
  if name is not None:
    _DECODERS[name] = entry
  else:
    _FAMILY_DECODERS[family] = entry


def get(name: str, **hparams) -> Encoding:
  """The encoding `name` bound to its hyperparameters (e.g. base=10000.0 for rope)."""
  if name not in NAMES:
    raise ValueError(f"unknown encoding {name!r}; expected one of {NAMES}")
  if name not in _REGISTRY:
    raise ValueError(f"encoding {name!r} is in NAMES but not implemented yet")
  e = _REGISTRY[name]
  d = _DECODERS.get(name, _FAMILY_DECODERS.get(e.family))
  if d is not None:
    d = _Decoder(*(functools.partial(f, name=name, hparams=hparams) for f in d))
  return Encoding(name, e.family, functools.partial(e.init, **hparams),
                  functools.partial(e.prepare, **hparams), e.check, d)


def attend(prep: Prepared, *, segment_ids=None, implementation=None, scale=None,
           kernel_options=None):
  """Runs the family's causal attention on prepared inputs, then any output transport.
  kernel_options: the Pallas kernels' options (kernels_pallas.BlockSizes fields), where they
  run."""
  from posenc_jax import rotations  # the family modules import this package's helpers

  if prep.family == "softmax":
    o = attention.softmax_attention(prep.q, prep.k, prep.v, segment_ids=segment_ids,
                                    scale=scale, implementation=implementation,
                                    kernel_options=kernel_options)
  elif prep.family == "grape_a":
    o = attention.grape_a_attention(prep.q, prep.k, prep.v, prep.inputs["rate_q"],
                                    prep.inputs["rate_k"], segment_ids=segment_ids, scale=scale,
                                    implementation=implementation,
                                    kernel_options=kernel_options)
  elif prep.family == "path":
    i = prep.inputs
    o = attention.path_attention(prep.q, prep.k, prep.v, i["w"], i["beta"],
                                 log_forget=i.get("log_forget"), segment_ids=segment_ids,
                                 scale=scale, implementation=implementation,
                                 kernel_options=kernel_options)
  elif prep.family == "forgetting":
    o = attention.forgetting_attention(prep.q, prep.k, prep.v, prep.inputs["log_forget"],
                                       segment_ids=segment_ids, scale=scale,
                                       implementation=implementation,
                                       kernel_options=kernel_options)
  elif prep.family == "path_integral":
    o = attention.path_integral_attention(prep.q, prep.k, prep.v, prep.inputs["p"],
                                          prep.inputs["alpha"], segment_ids=segment_ids,
                                          scale=scale, implementation=implementation,
                                          p_query=prep.inputs.get("p_query"))
  elif prep.family == "tapa":
    o = attention.tapa_attention(prep.q, prep.k, prep.v, segment_ids=segment_ids,
                                 implementation=implementation, **prep.inputs)
  elif prep.family == "stick_breaking":
    o = attention.stick_breaking_attention(prep.q, prep.k, prep.v, segment_ids=segment_ids,
                                           scale=scale, implementation=implementation,
                                           **prep.inputs)
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
for _module in ("rotary", "additive", "transport", "phase", "stick_breaking",
                "rotary_decode", "additive_decode", "transport_decode", "phase_decode",
                "stick_breaking_decode"):
  try:
    __import__(f"{__name__}.{_module}")
  except ModuleNotFoundError as _e:
    if _e.name != f"{__name__}.{_module}":
      raise

# Reading transformers configs and checkpoints (hf_rope.py): not encodings, helpers for them.
from posenc_jax.encodings.hf_rope import from_hf_rope  # noqa: E402,F401  (re-export)
from posenc_jax.encodings.hf_rope import half_to_interleaved  # noqa: E402,F401  (re-export)
from posenc_jax.encodings.hf_rope import interleaved_to_half  # noqa: E402,F401  (re-export)
