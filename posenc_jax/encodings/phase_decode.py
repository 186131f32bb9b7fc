"""Decoding with a cache for TAPA: keys, values and positions.

The state each encoding carries: docs/encodings/decoding.md#decoding-with-a-cache.

TAPA's logit depends on the distance i - j only through |i - j|^alpha inside the cosine, and
on the raw q, k otherwise: the cache holds the untransformed keys and values, and the
distances come from the slots (kv_cache.distances). Each step computes the new query's
amplitude and phase products against every cached key, O(S H D), the same order as a plain
attention read.

Cache: {"k": [B, K, S, D], "v": [B, K, S, Dv]}.
"""
from __future__ import annotations

import jax.numpy as jnp

from posenc_jax import kv_cache
from posenc_jax import tapa
from posenc_jax.encodings import prepare_token
from posenc_jax.encodings import register_decoder
from posenc_jax.encodings.rotary_decode import fill_kv
from posenc_jax.encodings.rotary_decode import init_kv


def _step(params, cache, *, prepare, layer, slots, **unused):
  del unused
  prep = prepare_token(prepare, params, layer, kv_cache.positions(slots))

  def logits(keys_BKSD, dist_BS):
    return tapa.tapa_logits(prep.q, jnp.swapaxes(keys_BKSD, 1, 2), dist_BS[:, None],
                            **prep.inputs)[:, :, 0]

  o, k, v = kv_cache.attend_and_append(prep.q, cache["k"], cache["v"], prep.k, prep.v, slots,
                                       logits=logits)
  return o, {**cache, "k": k, "v": v}


register_decoder(family="tapa", init_cache=init_kv, fill=fill_kv, step=_step)
