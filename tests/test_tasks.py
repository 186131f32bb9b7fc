"""The synthetic tasks against plain-python re-implementations of their rules."""
from __future__ import annotations

import itertools
import secrets

import numpy as np
import pytest

from experiments import data
from experiments.tasks import flipflop, mqrar, word_problem


@pytest.fixture
def rng():
  seed = secrets.randbits(31)
  print(f"numpy seed={seed}")
  return np.random.default_rng(seed)


def _config(**overrides):
  config = data.default_data_config()
  config.update(overrides)
  return config


# --- flip-flop ---------------------------------------------------------------------


def _flipflop_answers(tokens, targets):
  """Reads the flip-flop string pair by pair; returns {position of r: last written bit}."""
  s = list(tokens) + [targets[-1]]
  sym = [flipflop.VOCAB[t] for t in s]
  answers, memory = {}, None
  for p in range(0, len(sym) - 1, 2):
    op, bit = sym[p], sym[p + 1]
    assert op in "wri" and bit in "01", (p, op, bit)
    if op == "w":
      memory = bit
    elif op == "r":
      answers[p] = memory
  return answers


@pytest.mark.parametrize("seq_len", [2, 3, 17, 64, 129])
@pytest.mark.parametrize("ignore_prob", [0.8, 0.98, 0.1])
def test_flipflop_reads_return_last_written_bit(rng, seq_len, ignore_prob):
  for _ in range(20):
    ex = flipflop.generate(rng, seq_len=seq_len, ignore_prob=ignore_prob)
    tokens, targets = ex["tokens"], ex["targets"]
    np.testing.assert_array_equal(tokens[1:], targets[:-1])  # next-token layout
    assert flipflop.VOCAB[tokens[0]] == "w"
    answers = _flipflop_answers(tokens, targets)
    assert all(bit is not None for bit in answers.values())
    np.testing.assert_array_equal(np.flatnonzero(ex["loss_mask"]), sorted(answers))
    for p, bit in answers.items():
      assert flipflop.VOCAB[targets[p]] == bit
    if seq_len >= 3:  # the last pair whose instruction is visible is a read
      assert flipflop.VOCAB[tokens[(seq_len - 1) // 2 * 2]] == "r"


@pytest.mark.parametrize("name, p_ignore", [("id", 0.8), ("sparse", 0.98), ("dense", 0.1)])
def test_flipflop_test_sets_have_the_papers_ignore_rates(name, p_ignore):
  config = _config(task="flipflop", seq_len=512)
  batches = data.make_eval_sets(config, seq_len=512, batch_size=8, num_batches=4, seed=0)[name]
  ops = np.concatenate([b["tokens"][:, 2:-2:2].ravel() for b in batches])  # free instructions
  frac_ignore = np.mean(ops == flipflop.IGNORE)
  # 8k Bernoulli draws: 5 standard deviations is < 0.03.
  assert abs(frac_ignore - p_ignore) < 0.03, frac_ignore
  frac_read = np.mean(ops == flipflop.READ)
  assert abs(frac_read - (1 - p_ignore) / 2) < 0.03, frac_read


# --- word problems -----------------------------------------------------------------


def _even(p):
  """Parity by counting cycles (independent of the module's inversion count)."""
  seen, cycles = set(), 0
  for i in range(len(p)):
    if i not in seen:
      cycles += 1
      while i not in seen:
        seen.add(i)
        i = p[i]
  return (len(p) - cycles) % 2 == 0


@pytest.mark.parametrize("group, order", [("A5", 60), ("S5", 120)])
def test_word_problem_targets_are_running_products(rng, group, order):
  elems = word_problem.elements(group)
  assert len(elems) == order == word_problem.vocab_size(_config(group=group))
  assert elems[0] == (0, 1, 2, 3, 4)
  if group == "A5":
    assert all(_even(p) for p in elems)
  assert set(elems) == {p for p in itertools.permutations(range(5)) if group == "S5" or _even(p)}
  for _ in range(5):
    ex = word_problem.generate(rng, seq_len=37, group=group)
    assert ex["loss_mask"].tolist() == [1.0] * 37
    state = tuple(range(5))
    for g, target in zip(ex["tokens"], ex["targets"]):
      step = elems[g]
      state = tuple(step[state[i]] for i in range(5))  # apply state, then g
      assert elems[target] == state


def test_word_problem_tokens_cover_the_group(rng):
  ex = word_problem.generate(rng, seq_len=3000, group="A5")
  assert set(ex["tokens"].tolist()) == set(range(60))


def test_word_problem_generator_words(rng):
  """alphabet="generators": PaTH's words over 3-cycles and their inverses (A5), every letter
  used, the targets still the running products, which reach the whole group."""
  elems = word_problem.elements("A5")
  letters = {elems[i] for i in word_problem.generators("A5")}
  assert letters == {(1, 2, 0, 3, 4), (2, 0, 1, 3, 4), (1, 3, 2, 0, 4), (3, 0, 2, 1, 4),
                     (1, 4, 2, 3, 0), (4, 0, 2, 3, 1)}   # (0 1 2), (0 1 3), (0 1 4), inverses
  ex = word_problem.generate(rng, seq_len=3000, group="A5", alphabet="generators")
  assert {elems[g] for g in ex["tokens"]} == letters
  state = tuple(range(5))
  for g, target in zip(ex["tokens"], ex["targets"]):
    state = tuple(elems[g][state[i]] for i in range(5))
    assert elems[target] == state
  assert len(set(ex["targets"].tolist())) == 60
  config = _config(task="word_problem", alphabet="generators")
  batch = data.make_eval_sets(config, seq_len=16, batch_size=4, num_batches=1, seed=0)["test"][0]
  assert set(batch["tokens"].ravel().tolist()) <= set(word_problem.generators("A5").tolist())



def _loop_generate(rng, *, seq_len, group, alphabet):
  """word_problem.generate as it was before its scans: the same draws, then the plain loop."""
  table = word_problem.cayley_table(group)
  if alphabet == "generators":
    tokens = rng.choice(word_problem.generators(group), size=seq_len).astype(np.int32)
  else:
    tokens = rng.integers(0, table.shape[0], size=seq_len).astype(np.int32)
  targets = np.empty(seq_len, np.int32)
  state = 0  # identity
  for t, g in enumerate(tokens):
    state = table[state, g]
    targets[t] = state
  return tokens, targets


_SCAN_LENGTHS = (1, 2, 3, 63, 64, 65, 511, 512, 513, 1000)


@pytest.mark.parametrize("group", word_problem.GROUPS)
@pytest.mark.parametrize("alphabet", word_problem.ALPHABETS)
def test_word_problem_generate_matches_the_plain_loop(group, alphabet):
  """Every seed's stream is bit-identical to the loop's: same tokens, same targets, dtypes."""
  seeds = [0, 1] + [secrets.randbits(31) for _ in range(3)]
  print(f"numpy seeds={seeds}")
  for seq_len in _SCAN_LENGTHS:
    for seed in seeds:
      ex = word_problem.generate(np.random.default_rng(seed), seq_len=seq_len, group=group,
                                 alphabet=alphabet)
      tokens, targets = _loop_generate(np.random.default_rng(seed), seq_len=seq_len,
                                       group=group, alphabet=alphabet)
      assert ex["tokens"].dtype == ex["targets"].dtype == np.int32
      assert ex["loss_mask"].dtype == np.float32 and ex["loss_mask"].tolist() == [1.0] * seq_len
      np.testing.assert_array_equal(ex["tokens"], tokens)
      np.testing.assert_array_equal(ex["targets"], targets)


@pytest.mark.parametrize("group", word_problem.GROUPS)
@pytest.mark.parametrize("seq_len", [1, 64, 513, 1000])
def test_word_problem_last_target_is_the_words_product(rng, group, seq_len):
  """The last target against the word multiplied out on permutation tuples (not the table)."""
  elems = word_problem.elements(group)
  for alphabet in word_problem.ALPHABETS:
    ex = word_problem.generate(rng, seq_len=seq_len, group=group, alphabet=alphabet)
    state = tuple(range(5))
    for g in ex["tokens"]:
      state = tuple(elems[g][state[i]] for i in range(5))  # apply state, then g
    assert elems[ex["targets"][-1]] == state

# --- MQRAR-N -----------------------------------------------------------------------


@pytest.mark.parametrize("n_back", [1, 2, 4])
def test_mqrar_answers_are_the_nth_last_assignment(rng, n_back):
  num_pairs, num_values = 8, 5
  for seq_len in (2, 31, 300):
    ex = mqrar.generate(rng, seq_len=seq_len, n_back=n_back, num_pairs=num_pairs,
                        num_values=num_values, query_prob=0.4)
    tokens, targets = ex["tokens"], ex["targets"]
    np.testing.assert_array_equal(tokens[1:], targets[:-1])
    s = list(tokens) + [targets[-1]]
    history = {}
    expected_mask = np.zeros(seq_len)
    p = 0
    while p < len(s) - 1:
      if s[p] == 0:  # "? k a"
        k = s[p + 1] - 1
        assert 0 <= k < num_pairs
        assert len(history.get(k, [])) >= n_back
        if p + 2 < len(s):
          assert s[p + 2] == num_pairs + 1 + history[k][-n_back]
        if p + 1 < seq_len:
          expected_mask[p + 1] = 1
        p += 3
      else:  # "k v"
        k, v = s[p] - 1, s[p + 1] - num_pairs - 1
        assert 0 <= k < num_pairs and 0 <= v < num_values
        history.setdefault(k, []).append(v)
        p += 2
    np.testing.assert_array_equal(ex["loss_mask"], expected_mask)
    assert ex["tokens"].max() < mqrar.vocab_size(_config(num_pairs=num_pairs,
                                                         num_values=num_values))


def test_mqrar_paper_setting_has_answers_for_every_n():
  config = _config(task="mqrar", seq_len=768, num_pairs=32)
  for n in (1, 2, 3, 4):
    config.n_back = n
    batch = data.make_eval_sets(config, seq_len=768, batch_size=4, num_batches=1, seed=0)["test"][0]
    assert batch["loss_mask"].sum(axis=1).min() > 20


# --- validation --------------------------------------------------------------------


@pytest.mark.parametrize("field, value, task", [
    ("ignore_prob", 1.0, "flipflop"), ("dense_ignore_prob", -0.1, "flipflop"),
    ("group", "A4", "word_problem"), ("n_back", 0, "mqrar"), ("num_pairs", 0, "mqrar"),
    ("query_prob", 1.0, "mqrar"), ("alphabet", "letters", "word_problem"),
])
def test_bad_task_fields_raise_naming_the_field(field, value, task):
  config = _config(task=task, **{field: value})
  with pytest.raises(ValueError, match=f"data.{field}"):
    data.vocab_size(config)


def test_flipflop_in_byte_tokens_is_the_same_string_in_the_text_vocabulary():
  """data.byte_tokens: each symbol becomes its character's byte, in the text task's
  vocabulary, with the same strings and the same scored positions."""
  from experiments import data
  c = data.default_data_config()
  c.task, c.seq_len = "flipflop", 64
  plain = flipflop.make_example(c, np.random.default_rng(3), seq_len=64, split="train")
  c.byte_tokens = True
  as_bytes = flipflop.make_example(c, np.random.default_rng(3), seq_len=64, split="train")
  assert data.vocab_size(c) == 257 and flipflop.vocab_size(data.default_data_config()) == 5
  for key in ("tokens", "targets"):
    assert "".join(map(chr, as_bytes[key])) == "".join(flipflop.VOCAB[t] for t in plain[key])
  np.testing.assert_array_equal(as_bytes["loss_mask"], plain["loss_mask"])
