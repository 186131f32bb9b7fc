"""How a trained run's tokens read as text, for experiments.generate.

  text       the byte-level code corpus: a prompt is the document marker DOC followed by its
             UTF-8 bytes (a document's start, as training saw it); the output is bytes
             decoded as UTF-8 (invalid sequences replaced) and ends at DOC (end of file).
  flipflop   the symbols w r i 0 1, with or without spaces ("w1r1" or "w 1 r 1"); the output
             is printed spaced.
  any other  token ids separated by spaces or commas, printed the same way.

The task comes from the run's config.json (written by experiments.train), else its
summary.json, else the vocabulary size (257 is the text corpus, 5 flip-flop).

A tokenizer (experiments/tokenizer_json.py) takes precedence (`for_workdir`):
  a run that trained on the text task with data.tokenizer: the prompt is the document token
             followed by the prompt's ids, as training saw a document's start; the output
             ends at the document token;
  a workdir holding tokenizer.json (experiments.import_hf copies a checkpoint's): the prompt
             is encoded as transformers' tokenizer(prompt) would (the tokenizer's own special
             tokens, a BOS say, added); the output ends at the checkpoint's eos_token_id.
The decoded text leaves special tokens out.
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable, NamedTuple

import ml_collections

from experiments import tokenizer_json
from experiments.tasks import code_corpus
from experiments.tasks import flipflop


class Codec(NamedTuple):
  task: str
  encode: Callable[[str], list]   # prompt -> token ids (raises ValueError naming --prompt)
  decode: Callable[[list], str]   # generated ids -> text
  eos_id: int | None              # stop generating a row at this token


def _run_config(workdir: str) -> dict:
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      config = json.load(f)
  except (OSError, ValueError):
    return {}
  return config if isinstance(config, dict) else {}


def run_task(workdir: str, vocab_size: int) -> str:
  """The data.task a run in workdir trained on ("" when nothing says)."""
  for name, read in (("config.json", lambda d: d["data"]["task"]),
                     ("summary.json", lambda d: d["task"])):
    path = os.path.join(workdir, name)
    if os.path.exists(path):
      with open(path) as f:
        try:
          return read(json.load(f))
        except (KeyError, TypeError, ValueError):
          pass
  return {code_corpus.VOCAB_SIZE: "text", len(flipflop.VOCAB): "flipflop"}.get(vocab_size, "")


def _text() -> Codec:
  def encode(prompt: str) -> list:
    return [code_corpus.DOC] + list(prompt.encode("utf-8"))

  def decode(ids: list) -> str:
    ids = ids[:ids.index(code_corpus.DOC)] if code_corpus.DOC in ids else ids   # end of file
    return bytes(ids).decode("utf-8", errors="replace")

  return Codec("text", encode, decode, code_corpus.DOC)


def _flipflop() -> Codec:
  index = {s: i for i, s in enumerate(flipflop.VOCAB)}

  def encode(prompt: str) -> list:
    symbols = [c for c in prompt if not c.isspace()]
    bad = sorted({c for c in symbols if c not in index})
    if bad:
      raise ValueError(f"--prompt contains {''.join(bad)!r}: a flip-flop prompt uses the symbols "
                       f"{' '.join(flipflop.VOCAB)}")
    return [index[c] for c in symbols]

  return Codec("flipflop", encode, lambda ids: " ".join(flipflop.VOCAB[t] for t in ids), None)


def _ids(task: str, vocab_size: int) -> Codec:
  def encode(prompt: str) -> list:
    parts = [p for p in re.split(r"[\s,]+", prompt) if p]
    try:
      ids = [int(p) for p in parts]
    except ValueError:
      raise ValueError(f"--prompt={prompt!r}: this run (task {task or 'unknown'!r}) reads token "
                       f"ids separated by spaces or commas") from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
      raise ValueError(f"--prompt has token ids {bad} outside [0, {vocab_size})")
    return ids

  return Codec(task or "ids", encode, lambda ids: " ".join(str(t) for t in ids), None)


def for_task(task: str, vocab_size: int) -> Codec:
  if task == "text":
    return _text()
  if task == "flipflop":
    return _flipflop()
  return _ids(task, vocab_size)


def _tokenized(tok, *, name: str, vocab_size: int, eos: int | None, prefix: list,
               special: bool) -> Codec:
  """Text through `tok`: prefix + the prompt's ids (with the tokenizer's special tokens when
  `special`); the output cut at eos, decoded without special tokens."""
  n = tokenizer_json.vocab_size(tok)
  if n > vocab_size:
    raise ValueError(f"{name} has a vocabulary of {n} tokens, more than the model's "
                     f"{vocab_size}; give the tokenizer the model was trained with")

  def encode(prompt: str) -> list:
    return prefix + tok.encode(prompt, add_special_tokens=special).ids

  def decode(ids: list) -> str:
    ids = ids[:ids.index(eos)] if eos in ids else ids
    return tok.decode(ids, skip_special_tokens=True)

  return Codec("text", encode, decode, eos)


def for_workdir(workdir: str, vocab_size: int) -> Codec:
  """The codec of the run in workdir: its tokenizer (module docstring), else for_task's."""
  data = _run_config(workdir).get("data") or {}
  if data.get("task") == "text" and data.get("tokenizer"):
    config = ml_collections.ConfigDict(data)
    name = f"data.tokenizer={data['tokenizer']!r} (in {workdir}/config.json)"
    tok = tokenizer_json.load(data["tokenizer"], field=name)
    doc = code_corpus.doc_token(config)
    return _tokenized(tok, name=name, vocab_size=vocab_size, eos=doc, prefix=[doc],
                      special=False)
  path = os.path.join(workdir, tokenizer_json.FILE)
  if os.path.isfile(path):
    tok = tokenizer_json.load(path, field=path)
    return _tokenized(tok, name=path, vocab_size=vocab_size,
                      eos=tokenizer_json.eos_beside(path), prefix=[], special=True)
  return for_task(run_task(workdir, vocab_size), vocab_size)
