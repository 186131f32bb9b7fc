r"""The config a workdir recorded (WORKDIR/config.json), to continue that run as it was set up.

  python -m experiments.main --config=experiments/configs/from_workdir.py:WORKDIR \
      --workdir=WORKDIR [--config.train.steps=N ...]

For workdirs whose config no config file describes, such as the ones experiments.import_hf
writes for a transformers checkpoint. Overrides apply as to any config. Fields the recorded
config predates keep base.get_config()'s defaults.
"""
from __future__ import annotations

import json
import os

import ml_collections

from experiments import run_config
from experiments.configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if not arg:
    raise ValueError("from_workdir.py needs the workdir: --config=experiments/configs/"
                     "from_workdir.py:WORKDIR")
  path = os.path.join(arg, run_config.CONFIG)
  if not os.path.isfile(path):
    raise ValueError(f"{path} does not exist: give a workdir that holds a run's config.json")
  with open(path) as f:
    return on_defaults(json.load(f))


def on_defaults(recorded: dict) -> ml_collections.ConfigDict:
  """base.get_config() overlaid with a recorded config (model.encoding_kwargs whole: the
  recorded encoding's hyperparameters, not merged with another's)."""
  def overlay(into: dict, over: dict) -> dict:
    for k, v in over.items():
      into[k] = (overlay(into.get(k) or {}, v) if isinstance(v, dict) and k != "encoding_kwargs"
                 else v)
    return into
  return ml_collections.ConfigDict(overlay(base.get_config().to_dict(), recorded))
