"""The text corpus for the language-modelling experiments: byte-level files.

Documents are, with `data.text_dir` None (the default), the non-empty `.py` files of the
running interpreter's standard-library directory (`sysconfig.get_paths()["stdlib"]`,
without its site-packages / dist-packages). Otherwise `data.text_dir` names
  a directory   every non-empty text file under it (hidden entries, __pycache__,
                site-packages and dist-packages skipped),
  a file        that file alone; when a single file is listed, its last valid_fraction
                of bytes is the validation split,
  a glob        (`*`, `?`, `[...]`; `**` spans directories) the non-empty text files it
                matches, relative to its directory before the first wildcard;
a text file being one with no NUL byte in its first 8 KiB (binary files are skipped).
Files are listed in sorted order of their path relative to the root so the corpus is the
same wherever the same files are.

Hold-out: a file belongs to the validation split iff the first 8 bytes of
sha256(relative path) read as a fraction in [0, 1) fall below `data.valid_fraction`.
The split depends only on the path, so it is stable when `max_files` changes or
files are added. `data.max_files` keeps the first max_files training files and the
first ceil(max_files * valid_fraction) (at least one) validation files, for quick runs.

A document is a path relative to the root, or (path, first byte, end byte) for the two
parts of a single file.

Tokens: bytes 0..255, plus DOC = 256 which marks a document boundary. A document of
bytes b_1..b_n becomes the pair (inputs = [DOC, b_1, ..., b_n], targets =
[b_1, ..., b_n, DOC]): every byte is predicted, and so is the end of the file.

With `data.tokenizer` (a tokenizer.json, experiments/tokenizer_json.py) a document is its
text (UTF-8, invalid bytes replaced) encoded by that tokenizer without special tokens,
t_1..t_m, framed the same way by the document token `data.doc_token` (None: the eos_token_id
written beside the tokenizer file). The vocabulary is then the tokenizer's, or
`data.vocab_size` when set (a checkpoint's vocabulary is often padded past its tokenizer's).
"""
from __future__ import annotations

import functools
import glob
import hashlib
import math
import os
import sysconfig

import numpy as np

from experiments import tokenizer_json

DOC = 256
VOCAB_SIZE = 257
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def default_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def is_validation(relpath: str, valid_fraction: float) -> bool:
  digest = hashlib.sha256(relpath.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64 < valid_fraction


@functools.cache
def list_files(root: str) -> tuple[tuple[str, int], ...]:
  """(relative path, size in bytes) of every non-empty .py file under root, sorted: the
  default corpus (data.text_dir None) with root = default_root()."""
  if not os.path.isdir(root):
    raise ValueError(f"data.text_dir={root!r} is not a directory")
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
    for name in filenames:
      if name.endswith(".py"):
        path = os.path.join(dirpath, name)
        size = os.path.getsize(path)
        if size > 0:
          found.append((os.path.relpath(path, root), size))
  if not found:
    raise ValueError(f"data.text_dir={root!r} holds no non-empty .py files")
  return tuple(sorted(found))


_SNIFF_BYTES = 8192


def _is_text(path: str) -> bool:
  with open(path, "rb") as f:
    return b"\0" not in f.read(_SNIFF_BYTES)


def _text_file(root: str, path: str) -> tuple[str, int] | None:
  """(path relative to root, size) if path is a non-empty text file, else None."""
  try:
    if not os.path.isfile(path) or not os.path.getsize(path) or not _is_text(path):
      return None
  except OSError:  # unreadable: skipped like a binary file
    return None
  return os.path.relpath(path, root), os.path.getsize(path)


def _glob_root(pattern: str) -> str:
  """The directory of a glob before its first wildcard (its files' paths are relative to it)."""
  parts = pattern.split(os.sep)
  fixed = []
  for part in parts[:-1]:
    if glob.escape(part) != part:
      break
    fixed.append(part)
  return os.sep.join(fixed) or ("/" if pattern.startswith(os.sep) else ".")


@functools.cache
def list_text(text_dir: str) -> tuple[str, tuple[tuple[str, int], ...]]:
  """(root, ((relative path, size), ...)) of the text files data.text_dir names, sorted.

  Raises one ValueError naming the field when it names nothing or no non-empty text file.
  """
  where = f"data.text_dir={text_dir!r}"
  path = os.path.expanduser(text_dir)
  if os.path.isfile(path):
    root = os.path.dirname(path) or "."
    found = [_text_file(root, path)]
    if found[0] is None:
      raise ValueError(f"{where} is empty or binary (a NUL byte in its first 8 KiB); "
                       f"give a text file")
  elif os.path.isdir(path):
    root, found = path, []
    for dirpath, dirnames, filenames in os.walk(path):
      dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
      found += [_text_file(root, os.path.join(dirpath, n)) for n in filenames
                if not n.startswith(".")]
  elif glob.escape(path) != path:
    root = _glob_root(path)
    found = [_text_file(root, p) for p in glob.glob(path, recursive=True)]
  else:
    raise ValueError(f"{where} does not exist; give a directory, a file or a glob of text "
                     f"files (or None for the default corpus)")
  found = [f for f in found if f is not None]
  if not found:
    raise ValueError(f"{where} holds no non-empty text file (binary files are skipped)")
  return root, tuple(sorted(found))


def _split_one_file(root: str, relpath: str, size: int, split: str, valid_fraction: float):
  """A single file's split: its first (1 - valid_fraction) bytes train, the rest validate."""
  if size < 2:
    raise ValueError(f"data.text_dir={os.path.join(root, relpath)!r} has {size} byte; a single "
                     f"file needs at least 2 (one to train on, one to validate)")
  held = min(size - 1, max(1, round(size * valid_fraction)))
  start, stop = (0, size - held) if split == "train" else (size - held, size)
  return root, [(relpath, start, stop)], stop - start + 1


def split_files(config, split: str) -> tuple[str, list, int]:
  """(root, documents, total tokens) of the "train" or "valid" split."""
  if not 0.0 < config.valid_fraction < 1.0:
    raise ValueError(f"data.valid_fraction={config.valid_fraction} must lie in (0, 1)")
  if config.text_dir is None:
    root = default_root()
    listed = list_files(root)
  else:
    root, listed = list_text(config.text_dir)
  if len(listed) == 1:
    root, docs, tokens = _split_one_file(root, *listed[0], split, config.valid_fraction)
    if config.get("tokenizer"):
      tokens = _token_count(root, tuple(docs), config.tokenizer)
    return root, docs, tokens
  want_valid = {"train": False, "valid": True}[split]
  files = [(p, n) for p, n in listed if is_validation(p, config.valid_fraction) == want_valid]
  if config.max_files is not None:
    if config.max_files < 1:
      raise ValueError(f"data.max_files={config.max_files} must be >= 1 or None")
    n_valid = max(1, math.ceil(config.max_files * config.valid_fraction))
    keep = config.max_files if split == "train" else n_valid
    files = files[:keep]
  if not files:
    raise ValueError(f"the {split} split of data.text_dir={root!r} is empty "
                     f"(data.valid_fraction={config.valid_fraction}); add files or change it")
  docs = [p for p, _ in files]
  if config.get("tokenizer"):
    return root, docs, _token_count(root, tuple(docs), config.tokenizer)
  # Each document contributes its bytes plus one DOC token.
  return root, docs, sum(n + 1 for _, n in files)


def _read_bytes(root: str, doc) -> bytes:
  relpath, start, stop = (doc, 0, None) if isinstance(doc, str) else doc
  with open(os.path.join(root, relpath), "rb") as f:
    f.seek(start)
    return f.read() if stop is None else f.read(stop - start)


def read_document(root: str, doc, *, tokenizer=None, doc_token: int = DOC
                  ) -> dict[str, np.ndarray]:
  """One document as a next-token pair of int32 arrays of equal length (tokens + 1): its
  bytes, or its text's ids under `tokenizer` (a tokenizers.Tokenizer), framed by doc_token."""
  raw = _read_bytes(root, doc)
  if tokenizer is None:
    data = np.frombuffer(raw, np.uint8).astype(np.int32)
  else:
    data = np.asarray(_encode(tokenizer, raw), np.int32)
  doc = np.concatenate([[doc_token], data, [doc_token]]).astype(np.int32)
  return {"inputs": doc[:-1], "targets": doc[1:]}


def _encode(tokenizer, raw: bytes) -> list[int]:
  return tokenizer.encode(raw.decode("utf-8", errors="replace"), add_special_tokens=False).ids


# --- a tokenizer instead of bytes ------------------------------------------------------


def _tokenizer(config):
  return tokenizer_json.load(config.tokenizer, field="data.tokenizer")


def check_tokenizer(config) -> None:
  """One ValueError naming the data.* field: tokenizer, doc_token and vocab_size together."""
  path, vocab, doc = (config.get(f) for f in ("tokenizer", "vocab_size", "doc_token"))
  if config.task != "text":
    for field, value in (("tokenizer", path), ("vocab_size", vocab), ("doc_token", doc)):
      if value is not None:
        raise ValueError(f"data.{field}={value!r} is read by data.task='text' only; "
                         f"unset it for data.task={config.task!r}")
    return
  if path is None and doc is not None:
    raise ValueError(f"data.doc_token={doc!r} needs data.tokenizer (the byte corpus's "
                     f"document token is {DOC})")
  vocab_size(config)
  doc_token(config)


def vocab_size(config) -> int:
  """The model's vocabulary for the text task: bytes + DOC, or the tokenizer's, or
  data.vocab_size when set (not smaller than what the data holds)."""
  own, what = VOCAB_SIZE, "the byte corpus's vocabulary"
  if config.get("tokenizer"):
    own, what = tokenizer_json.vocab_size(_tokenizer(config)), (
        f"data.tokenizer={config.tokenizer!r}'s vocabulary")
  wanted = config.get("vocab_size")
  if wanted is None:
    return own
  if wanted < own:
    raise ValueError(f"data.vocab_size={wanted} is smaller than {what} ({own}); set it to "
                     f">= {own} or None")
  return wanted


def doc_token(config) -> int:
  """The id that marks document boundaries (DOC for bytes)."""
  if not config.get("tokenizer"):
    return DOC
  token = config.get("doc_token")
  if token is None:
    token = tokenizer_json.eos_beside(config.tokenizer)
    if token is None:
      raise ValueError(f"data.doc_token is None and no eos_token_id is written beside "
                       f"data.tokenizer={config.tokenizer!r} (generation_config.json or "
                       f"config.json); set data.doc_token to the id that ends a document")
  vocab = vocab_size(config)
  if not 0 <= token < vocab:
    raise ValueError(f"data.doc_token={token} must lie in [0, {vocab}) (the vocabulary)")
  return token


class DocumentReader:
  """doc -> read_document(...) for this config's tokenizer; picklable (the tokenizer is
  loaded by path in each process that reads)."""

  def __init__(self, config, root: str):
    self.root, self.path = root, config.get("tokenizer")
    self.doc_token = doc_token(config)

  def __call__(self, doc) -> dict[str, np.ndarray]:
    tok = None if self.path is None else tokenizer_json.load(self.path, field="data.tokenizer")
    return read_document(self.root, doc, tokenizer=tok, doc_token=self.doc_token)


@functools.lru_cache(maxsize=16)
def _token_count_cached(root: str, docs: tuple, path: str, mtime: float) -> int:
  del mtime  # part of the key: an edited tokenizer is counted again
  tok = tokenizer_json.load(path, field="data.tokenizer")
  return sum(len(_encode(tok, _read_bytes(root, d))) + 1 for d in docs)


def _token_count(root: str, docs: tuple, path: str) -> int:
  """Tokens the documents give under the tokenizer, one document token each included."""
  tokenizer_json.load(path, field="data.tokenizer")  # its one-line errors first
  return _token_count_cached(root, docs, path, os.path.getmtime(path))
