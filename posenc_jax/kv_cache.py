"""Fixed-size caches for decoding: slot bookkeeping and one new query against a cache.

A cache holds S = max_len slots per batch row. Row b's sequence occupies the slots
[start_b, end_b) in order, and decoding writes the next token at slot end_b. A right-padded
prompt batch starts every row at slot 0 (rows end at different slots); a left-padded one ends
every row at slot P (rows start at different slots). Slots outside [start, end) hold padding
or nothing and are masked out. The position of slot s inside its row is s - start_b. Every
step reads all S slots (fixed shapes: one compiled step for any length).

The per-encoding caches (posenc_jax/encodings/*_decode.py) store every per-slot array head
major, [B, N, S, ...] (N = K kv heads or H query heads): keys and values as [B, K, S, D], so
the new query's logits and output are batched matmuls over (B, K) with no transposed copy of
the cache per step (slot-major [B, S, K, D] makes XLA transpose the whole cache every step),
and per-key biases as [B, H, S], the layout of the logits.

Shape letters: B batch, S cache slots (max_len), P prompt length, H query heads, K kv heads,
N either, G = H // K, D head dim, Dv value dim.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from posenc_jax import path_integral
from posenc_jax.masking import NEG_INF


class Slots(NamedTuple):
  """Where each row's sequence lies in the cache: slots [start, end), int32 [B] each.

  During a decode step `end` is the slot the new token is written to (its position is
  end - start); the model advances it afterwards.
  """
  start: jax.Array
  end: jax.Array


def prompt_slots(lengths_B, prompt_len: int, *, padding: str) -> Slots:
  """Slots of a prompt batch padded to prompt_len tokens on the right or the left."""
  if padding not in ("right", "left"):
    raise ValueError(f"padding={padding!r} must be 'right' or 'left'")
  lengths = jnp.asarray(lengths_B, jnp.int32)
  start = jnp.zeros_like(lengths) if padding == "right" else prompt_len - lengths
  return Slots(start, start + lengths)


def prompt_mask(slots: Slots, prompt_len: int):
  """[B, P] bool: True on each row's prompt tokens (the prompt's slots are its time steps)."""
  t = jnp.arange(prompt_len)[None]
  return (t >= slots.start[:, None]) & (t < slots.end[:, None])


def visible(slots: Slots, num_slots: int):
  """[B, S] bool: the keys the token decoded at slot `end` attends to (itself included)."""
  s = jnp.arange(num_slots)[None]
  return (s >= slots.start[:, None]) & (s <= slots.end[:, None])


def positions(slots: Slots):
  """[B] int32: the in-row position of the token decoded at slot `end`."""
  return slots.end - slots.start


def distances(slots: Slots, num_slots: int):
  """[B, S] int32: i - j from the decoded token (slot end) to every slot (negative beyond)."""
  return slots.end[:, None] - jnp.arange(num_slots)[None]


def write_prompt(cache_BNS, x_BPN):
  """The prompt's per-token arrays [B, P, N, ...] written into slots [0, P) of [B, N, S, ...]."""
  x = jnp.moveaxis(x_BPN, 1, 2).astype(cache_BNS.dtype)
  return jax.lax.dynamic_update_slice(cache_BNS, x, (0,) * cache_BNS.ndim)


def write_token(cache_BNS, x_B1N, slots: Slots):
  """One token's array [B, 1, N, ...] written at each row's slot `end` (rows may differ)."""
  rows = jnp.arange(cache_BNS.shape[0])
  # One scatter with unique indices, in bounds by contract (the caller keeps end < S).
  return cache_BNS.at[rows, :, slots.end].set(x_B1N[:, 0].astype(cache_BNS.dtype),
                                              unique_indices=True, mode="promise_in_bounds")


def last_prompt_token(x_BP, slots: Slots):
  """x at each row's last prompt token (slot end - 1): [B, ...]."""
  idx = (slots.end - 1).reshape((-1,) + (1,) * (x_BP.ndim - 1))
  return jnp.take_along_axis(x_BP, idx, axis=1)[:, 0]


def attend_and_append(q_B1HD, k_BKSD, v_BKSD, k_B1KD, v_B1KD, slots: Slots, *, logits,
                      bias_BHS=None):
  """The new query attends over the cache and its own token; then the token is written at `end`.

  logits(keys [B, K, S', D], distances [B, S']) -> float32 [B, H, S'] gives the encoding's
  logits of q against keys at distances i - j (e.g. dot_logits for softmax encodings).
  bias_BHS (optional) is added to the logits of every slot (slot `end` included).

  The cache is only read here (its slot `end` still holds older contents, replaced by the new
  token's own logit and value), and written once at the end: with every read before the one
  in-place write, XLA can update a loop-carried cache in place (reading it after the write
  made XLA copy it several times per step; see generation.REGION_ANALYSIS too).
  Returns (o [B, 1, H, Dv] float32, keys, values with the token written).
  """
  B, S = k_BKSD.shape[0], k_BKSD.shape[2]
  s_new = logits(jnp.moveaxis(k_B1KD, 1, 2), jnp.zeros((B, 1), jnp.int32))   # [B, H, 1]
  s = logits(k_BKSD, distances(slots, S))
  if bias_BHS is not None:
    s, s_new = s + bias_BHS, s_new + select_slot(bias_BHS, slots)
  o = attend_new(s, s_new, v_BKSD, v_B1KD, slots)
  return o, write_token(k_BKSD, k_B1KD, slots), write_token(v_BKSD, v_B1KD, slots)


def select_slot(x_BNS, slots: Slots):
  """x at each row's slot `end`: [B, N, 1]."""
  return jnp.take_along_axis(x_BNS, slots.end[:, None, None], axis=2)


def attend_new(s_cache_BHS, s_new_BH1, v_BKSD, v_B1KD, slots: Slots):
  """softmax over the visible cached slots, whose slot `end` is replaced by the new token
  (logit s_new, value v_B1KD), then the weighted sum of values: [B, 1, H, Dv] float32."""
  B, H, S = s_cache_BHS.shape
  K, Dv = v_BKSD.shape[1], v_BKSD.shape[3]
  mask = visible(slots, S)[:, None]                                   # [B, 1, S]
  is_new = (jnp.arange(S)[None] == slots.end[:, None])[:, None]       # [B, 1, S]
  s = jnp.where(is_new, s_new_BH1, s_cache_BHS)
  a = jnp.where(mask, jax.nn.softmax(jnp.where(mask, s, NEG_INF), axis=-1), 0.0)
  a_new = jnp.sum(jnp.where(is_new, a, 0.0), axis=-1).reshape(B, K, H // K, 1)
  a_cache = jnp.where(is_new, 0.0, a).reshape(B, K, H // K, S)
  o = jnp.einsum("bkgs,bksd->bkgd", a_cache, v_BKSD, preferred_element_type=jnp.float32)
  o = o + a_new * v_B1KD[:, 0, :, None].astype(jnp.float32)
  return o.reshape(B, 1, H, Dv)


def dot_logits(q_B1HD, k_BKSD, scale):
  """scale * q . k_j against every cached key, float32 [B, H, S], without repeating kv heads."""
  B, _, H, D = q_B1HD.shape
  K, S = k_BKSD.shape[1], k_BKSD.shape[2]
  qg = q_B1HD[:, 0].reshape(B, K, H // K, D)
  s = jnp.einsum("bkgd,bksd->bkgs", qg, k_BKSD, preferred_element_type=jnp.float32)
  return scale * s.reshape(B, H, S)


def sum_after(x, mask_BS, *, axis: int):
  """out[.., j, ..] = sum of x[.., l, ..] over masked l > j along `axis` (the slot or time
  axis; batch is axis 0, mask_BS masks those two axes), float32.

  Path sums from key j to the newest token (FoX gates, GRAPE-AP potentials) are suffix sums
  over slots, so their float32 error scales with the sum itself, not with the position.
  """
  mask = jnp.expand_dims(mask_BS, [d for d in range(x.ndim) if d not in (0, axis)])
  x = jnp.where(mask, x.astype(jnp.float32), 0.0)
  return jnp.moveaxis(path_integral.sum_after(jnp.moveaxis(x, axis, -1)), -1, axis)
