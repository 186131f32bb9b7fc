"""Decoding with a cache for the rotation encodings
(docs/encodings/decoding.md#decoding-with-a-cache).

Position-driven maps need no state but the position: nope, rope and its scaled variants
(rope_pi, rope_ntk, rope_yarn, rope_llama3, ...), grape_m, grape_m_rank2,
grape_m_noncommuting and rope_v turn token t into G_t q_t, G_t k_t (G_t^T v_t) from
positions[t] alone. Their decoder, the default of the softmax family, runs the encoding's own
`prepare` on the new token at its position and caches the transformed key and value, so a new
position-driven variant decodes with nothing registered. (rope_ntk variant="dynamic" reads the
length from the positions it is given, so while decoding it takes the current length, as
transformers does, and the cached keys keep their earlier rotation: that equals the full
forward only up to train_len.)

Accumulated maps keep a running phase per row, O(H D) work per step beyond attention:
  grape_m_ctx      Phi [B] = sum_{s<t} w_s (exclusive): token t turns by Phi theta, then
                   Phi += w_t.
  acc_rot_*(_v)    phi [B, P] = sum_{s<=t} delta_s: phi += delta_t, then token t turns by phi.
                   acc_rot_random draws delta_t for position t from its eval_seed and layer
                   (rotations.positional_step_angles), as its full forward does at evaluation.

Cache: {"k": [B, K, S, D] transformed keys, "v": [B, K, S, Dv] values (pre-rotated by G_j^T
for value transport), "phase": the running phase (accumulated maps only)}. Attention of the
new query over it is plain softmax (kv_cache.attend_and_append); value transport post-rotates
the output.

Shape letters: B batch, S cache slots, P prompt length (or D/2 planes for phases), H query
heads, K kv heads, D head dim, C d_model.
"""
from __future__ import annotations

import jax.numpy as jnp

from posenc_jax import kv_cache
from posenc_jax import path_integral
from posenc_jax import rotations
from posenc_jax.encodings import Prepared
from posenc_jax.encodings import prepare_token
from posenc_jax.encodings import register_decoder
from posenc_jax.encodings import resolve_hparams
from posenc_jax.encodings import rotary


def init_kv(dims, *, batch_size: int, max_len: int, dtype, **unused) -> dict:
  """Zero key and value caches [B, K, S, D] in the model's dtype."""
  del unused
  shape = (batch_size, dims.num_kv_heads, max_len, dims.head_dim)
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def fill_kv(params, cache, prep: Prepared, **unused) -> dict:
  """The prompt's transformed keys and values in slots [0, P)."""
  del params, unused
  return {**cache, "k": kv_cache.write_prompt(cache["k"], prep.k),
          "v": kv_cache.write_prompt(cache["v"], prep.v)}


def softmax_step(prep: Prepared, cache, slots):
  """Appends the prepared token's k, v and attends its query over the cache.

  Returns (o [B, 1, H, Dv] float32, cache); the output is post-rotated by prep.out_angles.
  """
  scale = prep.q.shape[-1] ** -0.5
  o, k, v = kv_cache.attend_and_append(
      prep.q, cache["k"], cache["v"], prep.k, prep.v, slots,
      logits=lambda keys, dist: kv_cache.dot_logits(prep.q, keys, scale))
  if prep.out_angles is not None:
    o = rotations.rotate(o, prep.out_angles)
  return o, {**cache, "k": k, "v": v}


def _pointwise_step(params, cache, *, prepare, layer, slots, **unused):
  del unused
  return softmax_step(prepare_token(prepare, params, layer, kv_cache.positions(slots)), cache,
                      slots)


register_decoder(family="softmax", init_cache=init_kv, fill=fill_kv, step=_pointwise_step)


# ----------------------------------------------------------------------------------------
# Accumulated phases.


def _rotated(layer, angles_B1KP, *, values: bool) -> Prepared:
  """q, k (and v, with output transport) of one token turned by R(angles), as rotary does."""
  q, k, v = layer["q"], layer["k"], layer["v"]
  H, K = q.shape[2], angles_B1KP.shape[2]
  qa = angles_B1KP if K in (1, H) else jnp.repeat(angles_B1KP, H // K, axis=2)
  q2, k2 = rotations.rotate(q, qa), rotations.rotate(k, angles_B1KP)
  if not values:
    return Prepared("softmax", q2, k2, v, {})
  return Prepared("softmax", q2, k2, rotations.rotate(v, -angles_B1KP), {}, out_angles=qa)


def _resolve(name, hp):
  return resolve_hparams(name, hp, rotary.HPARAMS[name])


def _phase_decoder(steps, *, inclusive: bool, values: bool, plane_phase: bool):
  """A decoder for phases accumulated from per-token steps.

  steps(params, layer, positions_BT, hp) -> [B, T] (one phase per token: grape_m_ctx) or
  [B, T, P] (one per plane: acc_rot), the same steps the encoding's prepare accumulates.
  """
  def init_cache(dims, *, batch_size, max_len, dtype, name, hparams):
    del name, hparams
    shape = (batch_size, dims.head_dim // 2) if plane_phase else (batch_size,)
    return {**init_kv(dims, batch_size=batch_size, max_len=max_len, dtype=dtype),
            "phase": jnp.zeros(shape, jnp.float32)}

  def fill(params, cache, prep, *, layer, slots, name, hparams: dict):
    P = layer["x"].shape[1]
    valid = kv_cache.prompt_mask(slots, P)
    pos = path_integral.segment_positions(layer["segment_ids"], valid.shape[0], P)
    s = steps(params, layer, pos, _resolve(name, hparams))
    # One document per row: the phase after the prompt is the sum of its steps.
    mask = valid.reshape(valid.shape + (1,) * (s.ndim - 2))
    phase = jnp.sum(jnp.where(mask, s, 0.0), axis=1)
    return {**fill_kv(params, cache, prep), "phase": phase}

  def step(params, cache, *, prepare, layer, slots, name, hparams: dict):
    del prepare
    s = steps(params, layer, kv_cache.positions(slots)[:, None], _resolve(name, hparams))[:, 0]
    new_phase = cache["phase"] + s
    phase = new_phase if inclusive else cache["phase"]
    if plane_phase:
      angles = phase[:, None, None, :]                                       # [B, 1, 1, P]
    else:
      angles = phase[:, None, None, None] * jnp.exp(params["log_theta"])     # [B, 1, K, P]
    o, cache = softmax_step(_rotated(layer, angles, values=values), cache, slots)
    return o, {**cache, "phase": new_phase}

  return dict(init_cache=init_cache, fill=fill, step=step)


def _ctx_steps(params, layer, positions, hp):
  del positions
  gate, _ = rotary._ctx_variant(hp["variant"])   # the gate of the encoding's own prepare
  return gate(layer["x"].astype(jnp.float32) @ params["u"] + params["c"])


def _random_steps(params, layer, positions, hp):
  del params
  freqs = rotations.rope_frequencies(layer["q"].shape[-1], base=hp["base"])
  return rotations.positional_step_angles(rotary.eval_key(hp["eval_seed"], layer), positions,
                                          freqs, width=hp["width"])


def _learned_steps(params, layer, positions, hp):
  del positions, hp
  return jnp.take(params["angles"], layer["tokens"], axis=0)


register_decoder("grape_m_ctx", **_phase_decoder(_ctx_steps, inclusive=False, values=False,
                                                 plane_phase=False))
for _values, _suffix in ((False, ""), (True, "_v")):
  register_decoder(f"acc_rot_random{_suffix}", **_phase_decoder(
      _random_steps, inclusive=True, values=_values, plane_phase=True))
  register_decoder(f"acc_rot_learned{_suffix}", **_phase_decoder(
      _learned_steps, inclusive=True, values=_values, plane_phase=True))
