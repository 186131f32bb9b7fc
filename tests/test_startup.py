"""The start-up timeline (experiments.startup) and the benchmark that reads it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from experiments import startup
from experiments.benchmarks import cli_startup


def test_timeline_keeps_the_first_mark_and_gives_each_stage_its_own_seconds(monkeypatch):
  now = iter([10.5, 12.0, 13.0, 17.25])
  monkeypatch.setattr(startup.time, "time", lambda: next(now))
  tl = startup.Timeline(origin=10.0)
  tl.mark("imports")   # 0.5
  tl.mark("devices")   # 2.0
  tl.mark("imports")   # ignored: a stage is timed once
  tl.mark("compile")   # 7.25
  assert tl.marks == {"imports": 0.5, "devices": 2.0, "compile": 7.25}
  assert tl.durations() == {"imports": 0.5, "devices": 1.5, "compile": 5.25}
  assert tl.line() == "start-up 7.2 s: imports 0.5, devices 1.5, compile 5.2"
  with pytest.raises(ValueError, match="unknown start-up stage 'warmup'"):
    tl.mark("warmup")


def test_cli_startup_renders_stage_seconds_and_errors():
  marks = {"imports": 4.0, "devices": 9.0, "checks": 9.5, "checkpoint": 9.5, "model": 12.0,
           "data": 12.5, "eval_sets": 12.5, "state": 20.0, "compile": 60.0, "first_step": 61.0,
           "trained": 66.0, "saved": 68.5}
  rows = [{"encoding": "path", "run": "cold", "size": "134m", "startup_s": marks,
           "xla_compiles": [["_init_state", 9.1], ["_train_step", 38.0]],
           "tokens_per_s": 338123.4, "wall_s": 70.2},
          {"encoding": "rope", "run": "warm", "size": "134m", "error": "timeout after 400 s"}]
  table = cli_startup.render(rows).splitlines()
  assert table[2] == ("|  | path | cold | 4.0 | 5.0 | 0.5 | 0.0 | 2.5 | 0.5 | 0.0 | 7.5 | 40.0 "
                      "| 1.0 | 5.0 | 2.5 | 61.0 | 1 | 338,123 | 70.2 |")
  assert table[3] == "|  | rope | warm | error: timeout after 400 s |"


@pytest.mark.slow
def test_cli_startup_runs_the_command_cold_then_warm(tmp_path):
  out = tmp_path / "rows.jsonl"
  subprocess.run([sys.executable, "-m", "experiments.benchmarks.cli_startup", "--size", "tiny",
                  "--encodings", "rope", "--steps", "12", "--root", str(tmp_path / "runs"),
                  "--out", str(out)], check=True, cwd=cli_startup.REPO, timeout=300)
  cold, warm = [json.loads(line) for line in out.read_text().splitlines()]
  for row in (cold, warm):
    assert list(row["startup_s"]) == list(startup.STAGES)
    assert row["tokens_per_s"] > 0 and [s for s, _ in row["windows_tokens_per_s"]] == [10, 12]
  assert "XLA" in cold["compile_line"] and "compilation cache" in warm["compile_line"]


def test_retraces_keeps_jax_reasons_for_the_named_function_only():
  stderr = """noise
TRACING CACHE MISS at a.py:3 (<module>):
  never seen function:
    _train_step id=1 defined at train.py:9
TRACING CACHE MISS at a.py:3 (<module>):
  for _train_step defined at train.py:9
  all previously seen cache keys differ. For the closest previous key:
  different input types:
  * at state['params']['gate'], now f32[4] and before bf16[4]
TRACING CACHE MISS at a.py:5 (<module>):
  for _eval_step defined at train.py:20
  different input types:
"""
  found = cli_startup.retraces(stderr, "_train_step")
  assert len(found) == 1 and found[0].endswith("now f32[4] and before bf16[4]")
