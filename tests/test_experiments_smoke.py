"""End-to-end smoke test of every paper-reproduction experiment at its runlocal size.

Each experiment's config is run through the same code path as its committed command
(experiments.sweeps.run_sweep + results_writers.write, the probes' run + write), with one
or two encodings to keep it short; the probes read a length_extrapolation checkpoint
trained here. Besides "it runs", it checks the results files' contracts and two facts the
probes must get right: attention mass sums to 1 and RoPE's route transport is
route-independent (first moment exactly 1).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from experiments import results_writers
from experiments import sweeps

pytestmark = pytest.mark.slow

PROV = {"command": "pytest", "machine": "test", "jax": "-", "date": "-", "wall_time_s": 0,
        "train_time_s": 0}


def _sweep(name: str, arg: str, workdir: str, out: str) -> dict:
  mod = __import__(f"experiments.configs.{name}", fromlist=["get_config"])
  config = mod.get_config(arg)
  summaries = sweeps.run_sweep(config, workdir, log=lambda *_: None)
  results_writers.write(config.sweep.experiment, summaries, config, out, PROV)
  for f in ("results.json", "README.md"):
    assert os.path.getsize(os.path.join(out, f)) > 0
  assert any(f.endswith(".png") for f in os.listdir(out))
  with open(os.path.join(out, "results.json")) as f:
    return json.load(f)


def test_synthetic_experiments(tmp_path):
  r = _sweep("flipflop", "runlocal,encodings=rope+path", str(tmp_path / "ff"), str(tmp_path / "ffr"))
  assert set(r) == {"rope", "path"}
  assert all(0 <= r[n][f"{s}_error"] <= 1 for n in r for s in ("id", "sparse", "dense"))
  r = _sweep("word_problem", "runlocal,encodings=path", str(tmp_path / "wp"), str(tmp_path / "wpr"))
  assert 0 <= r["A5"]["accuracy"]["path"]["1"] <= 1
  r = _sweep("mqrar", "runlocal,encodings=fox", str(tmp_path / "mq"), str(tmp_path / "mqr"))
  assert 0 <= r["accuracy"]["fox"]["2"] <= 1


def test_length_extrapolation_and_probes(tmp_path):
  from experiments.configs import distance_bias as db_config
  from experiments.configs import mixing_window as mw_config
  from experiments.probes import distance_bias
  from experiments.probes import mixing_window

  wd = str(tmp_path / "le")
  r = _sweep("length_extrapolation", "runlocal,encodings=rope+path", wd, str(tmp_path / "ler"))
  assert r["train_len"] == 16 and set(r["encodings"]["rope"]) == {"16", "32", "64"}
  assert all(np.isfinite(v) and v > 1 for e in r["encodings"].values() for v in e.values())

  c = db_config.get_config(f"runlocal,encodings=rope,source_workdir={wd},source_arg=runlocal")
  res, hists = distance_bias.run(c)
  distance_bias.write(c, res, hists, str(tmp_path / "db"), PROV)
  assert set(res) == {"random_rho0.0", "random_rho0.5", "trained_layer0", "trained_layer1"}
  # Matching random content at short range scores higher than at 10^4 (RoPE's decay).
  assert res["random_rho0.5"]["rope"]["mean"] > 0.3

  c = mw_config.get_config(f"runlocal,encodings=rope+path,source_workdir={wd},source_arg=runlocal")
  res = mixing_window.run(c)
  mixing_window.write(c, res, str(tmp_path / "mw"), PROV)
  for name in ("rope", "path"):
    assert abs(sum(res[name]["attention_mass"].values()) - 1) < 1e-4
    assert 0 < res[name]["cancellation_plain"] <= 1 + 1e-6
  # RoPE transports every route of length r by the same rotation: ||E[T]|| = 1.
  np.testing.assert_allclose(list(res["rope"]["first_moment_spectral"].values()), 1.0, atol=1e-6)
  assert all(0 < v <= 1 + 1e-6 for v in res["path"]["first_moment_spectral"].values())
