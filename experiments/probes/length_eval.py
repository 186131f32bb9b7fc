"""Length-extrapolation evaluation on equal token budgets (experiment 4).

train.run evaluates every length on the same number of rows, so a short length would see
only the first few hundred bytes of the held-out files and a long one many more: the
lengths would differ in text, not only in context. Here every length n sees the same
`tokens` held-out tokens (the first ones of the sorted validation files, packed into rows
of n), in batches of `batch_tokens` tokens, so perplexity differences come from the
context length alone.
"""
from __future__ import annotations

import json
import os

import jax

from experiments import data
from experiments import evaluate
from experiments.probes import load


def evaluate_lengths(config, workdir: str, *, lengths, tokens: int,
                     batch_tokens: int) -> list[dict]:
  """Eval records (as train.run's summary["eval"]) of workdir's checkpoint; cached on disk."""
  cache = os.path.join(workdir, "length_eval.json")
  key = {"lengths": [int(n) for n in lengths], "tokens": tokens, "batch_tokens": batch_tokens}
  if os.path.exists(cache):
    with open(cache) as f:
      stored = json.load(f)
    if stored["key"] == key:
      return stored["eval"]
  trainer, params = load.restore(config, workdir)
  records = []
  with jax.set_mesh(trainer.mesh):
    for n in lengths:
      rows = max(1, batch_tokens // n)
      sets = data.make_eval_sets(config.data, seq_len=int(n), batch_size=rows,
                                 num_batches=max(1, tokens // (rows * n)), seed=config.eval.seed)
      records += evaluate.evaluate_all(trainer.eval_step, params, {int(n): sets}, trainer.put)
  with open(cache, "w") as f:
    json.dump({"key": key, "eval": records}, f, indent=1)
  return records
