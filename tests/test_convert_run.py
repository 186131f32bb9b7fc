"""experiments.convert end to end: a tiny RoPE teacher (2 layers, d_model 32, 30 steps on a
small text corpus) distilled into PaTH at configs/convert.py's runlocal budgets (20 + 20
steps of 4 x 16 tokens).

All under -m slow: compiling the teacher's training and the two stages' PaTH steps takes
70 s on 2 shared CPU cores (tests/test_convert.py checks the math without training).
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from experiments import convert
from experiments import train
from experiments.configs import convert as convert_config

pytestmark = pytest.mark.slow

LINES = "".join(f"def f{i}(x):\n  return x + {i} * 2\n" for i in range(300))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
  root = tmp_path_factory.mktemp("convert")
  (root / "corpus.txt").write_text(LINES)
  c = convert_config.get_config("run=teacher,runlocal")
  c.data.update(text_dir=str(root / "corpus.txt"), valid_fraction=0.2, max_files=None)
  c.model.update(d_model=32, head_dim=16)
  c.train.update(steps=30, warmup_steps=3)
  train.run(c, str(root / "teacher"))
  return str(root / "teacher")


@pytest.fixture(scope="module")
def converted(teacher, tmp_path_factory):
  """rope -> path at runlocal's budgets, every step logged."""
  c = convert_config.get_config(f"teacher={teacher},runlocal")
  c.train.log_every = 1
  wd = str(tmp_path_factory.mktemp("student") / "path")
  return c, wd, convert.run(c, wd)


def _records(wd):
  with open(f"{wd}/metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def test_stage1_mse_and_stage2_kl_fall(converted):
  c, wd, summary = converted
  records = _records(wd)
  mse = [r["mse"] for r in records if r["kind"] == "train" and r["stage"] == 1]
  kl = [r["kl"] for r in records if r["kind"] == "train" and r["stage"] == 2]
  assert len(mse) == c.convert.mse_steps and len(kl) == c.train.steps
  assert np.mean(mse[-5:]) < 0.7 * np.mean(mse[:5]), mse
  assert np.mean(kl[-5:]) < np.mean(kl[:5]), kl
  # The held-out KL(teacher || student) at step 0, after stage 1 and after stage 2.
  held = [r["kl"] for r in records if r["kind"] == "eval"]
  assert held[0] > held[1] > held[2], held
  s1, s2 = summary["stages"]
  assert (s1["loss"], s2["loss"], s1["tokens"], s2["tokens"]) == ("mse", "kl", 1280, 1280)
  assert (s1["first"], s1["last"], s2["first"], s2["last"]) == (mse[0], mse[-1], kl[0], kl[-1])
  row = summary["eval"][0]
  assert row["kl"] == held[2] and row["teacher_loss"] > 0 and row["loss"] > 0
  with open(f"{wd}/report.md") as f:
    report = f.read()
  assert "## Converted from rope" in report and "KL(teacher‖student)" in report


def test_student_workdir_generates(converted):
  from experiments import generate
  _, wd, _ = converted
  out = generate.generate(wd, "def f1", max_new_tokens=4, temperature=0.0, top_k=0, top_p=1.0,
                          seed=0, max_len=0, log=lambda _: None)
  assert out["prompt_tokens"][0] == 256 and 1 <= len(out["tokens"]) <= 4
  _, cfg, step = generate.load_model(wd)
  assert cfg.encoding == "path" and step == 40


def test_a_finished_conversion_is_not_redone(converted):
  c, wd, summary = converted
  assert convert.run(c, wd) == summary


def test_resume_continues_as_uninterrupted(converted, tmp_path):
  c, wd, summary = converted
  first = convert.run(c, str(tmp_path / "r"), stop_after=25)   # inside stage 2
  assert first == {"encoding": "path", "step": 25, "interrupted": True}
  again = convert.run(c, str(tmp_path / "r"))
  drop = lambda rs: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rs]  # noqa: E731
  assert drop(_records(tmp_path / "r")) == drop(_records(wd))
  assert again["eval"] == summary["eval"]


def test_cli_converts_and_generate_reads_the_student(teacher, tmp_path):
  wd = tmp_path / "student"
  run = lambda *args: subprocess.run([sys.executable, "-m", *args],  # noqa: E731
                                     capture_output=True, text=True, check=False)
  out = run("experiments.convert", f"--config=experiments/configs/convert.py:teacher={teacher},"
            f"runlocal", f"--workdir={wd}")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "## Converted from rope" in out.stdout and (wd / "summary.json").exists()
  out = run("experiments.generate", f"--workdir={wd}", "--prompt=def ", "--max_new_tokens=4")
  assert out.returncode == 0, out.stderr[-2000:]
  out = run("experiments.convert", "--config=experiments/configs/convert.py:teacher=/nonexistent",
            f"--workdir={wd}")
  assert out.returncode == 2
  assert out.stderr.strip() == ("error: --config=experiments/configs/convert.py:teacher="
                                "/nonexistent: convert.teacher='/nonexistent' does not exist; "
                                "give the workdir of a trained run")
  out = run("experiments.main", f"--config=experiments/configs/convert.py:teacher={teacher}",
            f"--workdir={tmp_path / 'main'}")
  assert out.returncode == 2 and out.stderr.strip() == (
      "error: config.convert is read by experiments.convert, not experiments.main: run python "
      "-m experiments.convert with this config")
