"""Decoding with a cache for PaTH and PaTH-FoX (PaTH paper §3.4).

The state each encoding carries: docs/encodings/decoding.md#decoding-with-a-cache.

The cache holds every key already transported to the newest position,
k~_j = H_t H_{t-1} ... H_{j+1} k_j, so the new query's logits are plain dot products
q_t . k~_j (plus the running log-gate sums of PaTH-FoX, as FoX decodes). When token t arrives
every cached key is updated in place, k~_j <- (I - beta_t w_t w_t^T) k~_j, before k_t joins
unchanged: O(S K D) per step, the order of attention's own read of the cache, and a cache the
size of a plain key-value cache. Keys are kept in float32 whatever the model's dtype: they
are rewritten at every step, and bf16 would round them thousands of times.

w_t reads the last conv_width tokens (a causal short convolution), so the cache also keeps
the previous conv_width - 1 layer inputs, "x_tail" [B, W-1, C]; each step runs the
encoding's own prepare on that window and takes its last w, beta (and log f).

The prefill transports the prompt's keys to its last token blockwise
(householder.prefill_keys: per chunk the UT transform, then a right-to-left scan carrying the
product of later chunks), never token by token; padding gets beta = 0 (the identity).

Cache: {"k": [B, K, S, D] float32, "v": [B, K, S, Dv], "x_tail": [B, W-1, C],
"gate": [B, H, S] float32 (path_fox)}.
"""
from __future__ import annotations

import jax.numpy as jnp

from posenc_jax import householder
from posenc_jax import kv_cache
from posenc_jax.encodings import prepare_token
from posenc_jax.encodings import register_decoder
from posenc_jax.encodings import resolve_hparams
from posenc_jax.encodings import transport
from posenc_jax.encodings.additive_decode import add_gate


def transport_and_logits(q_B1HD, k_BKSD, w_BKD, beta_BK, scale):
  """(H_t k_j for every cached key, scale q . H_t k_j) with H_t = I - beta w w^T.

  householder.transport_keys in the cache's head-major layout, with the logits taken from
  the old keys, q.(k - beta (k.w) w) = q.k - beta (q.w)(k.w): one batched matmul of
  [q; w] against the cache gives q.k and k.w together, so the cache is read twice per step
  (this matmul and the update) and written once, O(S K D).
  """
  B, _, H, D = q_B1HD.shape
  K = k_BKSD.shape[1]
  rows = jnp.concatenate([q_B1HD[:, 0].reshape(B, K, H // K, D).astype(jnp.float32),
                          w_BKD[:, :, None].astype(jnp.float32)], axis=2)   # [B, K, G+1, D]
  s = jnp.einsum("bkrd,bksd->bkrs", rows, k_BKSD, preferred_element_type=jnp.float32)
  qk, kw = s[:, :, :-1], s[:, :, -1:]                                 # [B,K,G,S], [B,K,1,S]
  qw = jnp.einsum("bkgd,bkd->bkg", rows[:, :, :-1], w_BKD)[..., None]   # [B, K, G, 1]
  b = beta_BK[:, :, None, None]
  logits = scale * (qk - b * qw * kw)
  keys = k_BKSD - (b * kw)[:, :, 0, :, None] * w_BKD[:, :, None]
  return keys, logits.reshape(B, H, -1)


def _init_cache(dims, *, batch_size, max_len, dtype, name, hparams):
  W = resolve_hparams(name, hparams, transport.HPARAMS[name])["conv_width"]
  B, S, K, D = batch_size, max_len, dims.num_kv_heads, dims.head_dim
  cache = {"k": jnp.zeros((B, K, S, D), jnp.float32), "v": jnp.zeros((B, K, S, D), dtype),
           "x_tail": jnp.zeros((B, W - 1, dims.d_model), dtype)}
  if name == "path_fox":
    cache["gate"] = jnp.zeros((B, dims.num_heads, S), jnp.float32)
  return cache


def _fill(params, cache, prep, *, layer, slots, **unused):
  del params, unused
  x = layer["x"]
  valid = kv_cache.prompt_mask(slots, x.shape[1])
  i = prep.inputs
  beta = jnp.where(valid[..., None], i["beta"], 0.0)        # padding transports nothing
  keys = householder.prefill_keys(prep.k, i["w"], beta)     # blockwise, to the last token
  cache = {**cache, "k": kv_cache.write_prompt(cache["k"], keys),
           "v": kv_cache.write_prompt(cache["v"], prep.v)}
  W1 = cache["x_tail"].shape[1]
  # The prompt's last W-1 inputs (slots before a row's start are never read: see _step).
  idx = jnp.clip(slots.end[:, None] - W1 + jnp.arange(W1)[None], 0, x.shape[1] - 1)
  cache["x_tail"] = jnp.take_along_axis(x, idx[..., None], axis=1).astype(cache["x_tail"].dtype)
  if "gate" in cache:
    cache["gate"] = kv_cache.write_prompt(cache["gate"],
                                          kv_cache.sum_after(i["log_forget"], valid, axis=1))
  return cache


def _step(params, cache, *, prepare, layer, slots, **unused):
  del unused
  x, q, k, v = layer["x"], layer["q"], layer["k"], layer["v"]
  B, W1 = x.shape[0], cache["x_tail"].shape[1]
  pos = kv_cache.positions(slots)
  window = jnp.concatenate([cache["x_tail"], x.astype(cache["x_tail"].dtype)], axis=1)
  # Tokens before the row's first form their own segment: the convolution restarts.
  seg = (pos[:, None] - W1 + jnp.arange(W1 + 1)[None] >= 0).astype(jnp.int32)
  wide = lambda a: jnp.broadcast_to(a, (B, W1 + 1) + a.shape[2:])  # noqa: E731  (unused rows)
  prep = prepare_token(prepare, params, {**layer, "x": window, "q": wide(q), "k": wide(k),
                                         "v": wide(v), "tokens": wide(layer["tokens"])},
                       pos, segment_ids=seg)
  w_t, beta_t = prep.inputs["w"][:, -1], prep.inputs["beta"][:, -1]
  scale = q.shape[-1] ** -0.5
  keys, s = transport_and_logits(q, cache["k"], w_t, beta_t, scale)  # H_t on every cached key
  s_new = kv_cache.dot_logits(q, jnp.moveaxis(k, 1, 2), scale)         # l_tt = scale q_t.k_t
  new = {**cache, "x_tail": window[:, 1:]}
  if "gate" in cache:
    new["gate"] = add_gate(cache, prep.inputs["log_forget"][:, -1:], slots)
    s = s + new["gate"]   # the new token's own gate sum is 0
  o = kv_cache.attend_new(s, s_new, cache["v"], v, slots)
  new["k"] = kv_cache.write_token(keys, k, slots)
  new["v"] = kv_cache.write_token(cache["v"], v, slots)
  return o, new


register_decoder(family="path", init_cache=_init_cache, fill=_fill, step=_step)
