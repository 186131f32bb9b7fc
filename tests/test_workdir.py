"""A run's workdir at its edges: one run at a time, damaged or unreadable checkpoints, an
unwritable or full disk, a changed config, a finished run rerun, records after a kill.

Most cases start from one finished 4-step quickstart run (checkpoints at steps 2 and 4),
copied per test; the two CLI cases check that a problem is one stderr line.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from experiments import checkpoint
from experiments import errors
from experiments import generate
from experiments import report
from experiments import run_config
from experiments import train
from experiments import workdir_lock
from experiments.configs import quickstart

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_ARG = "runlocal,encoding=rope"
TRAIN = {"steps": 4, "warmup_steps": 1, "checkpoint_every": 2, "log_every": 1}


def _config(**train_fields):
  c = quickstart.get_config(CONFIG_ARG)
  c.train.update(**{**TRAIN, **train_fields})
  return c


def _cli(workdir: str, *flags: str, file_size_limit: int | None = None
         ) -> subprocess.CompletedProcess:
  """experiments.main on the quickstart config; file_size_limit: RLIMIT_FSIZE in bytes."""
  args = [f"--config=experiments/configs/quickstart.py:{CONFIG_ARG}",
          *(f"--config.train.{k}={v}" for k, v in TRAIN.items()), *flags, f"--workdir={workdir}"]
  # The limit is set by the child itself: a preexec_fn would fork this multithreaded process.
  limit = (f"import resource; resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size_limit},) * 2); "
           if file_size_limit else "")
  run_main = limit + ("import runpy, sys; sys.argv[0] = 'experiments.main'; "
                      "runpy.run_module('experiments.main', run_name='__main__')")
  return subprocess.run([sys.executable, "-c", run_main, *args], cwd=REPO, text=True,
                        capture_output=True, timeout=300, check=False)


def _stderr_lines(stderr: str) -> list[str]:
  """stderr's lines without the progress bar's and the compile and start-up reports'."""
  lines = stderr.replace("\r", "\n").splitlines()
  return [line for line in lines if line.strip()
          and not line.startswith(("rope:", "compiled the train step", "start-up "))]


def _train_records(workdir) -> list[tuple[int, float]]:
  return [(r["step"], r["loss"]) for r in report.read_metrics(str(workdir)) if r["kind"] == "train"]


def _largest_state_file(workdir: str, step: int) -> str:
  root = os.path.join(workdir, "checkpoints", str(step), "state")
  files = [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]
  return max(files, key=os.path.getsize)


def _unwritable(path) -> str:
  """A directory this process cannot create files in: chmod for a user; root ignores that,
  so /sys/kernel, which Linux keeps unwritable even for root."""
  if os.geteuid() != 0:
    path.mkdir()
    path.chmod(0o500)
    return str(path)
  try:
    os.mkdir("/sys/kernel/.posenc-probe")
  except OSError:
    return "/sys/kernel"
  os.rmdir("/sys/kernel/.posenc-probe")
  pytest.skip("no directory here is unwritable for root")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> str:
  workdir = str(tmp_path_factory.mktemp("finished") / "run")
  summary = train.run(_config(), workdir)
  assert summary["step"] == 4 and checkpoint.all_steps(workdir) == [2, 4]
  return workdir


@pytest.fixture
def run_copy(finished, tmp_path) -> str:
  shutil.copytree(finished, tmp_path / "run")
  return str(tmp_path / "run")


# --- one run per workdir -----------------------------------------------------------

HOLD = ("import sys, time; from experiments import workdir_lock; "
        "lock = workdir_lock.hold(sys.argv[1]); lock.__enter__(); print('held', flush=True); "
        "time.sleep(120)")


def _holder(workdir: str) -> subprocess.Popen:
  proc = subprocess.Popen([sys.executable, "-c", HOLD, workdir], cwd=REPO, text=True,
                          stdout=subprocess.PIPE)
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_lock_refuses_a_live_run_and_takes_over_a_killed_ones(tmp_path):
  holder = _holder(str(tmp_path))
  try:
    with pytest.raises(errors.RunError,
                       match=rf"in use by another run \(pid {holder.pid} on host "):
      with workdir_lock.hold(str(tmp_path)):
        pass
  finally:
    holder.kill()  # SIGKILL: no cleanup runs, the kernel drops the flock
    holder.wait()
  with workdir_lock.hold(str(tmp_path)):
    assert json.loads((tmp_path / workdir_lock.LOCK).read_text())["pid"] == os.getpid()


def test_second_command_on_a_workdir_refuses_in_one_line(tmp_path):
  holder = _holder(str(tmp_path))
  try:
    result = _cli(str(tmp_path))
  finally:
    holder.kill()
    holder.wait()
  assert result.returncode == 2
  assert _stderr_lines(result.stderr) == [result.stderr.strip()]
  assert result.stderr.startswith(f"error: --workdir={tmp_path} is in use by another run "
                                  f"(pid {holder.pid} on host ")
  assert not (tmp_path / "metrics.jsonl").exists()


# --- damaged and unreadable checkpoints --------------------------------------------


def test_damaged_latest_checkpoint_falls_back_with_one_warning(run_copy, finished, capfd):
  state_file = _largest_state_file(run_copy, 4)
  with open(state_file, "r+b") as f:
    f.truncate(os.path.getsize(state_file) // 2)
  capfd.readouterr()
  summary = train.run(_config(steps=6), run_copy)
  err = capfd.readouterr().err
  warnings = [line for line in _stderr_lines(err) if line.startswith("warning:")]
  assert len(warnings) == 1 and "Traceback" not in err, err
  rel = os.path.relpath(state_file, os.path.join(run_copy, "checkpoints", "4"))
  assert f"checkpoint step 4 in {run_copy}/checkpoints is damaged ({rel} has " in warnings[0]
  assert warnings[0].endswith("resuming from step 2")
  assert os.path.isdir(os.path.join(run_copy, checkpoint.DAMAGED, "4"))
  assert summary["step"] == 6 and checkpoint.all_steps(run_copy) == [2, 4, 6]
  # The wall time spans the first 4 steps' run too.
  assert summary["wall_time_s"] > json.load(open(os.path.join(finished, "summary.json")))[
      "wall_time_s"]
  records = _train_records(run_copy)
  assert [s for s, _ in records] == [1, 2, 3, 4, 5, 6]
  # Steps 3 and 4 trained again from step 2, under the 6-step schedule.
  assert records[:2] == _train_records(finished)[:2]


def test_flipped_byte_is_found_and_generation_falls_back(run_copy, capsys):
  assert checkpoint.damage(os.path.join(run_copy, "checkpoints", "4")) is None
  state_file = _largest_state_file(run_copy, 4)
  with open(state_file, "r+b") as f:  # restores without error: only the CRC32 tells
    f.seek(os.path.getsize(state_file) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 1]))
  rel = os.path.relpath(state_file, os.path.join(run_copy, "checkpoints", "4"))
  assert checkpoint.damage(os.path.join(run_copy, "checkpoints", "4")) == (
      f"{rel} differs from what was written (CRC32)")
  _, _, step = generate.load_model(run_copy)
  assert step == 2
  warnings = capsys.readouterr().err.strip().splitlines()
  assert len(warnings) == 1 and warnings[0].startswith("warning: checkpoint step 4 in ")
  assert warnings[0].endswith("trying step 2")


def test_unreadable_model_config_or_missing_state_names_the_file(run_copy):
  for step in (2, 4):
    with open(os.path.join(run_copy, "checkpoints", str(step), "config", "metadata"), "w") as f:
      f.write("{not json")
  with pytest.raises(errors.RunError, match=r"no intact checkpoint in .*: step 4: "
                     r"config/metadata has 9 bytes, \d+ were written; step 2: config/metadata"):
    checkpoint.stored_model_config(run_copy)
  with pytest.raises(ValueError, match=r"move .*/checkpoints away to train from step 0"):
    generate.load_model(run_copy)
  for step in (2, 4):
    shutil.rmtree(os.path.join(run_copy, "checkpoints", str(step), "state"))
    os.remove(os.path.join(run_copy, "checkpoints", str(step), checkpoint.INTEGRITY))
  with pytest.raises(errors.RunError,
                     match=r"step 4: state/ is missing; step 2: state/ is missing"):
    checkpoint.stored_model_config(run_copy)


def test_unsealed_step_with_garbage_config_names_the_file(run_copy):
  os.remove(os.path.join(run_copy, "checkpoints", "4", checkpoint.INTEGRITY))  # killed unsealed
  with open(os.path.join(run_copy, "checkpoints", "4", "config", "metadata"), "w") as f:
    f.write("")
  assert checkpoint.damage(os.path.join(run_copy, "checkpoints", "4")).startswith(
      "config/metadata is not valid JSON (Expecting value")
  assert checkpoint.stored_model_config(run_copy)["encoding"] == "rope"  # step 2's


# --- writes that fail -----------------------------------------------------------------


def test_unwritable_checkpoints_stop_before_the_first_step(tmp_path):
  target = _unwritable(tmp_path / "readonly")
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "checkpoints").symlink_to(target)
  with pytest.raises(errors.RunError, match=r"/checkpoints is not writable \(.*\); fix its "):
    train.run(_config(), str(workdir))
  assert not (workdir / "metrics.jsonl").exists()
  with pytest.raises(errors.RunError, match=r"--workdir=.* cannot be created \("):
    train.run(_config(), os.path.join(target, "run"))


def test_full_disk_is_one_line_and_keeps_the_last_checkpoint(run_copy, finished):
  # Files may not grow past 8 KiB: the state of step 6 cannot be written (EFBIG, as a full
  # disk's ENOSPC, fails TensorStore's write), the small records can.
  result = _cli(run_copy, "--config.train.steps=6", file_size_limit=8192)
  assert result.returncode == 2, result.stderr
  lines = _stderr_lines(result.stderr)
  assert len(lines) == 1 and lines[0].startswith(
      f"error: saving checkpoint step 6 in {run_copy}/checkpoints failed ("), result.stderr
  assert lines[0].endswith("step 4 is the newest complete checkpoint; fix the cause (disk "
                           "space, permissions) and run the same command to resume")
  assert checkpoint.all_steps(run_copy) == [2, 4]
  assert checkpoint.damage(os.path.join(run_copy, "checkpoints", "4")) is None
  train.run(_config(steps=6), run_copy)
  assert [s for s, _ in _train_records(run_copy)] == [1, 2, 3, 4, 5, 6]
  assert _train_records(run_copy)[:4] == _train_records(finished)


# --- what a rerun may change -------------------------------------------------------


def test_changed_learning_rate_is_refused_or_kept_in_history(run_copy):
  with pytest.raises(errors.RunError, match=r"was trained with another config "
                     r"\(train.learning_rate 0.003 -> 0.01\); rerun with its config"):
    train.run(_config(steps=6, learning_rate=0.01), run_copy)
  assert json.loads(open(os.path.join(run_copy, "config.json")).read())["train"]["steps"] == 4
  summary = train.run(_config(steps=6, learning_rate=0.01, allow_config_change=True), run_copy)
  assert summary["step"] == 6
  old = json.load(open(os.path.join(run_copy, "config.4.json")))
  new = json.load(open(os.path.join(run_copy, "config.json")))
  assert (old["train"]["learning_rate"], new["train"]["learning_rate"]) == (0.003, 0.01)
  assert [s for s, _ in _train_records(run_copy)] == [1, 2, 3, 4, 5, 6]


def test_unreadable_config_json_names_the_file(run_copy):
  with open(os.path.join(run_copy, "config.json"), "w") as f:
    f.write("")
  with pytest.raises(errors.RunError, match=rf"^{run_copy}/config.json is unreadable \(Expecting "
                     r"value: .*\); restore it, or delete it to resume under this command's "
                     r"config"):
    train.run(_config(steps=6), run_copy)


def test_which_fields_a_resume_may_change():
  stored = run_config.as_dict(_config())
  changed = _config(steps=600, log_every=5, checkpoint_every=100)
  changed.eval.num_batches = 9
  changed.data.seq_len = 64
  changed.model.implementation = "xla"
  fields = [(k, a, b) for k, a, b in run_config.changes(stored, run_config.as_dict(changed))]
  assert {k for k, _, _ in fields} == {"train.steps", "train.log_every", "train.checkpoint_every",
                                       "eval.num_batches", "data.seq_len", "model.implementation"}
  assert [k for k, _, _ in fields if not run_config._changeable(k)] == ["data.seq_len"]


def test_finished_run_rerun_with_fewer_steps_says_so_and_keeps_its_report(run_copy, capfd):
  before = {n: open(os.path.join(run_copy, n), "rb").read()
            for n in ("summary.json", "report.md", "metrics.jsonl")}
  capfd.readouterr()
  summary = train.run(_config(steps=2), run_copy)
  assert capfd.readouterr().err.strip() == (
      f"{run_copy}: already at step 4 >= config.train.steps=2; rerunning with more steps "
      f"continues training")
  assert summary == json.loads(before["summary.json"])
  assert before == {n: open(os.path.join(run_copy, n), "rb").read() for n in before}
  os.remove(os.path.join(run_copy, "summary.json"))  # stopped past 2 steps, never finished
  with pytest.raises(errors.RunError, match=r"already at step 4, past config.train.steps=2; "
                     r"rerun with config.train.steps >= 4"):
    train.run(_config(steps=2), run_copy)


def test_records_of_a_run_killed_before_its_first_checkpoint_are_replaced(run_copy, finished):
  shutil.rmtree(os.path.join(run_copy, "checkpoints"))  # as if killed before step 2's save
  for name in ("summary.json", "config.json"):
    os.remove(os.path.join(run_copy, name))
  with open(os.path.join(run_copy, "metrics.jsonl"), "a") as f:
    f.write('{"kind": "train", "step": 3, "lo')  # a line the kill cut short
  train.run(_config(), run_copy)
  records = _train_records(run_copy)
  assert records == _train_records(finished)  # steps 1-4 once, the same losses bitwise
  assert np.isfinite([loss for _, loss in records]).all()
