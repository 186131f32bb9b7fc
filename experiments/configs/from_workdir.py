r"""The config a workdir recorded (WORKDIR/config.json), to continue that run as it was set up.

  python -m experiments.main --config=experiments/configs/from_workdir.py:WORKDIR \
      --workdir=WORKDIR [--config.train.steps=N ...]

For workdirs whose config no config file describes, such as the ones experiments.import_hf
writes for a transformers checkpoint. Overrides apply as to any config.
"""
from __future__ import annotations

import json
import os

import ml_collections

from experiments import run_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if not arg:
    raise ValueError("from_workdir.py needs the workdir: --config=experiments/configs/"
                     "from_workdir.py:WORKDIR")
  path = os.path.join(arg, run_config.CONFIG)
  if not os.path.isfile(path):
    raise ValueError(f"{path} does not exist: give a workdir that holds a run's config.json")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))
