"""Word problems on A5 / S5 (PaTH §4.1, Fig. 2 bottom; Merrill et al. 2024).

The input is a word g_1 g_2 ... g_T of group elements (drawn uniformly from the whole
group, or from fixed generators: config.alphabet below); the target at every position t
is the running product P_t = g_1 g_2 ... g_t
(a state-tracking "tagging" formulation, as in Merrill et al.'s word-problem code: the
model must output the prefix product after each element, not only whether the whole
word is the identity).

Conventions:
  * Elements are permutations of {0..4} as tuples p with p[i] the image of i. The
    enumeration is fixed: S5 = all 120 permutations in lexicographic order; A5 = the 60
    even ones in lexicographic order. Index 0 is the identity in both. Tokens and
    targets are indices into this enumeration, so vocab_size = |G|.
  * Products compose left to right, acting on the right: (p q)[i] = q[p[i]] (apply p,
    then q), so P_t = P_{t-1} g_t.
  * loss_mask is 1 at every position. The masked accuracy the evaluator reports is
    therefore the all-position (per-token) accuracy, which Merrill et al. log next to
    sequence accuracy; PaTH's ">90% accuracy" criterion is applied to it. The
    final-position accuracy (whether the whole word's product is predicted) is the
    last column of the same predictions.
  * By default every element of the group is drawn uniformly (Merrill et al.).
    config.alphabet="generators" gives PaTH's form (next bullet), which is the one the
    GPU reproduction learned (experiments/results/word_problem_gpu/NOTES.md).
  * config.alphabet (optional, "group" when absent) picks what the word is drawn from:
    "group", every element uniformly (Merrill et al.); "generators", PaTH's words over fixed
    generators and their inverses, uniformly: for A5 the 3-cycles (0 1 2), (0 1 3), (0 1 4)
    and their inverses (PaTH §4.1's example, 0-indexed); for S5 the transposition (0 1) and
    the 5-cycle (0 1 2 3 4) with its inverse. Tokens stay indices into the group's
    enumeration, so the vocabulary is the same either way.
  * There is no separate train/test distribution: "test" is fresh words of the
    requested length from a stream disjoint from training.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np

GROUPS = ("A5", "S5")
ALPHABETS = ("group", "generators")
TEST_SETS = ("test",)
MIN_SEQ_LEN = 1


def _parity(p: tuple[int, ...]) -> int:
  return sum(p[i] > p[j] for i in range(len(p)) for j in range(i + 1, len(p))) % 2


@functools.cache
def elements(group: str) -> tuple[tuple[int, ...], ...]:
  """The fixed enumeration of `group`'s elements (identity first)."""
  if group not in GROUPS:
    raise ValueError(f"data.group={group!r} must be one of {GROUPS}")
  perms = list(itertools.permutations(range(5)))
  if group == "A5":
    perms = [p for p in perms if _parity(p) == 0]
  return tuple(perms)


@functools.cache
def cayley_table(group: str) -> np.ndarray:
  """table[a, b] = index of (element a)(element b), left-to-right composition."""
  elems = elements(group)
  index = {p: n for n, p in enumerate(elems)}
  table = np.empty((len(elems), len(elems)), np.int32)
  for a, p in enumerate(elems):
    for b, q in enumerate(elems):
      table[a, b] = index[tuple(q[p[i]] for i in range(5))]
  return table


def vocab_size(config) -> int:
  return len(elements(config.group))


def validate(config) -> None:
  elements(config.group)
  if config.get("alphabet", "group") not in ALPHABETS:
    raise ValueError(f"data.alphabet={config.alphabet!r} must be one of {ALPHABETS}")


def _cycle(*points: int) -> tuple[int, ...]:
  """The permutation tuple of the cycle (points[0] points[1] ...) on {0..4}."""
  p = list(range(5))
  for a, b in zip(points, points[1:] + points[:1]):
    p[a] = b
  return tuple(p)


@functools.cache
def generators(group: str) -> np.ndarray:
  """Indices (into elements(group)) of the "generators" alphabet: generators and inverses."""
  cycles = ([(0, 1, 2), (0, 1, 3), (0, 1, 4)] if group == "A5"
            else [(0, 1), (0, 1, 2, 3, 4)])
  perms = [_cycle(*c) for c in cycles] + [_cycle(*reversed(c)) for c in cycles]
  index = {p: n for n, p in enumerate(elements(group))}
  return np.array(sorted({index[p] for p in perms}), np.int32)


def generate(rng: np.random.Generator, *, seq_len: int, group: str,
             alphabet: str = "group") -> dict[str, np.ndarray]:
  """One word of length T: tokens, running products as targets, loss_mask all ones."""
  if seq_len < MIN_SEQ_LEN:
    raise ValueError(f"word problem seq_len={seq_len} must be >= {MIN_SEQ_LEN}")
  table = cayley_table(group)
  if alphabet == "generators":
    tokens = rng.choice(generators(group), size=seq_len).astype(np.int32)
  else:
    tokens = rng.integers(0, table.shape[0], size=seq_len).astype(np.int32)
  return {"tokens": tokens, "targets": _running_products(tokens, group),
          "loss_mask": np.ones(seq_len, np.float32)}


@functools.cache
def _table_rows(group: str) -> tuple[tuple[int, ...], ...]:
  """cayley_table(group) as tuples of Python ints: every training word is generated on the
  host while small models wait, and indexing tuples one by one is about 3x faster than
  indexing the numpy table (a vectorized doubling scan is slower still below ~600 tokens)."""
  return tuple(map(tuple, cayley_table(group).tolist()))


def _running_products(tokens: np.ndarray, group: str) -> np.ndarray:
  """int32 P with P[t] = tokens[0] tokens[1] ... tokens[t], composed left to right."""
  rows = _table_rows(group)
  products, state = [], 0  # identity
  for g in tokens.tolist():
    state = rows[state][g]
    products.append(state)
  return np.array(products, np.int32)


def make_example(config, rng: np.random.Generator, *, seq_len: int,
                 split: str) -> dict[str, np.ndarray]:
  if split not in ("train",) + TEST_SETS:
    raise ValueError(f"word problem split={split!r} is not one of {('train',) + TEST_SETS}")
  return generate(rng, seq_len=seq_len, group=config.group,
                  alphabet=config.get("alphabet", "group"))
