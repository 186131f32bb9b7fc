"""Merging partial attentions over disjoint key sets by their log-sum-exps (online softmax).

A partial result is (o, lse): o [B, T, H, Dv] normalised over its keys, lse [B, T, H] the
natural log of its softmax denominator. A query that saw no key has lse = NEG_INF and any o:
it drops out of the merge.
"""
from __future__ import annotations

import jax.numpy as jnp

from posenc_jax.masking import NEG_INF


def merge(o1, lse1, o2, lse2):
  """(o1, lse1) + (o2, lse2) -> (o, lse) over the union of the two key sets, float32."""
  lse1 = lse1.astype(jnp.float32)
  lse2 = lse2.astype(jnp.float32)
  m = jnp.maximum(lse1, lse2)
  # Subtracting the max keeps exp() <= 1; both NEG_INF gives weights 1 and 1 on zeros.
  w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)
  total = w1 + w2
  o = (w1[..., None] * o1.astype(jnp.float32) + w2[..., None] * o2.astype(jnp.float32))
  o = o / total[..., None]
  lse = jnp.where(m <= NEG_INF / 2, NEG_INF, m + jnp.log(total))
  return o, lse
