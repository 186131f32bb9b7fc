"""A bad config fails before anything compiles: one `error:` line naming the field, exit 2."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from experiments import train
from experiments.configs import quickstart

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "--config=experiments/configs/quickstart.py:runlocal,encoding=rope"


def _main(workdir, *overrides):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "experiments.main", CONFIG, f"--workdir={workdir}",
                         *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)


def _assert_one_error_line(proc, *fragments):
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1, proc.stderr[-2000:]
  for f in fragments:
    assert f in errors[0], errors[0]


ROWS = [
    (["--config.model.encoding=bogus"], ["config.model.encoding='bogus'", "unknown"]),
    (["--config.model.encoding=kv_shift"], ["config.model.encoding='kv_shift'", "kv_shift=True"]),
    (["--config.model.head_dim=7"], ["config.model", "head_dim=7", "even"]),
    (["--config.model.num_kv_heads=3"], ["config.model.num_kv_heads=3", "multiple"]),
    (["--config.model.d_model=0"], ["config.model.d_model=0"]),
    (["--config.data.task=text", "--config.data.seq_len=1000000000"],
     ["config.data.seq_len=1000000000", "exceeds"]),
    (["--config.eval.lengths=(32,1000000000)", "--config.data.task=text"],
     ["config.eval.lengths", "1000000000"]),
    (["--config.train.warmup_steps=50"], ["config.train.warmup_steps=50"]),
    (["--config.mesh.data=3"], ["config.mesh"]),
    (["--config.model.implementation=pallas:bwd_lanes"],
     ["config.model.implementation='pallas:bwd_lanes'", "not KEY=VALUE"]),
]
# The CLI (a subprocess: ~5 s of CI time a row) runs a model, a data and a mesh row (0, 5, 8);
# the other rows take its same path (main.plan's ValueError printed as one `error:` line, exit
# 2) under -m slow, and test_bad_config_is_refused_by_the_checks holds every row's message
# in-process.
CLI_ROWS = [row if i in (0, 5, 8) else pytest.param(*row, marks=pytest.mark.slow)
            for i, row in enumerate(ROWS)]


@pytest.mark.parametrize("overrides,fragments", CLI_ROWS)
def test_bad_config_is_one_line(tmp_path, overrides, fragments):
  workdir = tmp_path / "run"
  proc = _main(workdir, *overrides)
  _assert_one_error_line(proc, *fragments)
  assert not workdir.exists(), "a rejected config must not start a run"


@pytest.mark.parametrize("overrides,fragments", ROWS)
def test_bad_config_is_refused_by_the_checks(tmp_path, overrides, fragments):
  """Each row in-process through config_checks.check, which experiments.main.plan runs on the
  config before anything compiles: one ValueError line naming the field, no workdir."""
  import ast

  import jax

  from experiments import config_checks
  from experiments import data
  config = quickstart.get_config("runlocal,encoding=rope")
  for override in overrides:
    path, _, text = override.removeprefix("--config.").partition("=")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    *parents, field = path.split(".")
    node = config
    for name in parents:
      node = getattr(node, name)
    setattr(node, field, value)
  workdir = tmp_path / "run"
  with pytest.raises(ValueError) as raised:
    config_checks.check(config, workdir=str(workdir), data_module=data,
                        num_devices=jax.device_count())
  message = str(raised.value)
  assert "\n" not in message, message
  for f in fragments:
    assert f in message, message
  assert not workdir.exists(), "a rejected config must not start a run"


def test_workdir_of_another_model_is_refused(tmp_path):
  config = quickstart.get_config("runlocal,encoding=rope,steps=1")
  config.eval.num_batches = 0
  train.run(config, str(tmp_path))
  proc = _main(tmp_path, "--config.model.num_layers=2")
  _assert_one_error_line(proc, f"--workdir={tmp_path}", "model.num_layers=1 in the checkpoint",
                         "2 in this config")
