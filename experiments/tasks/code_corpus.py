"""The code corpus for the language-modelling experiments: byte-level Python source.

Documents are the non-empty `.py` files under `data.text_dir` (default: the running
interpreter's standard-library directory, `sysconfig.get_paths()["stdlib"]`, without
its site-packages / dist-packages), listed in sorted order of their path relative to
the root so the corpus is the same wherever the same files are.

Hold-out: a file belongs to the validation split iff the first 8 bytes of
sha256(relative path) read as a fraction in [0, 1) fall below `data.valid_fraction`.
The split depends only on the path, so it is stable when `max_files` changes or
files are added. `data.max_files` keeps the first max_files training files and the
first ceil(max_files * valid_fraction) (at least one) validation files, for quick runs.

Tokens: bytes 0..255, plus DOC = 256 which marks a document boundary. A document of
bytes b_1..b_n becomes the pair (inputs = [DOC, b_1, ..., b_n], targets =
[b_1, ..., b_n, DOC]): every byte is predicted, and so is the end of the file.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import sysconfig

import numpy as np

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
  """(relative path, size in bytes) of every non-empty .py file under root, sorted."""
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


def split_files(config, split: str) -> tuple[str, list[str], int]:
  """(root, relative paths, total tokens) of the "train" or "valid" split."""
  root = config.text_dir or default_root()
  if not 0.0 < config.valid_fraction < 1.0:
    raise ValueError(f"data.valid_fraction={config.valid_fraction} must lie in (0, 1)")
  want_valid = {"train": False, "valid": True}[split]
  files = [(p, n) for p, n in list_files(root) if is_validation(p, config.valid_fraction) == want_valid]
  if config.max_files is not None:
    if config.max_files < 1:
      raise ValueError(f"data.max_files={config.max_files} must be >= 1 or None")
    n_valid = max(1, math.ceil(config.max_files * config.valid_fraction))
    keep = config.max_files if split == "train" else n_valid
    files = files[:keep]
  if not files:
    raise ValueError(f"the {split} split of data.text_dir={root!r} is empty "
                     f"(data.valid_fraction={config.valid_fraction}); add files or change it")
  # Each document contributes its bytes plus one DOC token.
  return root, [p for p, _ in files], sum(n + 1 for _, n in files)


def read_document(root: str, relpath: str) -> dict[str, np.ndarray]:
  """One file as a next-token pair of int32 arrays of equal length (bytes + 1)."""
  with open(os.path.join(root, relpath), "rb") as f:
    data = np.frombuffer(f.read(), np.uint8).astype(np.int32)
  doc = np.concatenate([[DOC], data, [DOC]]).astype(np.int32)
  return {"inputs": doc[:-1], "targets": doc[1:]}
