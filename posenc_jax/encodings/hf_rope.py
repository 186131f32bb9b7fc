"""transformers RoPE configs -> our encodings, and the q/k weight layout between the two.

    name, kwargs = encodings.from_hf_rope(config_dict)   # e.g. json.load(open("config.json"))
    enc = encodings.get(name, **kwargs)

`from_hf_rope` reads what transformers' rope initialisation functions read (v4 `rope_scaling`
or v5 `rope_parameters`, `rope_theta`, `max_position_embeddings`, `head_dim`,
`partial_rotary_factor`) and returns the encoding that computes the same frequencies and
attention factor:

    rope_type      encoding      kwargs
    default        rope          base
    linear         rope_pi       train_len = max_position_embeddings, eval_len = factor x that
    dynamic        rope_ntk      variant="dynamic", train_len = max_position_embeddings, s = factor
    yarn           rope_yarn     ramp="hf", train_len = original_max_position_embeddings,
                                 s = factor, beta_fast/beta_slow, truncate, attention_factor
                                 (or DeepSeek's mscale ratio)
    llama3         rope_llama3   train_len = original_max_position_embeddings, factor, low/high
                                 freq factors

Anything else (longrope, proportional, mrope, per-layer RoPE, partial rotary, a field we do not
read) raises one ValueError that names the field: silently dropping a field would change the
numbers.

Layouts. transformers rotates the half-split pairs (x[m], x[m + D/2]) by angle theta_m
(`rotate_half`: q cos + rotate_half(q) sin). Our default rotates adjacent pairs (x[2m], x[2m+1]).
The two differ by a fixed permutation P of each head's channels, (P x)[2m] = x[m],
(P x)[2m+1] = x[m + D/2], and R_adjacent(theta) P = P R_half(theta). As attention only sees
q.k = (P q).(P k), a checkpoint runs in either layout:
  * layout="half" (from_hf_rope's default): keep the weights, rotate in transformers' layout;
  * layout="interleaved": permute the q and k projections' output channels with
    `half_to_interleaved` (v, o untouched) and rotate adjacent pairs (what the Pallas and
    GRAPE-M paths assume); `interleaved_to_half` goes back.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
# The rope_scaling fields each type reads; transformers ignores "original_max_position_embeddings"
# for "dynamic" (it scales from max_position_embeddings), and so do we.
_FIELDS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
}
_LAYOUTS = ("half", "interleaved")
# Top-level fields of other architectures that change the rotation and that we do not read:
# GPT-NeoX/GPT-J partial rotary, Gemma 3 local-layer bases, DeepSeek MLA's rotary sub-head,
# DeepSeek's interleave flag.
_UNREAD = ("rotary_pct", "rotary_emb_base", "rotary_dim", "rope_local_base_freq",
           "qk_rope_head_dim", "rope_interleave")


def _scaling(config: Mapping) -> tuple[str, dict]:
  """(field name, rope dict): transformers v5 `rope_parameters` or v4 `rope_scaling`."""
  # transformers v5 lets an explicit rope_scaling win (convert_rope_params_to_dict).
  for where in ("rope_scaling", "rope_parameters"):
    params = config.get(where)
    if params:
      if not isinstance(params, Mapping):
        raise ValueError(f"{where} must be a dict, got {type(params).__name__}")
      nested = [k for k, v in params.items() if isinstance(v, Mapping)]
      if nested:
        raise ValueError(f"{where}.{nested[0]}: per-layer-type RoPE parameters are not supported")
      return where, dict(params)
  return "rope_parameters", {}


def _number(value, field: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ValueError(f"{field}={value!r} must be a finite number")
  if value <= 0:
    raise ValueError(f"{field}={value!r} must be positive")
  return float(value)


def _length(value, field: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f"{field}={value!r} must be a positive integer")
  return value


def _get(params, key, default=None):
  """params[key] with None treated as absent (transformers reads these with `.get`)."""
  value = params.get(key)
  return default if value is None else value


def from_hf_rope(config: Mapping[str, Any], *, layout: str = "half") -> tuple[str, dict]:
  """Maps a transformers model config (a dict) to (encoding name, kwargs) for `encodings.get`.

  Args:
    config: the model config as a dict (config.json, or PretrainedConfig.to_dict()).
    layout: "half" (default) if the q/k weights are used as transformers stores them;
      "interleaved" if they were permuted with `half_to_interleaved`.

  Returns:
    (name, kwargs) such that encodings.get(name, **kwargs) rotates q and k as transformers'
    rotary embedding and `apply_rotary_pos_emb` do (module docstring: the table).

  Raises:
    ValueError naming the field, for what we do not support or cannot read.
  """
  if not isinstance(config, Mapping):
    raise ValueError(f"config must be a dict (e.g. PretrainedConfig.to_dict()), got "
                     f"{type(config).__name__}")
  if layout not in _LAYOUTS:
    raise ValueError(f"layout={layout!r} is not one of {_LAYOUTS}")
  unread = [f for f in _UNREAD if config.get(f) is not None]
  if unread:
    raise ValueError(f"{unread[0]}={config[unread[0]]!r} is not supported (a field of another "
                     "RoPE scheme that this converter does not read)")
  where, params = _scaling(config)
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in _FIELDS:
    raise ValueError(f"{where}.rope_type={rope_type!r} is not supported; supported: "
                     f"{sorted(_FIELDS)}")
  unknown = sorted(k for k in params if k not in _COMMON | _FIELDS[rope_type])
  if unknown:
    raise ValueError(f"{where}.{unknown[0]} is not supported for rope_type={rope_type!r} "
                     f"(read: {sorted(_FIELDS[rope_type])})")
  partial = _get(params, "partial_rotary_factor", config.get("partial_rotary_factor"))
  if partial is not None and partial != 1.0:
    raise ValueError(f"partial_rotary_factor={partial!r}: partial rotary embeddings are not "
                     "supported (every channel pair is rotated)")
  head_dim = config.get("head_dim")
  if head_dim is None and config.get("hidden_size") and config.get("num_attention_heads"):
    head_dim = config["hidden_size"] // config["num_attention_heads"]
  if head_dim is not None and (_length(head_dim, "head_dim") % 2 or head_dim <= 2):
    raise ValueError(f"head_dim={head_dim} must be even and > 2 for RoPE")

  base = _number(_get(params, "rope_theta", _get(config, "rope_theta", 10000.0)), "rope_theta")
  kwargs: dict[str, Any] = {"base": base, "layout": layout}
  if rope_type == "default":
    return "rope", kwargs

  def max_len():
    if config.get("max_position_embeddings") is None:
      raise ValueError(f"max_position_embeddings is required for {where}.rope_type={rope_type!r}")
    return _length(config["max_position_embeddings"], "max_position_embeddings")

  def original_len():  # transformers prefers a top-level value (Phi-3 style) over rope_scaling's
    if config.get("original_max_position_embeddings") is not None:
      return _length(config["original_max_position_embeddings"], "original_max_position_embeddings")
    if params.get("original_max_position_embeddings") is not None:
      return _length(params["original_max_position_embeddings"],
                     f"{where}.original_max_position_embeddings")
    return max_len()

  def factor(default=None):
    value = _get(params, "factor", default)
    if value is None:
      raise ValueError(f"{where}.factor is required for rope_type={rope_type!r}")
    f = _number(value, f"{where}.factor")
    if f < 1.0:  # our extensions take s = max(1, eval_len / train_len)
      raise ValueError(f"{where}.factor={value!r} < 1 (a compression) is not supported")
    return f

  if rope_type == "llama3":
    for key in ("low_freq_factor", "high_freq_factor"):
      if params.get(key) is None:
        raise ValueError(f"{where}.{key} is required for rope_type='llama3'")
    kwargs.update(train_len=original_len(), factor=factor(),
                  low_freq_factor=_number(params["low_freq_factor"], f"{where}.low_freq_factor"),
                  high_freq_factor=_number(params["high_freq_factor"], f"{where}.high_freq_factor"))
    return "rope_llama3", kwargs

  if rope_type in ("linear", "dynamic"):
    s = factor()
    length = max_len()
    kwargs.update(train_len=length, eval_len=_scaled(length, s))
    if rope_type == "linear":
      return "rope_pi", kwargs
    kwargs["variant"] = "dynamic"
    return "rope_ntk", kwargs

  # yarn. A missing factor is max_position_embeddings / original (DeepSeek-V3), as transformers.
  length = original_len()
  s = factor(default=max_len() / length if params.get("factor") is None else None)
  att = params.get("attention_factor")
  mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
  if att is not None:
    att = _number(att, f"{where}.attention_factor")
  elif mscale and mscale_all:  # DeepSeek: a ratio of two mscales (both must be set and nonzero)
    att = _mscale(s, _number(mscale, f"{where}.mscale")) / _mscale(
        s, _number(mscale_all, f"{where}.mscale_all_dim"))
  truncate = params["truncate"] if "truncate" in params else True
  if not isinstance(truncate, bool) and truncate is not None:
    raise ValueError(f"{where}.truncate={truncate!r} must be true or false")
  kwargs.update(train_len=length, eval_len=_scaled(length, s),
                beta_fast=_number(_get(params, "beta_fast", 32.0) or 32.0,
                                  f"{where}.beta_fast"),
                beta_slow=_number(_get(params, "beta_slow", 1.0) or 1.0,
                                  f"{where}.beta_slow"),
                ramp="hf", truncate=bool(truncate), attention_factor=att)
  return "rope_yarn", kwargs


def _scaled(length: int, factor: float):
  """length * factor, an int when exact (the extension's eval_len; s = eval_len / train_len)."""
  value = length * factor
  return int(value) if float(value).is_integer() else value


def _mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's 0.1 m ln(s) + 1 (1 for s <= 1), as DeepSeek's mscale / mscale_all_dim use it."""
  return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


# ----------------------------------------------------------------------------------------
# q/k projection weights between transformers' half-split layout and adjacent pairs.


def _channel_order(w, head_dim: int, axis: int, order):
  if head_dim % 2 or head_dim <= 0:
    raise ValueError(f"head_dim={head_dim} must be a positive even number")
  n = w.shape[axis]
  if n % head_dim:
    raise ValueError(f"w.shape[{axis}]={n} must be a multiple of head_dim={head_dim} "
                     "(num_heads * head_dim output channels)")
  index = (np.arange(n // head_dim)[:, None] * head_dim + order[None, :]).reshape(-1)
  xp = np if isinstance(w, np.ndarray) else jnp
  return xp.take(w, index, axis=axis)


def half_to_interleaved(w, *, head_dim: int, axis: int = -1):
  """Reorders each head's channels of a q/k projection from (x[m], x[m+D/2]) pairs to
  (x[2m], x[2m+1]) pairs: new[2m] = old[m], new[2m+1] = old[m + D/2] within every head.

  w: any array whose `axis` holds num_heads * head_dim output channels, head-major (as
  transformers views q_proj(x) as [..., heads, head_dim]): a torch q_proj/k_proj weight
  [out, in] as numpy with axis=0, a Flax/jnp kernel [in, out] with axis=-1, a bias [out].
  Apply it to q and k only; with layout="interleaved" the model then computes the same logits.
  """
  half = head_dim // 2
  return _channel_order(w, head_dim, axis, np.stack([np.arange(half), np.arange(half) + half],
                                                     -1).reshape(-1))


def interleaved_to_half(w, *, head_dim: int, axis: int = -1):
  """The inverse of `half_to_interleaved`: new[m] = old[2m], new[m + D/2] = old[2m + 1]."""
  return _channel_order(w, head_dim, axis, np.concatenate([np.arange(0, head_dim, 2),
                                                           np.arange(1, head_dim, 2)]))
