"""Flip-flop language modelling (FFLM; Liu et al. 2023, PaTH §4.1 and Table 1).

A flip-flop string is a sequence of instruction/bit pairs over the vocabulary
{w, r, i, 0, 1}: `w b` writes bit b, `i b` is a distractor (b is noise), and `r b`
reads: b must equal the bit of the most recent write. Example: "w 1 r 1 w 0 i 1 i 0
i 1 r 0".

Choices this module makes, following Liu et al. where PaTH is silent:
  * Instructions are drawn i.i.d. with P(i) = `ignore_prob` and P(w) = P(r) =
    (1 - ignore_prob) / 2. The first instruction is always `w` (so every read has an
    answer; PaTH's Theorem A.1 proof relies on it) and the last instruction whose
    answer bit falls inside the window is always `r`.
  * Bits after `w` and `i` are uniform; bits after `r` are the last written bit.
  * Train: ignore_prob 0.8 (FFL(0.8)). Test sets: "id" (the training distribution,
    fresh samples), "sparse" (98% ignore), "dense" (10% ignore), each at the length
    the evaluator asks for.
  * Scoring: only the bit after each `r` is deterministic, so `loss_mask` is 1 exactly
    on positions holding an `r` token (whose next-token target is the read bit). The
    task's error rate is the fraction of those answer tokens predicted wrongly (argmax),
    the metric of PaTH Table 1. The loss is also restricted to these positions (the
    other bits are coin flips and the instructions are i.i.d., so they carry no signal).

Next-token layout: an example of length T holds tokens s[0:T] and targets s[1:T+1] of
one flip-flop string s of length T + 1 (pairs start at even positions).
"""
from __future__ import annotations

import numpy as np

from experiments.tasks import code_corpus

WRITE, READ, IGNORE, ZERO, ONE = range(5)
VOCAB = ("w", "r", "i", "0", "1")
BYTE_IDS = np.array([ord(c) for c in VOCAB], np.int32)   # data.byte_tokens
TEST_SETS = ("id", "sparse", "dense")
MIN_SEQ_LEN = 2


def vocab_size(config) -> int:
  """5, or with data.byte_tokens the byte-level text task's vocabulary: each symbol is then
  its character's byte (w = 119, ...), so a model trained on text is fine-tuned on flip-flop
  as it is (train.init_from), as a state-tracking probe of a language model."""
  return code_corpus.VOCAB_SIZE if config.get("byte_tokens", False) else len(VOCAB)


def validate(config) -> None:
  for name in ("ignore_prob", "sparse_ignore_prob", "dense_ignore_prob"):
    p = config[name]
    if not 0.0 <= p < 1.0:
      raise ValueError(f"data.{name}={p} must lie in [0, 1): reads and writes need probability > 0")


def split_ignore_prob(config, split: str) -> float:
  """The ignore probability of a split ("train" or one of TEST_SETS)."""
  table = {"train": config.ignore_prob, "id": config.ignore_prob,
           "sparse": config.sparse_ignore_prob, "dense": config.dense_ignore_prob}
  if split not in table:
    raise ValueError(f"flip-flop split={split!r} is not one of {tuple(table)}")
  return float(table[split])


def generate(rng: np.random.Generator, *, seq_len: int,
             ignore_prob: float) -> dict[str, np.ndarray]:
  """One example: tokens, targets (int32 [T]) and loss_mask (float32 [T])."""
  if seq_len < MIN_SEQ_LEN:
    raise ValueError(f"flip-flop seq_len={seq_len} must be >= {MIN_SEQ_LEN}")
  n_pairs = seq_len // 2 + 1  # 2 * n_pairs >= seq_len + 1 tokens
  p_rw = (1.0 - ignore_prob) / 2
  ops = rng.choice(np.array([WRITE, READ, IGNORE]), size=n_pairs, p=[p_rw, p_rw, ignore_prob])
  ops[0] = WRITE
  # The last pair whose instruction lies inside tokens[0:T] is a read, as in Liu et al.
  last = (seq_len - 1) // 2
  if last > 0:
    ops[last] = READ
  bits = rng.integers(0, 2, size=n_pairs)
  # The bit a read returns: the bit of the latest write at or before it.
  write_idx = np.where(ops == WRITE, np.arange(n_pairs), 0)
  latest_write = np.maximum.accumulate(write_idx)
  bits = np.where(ops == READ, bits[latest_write], bits)
  s = np.empty(2 * n_pairs, np.int32)
  s[0::2] = ops
  s[1::2] = ZERO + bits
  tokens, targets = s[:seq_len], s[1:seq_len + 1]
  return {"tokens": tokens, "targets": targets, "loss_mask": (tokens == READ).astype(np.float32)}


def make_example(config, rng: np.random.Generator, *, seq_len: int,
                 split: str) -> dict[str, np.ndarray]:
  example = generate(rng, seq_len=seq_len, ignore_prob=split_ignore_prob(config, split))
  if config.get("byte_tokens", False):
    for key in ("tokens", "targets"):
      example[key] = BYTE_IDS[example[key]]
  return example
