"""Next-token sampling from logits: greedy, temperature, top-k and top-p (nucleus), keyed.

temperature = 0 is greedy: argmax, deterministic, the key unused. Otherwise the logits are
divided by the temperature, restricted to the top_k most likely tokens (top_k = 0: all of
them) and then to the nucleus, the smallest set of the most likely remaining tokens whose
probability reaches top_p (top_p = 1: all; the most likely token is always kept), and one
token is drawn. Tokens tied with the last one kept are kept too.

The three parameters may be traced scalars, so one compiled decoding loop serves every
setting; `check` validates concrete values once, outside jit.

Shape letters: B batch, V vocabulary.
"""
from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp


def check(*, temperature, top_k, top_p) -> None:
  """Raises one ValueError naming the first parameter out of range."""
  if not (isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
          and math.isfinite(temperature) and temperature >= 0):
    raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 "
                     f"(0 = greedy)")
  if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
    raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0 = no top-k filter)")
  if not (isinstance(top_p, numbers.Real) and not isinstance(top_p, bool) and 0.0 < top_p <= 1.0):
    raise ValueError(f"top_p={top_p!r} must lie in (0, 1] (1 = no nucleus filter)")


def filter_logits(logits_BV, *, temperature, top_k, top_p):
  """logits / temperature with every token outside top-k and the nucleus set to -inf.

  temperature must be > 0 here (sample() handles 0); float32 [B, V].
  """
  V = logits_BV.shape[-1]
  scaled = logits_BV.astype(jnp.float32) / temperature
  desc = -jnp.sort(-scaled, axis=-1)                                   # [B, V], largest first
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  rank = jnp.arange(V)[None]
  desc = jnp.where(rank < k, desc, -jnp.inf)
  probs = jax.nn.softmax(desc, axis=-1)
  # A token is in the nucleus iff the tokens ranked above it hold less than top_p.
  in_nucleus = (jnp.cumsum(probs, axis=-1) - probs < top_p) & (rank < k)
  cutoff = jnp.min(jnp.where(in_nucleus, desc, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def sample(logits_BV, key, *, temperature, top_k=0, top_p=1.0):
  """One token per row, int32 [B]: greedy when temperature == 0, else a filtered draw."""
  greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  t = jnp.asarray(temperature, jnp.float32)
  safe_t = jnp.where(t > 0, t, 1.0)            # the greedy branch must stay finite too
  drawn = jax.random.categorical(
      key, filter_logits(logits_BV, temperature=safe_t, top_k=top_k, top_p=top_p), axis=-1)
  return jnp.where(t > 0, drawn.astype(jnp.int32), greedy)
