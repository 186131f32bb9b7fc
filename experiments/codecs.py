"""How a trained run's tokens read as text, for experiments.generate.

  text       the byte-level code corpus: a prompt is the document marker DOC followed by its
             UTF-8 bytes (a document's start, as training saw it); the output is bytes
             decoded as UTF-8 (invalid sequences replaced) and ends at DOC (end of file).
  flipflop   the symbols w r i 0 1, with or without spaces ("w1r1" or "w 1 r 1"); the output
             is printed spaced.
  any other  token ids separated by spaces or commas, printed the same way.

The task comes from the run's config.json (written by experiments.train), else its
summary.json, else the vocabulary size (257 is the text corpus, 5 flip-flop).
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable, NamedTuple

from experiments.tasks import code_corpus
from experiments.tasks import flipflop


class Codec(NamedTuple):
  task: str
  encode: Callable[[str], list]   # prompt -> token ids (raises ValueError naming --prompt)
  decode: Callable[[list], str]   # generated ids -> text
  eos_id: int | None              # stop generating a row at this token


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
