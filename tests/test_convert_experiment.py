"""experiments/convert_experiment.py (issue 52's experiment): its runs, its results.json, and
the README section experiments/convert_pages.py draws from it."""
from __future__ import annotations

import json
import os

import pytest

from experiments import convert_experiment
from experiments import convert_pages
from experiments.configs import convert as convert_config


def test_plan_runs_each_conversion_after_its_teacher_and_each_probe_after_its_run():
  runs = convert_experiment.plan("gpu", "W", ["path", "path_fox"])
  names = [n for n, _, _ in runs]
  assert names[:6] == ["teacher", "path_converted", "path_fox_converted",
                       "path_converted_early", "rope_scratch", "path_scratch"]
  assert names[6:] == [f"probe_{n}" for n in names[:6]]
  args = dict((n, a) for n, a, _ in runs)
  assert args["path_converted_early"] == "gpu,teacher=W/teacher,encoding=path,teacher_step=600"
  assert args["probe_path_scratch"] == "gpu,run=probe,init=W/path_scratch"
  assert {m for n, _, m in runs[:6] if n.endswith(("converted", "early"))} == {"convert"}
  for _, arg, _ in runs[:1] + runs[4:6]:   # the runs that need no teacher are valid configs
    convert_config.get_config(arg)


def _summary(encoding, tokens, losses, *, step=10, teacher_step=None, sets=None):
  s = {"encoding": encoding, "tokens_seen": tokens, "step": step, "wall_time_s": 3.0,
       "device": "cpu x1", "finished": "2026-11-29 08:00 UTC",
       "eval": [{"set": sets or "valid", "length": n, "loss": x, "error": x / 10}
                for n, x in losses.items()]}
  if teacher_step is not None:
    s["teacher"] = {"step": teacher_step}
  return s


def test_results_count_a_conversions_teacher_tokens_up_to_its_step_and_list_every_seed():
  def seed(d):
    return {
        "teacher": _summary("rope", 1000, {16: 2.0 + d, 64: 3.0}, step=10),
        "path_converted": _summary("path", 300, {16: 2.1 + d, 64: 2.5}, teacher_step=10),
        "path_converted_early": _summary("path", 300, {16: 2.4, 64: 2.6}, teacher_step=5),
        "probe_path_converted": _summary("path", 50, {16: 0.5 + d}, sets="id"),
    }
  got = convert_experiment.results([seed(0.0), seed(0.5)])
  assert got["lengths"] == [16, 64] and got["seeds"] == 2
  runs = got["runs"]
  assert set(runs) == {"teacher", "path_converted", "path_converted_early"}
  assert [runs[n]["tokens"] for n in runs] == [1000, 1300, 800]
  assert runs["path_converted"]["loss"] == {"16": [2.1, 2.6], "64": [2.5, 2.5]}
  assert runs["path_converted"]["probe_error"] == {"id@16": [0.05, 0.1]}
  assert runs["teacher"]["probe_error"] == {} and runs["path_converted"]["wall_s"] == 12


def _seed(d):
  """One seed's summaries, every loss shifted by d."""
  return {
      "teacher": _summary("rope", 1000, {16: 2.0 + d, 64: 3.0 - d}, step=10),
      "path_converted": _summary("path", 300, {16: 2.1 + d, 64: 2.5}, teacher_step=10),
      "probe_path_converted": _summary("path", 50, {16: 0.5 + d}, sets="id"),
  }


def test_seeds_merged_into_results_equal_the_results_of_all_seeds_at_once():
  alone = convert_experiment.results([_seed(0.0)])   # written before seed_ids existed: 0
  del alone["seed_ids"]
  later = convert_experiment.results([_seed(0.25), _seed(0.5)], [1, 2])
  merged = convert_experiment.merge(alone, later)
  direct = convert_experiment.results([_seed(0.0), _seed(0.25), _seed(0.5)], [0, 1, 2])
  assert merged == direct
  assert merged["runs"]["teacher"]["loss"]["16"] == [2.0, 2.25, 2.5]
  again = convert_experiment.merge(merged, convert_experiment.results([_seed(0.7)], [1]))
  assert again["seed_ids"] == [0, 1, 2] and again["runs"]["teacher"]["loss"]["16"] == [
      2.0, 2.7, 2.5]                                   # a seed run again replaces its values
  # An earlier seed added later still lands in seed order.
  assert convert_experiment.merge(later, convert_experiment.results([_seed(0.0)], [0])) == direct
  other = convert_experiment.results([{"teacher": _seed(0)["teacher"]}], [3])
  with pytest.raises(ValueError, match="not the same experiment"):
    convert_experiment.merge(merged, other)


def _write_seed(root, seed: int, d: float, students) -> str:
  """A finished seed folder as a device run leaves it: each run's summary.json and config."""
  seed_dir = os.path.join(root, f"seed{seed}")
  summaries = _seed(d)
  for name, _, _ in convert_experiment.plan("cpu", seed_dir, students):
    os.makedirs(os.path.join(seed_dir, name))
    kind = "teacher" if name == "teacher" else ("probe_path_converted" if name.startswith(
        "probe_") else "path_converted")
    with open(os.path.join(seed_dir, name, "summary.json"), "w") as f:
      json.dump(summaries[kind], f)
    config = convert_config.get_config("runlocal,run=teacher").to_dict()   # as train saves it
    config["train"]["seed"] = seed
    with open(os.path.join(seed_dir, name, "config.json"), "w") as f:
      json.dump(config, f)
  return seed_dir


def test_gather_adds_seed_folders_to_a_results_folder(tmp_path, capsys):
  students = ["path"]
  parts = [_write_seed(tmp_path / "parts", n, d, students) for n, d in ((0, 0.0), (1, 0.25),
                                                                        (2, 0.5))]
  out = str(tmp_path / "results")
  run = lambda *gather: convert_experiment.main(  # noqa: E731
      ["--size=runlocal", f"--results={out}", "--students=path", "--gather=" + ",".join(gather)])
  run(parts[0])
  run(parts[1], parts[2])
  with open(os.path.join(out, "results.json")) as f:
    got = json.load(f)
  assert got["seeds"] == 3 and got["seed_ids"] == [0, 1, 2]
  assert got["runs"]["path_converted"]["loss"]["16"] == [2.1, 2.35, 2.6]
  assert got["runs"]["path_scratch"]["probe_error"]["id@16"] == [0.05, 0.075, 0.1]
  with open(os.path.join(out, "README.md")) as f:
    readme = f.read()
  assert "- commands: `python -m experiments.convert_experiment" in readme
  assert "; then `python -m experiments.convert_experiment" in readme and "seeds: 3" in readme
  run(parts[1])                       # a seed gathered again replaces its own values
  with open(os.path.join(out, "results.json")) as f:
    again = json.load(f)
  assert again["seed_ids"] == [0, 1, 2]
  assert {n: r["loss"] for n, r in again["runs"].items()} == {
      n: r["loss"] for n, r in got["runs"].items()}
  with pytest.raises(SystemExit):   # seeds of another size
    convert_experiment.main(["--size=cpu", f"--results={tmp_path / 'cpu'}", "--students=path",
                             f"--gather={parts[1]}"])
  assert "trained with another configuration than --size's" in capsys.readouterr().err
  os.remove(os.path.join(parts[2], "probe_path_scratch", "summary.json"))
  with pytest.raises(SystemExit):
    run(parts[2])
  assert "run probe_path_scratch has not finished" in capsys.readouterr().err


def test_the_section_tables_every_run_and_draws_the_plot(tmp_path):
  results = {"lengths": [16, 64], "runs": {
      "teacher": {"encoding": "rope", "tokens": 1000, "loss": {"16": [2.0, 2.2], "64": [3.0, 3.0]},
                  "probe_error": {"id@16": [0.25, 0.25]}, "teacher_step": None},
      "path_scratch": {"encoding": "path", "tokens": 1300, "loss": {"16": [1.9, 1.9]},
                       "probe_error": {}, "teacher_step": None}}, "seeds": 2}
  cfg = convert_config.get_config("runlocal,run=teacher")
  prov = {"command": "python -m experiments.convert_experiment", "machine": "cpu",
          "jax": "0", "date": "today", "wall_time_s": 1}
  text = "\n".join(convert_pages.section(cfg, results, prov, str(tmp_path), img="x/"))
  assert "| teacher " in text and "2.1000 ± 0.1000 (2.0000, 2.2000)" in text
  assert "3.0000 (both seeds)" in text and "25.0% (both seeds)" in text and "seeds: 2" in text
  assert "| path_scratch " in text and "![held-out loss" in text
  assert "(x/loss_vs_length.png)" in text
  assert os.path.getsize(tmp_path / convert_pages.PLOT) > 1000
  with pytest.raises(ValueError, match="none of"):
    convert_pages.kind("student")


@pytest.mark.slow
def test_the_whole_experiment_runs_at_runlocal_size(tmp_path):
  """Every run of the plan trains (seconds each), results.json holds them all, the README is
  written; running it again trains nothing new."""
  from experiments import results_pages
  summaries = convert_experiment.run_all("runlocal", str(tmp_path / "w"), ["path"],
                                         log=lambda _: None)
  assert len(summaries) == 10
  res = convert_experiment.results([summaries])
  assert set(res["runs"]) == {"teacher", "path_converted", "path_converted_early",
                              "rope_scratch", "path_scratch"}
  assert all(len(r["probe_error"]) == 6 for r in res["runs"].values())
  # The early conversion trains longer, to the late one's total tokens.
  assert res["runs"]["path_converted_early"]["tokens"] == res["runs"]["path_converted"]["tokens"]
  assert summaries["path_converted_early"]["step"] == summaries["path_converted"]["step"] + (
      convert_experiment.early_extra_steps("runlocal"))
  from experiments import results_writers
  out = tmp_path / "r"
  cfg = convert_config.get_config("runlocal,run=teacher")
  results_writers.save_results(str(out), "convert", res, cfg, {
      "command": "c", "machine": "m", "jax": "j", "date": "d", "wall_time_s": 0})
  results_pages.write_page(str(out))
  assert "path_converted_early" in (out / "README.md").read_text()
  assert json.loads((out / "provenance.json").read_text())["experiment"] == "convert"
  again = convert_experiment.run_all("runlocal", str(tmp_path / "w"), ["path"],
                                     log=lambda _: None)
  assert again["path_converted"]["step"] == summaries["path_converted"]["step"]
