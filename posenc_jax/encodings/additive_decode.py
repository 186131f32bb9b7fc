"""Decoding with a cache for the additive encodings
(docs/encodings/decoding.md#decoding-with-a-cache).

Every one caches keys and values as they enter the logits (untransformed) plus what its bias
needs per cached key; the new query's logits are scale q.k_j + b_j over the cache.

  alibi, fox   (family "forgetting", pointwise: the gate of token t reads x_t only)
               "gate" [B, H, S]: per cached key j, the running log-gate sum
               sum_{s=j+1}^{t} log f_s. Each step adds the new token's log f_t to every entry
               (O(S H), beside attention's O(S K D) read) and starts the new key at 0; the
               sums stay relative to the key, never absolute prefix sums, so their float32
               error scales with the bias and not with the position. ALiBi is the constant
               gate -slope_h: its entries are exactly -slope_h (t - j) up to rounding.
  grape_a_*    "lam_k" [B, H, S] (key-gate variants): lambda_k(k_j) per cached key. Positions
               come from the slots: b_j = -(i - j) omega_h [lambda_q(q_i) + lambda_k(k_j)],
               O(S H) per step. The full forward lifts q, k with extra channels
               (grape_a_augment); decoding computes the same bias directly on K-head keys.
  grape_ap     (family "path_integral", pointwise) "r" [B, H, S, d_p]: the rotated probes
               R_l p_l of every cached position. The bias sum_{l=j+1}^{i} psi(i, l) has
               psi(i, l) = alpha log_sigmoid(<p_i, R_l p_l> / d_p), which depends on the new
               query's probe p_i through a nonlinearity, so no running sum survives a step:
               each step recomputes psi for every cached l (O(S H d_p)) and takes one suffix
               sum over the slots (O(S H)). The state is the probe cache, G d_p / (2 D) of
               the key-value cache's size (G = H / K; 1/8 at d_p = 16, D = 64 without GQA).

kv_shift (the modifier) keeps the previous token's k and v (before the shift) per row:
`kv_shift_prefill_state` and `kv_shift_step`.

Shape letters: B batch, S cache slots, P prompt length, H query heads, K kv heads, D head dim,
C d_model.
"""
from __future__ import annotations

import jax.numpy as jnp

from posenc_jax import grape_a
from posenc_jax import kv_cache
from posenc_jax import path_integral
from posenc_jax.encodings import additive
from posenc_jax.encodings import prepare_token
from posenc_jax.encodings import register_decoder
from posenc_jax.encodings import resolve_hparams
from posenc_jax.encodings.additive import kv_shift_apply
from posenc_jax.encodings.rotary_decode import fill_kv
from posenc_jax.encodings.rotary_decode import init_kv


def _with(extra_shape, key):
  """init_cache: the key-value cache plus a float32 array [B, N, S, ...]: (N, ...) =
  extra_shape(dims, name, hparams)."""
  def init_cache(dims, *, batch_size, max_len, dtype, name, hparams):
    n, *rest = extra_shape(dims, name, hparams)
    shape = (batch_size, n, max_len, *rest)
    return {**init_kv(dims, batch_size=batch_size, max_len=max_len, dtype=dtype),
            key: jnp.zeros(shape, jnp.float32)}
  return init_cache


def _heads(dims, name, hparams):
  del name, hparams
  return (dims.num_heads,)


def _biased_step(q, k_t, v_t, cache, bias_BHS, slots):
  """Attends q over the cache and k_t, v_t with logits scale q.k_j + bias[..., j]; appends them."""
  scale = q.shape[-1] ** -0.5
  o, k, v = kv_cache.attend_and_append(
      q, cache["k"], cache["v"], k_t, v_t, slots, bias_BHS=bias_BHS,
      logits=lambda keys, dist: kv_cache.dot_logits(q, keys, scale))
  return o, {**cache, "k": k, "v": v}


# Forgetting gates (ALiBi, FoX) -------------------------------------------------------------

def _gate_fill(params, cache, prep, *, layer, slots, **unused):
  del unused
  valid = kv_cache.prompt_mask(slots, layer["x"].shape[1])
  gate = kv_cache.sum_after(prep.inputs["log_forget"], valid, axis=1)  # sum over (j, end)
  return {**fill_kv(params, cache, prep), "gate": kv_cache.write_prompt(cache["gate"], gate)}


def add_gate(cache, log_forget_B1H, slots):
  """Every cached key's running log-gate sum grows by the new token's gate; the new key's is 0."""
  gate = cache["gate"] + jnp.moveaxis(log_forget_B1H, 1, 2).astype(jnp.float32)
  return kv_cache.write_token(gate, jnp.zeros_like(log_forget_B1H, jnp.float32), slots)


def _gate_step(params, cache, *, prepare, layer, slots, **unused):
  del unused
  prep = prepare_token(prepare, params, layer, kv_cache.positions(slots))
  gate = add_gate(cache, prep.inputs["log_forget"], slots)
  o, cache = _biased_step(prep.q, prep.k, prep.v, cache, gate, slots)
  return o, {**cache, "gate": gate}


register_decoder(family="forgetting", init_cache=_with(_heads, "gate"), fill=_gate_fill,
                 step=_gate_step)


# GRAPE-A ---------------------------------------------------------------------------------

def _grape_a_init(dims, *, batch_size, max_len, dtype, name, hparams):
  del hparams
  if name == "grape_a_q":  # no key gate: keys and values only
    return init_kv(dims, batch_size=batch_size, max_len=max_len, dtype=dtype)
  return _with(_heads, "lam_k")(dims, batch_size=batch_size, max_len=max_len, dtype=dtype,
                                name=name, hparams=None)


def _gates(params, q, k):
  return grape_a.grape_a_gates(q, k, params.get("v"), params.get("u"))


def _grape_a_fill(params, cache, prep, *, layer, slots, **unused):
  del prep, unused  # the lifted q/k of the full forward are not cached: raw k, v and gates are
  cache = {**cache, "k": kv_cache.write_prompt(cache["k"], layer["k"]),
           "v": kv_cache.write_prompt(cache["v"], layer["v"])}
  _, lam_k = _gates(params, layer["q"], layer["k"])
  if lam_k is not None:
    cache["lam_k"] = kv_cache.write_prompt(cache["lam_k"], lam_k)
  return cache


def _grape_a_step(params, cache, *, prepare, layer, slots, **unused):
  del prepare, unused
  q, k = layer["q"], layer["k"]
  lam_q, lam_k = _gates(params, q, k)                                  # [B, 1, H] or None
  rate = 0.0
  if lam_k is not None:  # slot `end` still holds an old gate: its distance 0 cancels it
    rate = cache["lam_k"]                                              # [B, H, S]
  if lam_q is not None:
    rate = rate + jnp.moveaxis(lam_q, 1, 2)                            # [B, H, 1]
  dist = kv_cache.distances(slots, cache["k"].shape[2]).astype(jnp.float32)[:, None]
  bias = -dist * jnp.exp(params["log_omega"])[:, None] * rate          # [B, H, S]
  o, cache = _biased_step(q, k, layer["v"], cache, bias, slots)
  if lam_k is not None:
    cache["lam_k"] = kv_cache.write_token(cache["lam_k"], lam_k, slots)
  return o, cache


for _name in ("grape_a_q", "grape_a_k", "grape_a_qk"):
  register_decoder(_name, init_cache=_grape_a_init, fill=_grape_a_fill, step=_grape_a_step)


# GRAPE-AP --------------------------------------------------------------------------------

def _probe_shape(dims, name, hparams):
  return (dims.num_heads, resolve_hparams(name, hparams, additive.HPARAMS[name])["d_p"])


def _ap_fill(params, cache, prep, *, layer, slots, **unused):
  del unused
  B, P = layer["x"].shape[:2]
  r = path_integral.rotate_probes(prep.inputs["p"],
                                  path_integral.segment_positions(layer["segment_ids"], B, P))
  return {**fill_kv(params, cache, prep), "r": kv_cache.write_prompt(cache["r"], r)}


def _ap_step(params, cache, *, prepare, layer, slots, **unused):
  del unused
  pos = kv_cache.positions(slots)
  prep = prepare_token(prepare, params, layer, pos)
  r_t = path_integral.rotate_probes(prep.inputs["p"], pos[:, None])   # [B, 1, H, d_p]
  p_i = prep.inputs.get("p_query", prep.inputs["p"])

  def psi(r_BSHP):  # psi(i, l) [B, H, S] for the new query i
    return path_integral.edge_potentials(p_i, r_BSHP, prep.inputs["alpha"])[:, :, 0]

  S = cache["r"].shape[2]
  is_new = (jnp.arange(S)[None] == slots.end[:, None])[:, None]
  # psi(i, l) for every cached l, the new position's own from r_t (read before the write).
  psi_BHS = jnp.where(is_new, psi(r_t), psi(jnp.swapaxes(cache["r"], 1, 2)))
  bias = kv_cache.sum_after(psi_BHS, kv_cache.visible(slots, S), axis=2)
  o, cache = _biased_step(prep.q, prep.k, prep.v, cache, bias, slots)
  return o, {**cache, "r": kv_cache.write_token(cache["r"], r_t, slots)}


register_decoder(family="path_integral", init_cache=_with(_probe_shape, "r"), fill=_ap_fill,
                 step=_ap_step)


# KV-shift (modifier) -----------------------------------------------------------------------

def kv_shift_prefill_state(k_BPKD, v_BPKD, slots) -> dict:
  """What kv_shift needs after a prompt: its last token's k and v before the shift [B, K, D]."""
  return {"k": kv_cache.last_prompt_token(k_BPKD, slots),
          "v": kv_cache.last_prompt_token(v_BPKD, slots)}


def kv_shift_step(params, state, *, x, k, v):
  """k'_t = a_t k_{t-1} + (1 - a_t) k_t (and v) for one token per row, and the next state.

  x [B, 1, C], k, v [B, 1, K, D]; state from kv_shift_prefill_state (rows are never empty, so
  the previous token always exists). Runs kv_shift_apply on the pair (t-1, t), so the gate is
  the modifier's own; the pair's first output is discarded.
  """
  pair = lambda prev, y: jnp.concatenate([prev[:, None].astype(y.dtype), y], axis=1)  # noqa: E731
  k2, v2 = kv_shift_apply(params, x=jnp.concatenate([x, x], axis=1), k=pair(state["k"], k),
                          v=pair(state["v"], v))
  return k2[:, 1:], v2[:, 1:], {"k": k[:, 0], "v": v[:, 0]}
