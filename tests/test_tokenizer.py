"""The text task and experiments.generate through a tokenizer.json (experiments/tokenizer_json.py).

A byte-level BPE tokenizer is trained here on a few lines with the `tokenizers` package (no
download); skipped where that package is not installed.
"""
from __future__ import annotations

import json
import sys

import ml_collections
import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from experiments import codecs  # noqa: E402
from experiments import data  # noqa: E402
from experiments import tokenizer_json  # noqa: E402
from experiments.tasks import code_corpus  # noqa: E402

LINES = [f"def f{i}(x):\n  return x + {i} * 2\n" for i in range(60)]
VOCAB = 300
BOS, EOS = 0, 1


def write_tokenizer(directory, *, eos_in: str | None = "generation_config.json") -> str:
  """directory/tokenizer.json: byte-level BPE of VOCAB ids, <s> = 0 (added in front of every
  encoding, as Llama's tokenizers do) and </s> = 1; eos_token_id 1 written to `eos_in`."""
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(LINES, trainers.BpeTrainer(
      vocab_size=VOCAB, special_tokens=["<s>", "</s>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
  directory.mkdir(parents=True, exist_ok=True)
  path = directory / "tokenizer.json"
  tok.save(str(path))
  if eos_in:
    (directory / eos_in).write_text(json.dumps({"eos_token_id": EOS}))
  return str(path)


def _text_config(tmp_path, **fields):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("".join(LINES * 4))
  config = data.default_data_config()
  config.update(task="text", text_dir=str(corpus), seq_len=16, valid_fraction=0.25,
                shuffle_window=0, **fields)
  return config


def test_text_task_tokenizes_documents_and_takes_its_vocabulary(tmp_path):
  path = write_tokenizer(tmp_path / "tok")
  config = _text_config(tmp_path, tokenizer=path)
  assert data.vocab_size(config) == VOCAB
  assert code_corpus.doc_token(config) == EOS    # the eos written beside the tokenizer
  tok = tokenizer_json.load(path, field="t")
  root, docs, count = code_corpus.split_files(config, "valid")
  with open(f"{root}/corpus.txt", "rb") as f:
    f.seek(docs[0][1])
    text = f.read().decode()
  ids = tok.encode(text, add_special_tokens=False).ids
  assert count == len(ids) + 1 and data.max_seq_len(config) == count
  batches = data.make_eval_sets(config, seq_len=16, batch_size=2, num_batches=50, seed=0)
  rows = np.concatenate([b["tokens"] for b in batches["valid"]]).reshape(-1)
  targets = np.concatenate([b["targets"] for b in batches["valid"]]).reshape(-1)
  mask = np.concatenate([b["loss_mask"] for b in batches["valid"]]).reshape(-1) > 0
  assert rows[mask].tolist() == [EOS] + ids   # the document token, then the text's ids
  assert targets[mask].tolist() == ids + [EOS]
  # A padded vocabulary (a checkpoint's) is allowed; a smaller one is not.
  assert data.vocab_size(_text_config(tmp_path, tokenizer=path, vocab_size=320)) == 320


def test_byte_corpus_is_unchanged_without_a_tokenizer(tmp_path):
  config = _text_config(tmp_path)
  assert data.vocab_size(config) == code_corpus.VOCAB_SIZE
  root, docs, _ = code_corpus.split_files(config, "valid")
  got = code_corpus.DocumentReader(config, root)(docs[0])
  want = code_corpus.read_document(root, docs[0])
  np.testing.assert_array_equal(got["inputs"], want["inputs"])
  assert got["inputs"][0] == code_corpus.DOC


@pytest.mark.parametrize("fields, message", [
    (dict(tokenizer="/nonexistent/tokenizer.json"),
     "data.tokenizer='/nonexistent/tokenizer.json' does not exist"),
    (dict(vocab_size=100), r"data.vocab_size=100 is smaller than data.tokenizer=.* \(300\)"),
    (dict(doc_token=300), r"data.doc_token=300 must lie in \[0, 300\)"),
])
def test_tokenizer_errors_are_one_line_naming_the_field(tmp_path, fields, message):
  config = _text_config(tmp_path, tokenizer=write_tokenizer(tmp_path / "tok"))
  config.update(fields)
  with pytest.raises(ValueError, match=message) as e:
    data.vocab_size(config)
  assert "\n" not in str(e.value)


def test_missing_eos_bad_file_and_missing_package(tmp_path, monkeypatch):
  config = _text_config(tmp_path, tokenizer=write_tokenizer(tmp_path / "tok", eos_in=None))
  with pytest.raises(ValueError, match="data.doc_token is None and no eos_token_id"):
    data.vocab_size(config)
  config.doc_token = 1
  assert data.vocab_size(config) == VOCAB
  (tmp_path / "bad.json").write_text("{}")
  with pytest.raises(ValueError, match="data.tokenizer='.*bad.json' is not a tokenizers"):
    data.vocab_size(_text_config(tmp_path, tokenizer=str(tmp_path / "bad.json")))
  with pytest.raises(ValueError, match="data.tokenizer=.* is read by data.task='text' only"):
    data.vocab_size(ml_collections.ConfigDict(dict(data.default_data_config(),
                                                   tokenizer=config.tokenizer)))
  monkeypatch.setitem(sys.modules, "tokenizers", None)   # `import tokenizers` fails
  with pytest.raises(ValueError, match="needs the tokenizers package: pip install tokenizers"):
    tokenizer_json.load(config.tokenizer, field="data.tokenizer")


def test_codecs_read_the_workdir_tokenizer(tmp_path):
  # An imported workdir: the tokenizer's own template (BOS first), eos from beside it.
  write_tokenizer(tmp_path / "wd")
  codec = codecs.for_workdir(str(tmp_path / "wd"), VOCAB)
  ids = codec.encode("def f1(x):")
  assert ids[0] == BOS and codec.eos_id == EOS
  assert codec.decode(ids[1:] + [EOS, 5, 6]) == "def f1(x):"
  with pytest.raises(ValueError, match="has a vocabulary of 300 tokens, more than the model's 200"):
    codecs.for_workdir(str(tmp_path / "wd"), 200)
  # A run trained on the text task with data.tokenizer: the document token starts the prompt.
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text(json.dumps({"data": dict(
      task="text", tokenizer=str(tmp_path / "wd" / "tokenizer.json"), doc_token=None)}))
  codec = codecs.for_workdir(str(run), VOCAB)
  assert codec.encode("def f1(x):") == [EOS] + ids[1:] and codec.eos_id == EOS
