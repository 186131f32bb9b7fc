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
  # As JAX logs them through absl, one behind the progress bar's carriage return.
  stderr = """noise
W1129 04:10:22.4 1 partial_eval.py:1951] TRACING CACHE MISS at :
  never seen function:
    _train_step id=1 defined at train.py:9
\rpath:   8%|8         | 1/12 [00:34<06:19, 34.52s/step]W1129 04:10:51.4 1 partial_eval.py:1959] \
TRACING CACHE MISS at train.py:322:27 (_train):
  for _train_step defined at train.py:9
  all previously seen cache keys differ. For the closest previous key:
  Tracing context doesn't match, e.g. due to config or context manager.
  * number of tracing context values differs: now 51 and before 50
W1129 04:10:52.6 1 partial_eval.py:1951] TRACING CACHE MISS at model.py:344:9 (embed_tokens):
  for _eval_step defined at train.py:20
  different input types:
W1129 04:10:53.1 1 dispatch.py:204] Finished tracing _train_step for jit in 1.67 sec
"""
  found = cli_startup.retraces(stderr, "_train_step")
  assert len(found) == 1 and found[0].endswith("now 51 and before 50")
