"""Runs over several processes: two processes on 127.0.0.1 with 2 CPU devices each train as
one process with 4 devices does, and their checkpoints resume in the other arrangement.

Losses are compared at RTOL: the cross-process all-reduce (gloo) adds the devices' partial
sums in another order than the in-process one, which moves a float32 loss by an ulp or so
(measured: at most 1.2e-7 relative over 6 steps and the eval sets).
"""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from experiments import distributed
from tests import util

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-6
STEPS, EVERY = 6, 3
# One row per mesh the pair trains on (4 devices in all).
MESHES = [
    {"data": 2, "context": 2},   # the layout: each process holds one row block, T split
]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict:
  return util.fake_devices_env(devices)


def _command(workdir, mesh) -> list[str]:
  return [sys.executable, "-m", "experiments.main",
          "--config=experiments/configs/quickstart.py:runlocal,encoding=rope",
          f"--workdir={workdir}", f"--config.train.steps={STEPS}",
          f"--config.train.checkpoint_every={EVERY}", "--config.train.log_every=1",
          "--config.train.batch_size=8", "--config.eval.batch_size=8",
          *(f"--config.mesh.{k}={v}" for k, v in mesh.items())]


def _start(workdir, mesh, *, processes: int) -> list[subprocess.Popen]:
  """experiments.main in `processes` processes sharing 4 CPU devices."""
  if processes == 1:
    return [subprocess.Popen(_command(workdir, mesh), cwd=REPO, env=_env(4), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]
  address = f"127.0.0.1:{_free_port()}"
  return [subprocess.Popen(
      _command(workdir, mesh) + [f"--config.distributed.coordinator={address}",
                                 f"--config.distributed.num_processes={processes}",
                                 f"--config.distributed.process_id={i}"],
      cwd=REPO, env=_env(4 // processes), text=True, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT) for i in range(processes)]


def _wait(procs: list[subprocess.Popen]) -> None:
  try:
    outs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]


def _records(workdir) -> tuple[dict, dict]:
  """({step: train loss}, {(set, length): eval loss}) of the run in workdir."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return ({r["step"]: r["loss"] for r in records if r["kind"] == "train"},
          {(r["set"], r["length"]): r["loss"] for r in records if r["kind"] == "eval"})


def _assert_close(actual: dict, expected: dict, what: str) -> None:
  assert actual.keys() == expected.keys(), what
  for k in expected:
    assert actual[k] == pytest.approx(expected[k], rel=RTOL), f"{what} {k}"


def _forget_last_checkpoint(workdir) -> None:
  """Leaves step EVERY as the newest checkpoint: the next run resumes there."""
  shutil.rmtree(os.path.join(workdir, "checkpoints", str(STEPS)))


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
def test_two_processes_train_and_resume_as_one(tmp_path, mesh):
  one, pair = tmp_path / "one", tmp_path / "pair"
  runs = _start(one, mesh, processes=1) + _start(pair, mesh, processes=2)
  _wait(runs)
  train, evals = _records(one)
  assert sorted(train) == list(range(1, STEPS + 1)) and evals
  _assert_close(_records(pair)[0], train, "pair's train loss at step")
  _assert_close(_records(pair)[1], evals, "pair's eval loss of")
  # Each resumes the other's arrangement from step EVERY: the pair's checkpoint in one
  # process (its arrays resharded onto 4 local devices, its data position from process 0's
  # file), the single process's in the pair.
  _forget_last_checkpoint(one)
  _forget_last_checkpoint(pair)
  _wait(_start(pair, mesh, processes=1) + _start(one, mesh, processes=2))
  for workdir, what in ((pair, "pair -> one"), (one, "one -> pair")):
    resumed_train, resumed_evals = _records(workdir)
    _assert_close(resumed_train, train, f"{what}: train loss at step")
    _assert_close(resumed_evals, evals, f"{what}: eval loss of")


# --- config.distributed ------------------------------------------------------------


def _settings(environ=None, **fields):
  cfg = {"coordinator": None, "num_processes": None, "process_id": None, **fields}
  return distributed.settings(cfg, environ=environ or {})


def test_settings_from_config_and_environment():
  assert _settings() is None
  want = {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}
  assert _settings(coordinator="10.0.0.1:1234", num_processes=2, process_id=1) == want
  environ = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2",
             "JAX_PROCESS_ID": "1"}
  assert _settings(environ) == want


@pytest.mark.parametrize("fields, environ, message", [
    ({"coordinator": "10.0.0.1", "num_processes": 2, "process_id": 0}, {},
     r"config.distributed.coordinator='10.0.0.1' must be HOST:PORT"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, {},
     r"config.distributed.process_id=2 must be an integer in \[0, 1\]"),
    ({"coordinator": "h:1", "num_processes": 0, "process_id": 0}, {},
     r"config.distributed.num_processes=0 must be an integer >= 1"),
    ({"num_processes": 2}, {}, r"config.distributed.coordinator is unset while "
     r"config.distributed.num_processes=2 is set"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"},
     r"JAX_COORDINATOR_ADDRESS is set but JAX_PROCESS_ID is not"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     r"JAX_NUM_PROCESSES='two' must be an integer >= 1"),
])
def test_bad_settings_name_the_field(fields, environ, message):
  with pytest.raises(ValueError, match=message):
    _settings(environ, **fields)


def test_cli_bad_process_id_is_one_error_line(tmp_path):
  result = subprocess.run(
      _command(tmp_path, MESHES[0]) + ["--config.distributed.coordinator=127.0.0.1:1",
                                       "--config.distributed.num_processes=2",
                                       "--config.distributed.process_id=5"],
      cwd=REPO, env=_env(4), text=True, capture_output=True, timeout=120, check=False)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "error: config.distributed.process_id=5 must be an integer in [0, 1] (num_processes=2)"]


def test_pair_on_a_locked_workdir_stops_in_both_processes(tmp_path):
  """Process 0 cannot take run.lock: each process prints one error line and exits with 2
  (process 1 does not wait for process 0 at the first step until a timeout)."""
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys; from experiments import workdir_lock; "
       "lock = workdir_lock.hold(sys.argv[1]); lock.__enter__(); print('held', flush=True); "
       "sys.stdin.read()", str(tmp_path)],
      cwd=REPO, env=_env(1), text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  procs = []
  try:
    assert holder.stdout.readline().strip() == "held"
    procs = _start(tmp_path, MESHES[0], processes=2)
    outs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    holder.kill()
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [2, 2], outs
  errors = [[line for line in out.splitlines() if line.startswith("error: ")] for out in outs]
  assert len(errors[0]) == 1 and "is in use by another run" in errors[0][0], outs[0]
  assert len(errors[1]) == 1 and "process 0 could not take run.lock" in errors[1][0], outs[1]


def test_shutdown_ends_the_service_after_the_clients(monkeypatch):
  """Process 0's coordination service outlives the clients' shutdown barrier by
  SERVICE_GRACE_S (the peers' last calls would otherwise reach a server being destroyed);
  without a service (process > 0, or one process) only the clients end."""
  from jax._src import distributed as jax_distributed

  events = []

  class Service:
    def shutdown(self):
      events.append("service")

  class State:
    def __init__(self, service):
      self.service = service

    def shutdown(self):  # what jax.distributed.shutdown calls
      events.append(("clients", self.service))

  monkeypatch.setattr(distributed.time, "sleep", lambda s: events.append(("sleep", s)))
  monkeypatch.setattr(jax_distributed, "global_state", State(Service()))
  distributed.shutdown()
  assert events == [("clients", None), ("sleep", distributed.SERVICE_GRACE_S), "service"]
  assert distributed.SERVICE_GRACE_S >= 0.5
  events.clear()
  monkeypatch.setattr(jax_distributed, "global_state", State(None))
  distributed.shutdown()
  assert events == [("clients", None)]
