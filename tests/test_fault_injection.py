"""Fault injection: a text run killed (SIGKILL, SIGTERM) at 20 random steps, some while a
checkpoint is being written, must end with the losses of the uninterrupted run, bitwise, and
record each step once.

The seed is random per run and printed; POSENC_FAULT_SEED=<seed> replays a failing schedule.
Every segment is a process forked from one warm process (tests/fault_segment.py), sharing a
persistent compilation cache in the test's directory, so a restart costs the backend start,
the tracing and a restore, not the imports and compiles.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import numpy as np

from experiments import report
from tests import fault_segment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILLS = 20


def _corpus(root) -> str:
  """A few small text files (the byte-level model's documents), fixed by a seed."""
  rng = np.random.default_rng(0)
  root.mkdir()
  for i in range(12):
    size = int(rng.integers(10, 120))
    (root / f"m{i}.py").write_bytes(rng.integers(32, 127, size, dtype=np.uint8).tobytes())
  return str(root)


def schedule(seed: int) -> list[tuple[int, str, str]]:
  """KILLS (step, signal, where) in increasing step order: each segment reaches its kill
  step, since a run resumes at or before the previous kill's step.

  The first is a SIGTERM inside the first shuffle window, whose saved positions the text
  iterator's state used to get wrong; the others are random.
  """
  rng = np.random.default_rng(seed)
  first_window = fault_segment.SHUFFLE_WINDOW // 2  # steps, at batch 2
  first = int(rng.integers(1, first_window))
  later = rng.choice(np.arange(first + 1, fault_segment.STEPS), KILLS - 1, replace=False)
  kills = [(first, "SIGTERM", "step")]
  for step in sorted(later.tolist()):
    sig = str(rng.choice(["SIGKILL", "SIGTERM"]))
    in_save = step % fault_segment.CHECKPOINT_EVERY == 0 and rng.random() < 0.7
    kills.append((int(step), sig, "save" if in_save else "step"))
  return kills


class _Zygote:
  """The warm process that forks each segment."""

  def __init__(self, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    self._proc = subprocess.Popen([sys.executable, "-m", "tests.fault_segment"], cwd=REPO,
                                  env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
    self._tmp, self._n = tmp_path, 0
    self.cpu_s: list[float] = []  # each segment's, shown with a failure

  def run(self, **job) -> tuple[int, str]:
    """(exit code, log path) of one segment."""
    self._n += 1
    log = str(self._tmp / f"segment{self._n}.log")
    self._proc.stdin.write(json.dumps({**job, "log": log}) + "\n")
    self._proc.stdin.flush()
    answer = self._proc.stdout.readline()
    assert answer, "the fault_segment process died"
    answer = json.loads(answer)
    self.cpu_s.append(round(answer["cpu_s"], 1))
    return answer["code"], log

  def close(self) -> None:
    self._proc.stdin.close()
    self._proc.wait(timeout=60)


def _train_records(workdir: str) -> list[tuple[int, float]]:
  return [(r["step"], r["loss"]) for r in report.read_metrics(workdir) if r["kind"] == "train"]


def test_killed_runs_resume_bitwise(tmp_path):
  seed = int(os.environ.get("POSENC_FAULT_SEED", secrets.randbits(31)))
  print(f"POSENC_FAULT_SEED={seed}")
  kills = schedule(seed)
  common = {"corpus": _corpus(tmp_path / "corpus"), "cache": str(tmp_path / "jax_cache")}
  zygote = _Zygote(tmp_path)
  try:
    code, log = zygote.run(workdir=str(tmp_path / "straight"), **common)
    assert code == 0, open(log).read()[-3000:]
    work = str(tmp_path / "killed")
    for kill in kills:
      code, log = zygote.run(workdir=work, kill=kill, **common)
      expected = -9 if kill[1] == "SIGKILL" else 143
      assert code == expected, (f"seed {seed}, kill {kill}: exit {code}, expected {expected}\n"
                                + open(log).read()[-3000:])
    code, log = zygote.run(workdir=work, **common)
    assert code == 0, f"seed {seed}: the final segment failed\n" + open(log).read()[-3000:]
  finally:
    zygote.close()
    print(f"segments' CPU seconds: {zygote.cpu_s}")
  straight, killed = _train_records(str(tmp_path / "straight")), _train_records(work)
  assert [s for s, _ in straight] == list(range(1, fault_segment.STEPS + 1))
  assert [s for s, _ in killed] == [s for s, _ in straight], f"seed {seed}: steps recorded"
  differ = [s for (s, a), (_, b) in zip(straight, killed) if a != b]
  assert not differ, f"seed {seed}, kills {kills}: losses differ from step {differ[0]} on"


def test_schedule_is_seeded_and_reaches_every_kill():
  assert schedule(3) == schedule(3) and schedule(3) != schedule(4)
  for seed in range(20):
    kills = schedule(seed)
    steps = [k[0] for k in kills]
    assert len(kills) == KILLS and steps == sorted(set(steps))
    assert all(0 < s < fault_segment.STEPS for s in steps)
    assert kills[0][1] == "SIGTERM" and kills[0][0] < fault_segment.SHUFFLE_WINDOW // 2
    assert all(s % fault_segment.CHECKPOINT_EVERY == 0 for s, _, where in kills if where == "save")
