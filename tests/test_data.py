"""grain pipelines: the batch contract, determinism, checkpoint resume, packing, sharding."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from experiments import data
from experiments.tasks import code_corpus

SYNTHETIC = ("flipflop", "word_problem", "mqrar")
FIELDS = {"tokens": np.int32, "targets": np.int32, "loss_mask": np.float32,
          "segment_ids": np.int32, "positions": np.int32}


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
  """A small tree of text files: empty, short, and longer than any row used here (bytes
  1..255: a NUL byte would make a file binary, which the corpus skips)."""
  root = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(0)
  sizes = [0, 1, 5, 40, 97, 300, 1000, 37, 2, 250] * 3
  for n, size in enumerate(sizes):
    sub = root / f"pkg{n % 3}"
    sub.mkdir(exist_ok=True)
    (sub / f"mod{n}.py").write_bytes(rng.integers(1, 256, size, dtype=np.uint8).tobytes())
  (root / "site-packages").mkdir()
  (root / "site-packages" / "skipped.py").write_bytes(b"x = 1\n")
  (root / "notes.txt").write_bytes(b"not python")
  return str(root)


def _config(task, **overrides):
  config = data.default_data_config()
  config.task = task
  config.seq_len = 33
  config.update(overrides)
  return config


def _text_config(corpus_dir, **overrides):
  return _config("text", **{"text_dir": corpus_dir, "valid_fraction": 0.3, "shuffle_window": 4,
                            **overrides})


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _assert_contract(batch, batch_size, seq_len):
  assert set(batch) == set(FIELDS)
  for name, dtype in FIELDS.items():
    assert batch[name].shape == (batch_size, seq_len), name
    assert batch[name].dtype == dtype, name


# --- contract, determinism, resume -------------------------------------------------


@pytest.mark.parametrize("task", SYNTHETIC + ("text",))
def test_train_iter_is_deterministic_and_seeded(task, corpus_dir):
  config = _text_config(corpus_dir) if task == "text" else _config(task)
  first = _take(data.make_train_iter(config, batch_size=3, seed=5), 3)
  for b in first:
    _assert_contract(b, 3, 33)
  _assert_batches_equal(first, _take(data.make_train_iter(config, batch_size=3, seed=5), 3))
  other = _take(data.make_train_iter(config, batch_size=3, seed=6), 3)
  assert any(not np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(first, other))
  assert max(int(b["tokens"].max()) for b in first) < data.vocab_size(config)


@pytest.mark.parametrize("task", SYNTHETIC + ("text",))
def test_iterator_state_round_trip(task, corpus_dir):
  config = _text_config(corpus_dir) if task == "text" else _config(task)
  it = data.make_train_iter(config, batch_size=2, seed=1)
  _take(it, 3)
  state = it.get_state()
  expected = _take(it, 2)
  fresh = data.make_train_iter(config, batch_size=2, seed=1)
  fresh.set_state(state)
  _assert_batches_equal(expected, _take(fresh, 2))


@pytest.mark.parametrize("task", SYNTHETIC[:1] + ("text",))
def test_resume_from_json_state_inside_the_first_window(task, corpus_dir):
  """The state as Orbax stores it (JSON: tuples become lists) resumes exactly inside the first
  shuffle window (whose start state, before any document was read, a JSON round trip used
  to break), at its end, and in the windows after it."""
  config = (_text_config(corpus_dir, seq_len=16, shuffle_window=8) if task == "text"
            else _config(task))
  it = data.make_train_iter(config, batch_size=2, seed=7)
  states, batches = {}, []
  for k in range(13):  # a window holds 8 rows = 4 batches
    states[k] = json.loads(json.dumps(it.get_state()))
    batches.append(next(it))
  for k in (0, 1, 3, 4, 5, 11):
    fresh = data.make_train_iter(config, batch_size=2, seed=7)
    fresh.set_state(states[k])
    _assert_batches_equal(batches[k:k + 2], _take(fresh, 2))


def test_text_resume_across_epochs(corpus_dir):
  """A state saved deep into the repeated, reshuffled file stream still resumes exactly."""
  config = _text_config(corpus_dir, seq_len=64)
  it = data.make_train_iter(config, batch_size=4, seed=3)
  _take(it, 50)  # the training split fills ~66 rows of 64: this is three epochs in
  state = it.get_state()
  expected = _take(it, 3)
  fresh = data.make_train_iter(config, batch_size=4, seed=3)
  fresh.set_state(state)
  _assert_batches_equal(expected, _take(fresh, 3))


@pytest.mark.parametrize("task", SYNTHETIC)
def test_synthetic_rows_are_single_sequences(task):
  batch = next(data.make_train_iter(_config(task), batch_size=2, seed=0))
  assert (batch["segment_ids"] == 1).all()
  np.testing.assert_array_equal(batch["positions"], np.tile(np.arange(33), (2, 1)))
  assert batch["loss_mask"].sum() > 0


@pytest.mark.parametrize("task", SYNTHETIC)
def test_processes_read_blocks_of_the_global_batch(task):
  config = _config(task)
  whole = _take(data.make_train_iter(config, batch_size=6, seed=2), 2)
  for p in range(2):  # process p reads rows 3p .. 3p + 2 of every global batch
    it = data.make_train_iter(config, batch_size=3, seed=2, process_index=p, process_count=2)
    for b, batch in enumerate(_take(it, 2)):
      np.testing.assert_array_equal(batch["tokens"], whole[b]["tokens"][3 * p:3 * p + 3])
    assert it.get_state() == {"next_index": 2}  # global batches: the same in every process


def test_text_processes_read_blocks_of_the_global_batch(corpus_dir):
  config = _text_config(corpus_dir)
  whole = _take(data.make_train_iter(config, batch_size=4, seed=0), 3)
  states = []
  for p in range(2):
    it = data.make_train_iter(config, batch_size=2, seed=0, process_index=p, process_count=2)
    for b, batch in enumerate(_take(it, 3)):
      for k in batch:
        np.testing.assert_array_equal(batch[k], whole[b][k][2 * p:2 * p + 2])
    states.append(it.get_state())
  assert states[0] == states[1]


def test_eval_sets_split_into_process_blocks(corpus_dir):
  for config in (_config("flipflop"), _text_config(corpus_dir)):
    whole = data.make_eval_sets(config, seq_len=33, batch_size=4, num_batches=2, seed=4)
    for p in range(2):
      part = data.make_eval_sets(config, seq_len=33, batch_size=2, num_batches=2, seed=4,
                                 process_index=p, process_count=2)
      for name, batches in whole.items():
        for b, batch in enumerate(batches):
          np.testing.assert_array_equal(part[name][b]["tokens"], batch["tokens"][2 * p:2 * p + 2])


# --- eval sets ---------------------------------------------------------------------


@pytest.mark.parametrize("task, names", [("flipflop", ("id", "sparse", "dense")),
                                         ("word_problem", ("test",)), ("mqrar", ("test",))])
def test_eval_sets_at_longer_lengths(task, names):
  config = _config(task)
  for seq_len in (33, 66, 133):
    sets = data.make_eval_sets(config, seq_len=seq_len, batch_size=2, num_batches=3, seed=4)
    assert tuple(sets) == names == data.eval_set_names(config)
    for batches in sets.values():
      assert len(batches) == 3
      for b in batches:
        _assert_contract(b, 2, seq_len)
    _assert_batches_equal(sets[names[0]], data.make_eval_sets(
        config, seq_len=seq_len, batch_size=2, num_batches=3, seed=4)[names[0]])
  # Eval streams never coincide with the training stream of the same seed.
  train = next(data.make_train_iter(config, batch_size=2, seed=4))
  evals = data.make_eval_sets(config, seq_len=33, batch_size=2, num_batches=1, seed=4)
  assert all(not np.array_equal(train["tokens"], b[0]["tokens"]) for b in evals.values())


def test_text_valid_is_held_out_and_reaches_max_seq_len(corpus_dir):
  config = _text_config(corpus_dir)
  _, train_files, _ = code_corpus.split_files(config, "train")
  _, valid_files, valid_tokens = code_corpus.split_files(config, "valid")
  assert valid_files and train_files and not set(train_files) & set(valid_files)
  # 30 .py files (3 empty) and notes.txt; site-packages skipped
  assert len(train_files) + len(valid_files) == 28
  assert data.max_seq_len(config) == valid_tokens
  for seq_len in (33, 66, valid_tokens):
    batches = data.make_eval_sets(config, seq_len=seq_len, batch_size=2, num_batches=50,
                                  seed=0)["valid"]
    for b in batches:
      _assert_contract(b, 2, seq_len)
    # All held-out tokens appear exactly once, then only padding.
    assert sum(b["loss_mask"].sum() for b in batches) == valid_tokens
  assert len(batches) == 1 and batches[0]["loss_mask"][0].all()


def test_text_max_files_limits_the_corpus(corpus_dir):
  config = _text_config(corpus_dir, max_files=4)
  _, train_files, _ = code_corpus.split_files(config, "train")
  _, valid_files, _ = code_corpus.split_files(config, "valid")
  assert len(train_files) == 4 and len(valid_files) == 2  # ceil(4 * 0.3)


# --- packing -----------------------------------------------------------------------


def _segments(batches):
  """(tokens, targets, positions) of every segment, in stream order."""
  for b in batches:
    for row in range(b["tokens"].shape[0]):
      seg = b["segment_ids"][row]
      assert (np.diff(seg[seg > 0]) >= 0).all() and (seg[seg > 0][:1] == 1).all()
      # padding at the end
      assert (seg[np.argmin(seg > 0):] == 0).all() if (seg == 0).any() else True
      np.testing.assert_array_equal(b["loss_mask"][row], (seg > 0).astype(np.float32))
      for s in range(1, seg.max() + 1):
        idx = np.flatnonzero(seg == s)
        assert (np.diff(idx) == 1).all()  # contiguous
        yield b["tokens"][row, idx], b["targets"][row, idx], b["positions"][row, idx]


def test_packing_keeps_documents_whole_and_apart(corpus_dir):
  config = _text_config(corpus_dir)
  root, files, _ = code_corpus.split_files(config, "valid")
  batches = data.make_eval_sets(config, seq_len=17, batch_size=3, num_batches=100, seed=0)["valid"]
  pieces = list(_segments(batches))
  for tokens, targets, positions in pieces:
    np.testing.assert_array_equal(positions, np.arange(len(tokens)))
    np.testing.assert_array_equal(tokens[1:], targets[:-1])  # every target is in its own segment
    # DOC opens a document and closes it: inside a segment it may only open at the
    # start and close at the end, so no segment mixes two documents.
    assert (tokens[1:] != code_corpus.DOC).all()
    assert (targets[:-1] != code_corpus.DOC).all()
  # Re-joining the pieces in order gives back the files, byte for byte.
  expected = []
  for path in files:
    with open(os.path.join(root, path), "rb") as f:
      expected += [code_corpus.DOC] + list(f.read())
  expected.append(code_corpus.DOC)
  joined = np.concatenate([t for t, _, _ in pieces])
  np.testing.assert_array_equal(joined, expected[:-1])
  np.testing.assert_array_equal(np.concatenate([t for _, t, _ in pieces]), expected[1:])
  assert any(len(t) == 17 and t[0] != code_corpus.DOC for t, _, _ in pieces)  # some doc was split


def test_training_rows_pack_the_training_files(corpus_dir):
  config = _text_config(corpus_dir, seq_len=20)
  root, files, _ = code_corpus.split_files(config, "train")
  docs = []
  for path in files:
    with open(os.path.join(root, path), "rb") as f:
      docs.append(bytes([code_corpus.DOC % 256]) + f.read())
  it = data.make_train_iter(config, batch_size=2, seed=0)
  for tokens, targets, positions in _segments(_take(it, 10)):
    np.testing.assert_array_equal(tokens[1:], targets[:-1])
    np.testing.assert_array_equal(positions, np.arange(len(tokens)))
    assert (tokens[1:] != code_corpus.DOC).all()
    # Each segment is a contiguous piece of one training file.
    piece = bytes(int(t) % 256 for t in tokens)
    assert any(piece in d for d in docs)


def test_stdlib_corpus_default():
  config = _config("text", max_files=3, seq_len=64, shuffle_window=0)
  files = code_corpus.list_files(code_corpus.default_root())
  assert len(files) > 100 and all(p.endswith(".py") and "site-packages" not in p for p, _ in files)
  batch = next(data.make_train_iter(config, batch_size=2, seed=0))
  _assert_contract(batch, 2, 64)
  assert data.vocab_size(config) == 257


# --- errors ------------------------------------------------------------------------


def test_unknown_task_raises_naming_data_task():
  config = _config("copying")
  for call in (lambda: data.vocab_size(config), lambda: data.max_seq_len(config),
               lambda: data.make_train_iter(config, batch_size=2, seed=0),
               lambda: data.make_eval_sets(config, seq_len=8, batch_size=2, num_batches=1, seed=0)):
    with pytest.raises(ValueError, match="data.task"):
      call()


@pytest.mark.parametrize("overrides, match", [
    ({"task": "flipflop", "seq_len": 1}, "data.seq_len"),
    ({"task": "text", "text_dir": "/nonexistent/dir"}, "data.text_dir"),
    ({"task": "text", "valid_fraction": 0.0}, "data.valid_fraction"),
    ({"task": "text", "max_files": 0}, "data.max_files"),
    ({"task": "flipflop", "read_threads": 0}, "data.read_threads"),
    ({"task": "mqrar", "prefetch_batches": 0}, "data.prefetch_batches"),
])
def test_bad_fields_raise(overrides, match):
  config = _config(**overrides)
  with pytest.raises(ValueError, match=match):
    data.make_train_iter(config, batch_size=2, seed=0)


def test_bad_call_arguments_raise():
  config = _config("flipflop")
  with pytest.raises(ValueError, match="batch_size"):
    data.make_train_iter(config, batch_size=0, seed=0)
  with pytest.raises(ValueError, match="process_index"):
    data.make_train_iter(config, batch_size=2, seed=0, process_index=2, process_count=2)
  with pytest.raises(ValueError, match="seq_len"):
    data.make_eval_sets(config, seq_len=1, batch_size=2, num_batches=1, seed=0)
  with pytest.raises(ValueError, match="num_batches"):
    data.make_eval_sets(config, seq_len=8, batch_size=2, num_batches=0, seed=0)


def test_default_config_has_every_field():
  config = data.default_data_config()
  for name in ("task", "seq_len", "ignore_prob", "sparse_ignore_prob", "dense_ignore_prob", "group",
               "n_back", "num_pairs", "num_values", "query_prob", "text_dir", "max_files",
               "valid_fraction", "shuffle_window"):
    assert name in config
  assert (config.ignore_prob, config.sparse_ignore_prob,
          config.dense_ignore_prob) == (0.8, 0.98, 0.1)
  config.text_dir = "/tmp"  # placeholders accept their type
  config.max_files = 3


def test_synthetic_source_pickles_for_multiprocess_prefetch():
  import pickle
  config = _config("mqrar")
  fn = data._SyntheticExample(config, split="train", seq_len=33, seed=9)
  clone = pickle.loads(pickle.dumps(fn))
  config.n_back = 3  # later edits to the config do not reach a built pipeline
  first = next(data.make_train_iter(_config("mqrar"), batch_size=2, seed=9))
  np.testing.assert_array_equal(clone(1)["tokens"], first["tokens"][1])
  np.testing.assert_array_equal(fn(0)["targets"], first["targets"][0])
