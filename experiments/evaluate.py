"""Losses and metrics: the training loss, and evaluation at several sequence lengths.

Every metric counts only positions where `loss_mask` is nonzero: for synthetic tasks these
are the answer tokens (flip-flop reads, word-problem states, MQRAR recalls), so accuracy
and error are the task's. Length extrapolation = the same eval sets built at each length of
config.eval.lengths, with the model trained at config.data.seq_len.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax


def token_sums(logits_BTV, batch) -> dict:
  """Masked sums over the batch: cross-entropy, correct predictions, counted tokens."""
  mask = batch["loss_mask"].astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32),
                                                       batch["targets"])
  correct = (jnp.argmax(logits_BTV, axis=-1) == batch["targets"]).astype(jnp.float32)
  return {"ce": jnp.sum(ce * mask), "correct": jnp.sum(correct * mask), "count": jnp.sum(mask)}


def loss_and_metrics(logits_BTV, batch) -> tuple[jax.Array, dict]:
  """Mean masked cross-entropy (the training loss) and token accuracy."""
  s = token_sums(logits_BTV, batch)
  count = jnp.maximum(s["count"], 1.0)
  return s["ce"] / count, {"accuracy": s["correct"] / count}


def summarise(sums: dict) -> dict:
  """Turns accumulated sums into loss, perplexity, accuracy and error (plain floats)."""
  count = max(float(sums["count"]), 1.0)
  loss = float(sums["ce"]) / count
  accuracy = float(sums["correct"]) / count
  return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "accuracy": accuracy,
          "error": 1.0 - accuracy, "tokens": int(sums["count"])}


def evaluate(eval_step: Callable, params, batches: Iterable[dict], put: Callable) -> dict:
  """Runs `eval_step(params, batch) -> sums` over `batches` and summarises.

  put: moves a host batch onto the mesh (sharded like training batches).
  """
  total = None
  for batch in batches:
    sums = eval_step(params, put(batch))
    total = sums if total is None else jax.tree.map(jnp.add, total, sums)
  if total is None:
    raise ValueError("an eval set has no batches; check config.eval.num_batches")
  return summarise(jax.device_get(total))


def evaluate_all(eval_step: Callable, params, eval_sets: dict, put: Callable) -> list[dict]:
  """One record per (set, length): eval_sets maps length -> {set_name: [batch, ...]}."""
  records = []
  for length, sets in sorted(eval_sets.items()):
    for name, batches in sets.items():
      records.append({"set": name, "length": int(length),
                      **evaluate(eval_step, params, batches, put)})
  return records


def first_nonfinite(values: np.ndarray) -> int | None:
  """Index of the first NaN/inf in `values`, or None."""
  bad = np.flatnonzero(~np.isfinite(values))
  return int(bad[0]) if bad.size else None
