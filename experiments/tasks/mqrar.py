"""Multi-query repeated associative recall with N-back (MQRAR-N; PaTH §4.1, Fig. 2 top).

PaTH adapts MQRAR (Tan et al., stick-breaking attention) so that a query asks for the
N-th last value assigned to a key: N = 1 is ordinary repeated recall (the current
value), N > 1 must skip the N - 1 more recent assignments of that key. The paper's
worked example did not survive extraction, so the exact layout below is our own; it
keeps everything the text fixes (N-back semantics, 32 keys, length 768, multi-query,
repeated assignment).

Layout: a stream of items, each either
  * an assignment `k v` (2 tokens): key k now holds value v (keys are reassigned many
    times, with fresh uniform values), or
  * a query `? k a` (3 tokens): a is the value of the N-th last assignment of k
    (counting the most recent as the 1st). Queries do not change any key's history.
Each step draws a uniform key k; with probability `query_prob`, and if k already has
>= N assignments, the item queries k, otherwise it assigns k a uniform value. So
queries spread evenly over the keys, and early in a stream (before keys have N
values) assignments dominate. The default query_prob 0.3 leaves about 7 assignments
per key in a 768-token stream with 32 keys, so N up to 4 still gets ~70 queries per
stream (N = 1: ~90). `num_pairs` is the number of distinct keys (variables),
`num_values` the number of value symbols; PaTH's "32 key-value pairs" is read as 32
keys.

Vocabulary: 0 = `?`, 1..num_pairs = keys, num_pairs + 1 .. num_pairs + num_values =
values. loss_mask is 1 on the key token of each query (its next-token target is the
answer a) and 0 elsewhere; the metric is accuracy on those answers. Next-token layout:
tokens s[0:T], targets s[1:T+1] of one stream s.
"""
from __future__ import annotations

import numpy as np

QUERY = 0
TEST_SETS = ("test",)
MIN_SEQ_LEN = 2


def vocab_size(config) -> int:
  return 1 + config.num_pairs + config.num_values


def validate(config) -> None:
  for name in ("n_back", "num_pairs", "num_values"):
    if config[name] < 1:
      raise ValueError(f"data.{name}={config[name]} must be >= 1")
  if not 0.0 < config.query_prob < 1.0:
    raise ValueError(f"data.query_prob={config.query_prob} must lie in (0, 1)")


def generate(rng: np.random.Generator, *, seq_len: int, n_back: int, num_pairs: int,
             num_values: int, query_prob: float) -> dict[str, np.ndarray]:
  """One stream: tokens, targets (int32 [T]), loss_mask (float32 [T], 1 on queried keys)."""
  if seq_len < MIN_SEQ_LEN:
    raise ValueError(f"mqrar seq_len={seq_len} must be >= {MIN_SEQ_LEN}")
  # Draw every random number up front (each item takes >= 2 tokens): the loop then
  # runs on python ints, ~10x faster than a Generator call per step.
  n_items = seq_len // 2 + 1
  keys = rng.integers(num_pairs, size=n_items).tolist()
  values = rng.integers(num_values, size=n_items).tolist()
  is_query = (rng.random(n_items) < query_prob).tolist()
  history: list[list[int]] = [[] for _ in range(num_pairs)]
  s: list[int] = []
  answer_at: list[int] = []
  for k, v, q in zip(keys, values, is_query):
    if len(s) >= seq_len + 1:
      break
    if q and len(history[k]) >= n_back:
      answer_at.append(len(s) + 1)
      s += [QUERY, 1 + k, 1 + num_pairs + history[k][-n_back]]
    else:
      history[k].append(v)
      s += [1 + k, 1 + num_pairs + v]
  s_arr = np.asarray(s[:seq_len + 1], np.int32)
  loss_mask = np.zeros(seq_len, np.float32)
  answer_at = [p for p in answer_at if p < seq_len]
  loss_mask[answer_at] = 1.0
  return {"tokens": s_arr[:seq_len], "targets": s_arr[1:], "loss_mask": loss_mask}


def make_example(config, rng: np.random.Generator, *, seq_len: int,
                 split: str) -> dict[str, np.ndarray]:
  if split not in ("train",) + TEST_SETS:
    raise ValueError(f"mqrar split={split!r} is not one of {('train',) + TEST_SETS}")
  return generate(rng, seq_len=seq_len, n_back=config.n_back, num_pairs=config.num_pairs,
                  num_values=config.num_values, query_prob=config.query_prob)
