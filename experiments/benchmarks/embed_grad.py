"""The token embedding's table gradient: the gather's scatter-add against one-hot matmuls.

  python -m experiments.benchmarks.embed_grad

Decides posenc_jax.model.ONE_HOT_EMBED_MAX_VOCAB; docs/benchmarks/embed_grad.md has the
table. Both columns run embed_tokens (a gather forward); "one-hot" is its one_hot=True gradient.
Each row: a vocabulary V, width C and the number of distinct token ids that occur (`used`: a
byte-level corpus uses ~100 of a 32,000-row table, so its gather gradient collides as much as a
small vocabulary's), 32,768 tokens, bf16, ids drawn Zipf-like as text's are. Median ms of the
jitted table gradient over 20 runs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.common import median_ms
from posenc_jax.model import embed_tokens

CASES = [(5, 64, 5), (64, 256, 64), (256, 768, 100), (4096, 768, 100), (4096, 768, 4096),
         (32000, 768, 100), (32000, 768, 32000)]


def main():
  rng = np.random.default_rng(0)
  print(f"{jax.devices()[0].device_kind}")
  print("| V | C | ids used | gather ms | one-hot ms |\n|---|---|---|---|---|")
  for V, C, used in CASES:
    p = 1.0 / np.arange(1, used + 1)
    ids = rng.choice(used, size=(16, 2048), p=p / p.sum()).astype(np.int32)
    table = jnp.asarray(rng.standard_normal((V, C)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((16, 2048, C)), jnp.bfloat16)
    row = []
    for one_hot in (False, True):
      f = jax.jit(jax.grad(lambda t, i, oh=one_hot: jnp.sum(
          (embed_tokens(t, i, dtype=jnp.bfloat16, one_hot=oh) * ct).astype(jnp.float32))))
      row.append(median_ms(f, table, jnp.asarray(ids), n=20))
    print(f"| {V} | {C} | {used} | {row[0]:.3f} | {row[1]:.3f} |")


if __name__ == "__main__":
  main()
