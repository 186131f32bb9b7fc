"""Results gathered over several sweep invocations (e.g. device calls that each train a subset
of the encodings) land in one table: summaries merge by run, across equal configs only."""
from __future__ import annotations

import importlib
import json
import os

import subprocess
import sys

import pytest
from absl import flags

from experiments import cli_config
from experiments import results_writers
from experiments import sweeps
from experiments.configs import length_extrapolation


def _summary(encoding, loss, seed=0):
  return {"encoding": encoding, "seed": seed, "axis_value": None, "final_loss": loss,
          "wall_time_s": 12.0, "device": "NVIDIA H100 80GB HBM3 x1", "finished": "2026-11-23",
          "tokens_seen": 1000, "command": f"python -m experiments.sweeps encodings={encoding}"}


def test_config_fingerprint_ignores_only_the_run_selection():
  fp = lambda arg: sweeps.config_fingerprint(length_extrapolation.get_config(arg))  # noqa: E731
  assert fp("encodings=rope") == fp("encodings=path+alibi") == fp("encodings=rope,seeds=3")
  seed2 = length_extrapolation.get_config("encodings=rope")
  seed2.train.seed = 2   # what --config.train.seed=2 sets: seed 2's runs of the same sweep
  assert sweeps.config_fingerprint(seed2) == fp("encodings=rope")
  # A results folder's stored config (a plain dict, lists for tuples) gives the same hash.
  stored = json.loads(json.dumps(length_extrapolation.get_config("encodings=rope").to_dict()))
  assert sweeps.config_fingerprint(stored) == fp("encodings=rope")
  # A field the config gained later, at its default, leaves older runs' fingerprints alone;
  # set away from its default, it is part of what the run computes.
  older = dict(stored, train={k: v for k, v in stored["train"].items() if k != "init_from"})
  assert sweeps.config_fingerprint(older) == fp("encodings=rope")
  other = length_extrapolation.get_config("encodings=rope")
  other.train.init_from = "/some/checkpoint"
  assert sweeps.config_fingerprint(other) != fp("encodings=rope")
  assert fp("encodings=rope") != fp("encodings=rope,steps=7")
  assert fp("encodings=rope") != fp("encodings=rope,train_len=128")
  from experiments.configs import word_problem
  fp = lambda arg: sweeps.config_fingerprint(word_problem.get_config(arg))  # noqa: E731
  assert fp("gpu,layers=1+2") == fp("gpu,layers=3+4,encodings=path")   # the axis's values
  assert fp("gpu") != fp("gpu,seq_len=128")
  assert fp("gpu") != fp("gpu,lr=3e-3")
  # How fast the host feeds the runs is no part of what they compute.
  fast = word_problem.get_config("gpu")
  fast.data.update(read_threads=4, prefetch_batches=64)
  assert sweeps.config_fingerprint(fast) == fp("gpu")


def test_merge_summaries_gathers_runs_of_one_config(tmp_path):
  out, notes = str(tmp_path), []
  merge = lambda s, fp: results_writers.merge_summaries(out, s, fingerprint=fp,  # noqa: E731
                                                        log=notes.append)
  assert [s["encoding"] for s in merge([_summary("rope", 2.0)], "A")] == ["rope"]
  merged = merge([_summary("path", 1.5), _summary("alibi", 1.8)], "A")
  assert sorted(s["encoding"] for s in merged) == ["alibi", "path", "rope"]
  merged = merge([_summary("rope", 1.9)], "A")       # a re-run replaces its earlier summary
  assert sorted((s["encoding"], s["final_loss"]) for s in merged) == [
      ("alibi", 1.8), ("path", 1.5), ("rope", 1.9)]
  with open(os.path.join(out, results_writers.SUMMARIES)) as f:
    assert len(json.load(f)) == 3
  merged = merge([_summary("rope", 1.0)], "B")       # another config: the old runs go
  assert [(s["encoding"], s["final_loss"]) for s in merged] == [("rope", 1.0)]
  assert notes and "3 earlier run(s) of another config dropped" in notes[0]


def test_runs_table_names_device_date_and_tokens():
  lines = results_writers.runs_table([_summary("rope", 2.0), _summary("path", 1.5, seed=1)])
  text = "\n".join(lines)
  assert lines[0] == "## Runs"
  assert "NVIDIA H100 80GB HBM3 x1" in text and "1,000" in text and "encodings=path" in text
  assert results_writers.runs_table([{"encoding": "rope", "wall_time_s": 1}]) == []


@pytest.mark.parametrize("name", ["length_extrapolation", "flipflop", "word_problem", "mqrar"])
def test_gpu_switch_builds_valid_runs(name, tmp_path):
  """Every paper experiment's `gpu` size passes the config checks for each of its runs (on a
  one-device mesh; nothing trains), and `runlocal,gpu` is refused with one message."""
  import jax

  from experiments import config_checks
  from experiments import data
  mod = importlib.import_module(f"experiments.configs.{name}")
  config = mod.get_config("gpu")
  assert config.model.dtype == "bfloat16"
  runs = sweeps.plan_runs(config, str(tmp_path))
  assert runs
  for r in runs:
    mcfg = config_checks.check(r["config"], workdir=r["workdir"], data_module=data,
                               num_devices=jax.device_count())
    assert mcfg.encoding == r["encoding"]
  with pytest.raises(ValueError, match="runlocal and gpu exclude each other"):
    mod.get_config("runlocal,gpu")


def test_length_extrapolation_gpu_is_the_issue_scale():
  c = length_extrapolation.get_config("gpu")
  assert c.data.seq_len == 512 and c.sweep.eval_lengths[-1] == 32 * 512
  assert set(c.sweep.encodings) == set(length_extrapolation.GPU_ENCODINGS)
  params = 12 * c.model.d_model ** 2 * c.model.num_layers
  assert 40e6 <= params <= 125e6, params


def test_length_extrapolation_acc_rot_table_is_the_papers_seven_rows_to_128x():
  c = length_extrapolation.get_config("gpu,table=acc_rot,seeds=3")
  assert c.sweep.encodings == length_extrapolation.ACC_ROT_TABLE and len(c.sweep.encodings) == 7
  assert c.sweep.eval_lengths[-1] == 128 * 512 and tuple(c.sweep.seeds) == (0, 1, 2)
  one = length_extrapolation.get_config("gpu,table=acc_rot,encodings=alibi")
  assert one.sweep.encodings == ("alibi",) and one.sweep.eval_lengths == c.sweep.eval_lengths
  with pytest.raises(ValueError, match="table='x' must be acc_rot"):
    length_extrapolation.get_config("table=x")


def test_gather_merges_side_by_side_sweeps_of_one_config(tmp_path):
  parts = [str(tmp_path / p) for p in ("a", "b")]
  a = dict(_summary("rope", 2.0), finished="2026-11-25 05:10 UTC", wall_time_s=120.0)
  b = dict(_summary("path", 1.5), finished="2026-11-25 05:12 UTC", wall_time_s=60.0)
  results_writers.merge_summaries(parts[0], [a], fingerprint="A", log=print)
  results_writers.merge_summaries(parts[1], [b, _summary("alibi", 1.0)], fingerprint="A",
                                  log=print)
  results_writers.merge_summaries(str(tmp_path / "c"), [_summary("nope", 3.0)], fingerprint="B",
                                  log=print)
  notes = []
  got = results_writers.gather_summaries(parts + [str(tmp_path / "c")], fingerprint="A",
                                         log=notes.append)
  assert sorted(s["encoding"] for s in got) == ["alibi", "path", "rope"]
  assert len(notes) == 1 and "nope" in notes[0]          # the other config's run, named
  prov = results_writers.gathered_provenance(["sweeps", "--gather=a,b"], [a, b])
  assert prov["wall_time_s"] == 240                       # 05:08 start of rope to 05:12
  assert prov["date"] == "2026-11-25 05:12 UTC"
  with pytest.raises(ValueError, match="--gather: .*does not exist"):
    results_writers.gather_summaries([str(tmp_path / "missing")], fingerprint="A")


def test_interrupted_sweep_keeps_the_runs_that_finished(tmp_path, monkeypatch):
  from experiments import train
  from experiments.configs import flipflop

  def fake_run(config, workdir, **_):
    if config.model.encoding == "path":
      return {"encoding": "path", "step": 3, "interrupted": True}
    return dict(_summary(config.model.encoding, 1.0), interrupted=False)

  monkeypatch.setattr(train, "run", fake_run)
  config = flipflop.get_config("runlocal,encodings=rope+path+alibi,seeds=1")
  with pytest.raises(sweeps.Interrupted) as e:
    sweeps.run_sweep(config, str(tmp_path), log=lambda *_: None)
  assert e.value.code == 143                              # exits as interrupted
  assert [s["encoding"] for s in e.value.summaries] == ["rope"]   # alibi never started


def test_command_line_narrows_the_sweep(tmp_path):
  """A swept field set on the command line runs that value alone: the encoding, the seed and
  the axis's field (word_problem sweeps model.num_layers), each with a note."""
  values = flags.FlagValues()
  argv = ["sweeps", "--config=experiments/configs/word_problem.py", "--config.model.encoding=path",
          "--config.train.seed=5", "--config.model.num_layers=2"]
  cli_config.define_config_flag(flag_values=values, sys_argv=argv)
  cli_config.parse(argv, flag_values=values)
  config = values["config"].value
  notes = cli_config.follow_explicit(config, cli_config.explicit_fields(flag_values=values),
                                     swept=sweeps.swept_fields(config))
  assert [n.split(":")[1] for n in notes] == [" --config.model.encoding=path",
                                             " --config.train.seed=5",
                                             " --config.model.num_layers=2"]
  runs = sweeps.plan_runs(config, str(tmp_path))
  assert [(r["encoding"], r["seed"], r["axis_value"]) for r in runs] == [("path", 5, 2)]
  assert runs[0]["workdir"] == str(tmp_path / "num_layers=2" / "path" / "seed5")


def test_sweeps_cli_names_an_unknown_field(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-m", "experiments.sweeps",
                         "--config=experiments/configs/flipflop.py:runlocal",
                         f"--workdir={tmp_path / 'w'}", "--config.model.foo=1"], cwd=root,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].startswith(
      "error: config.model has no field foo; fields: block, d_model,"), proc.stderr[-2000:]
  assert not (tmp_path / "w").exists()


def _sweeps_cli(*args, cwd=None):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.run([sys.executable, "-m", "experiments.sweeps", *args], cwd=cwd or root,
                        capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_side_by_side_trains_the_same_runs_as_one_process(tmp_path):
  """--side_by_side=2 over a 2-encoding x 2-seed flip-flop sweep: two workers, each its share,
  then one results table whose final losses equal those of the same sweep in one process."""
  cfg = "--config=experiments/configs/flipflop.py:runlocal,encodings=rope+alibi,seeds=2,steps=4"
  seq = _sweeps_cli(cfg, f"--workdir={tmp_path / 'seq'}", f"--results={tmp_path / 'rs'}")
  assert seq.returncode == 0, seq.stderr[-2000:]
  par = _sweeps_cli(cfg, f"--workdir={tmp_path / 'par'}", "--side_by_side=2",
                    "--results", str(tmp_path / "rp"))
  assert par.returncode == 0, par.stderr[-2000:]
  logs = sorted(p.name for p in (tmp_path / "par").iterdir() if p.name.endswith(".log"))
  assert logs == ["side_by_side.0.log", "side_by_side.1.log"]
  loss = lambda d: sorted((s["encoding"], s["seed"], s["final_loss"])  # noqa: E731
                          for s in json.load(open(d / results_writers.SUMMARIES)))
  assert loss(tmp_path / "rp") == loss(tmp_path / "rs")
  # Every run finished: the same command again trains nothing and starts no worker.
  again = _sweeps_cli(cfg, f"--workdir={tmp_path / 'par'}", "--side_by_side=2",
                      f"--results={tmp_path / 'rp'}")
  assert again.returncode == 0 and "worker 0" not in again.stdout + again.stderr


def test_a_failed_side_by_side_worker_is_one_error_naming_its_log(tmp_path, monkeypatch):
  import subprocess as sp

  class Failing:
    def __init__(self, cmd, **kw):
      self.cmd = cmd

    def wait(self):
      return 0 if "--run_indices=0" in self.cmd else 3

  monkeypatch.setattr(sp, "Popen", Failing)
  from experiments.configs import flipflop
  config = flipflop.get_config("runlocal,encodings=rope+path,seeds=1")
  runs = sweeps.plan_runs(config, str(tmp_path))
  argv = ["sweeps.py", "--config=x", "--side_by_side=2", "--results", "R", "--workdir=W"]
  with pytest.raises(sweeps.SideBySideError, match=r"side_by_side\.1\.log \(exit 3\)"):
    sweeps.side_by_side(argv, runs, 2, str(tmp_path), log=lambda *_: None)


def test_side_by_side_workers_get_their_share_and_no_results_flag(tmp_path, monkeypatch):
  import subprocess as sp

  seen = []

  class Ok:
    def __init__(self, cmd, env=None, **kw):
      seen.append((cmd, env["XLA_PYTHON_CLIENT_MEM_FRACTION"]))

    def wait(self):
      return 0

  monkeypatch.setattr(sp, "Popen", Ok)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  from experiments.configs import flipflop
  config = flipflop.get_config("runlocal,encodings=rope+path+alibi,seeds=1")
  runs = sweeps.plan_runs(config, str(tmp_path))
  os.makedirs(runs[1]["workdir"])
  open(os.path.join(runs[1]["workdir"], "summary.json"), "w").write("{}")   # finished
  argv = ["sweeps.py", "--config=x", "--side_by_side=2", "--results", "R", "--workdir=W"]
  sweeps.side_by_side(argv, runs, 2, str(tmp_path), log=lambda *_: None)
  assert [c[-1] for c, _ in seen] == ["--run_indices=0", "--run_indices=2"]
  assert all("--results" not in c and "R" not in c and "--side_by_side=2" not in c
             for c, _ in seen)
  assert {m for _, m in seen} == {"0.450"}


def test_length_evaluation_is_kept_and_reused(tmp_path, monkeypatch):
  from experiments import train
  from experiments.probes import length_eval

  calls = []
  def fake_run(config, workdir, **_):   # as train.run, it leaves its workdir behind
    os.makedirs(workdir, exist_ok=True)
    return dict(_summary(config.model.encoding, 1.0), interrupted=False, step=6)

  monkeypatch.setattr(train, "run", fake_run)
  monkeypatch.setattr(length_eval, "evaluate_lengths",
                      lambda config, workdir, **kw: calls.append(workdir) or {"16": 3.0})
  config = length_extrapolation.get_config("runlocal,encodings=rope")
  first = sweeps.run_sweep(config, str(tmp_path), log=lambda *_: None)
  run_dir = first[0]["workdir"]
  with open(os.path.join(run_dir, "summary.json"), "w") as f:   # as train.run leaves it
    json.dump(dict(_summary("rope", 1.0), interrupted=False, step=6), f)
  again = sweeps.run_sweep(config, str(tmp_path), log=lambda *_: None)
  assert calls == [run_dir] and again[0]["eval"] == first[0]["eval"] == {"16": 3.0}
  with config.unlocked():
    config.sweep.eval_tokens = 2 * config.sweep.eval_tokens     # another evaluation: redone
  sweeps.run_sweep(config, str(tmp_path), log=lambda *_: None)
  assert calls == [run_dir, run_dir]


def test_stopped_workers_that_ignore_sigterm_are_killed_after_the_grace(tmp_path):
  """A worker inside a compile or an evaluation does not act on SIGTERM: stop_workers kills it
  once the grace has passed, and leaves alone one that exits on SIGTERM."""
  import subprocess
  import sys
  import time

  ready = tmp_path / "ready"
  stubborn = subprocess.Popen([sys.executable, "-c", (
      "import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
      f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")])
  polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  while not ready.exists():   # the handler is installed before SIGTERM is sent
    time.sleep(0.05)
  said = []
  t0 = time.monotonic()
  sweeps.stop_workers([polite, stubborn], grace_s=1.0, log=said.append)
  assert time.monotonic() - t0 < 10
  assert polite.returncode == -15 and stubborn.returncode == -9
  assert len(said) == 1 and f"worker {stubborn.pid}" in said[0]
