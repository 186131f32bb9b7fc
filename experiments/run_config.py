"""A run's config in its workdir: config.json, what a resumed run may change, and the history.

WORKDIR/config.json is the whole config of the run's latest segment (experiments.generate
and the reports read it). A resumed run (one whose workdir holds a checkpoint) must train
under the config that wrote it: a change to any field that alters the numbers trained
(learning rate, schedule, seed, batch, data, model, ...) stops the run with one line naming
the changed fields, unless config.train.allow_config_change=True. Fields that leave the
trained numbers alone may change freely: train.steps (a finished run continues with more),
the warmup (configs derive it from the steps), logging / checkpoint / evaluation cadence, the
mesh and speed-only choices (CHANGEABLE).

History: when a resumed run's config differs from config.json in any field, the old file is
kept as config.<step>.json, <step> being the step it trained up to, before config.json is
rewritten.
"""
from __future__ import annotations

import json
import os

from experiments.errors import RunError

CONFIG = "config.json"
ABSENT = "<absent>"
# Field names, or prefixes ending in "." / "_", that may differ when a run resumes.
CHANGEABLE = ("train.steps", "train.warmup_steps", "train.log_every", "train.checkpoint_every",
              "train.allow_config_change", "train.compile_cache_dir", "train.divergence_",
              "train.init_from",
              "eval.", "mesh.", "sweep.", "distributed.", "data.read_threads",
              "data.prefetch_batches", "model.implementation", "model.scan_layers")


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict) and v:
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _changeable(field: str) -> bool:
  return any(field == c or (c[-1] in "._" and field.startswith(c)) for c in CHANGEABLE)


def changes(stored: dict, current: dict) -> list[tuple[str, object, object]]:
  """(field, stored value, current value) for each differing field, sorted by field; a field
  only one side has is reported with ABSENT on the other."""
  a, b = _flat(stored), _flat(current)
  return [(k, a.get(k, ABSENT), b.get(k, ABSENT)) for k in sorted(set(a) | set(b))
          if a.get(k, ABSENT) != b.get(k, ABSENT)]


def as_dict(config) -> dict:
  """The config as config.json holds it (JSON types: tuples become lists)."""
  return json.loads(config.to_json_best_effort())


def stored(workdir: str) -> dict | None:
  """The config.json in workdir, or None; RunError naming the file if it is unreadable."""
  path = os.path.join(workdir, CONFIG)
  try:
    with open(path) as f:
      value = json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    raise RunError(f"{path} is unreadable ({e}); restore it, or delete it to resume under "
                   f"this command's config") from None
  if not isinstance(value, dict):
    raise RunError(f"{path} holds no config (a JSON {type(value).__name__}); restore it, or "
                   f"delete it to resume under this command's config")
  return value


def check_resume(workdir: str, config) -> None:
  """RunError naming the changed fields if resuming workdir would train under another config."""
  old = stored(workdir)
  if old is None or config.train.get("allow_config_change", False):
    return
  # A field one side lacks came or went with the code (the workdir predates it): not a change.
  fixed = [(k, a, b) for k, a, b in changes(old, as_dict(config))
           if not _changeable(k) and ABSENT not in (a, b)]
  if fixed:
    shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in fixed)
    raise RunError(f"--workdir={workdir} was trained with another config ({shown}); rerun with "
                   f"its config, use a new --workdir, or pass "
                   f"--config.train.allow_config_change=True to continue under the new values")


def record(workdir: str, config, *, step: int) -> None:
  """Writes config.json; a differing old one is kept as config.<step>.json when step > 0."""
  path = os.path.join(workdir, CONFIG)
  new = as_dict(config)
  old = stored(workdir) if step > 0 else None
  if old is not None and changes(old, new):
    kept = os.path.join(workdir, f"config.{step}.json")
    if not os.path.exists(kept):  # an earlier change at this step already kept the older one
      os.replace(path, kept)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(config.to_json_best_effort(indent=1))
  os.replace(tmp, path)
