"""Which config a probe rebuilds a trained run from (experiments.probes.load.source_run)."""
from __future__ import annotations

import json
import os

import pytest

from experiments import run_config
from experiments.configs import length_extrapolation
from experiments.probes import load


def _record(workdir, config):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, run_config.CONFIG), "w") as f:
    json.dump(run_config.as_dict(config), f)


def test_a_recorded_run_keeps_the_overrides_it_trained_with(tmp_path):
  """TAPA trained with phase_scale 0.1 from the command line: the config arg alone would
  rebuild it with phase_scale 1 and the same parameter shapes, a silently different model."""
  trained = length_extrapolation.get_config("runlocal,encodings=tapa")
  with trained.unlocked():
    trained.model.encoding = "tapa"
    trained.model.encoding_kwargs = {"phase_scale": 0.1}
    trained.train.learning_rate = 2e-4
  run = str(tmp_path / "tapa" / "seed0")
  _record(run, trained)
  got = load.source_run("length_extrapolation", "runlocal", "tapa", run)
  assert got.model.encoding == "tapa"
  assert dict(got.model.encoding_kwargs) == {"phase_scale": 0.1}
  assert got.train.learning_rate == 2e-4
  assert got.data.seq_len == trained.data.seq_len


def test_without_a_record_the_config_arg_is_rebuilt(tmp_path):
  got = load.source_run("length_extrapolation", "runlocal", "rope", str(tmp_path / "old"))
  want = length_extrapolation.get_config("runlocal")
  assert got.model.encoding == "rope"
  assert got.data.seq_len == want.data.seq_len and got.model.d_model == want.model.d_model


def test_a_record_of_another_encoding_is_one_error(tmp_path):
  run = str(tmp_path / "path" / "seed0")
  config = length_extrapolation.get_config("runlocal")
  with config.unlocked():
    config.model.encoding = "rope"
  _record(run, config)
  with pytest.raises(ValueError, match="trained encoding 'rope', not 'path'"):
    load.source_run("length_extrapolation", "runlocal", "path", run)
