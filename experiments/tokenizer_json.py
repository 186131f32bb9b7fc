"""A `tokenizers` tokenizer.json (what transformers checkpoints ship) for the text task and
experiments.generate.

  tok = tokenizer_json.load(path, field="data.tokenizer")   # one-line ValueError naming field
  tokenizer_json.vocab_size(tok), tokenizer_json.eos_beside(path)

The end-of-text token is not in tokenizer.json: a checkpoint states it as eos_token_id in
generation_config.json or config.json beside it (a list's first entry is taken: the
generation loop stops at one id). experiments.import_hf writes generation_config.json into
the workdir it fills, so the copy of tokenizer.json there keeps it. Files are read once per
path and modification time.
"""
from __future__ import annotations

import functools
import json
import os

EOS_FILES = ("generation_config.json", "config.json")
FILE = "tokenizer.json"  # a checkpoint's, and a workdir's copy (experiments.import_hf)


def load(path: str, *, field: str):
  """The tokenizers.Tokenizer in `path`; ValueError naming `field` when it cannot be read."""
  if not os.path.isfile(path):
    raise ValueError(f"{field}={path!r} does not exist; give a tokenizer.json file (as "
                     f"transformers' save_pretrained writes it)")
  try:
    import tokenizers  # noqa: F401  (optional: only runs that use a tokenizer need it)
  except ImportError:
    raise ValueError(f"{field}={path!r} needs the tokenizers package: pip install "
                     f"tokenizers") from None
  try:
    return _read(os.path.abspath(path), os.path.getmtime(path))
  except Exception as e:  # pylint: disable=broad-except  # the Rust side raises its own types
    raise ValueError(f"{field}={path!r} is not a tokenizers tokenizer.json "
                     f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime: float):
  del mtime  # part of the cache key: an edited file is read again
  import tokenizers
  return tokenizers.Tokenizer.from_file(path)


def vocab_size(tok) -> int:
  """Ids the tokenizer can emit: its vocabulary with the added (special) tokens."""
  return tok.get_vocab_size(with_added_tokens=True)


def eos_beside(path: str) -> int | None:
  """eos_token_id from generation_config.json, else config.json, in path's directory."""
  where = os.path.dirname(os.path.abspath(path))
  for name in EOS_FILES:
    try:
      with open(os.path.join(where, name)) as f:
        value = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
      continue
    if isinstance(value, list):
      value = value[0] if value else None
    if isinstance(value, int) and not isinstance(value, bool):
      return value
  return None
