"""One look per encoding and per evaluation set, shared by every plot of the project.

A reader compares plots across folders: PaTH must be the same red in the flip-flop bars, the
length curves and the word-problem depths. Every plotting module takes its colours, markers
and line styles from here and from nowhere else.

  encoding(name)  -> {"color", "marker", "linestyle"} for matplotlib's plot()
  eval_set(name)  -> the same for an evaluation set ("train", "id", "sparse", "dense", ...)
  dodge(i, n)     -> a small horizontal offset for the i-th of n series, so that series with
                     equal values (two encodings at 20.2%, three sets at 0 error) stay visible
  marker_size(i)  -> decreasing marker sizes: coincident points are drawn as nested rings

Value-transport variants (`*_v`) share their base's hue family, lighter, with dashed lines.
"""
from __future__ import annotations

import hashlib

# name: (colour, marker, linestyle). Colour-blind-safe hues for the encodings that appear
# together most (path, path_fox, rope, fox, alibi); the rest are distinct but quieter.
ENCODINGS = {
    "path": ("#d62728", "o", "-"),
    "path_fox": ("#9467bd", "s", "-"),
    "rope": ("#1f77b4", "^", "-"),
    "rope_v": ("#6baed6", "^", "--"),
    "rope_pi": ("#08306b", "v", ":"),
    "rope_ntk": ("#2171b5", "<", ":"),
    "rope_yarn": ("#4292c6", ">", ":"),
    "rope_llama3": ("#08519c", "1", ":"),
    "fox": ("#2ca02c", "D", "-"),
    "alibi": ("#7f7f7f", "v", "-"),
    "nope": ("#000000", "x", "-"),
    "grape_ap": ("#8c564b", "P", "-"),
    "grape_a_qk": ("#c49c94", "p", "-"),
    "grape_a_q": ("#a0522d", "p", "--"),
    "grape_a_k": ("#deb887", "p", ":"),
    "grape_m": ("#bcbd22", "h", "-"),
    "grape_m_ctx": ("#17becf", "H", "-"),
    "grape_m_rank2": ("#8c8c00", "h", "--"),
    "grape_m_noncommuting": ("#dbdb8d", "h", ":"),
    "acc_rot_random": ("#a6761d", "<", "-"),
    "acc_rot_random_v": ("#d9b365", "<", "--"),
    "acc_rot_learned": ("#e377c2", ">", "-"),
    "acc_rot_learned_v": ("#c51b7d", ">", "--"),
    "tapa": ("#ff7f0e", "*", "-"),
    "tapa_linear": ("#fdae6b", "*", "--"),
    "sba": ("#e6ab02", "d", "-"),
    "kv_shift": ("#525252", "|", "-"),
}

# Evaluation sets: one look each, in the per-run plots and the flip-flop bars alike.
EVAL_SETS = {
    "train": ("#000000", "", "-"),
    "id": ("#1b9e77", "o", "-"),
    "sparse": ("#d95f02", "s", "--"),
    "dense": ("#7570b3", "^", ":"),
    "valid": ("#e7298a", "D", "-"),
    "test": ("#66a61e", "v", "-"),
}

_FALLBACK = ("#006d5b", "#666666", "#1b7837", "#762a83", "#b35806", "#01665e")
_FALLBACK_MARKERS = ("o", "s", "^", "D", "v", "P")


def _fallback(name: str) -> tuple[str, str, str]:
  # A name without an entry (a new encoding) still gets the same look in every plot.
  h = int(hashlib.sha256(name.encode()).hexdigest(), 16)
  return (_FALLBACK[h % len(_FALLBACK)], _FALLBACK_MARKERS[(h // 7) % len(_FALLBACK_MARKERS)],
          "-.")


def _style(table: dict, name: str) -> dict:
  color, marker, linestyle = table.get(name) or _fallback(name)
  return {"color": color, "marker": marker, "linestyle": linestyle}


def encoding(name: str) -> dict:
  """plot() keywords for encoding `name` (a kv_shift suffix keeps the base's look)."""
  return _style(ENCODINGS, name.removesuffix(" + kv_shift"))


def eval_set(name: str) -> dict:
  return _style(EVAL_SETS, name)


def set_order(names) -> list[str]:
  """Evaluation sets in EVAL_SETS' order (id, sparse, dense, ...), unknown ones last by name."""
  known = list(EVAL_SETS)
  return sorted(set(names), key=lambda n: (known.index(n) if n in known else len(known), n))


def dodge(i: int, n: int, *, width: float = 0.24) -> float:
  """Offset of series i of n, spread evenly over `width` and centred on 0."""
  return 0.0 if n <= 1 else width * (i / (n - 1) - 0.5)


def marker_size(i: int, *, largest: float = 9.0, step: float = 1.6, smallest: float = 3.0) -> float:
  return max(smallest, largest - step * i)
