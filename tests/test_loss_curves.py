"""experiments/benchmarks/loss_curves.py: the windowed means and step gaps it tabulates."""
import json

import pytest

from experiments.benchmarks import loss_curves


def _rows(tmp_path, losses_list):
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps({"encoding": "path", "seq_len": 8, "losses": l}) + "\n"
                          for l in losses_list))
  return str(path)


def test_table_means_and_gap(tmp_path):
  rows = loss_curves.read_rows(_rows(tmp_path, [[4.0, 2.0, 1.0, 3.0, 5.0],
                                                [4.0, 2.5, 1.0, 2.0, 5.0]]))
  text = loss_curves.table(rows, ["a", "b"], window=2)
  lines = text.splitlines()
  assert lines[0] == "| row | 0-1 | 2-3 | 4-4 | max step gap to row 0 |"
  assert lines[2] == "| a | 3.000 | 2.000 | 5.000 | 0.000 |"
  assert lines[3] == "| b | 3.250 | 1.500 | 5.000 | 1.000 |"


def test_rows_without_losses_name_them(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text(json.dumps({"encoding": "rope", "seq_len": 8, "losses": [1.0]}) + "\n"
                  + json.dumps({"encoding": "path", "seq_len": 8, "error": "oom"}) + "\n")
  with pytest.raises(ValueError, match=r"rows \[1\] have no 'losses'"):
    loss_curves.read_rows(str(path))


def test_labels_must_match_rows(tmp_path):
  with pytest.raises(ValueError, match="--labels has 1 names for 2 rows"):
    loss_curves.main([_rows(tmp_path, [[1.0], [2.0]]), "--labels", "x"])


def test_rows_of_one_encoding_share_its_colour_and_differ_in_line():
  from experiments import plot_style

  rows = [{"encoding": e} for e in ("path", "path", "rope", "path")]
  styles = loss_curves.line_styles(rows)
  assert [s["color"] for s in styles] == [plot_style.encoding(e)["color"]
                                          for e in ("path", "path", "rope", "path")]
  paths = [styles[i] for i in (0, 1, 3)]
  assert len({s["linestyle"] for s in paths}) == 3
  assert len({s["markevery"] for s in paths}) == 3    # bitwise-equal curves still show twice
