"""Decoding with a cache for stick-breaking attention (docs/encodings/stick_breaking.md#decoding).

The cache is the untransformed keys and values ({"k": [B, K, S, D], "v": [B, K, S, Dv]}).
Each step breaks the new query's stick over the visible slots, nearest first: the logits
against every cached key, a suffix sum over the slots of log_sigmoid(-z) (kv_cache.sum_after,
relative to each key, so its float32 error scales with the sum and not with the position) and
one weighted read of the values: O(S H D) per token, the order of a softmax step. Nothing
else is carried: the weights of a new query do not reuse an earlier query's.

Shape letters: B batch, S cache slots, H query heads, K kv heads, D head dim, Dv value dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from posenc_jax import kv_cache
from posenc_jax.encodings import prepare_token
from posenc_jax.encodings import register_decoder
from posenc_jax.encodings.rotary_decode import fill_kv
from posenc_jax.encodings.rotary_decode import init_kv


def step_weights(z_BHS, visible_BS):
  """(A [B, H, S], log of the leftover stick [B, H]) of one query over slots in time order."""
  mask = visible_BS[:, None]
  log_beta = jnp.where(mask, jax.nn.log_sigmoid(-z_BHS), 0.0)
  nearer = kv_cache.sum_after(log_beta, visible_BS, axis=2)
  a = jnp.where(mask, jnp.exp(jax.nn.log_sigmoid(z_BHS) + nearer), 0.0)
  return a, jnp.sum(log_beta, axis=-1)


def _step(params, cache, *, prepare, layer, slots, **unused):
  del unused
  prep = prepare_token(prepare, params, layer, kv_cache.positions(slots))
  q, k_t, v_t = prep.q, prep.k, prep.v
  B, _, H, D = q.shape
  K, S, Dv = cache["v"].shape[1], cache["v"].shape[2], cache["v"].shape[3]
  scale = D**-0.5
  # Slot `end` still holds older contents: the new token's own logit and value replace it.
  is_new = jnp.arange(S)[None] == slots.end[:, None]                          # [B, S]
  z = jnp.where(is_new[:, None], kv_cache.dot_logits(q, jnp.moveaxis(k_t, 1, 2), scale),
                kv_cache.dot_logits(q, cache["k"], scale))
  vis = kv_cache.visible(slots, S)
  if not prep.inputs["attend_current"]:
    vis = vis & ~is_new
  a, stick = step_weights(z, vis)
  a_new = jnp.sum(jnp.where(is_new[:, None], a, 0.0), axis=-1)                # [B, H]
  if prep.inputs["remainder"] == "current":
    a_new = a_new + jnp.exp(stick)
  a_cache = jnp.where(is_new[:, None], 0.0, a).reshape(B, K, H // K, S)
  o = jnp.einsum("bkgs,bksd->bkgd", a_cache, cache["v"], preferred_element_type=jnp.float32)
  o = o + a_new.reshape(B, K, H // K, 1) * v_t[:, 0, :, None].astype(jnp.float32)
  cache = {**cache, "k": kv_cache.write_token(cache["k"], k_t, slots),
           "v": kv_cache.write_token(cache["v"], v_t, slots)}
  return o.reshape(B, 1, H, Dv), cache


register_decoder(family="stick_breaking", init_cache=init_kv, fill=fill_kv, step=_step)
