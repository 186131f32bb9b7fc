"""data.text_dir: a directory of any text files, a single file or a glob; binary files skipped;
naming nothing is one error naming the field."""
from __future__ import annotations

import os

import numpy as np
import pytest

from experiments import data
from experiments.tasks import code_corpus


@pytest.fixture
def tree(tmp_path):
  files = {"notes.md": b"# notes\n", "a/b/story.txt": b"once upon a time\n" * 20,
           "a/run.sh": b"echo hi\n", "a/mod.py": b"x = 1\n", "a/empty.txt": b"",
           "a/image.png": b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", ".git/HEAD": b"ref: main\n",
           "a/__pycache__/mod.cpython.pyc": b"text but cached", ".hidden.txt": b"hidden\n"}
  for name, content in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_bytes(content)
  return tmp_path


def _config(text_dir, **kw):
  config = data.default_data_config()
  config.update(task="text", seq_len=8, valid_fraction=0.3, **kw)
  config.text_dir = None if text_dir is None else str(text_dir)
  return config


def test_directory_lists_every_text_file(tree):
  root, files = code_corpus.list_text(str(tree))
  assert root == str(tree)
  assert [p for p, _ in files] == ["a/b/story.txt", "a/mod.py", "a/run.sh", "notes.md"]
  assert dict(files)["notes.md"] == 8


def test_glob_lists_what_it_matches_relative_to_its_directory(tree):
  root, files = code_corpus.list_text(str(tree / "a" / "**" / "*.txt"))
  assert root == str(tree / "a") and [p for p, _ in files] == ["b/story.txt"]  # empty skipped
  root, files = code_corpus.list_text(str(tree / "*.md"))
  assert root == str(tree) and [p for p, _ in files] == ["notes.md"]


def test_single_file_holds_out_its_tail(tree):
  """One file: train on its first 70% of bytes, validate on the rest; both read back exactly."""
  path = tree / "a" / "b" / "story.txt"
  config = _config(path, shuffle_window=0)   # rows in file order
  raw = path.read_bytes()
  parts = {}
  for split in ("train", "valid"):
    root, docs, tokens = code_corpus.split_files(config, split)
    (doc,) = docs
    piece = code_corpus.read_document(root, doc)["inputs"][1:]      # after the DOC token
    parts[split] = bytes(piece.astype(np.uint8).tolist())
    assert tokens == len(parts[split]) + 1
  assert parts["train"] + parts["valid"] == raw and len(parts["valid"]) == round(0.3 * len(raw))
  batch = next(data.make_train_iter(config, batch_size=2, seed=0))
  assert bytes(batch["tokens"][0, 1:].astype(np.uint8).tolist()) == raw[:7]
  valid = data.make_eval_sets(config, seq_len=8, batch_size=2, num_batches=1, seed=0)["valid"]
  assert bytes(valid[0]["targets"][0, :7].astype(np.uint8).tolist()) == parts["valid"][:7]


@pytest.mark.parametrize("name,message", [
    ("missing", "data.text_dir='{p}' does not exist; give a directory, a file or a glob"),
    ("nothing/*.txt", "data.text_dir='{p}' holds no non-empty text file (binary files are "
                      "skipped)"),
    ("a/image.png", "data.text_dir='{p}' is empty or binary"),
    ("a/*.png", "data.text_dir='{p}' holds no non-empty text file"),
])
def test_naming_no_text_is_one_error_naming_the_field(tree, name, message):
  path = str(tree / name)
  with pytest.raises(ValueError) as raised:
    data.vocab_size(_config(path))
  assert str(raised.value).startswith(message.format(p=path)), str(raised.value)


def test_default_corpus_is_the_stdlib_python_files():
  """text_dir None keeps the corpus the committed results were trained on."""
  root, files, _ = code_corpus.split_files(_config(None, max_files=2), "train")
  assert root == code_corpus.default_root() and all(f.endswith(".py") for f in files)
  assert not os.path.isabs(files[0])
