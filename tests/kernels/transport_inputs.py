"""Inputs for the kernel tests: unit w and beta, random or in the layouts that once broke the
pre-pass in bf16 (transport_vectors), and segment ids in the layouts the document skipping
must handle (segment_ids)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def transport_vectors(key, B, T, K, D, *, mode):
  """Unit w [B, T, K, D] and beta [B, T, K].

  mode "random": independent w, beta uniform in (0, 2). The others are the inputs that made the
  old in-kernel inverse (a Neumann product of powers of A) overflow in bf16 training: w sharing
  a direction, as the PaTH layer's low-rank projection + short convolution make them, w_t =
  normalize(a + eps n_t) for one a per row and head ("shared:EPS"), or neighbours alternating
  in sign ("antiparallel"); beta there is 2 (reflections), the hardest case."""
  ka, kn, kb = jax.random.split(key, 3)
  n = jax.random.normal(kn, (B, T, K, D), jnp.float32)
  beta = 2 * jax.random.uniform(kb, (B, T, K), jnp.float32)
  if mode == "random":
    w = n
  else:
    a = jax.random.normal(ka, (B, 1, K, D), jnp.float32)
    if mode == "antiparallel":
      sign = jnp.where(jnp.arange(T) % 2 == 0, 1.0, -1.0)[None, :, None, None]
      w = sign * (a + 1e-3 * n)
    else:
      w = a + float(mode.split(":")[1]) * n
    beta = jnp.full((B, T, K), 2.0, jnp.float32)
  return w / jnp.linalg.norm(w, axis=-1, keepdims=True), beta


def segment_ids(key, B, T, mode):
  """[B, T] int32 ids. "few": 2-4 packed documents per row; "short": packed documents of ~8
  tokens (most chunk pairs of a causal walk lie before the query's document: the kernels skip
  them); "interleaved": ids 0-2 at random, a document's tokens not contiguous (the skipping
  must stay exact for any layout); "alternating:N": two documents in alternating runs of N
  tokens (a document's chunks come back after the other's)."""
  if mode == "interleaved":
    return jax.random.randint(key, (B, T), 0, 3).astype(jnp.int32)
  if mode.startswith("alternating:"):
    run = int(mode.partition(":")[2])
    return jnp.broadcast_to((jnp.arange(T) // run) % 2, (B, T)).astype(jnp.int32)
  rate = {"few": 3.0 / T, "short": 1.0 / 8}[mode]
  return jnp.cumsum(jax.random.uniform(key, (B, T)) < rate, axis=1).astype(jnp.int32)
