"""Every committed results README says what its JSON says (experiments/results_pages.py).

The READMEs are generated from results.json, summaries.json, provenance.json and NOTES.md;
these tests rebuild each one and compare it with the committed file, so a number typed by
hand, a JSON changed without regenerating, or a README edited directly fails here. Fix:
`python -m experiments.results_pages` (then review the diff).
"""
from __future__ import annotations

import json
import os
import shutil

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from experiments import claims as results_claims  # noqa: E402
from experiments import results_pages  # noqa: E402
from experiments import results_render  # noqa: E402
from experiments import results_writers  # noqa: E402

FOLDERS = results_pages.folders()
REGENERATE = "python -m experiments.results_pages"


def _rel(path):
  return results_pages.relative(path)


def test_every_results_folder_is_found():
  assert len(FOLDERS) >= 20
  readmes = {os.path.dirname(os.path.join(root, "README.md"))
             for root, _, files in os.walk(results_pages.RESULTS_ROOT) if "README.md" in files}
  orphans = sorted(readmes - set(FOLDERS) - {results_pages.RESULTS_ROOT})
  assert not orphans, f"README.md without provenance.json (not generated): {orphans}"


@pytest.mark.parametrize("path", FOLDERS, ids=_rel)
def test_readme_equals_what_its_files_say(path):
  with open(os.path.join(path, "README.md")) as f:
    committed = f.read()
  assert committed == results_pages.page_text(path), (
      f"{path}/README.md differs from its JSON/NOTES: run `{REGENERATE} {path}`")


def test_index_equals_what_the_folders_say():
  with open(os.path.join(results_pages.RESULTS_ROOT, "README.md")) as f:
    assert f.read() == results_pages.index_text(), f"results/README.md is stale: run `{REGENERATE}`"


@pytest.mark.parametrize("path", [p for p in FOLDERS
                                  if os.path.exists(os.path.join(p, "summaries.json"))], ids=_rel)
def test_results_json_is_the_aggregate_of_its_runs(path):
  folder = results_pages.Folder(path)
  got = results_writers.aggregate(folder.kind, folder.summaries, folder.config)
  assert json.loads(json.dumps(got)) == folder.results


@pytest.mark.parametrize("path", FOLDERS, ids=_rel)
def test_every_folder_states_verdicts_and_deviations(path):
  spec = results_claims.PAGES.get(_rel(path))
  assert spec is not None, f"add {_rel(path)!r} to experiments/claims/__init__.py PAGES"
  verdicts = spec.claims(results_pages.Loader(path))
  assert verdicts and spec.deviations
  assert {v.verdict for v in verdicts} <= set(results_pages.VERDICTS)
  text = results_pages.page_text(path)
  assert "## Verdict" in text and "## Deviations from the paper" in text
  for v, line in zip(verdicts, results_pages.verdict_lines(verdicts)):
    assert line in text
    # A verdict on one seed says so; several seeds are counted.
    assert ("One seed" in line) == (v.seeds == 1), line
    assert v.seeds <= 1 or f"{v.seeds} seeds." in line, line


def test_check_names_a_stale_readme(tmp_path, monkeypatch, capsys):
  root = tmp_path / "results"
  shutil.copytree(results_pages.RESULTS_ROOT, root)   # with its images: a README links
                                                      # only the plots that exist
  monkeypatch.setattr(results_pages, "RESULTS_ROOT", str(root))
  assert results_pages.main(["--check"]) == 0
  path = root / "length_extrapolation_gpu" / "results.json"
  r = json.loads(path.read_text())
  r["encodings"]["path_fox"]["512"] = 1.7654   # a number changed without regenerating
  path.write_text(json.dumps(r))
  assert results_pages.main(["--check"]) == 1
  out = capsys.readouterr().out
  assert f"stale: {root / 'length_extrapolation_gpu' / 'README.md'}" in out
  assert f"stale: {root / 'README.md'}" in out  # the index quotes it too


def test_numbers_are_rounded_from_the_json():
  index = results_pages.index_text()
  # results.json at 512: PaTH-FoX 1.7646 / 1.7442 / 1.7680 (mean 1.75896), GRAPE-AP 1.7547 /
  # 1.7626 / 1.7620, FoX 1.7367 / 1.7396 / 1.7504 (mean 1.74227).
  assert "PaTH-FoX 1.759 ± 0.012 (1.765, 1.744, 1.768), FoX 1.742 ± 0.007" in index
  assert "GRAPE-AP at 1x 1.760 ± 0.004 (1.755, 1.763, 1.762)" in index
  # mqrar_gpu/rope_n1_seeds: seeds 0 and 1 at N = 1.
  assert results_render.seeds_cell([0.0896121647018623, 0.9999145737228772], ".2f", scale=100,
                                   unit="%") == "54.48% ± 45.52 (8.96, 99.99)"
  assert results_render.seeds_cell([0.0, 0.0], ".2f", scale=100, unit="%") == "0.00% (both seeds)"


def _figure(sub):
  folder = results_pages.Folder(os.path.join(results_pages.RESULTS_ROOT, sub))
  r = folder.results
  acc, per = (r["accuracy"], r["per_seed"]) if "accuracy" in r else (
      r["A5"]["accuracy"], r["A5"]["per_seed"])
  return folder, results_render.accuracy_figure(folder.config, acc, per, axis_label="x", notes={})


def test_a_bimodal_seed_pair_is_drawn_seed_by_seed():
  folder, (fig, ax) = _figure("mqrar_gpu/rope_n1_seeds")
  try:
    ys = sorted(y for line in ax.get_lines() for y in line.get_ydata() if y != 90)
    per = [100 * v for v in folder.results["per_seed"]["rope"]["1"]]
    assert ys == pytest.approx(sorted(per))            # 8.96 and 99.99, nothing at 54.48
    assert "2 seeds" in ax.get_title()
  finally:
    plt.close(fig)


def test_equal_accuracies_stay_visible_and_path_keeps_its_colour():
  from experiments import plot_style

  for sub in ("word_problem_gpu/words16_lr3e-4", "word_problem_gpu/generators_words16"):
    folder, (fig, ax) = _figure(sub)
    try:
      # One seed: the line is labelled by the encoding; three: its median line, "path (median...".
      lines = {l.get_label().split()[0]: l for l in ax.get_lines()
               if l.get_label().split()[0] in ("rope", "path")}
      assert lines["path"].get_color() == plot_style.encoding("path")["color"]
      xr, xp = lines["rope"].get_xdata(), lines["path"].get_xdata()
      assert all(a != b for a, b in zip(xr, xp))       # rope not under path (20.21 / 20.24%)
      alphabet = "generator alphabet" if "generators" in sub else "uniformly drawn elements"
      assert alphabet in ax.get_title()
    finally:
      plt.close(fig)


def test_new_runs_that_break_a_claim_still_get_a_readme(tmp_path, monkeypatch):
  root = tmp_path / "results"
  shutil.copytree(results_pages.RESULTS_ROOT, root, ignore=shutil.ignore_patterns("*.png"))
  monkeypatch.setattr(results_pages, "RESULTS_ROOT", str(root))
  path = root / "mqrar_gpu" / "results.json"
  r = json.loads(path.read_text())
  for key in ("accuracy", "per_seed"):
    del r[key]["fox"]                                   # a sweep of other encodings
  path.write_text(json.dumps(r))
  text = results_pages.page_text(str(root / "mqrar_gpu"))
  why = "verdicts not computed (KeyError: 'fox'): update the claims of 'mqrar_gpu'"
  assert f"- {why} in experiments/claims/" in text
  assert why in results_pages.index_text()             # the index is still written
  assert "| path " in text                             # the table is still there


def test_a_setting_names_the_heads_and_the_encoding_options():
  """Folders that differ only in head width or an encoding option get titles that say so."""
  def setting(sub):
    return results_render.setting(
        results_pages.Folder(os.path.join(results_pages.RESULTS_ROOT, sub)).config)
  assert "6 x 768 (6 heads x 128), phase_norm, phase_scale 0.03," in setting(
      "length_extrapolation_gpu/tapa_norm_hd128")
  assert "(12 heads x 64), alpha 0.5, phase_norm," in setting(
      "length_extrapolation_gpu/tapa_norm_alpha05")
  assert "(12 heads x 64), 600 steps" in setting("length_extrapolation_gpu")


def test_the_seeds_line_counts_the_runs_a_folder_holds(tmp_path, monkeypatch):
  """Deviations state no seed count by hand: the line is counted from the runs, so a gather of
  more seeds cannot leave it stale."""
  typed = [d for page in results_claims.PAGES.values() for d in page.deviations
           if d.startswith("Seeds")]
  assert typed == []
  root = tmp_path / "results"
  shutil.copytree(results_pages.RESULTS_ROOT, root, ignore=shutil.ignore_patterns("*.png"))
  monkeypatch.setattr(results_pages, "RESULTS_ROOT", str(root))
  folder = root / "length_extrapolation_gpu" / "rope_3000"
  assert "- Seeds: 3.\n" in results_pages.page_text(str(folder))
  summaries = json.loads((folder / "summaries.json").read_text())
  (folder / "summaries.json").write_text(json.dumps(   # seed 2 gone, another encoding added
      [s for s in summaries if s["seed"] != 2] + [dict(summaries[0], encoding="fox")]))
  assert "- Seeds: 2 for rope; 1 for fox.\n" in results_pages.page_text(str(folder))
  tapa = results_pages.page_text(str(root / "length_extrapolation_gpu" / "tapa_norm_3000"))
  assert "- Seeds: 3 (this folder); 2 for rope; 1 for fox (../rope_3000/).\n" in tapa
