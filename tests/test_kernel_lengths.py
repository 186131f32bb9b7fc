"""The PaTH Fig. 1 benchmark's table and figure from its rows (the timing itself is
path_kernel.py's, on a GPU)."""
from __future__ import annotations

import os

from experiments.benchmarks import kernel_lengths


def _rows():
  def cell(fwd, fb):
    return {"fwd_ms": fwd, "fwdbwd_ms": fb}
  return [{"case": "32x4096x32x64", "B": 32, "T": 4096, "H": 32, "D": 64,
           "cudnn": cell(5.0, 20.0), "fox": cell(9.0, 40.0), "path": cell(16.0, 60.0),
           "path_fox": "ERR out of time"},
          {"case": "32x2048x32x64", "B": 32, "T": 2048, "H": 32, "D": 64,
           "cudnn": cell(2.0, 6.5), "fox": cell(3.0, 13.0), "path": cell(6.0, 23.4),
           "path_fox": cell(6.5, 24.9)}]


def test_series_and_table_follow_the_rows(tmp_path):
  rows = _rows()
  got = kernel_lengths.series(rows)
  assert got["path"] == [(2048, 23.4), (4096, 60.0)]
  assert got["path_fox"] == [(2048, 24.9)]          # the error row is left out
  lines = kernel_lengths.table(rows).splitlines()
  assert lines[2].startswith("| 2048 | 2.0 / 6.5 | 3.0 / 13.0 | 6.0 / 23.4 | 6.5 / 24.9 |")
  assert lines[2].endswith(f"| {23.4 / 6.5:.2f} | {23.4 / 13.0:.2f} |")
  assert "ERR out of time" in lines[3] and lines[3].endswith("| 3.00 | 1.50 |")
  kernel_lengths.render(rows, str(tmp_path))
  assert os.path.getsize(tmp_path / "kernel_lengths.png") > 10_000
  assert (tmp_path / "kernel_lengths.md").read_text().strip() == kernel_lengths.table(rows)


def test_unknown_variant_is_one_error_line(capsys):
  import pytest
  with pytest.raises(SystemExit):
    kernel_lengths.main(["--variants", "path,flash"])
  assert "--variants flash" in capsys.readouterr().err


def test_each_cell_is_written_as_it_finishes_and_merged_by_T(tmp_path, monkeypatch):
  """A run adds its lengths to the rows already in --out, replacing the cells it measures again
  and keeping the others of the same T, and has written every variant it finished when a
  later one fails: a run cut short in the middle of a length keeps that length's finished
  cells."""
  import json

  import pytest

  old = _rows()
  (tmp_path / kernel_lengths.ROWS).write_text(json.dumps(old))
  calls = []

  def fake_run(lengths, *, variants, **kw):
    (t,), (v,) = lengths, variants
    calls.append((t, v))
    if (t, v) == (16384, "path"):
      raise RuntimeError("out of time")
    return [{"case": f"32x{t}x32x64", "B": 32, "T": t, "H": 32, "D": 64,
             v: {"fwd_ms": t / 1000, "fwdbwd_ms": t / 250}}]

  monkeypatch.setattr(kernel_lengths, "run", fake_run)
  with pytest.raises(RuntimeError):
    kernel_lengths.main(["--lengths", "4096,16384", "--variants", "cudnn,fox,path",
                         "--out", str(tmp_path)])
  assert calls == [(4096, "cudnn"), (4096, "fox"), (4096, "path"),
                   (16384, "cudnn"), (16384, "fox"), (16384, "path")]
  rows = json.loads((tmp_path / kernel_lengths.ROWS).read_text())
  assert [r["T"] for r in rows] == [2048, 4096, 16384]
  assert rows[0] == old[1]                                  # untouched
  assert rows[1]["path"] == {"fwd_ms": 4.096, "fwdbwd_ms": 16.384}      # measured again
  assert rows[1]["path_fox"] == old[0]["path_fox"]                      # not: kept
  assert set(rows[2]) == {"case", "B", "T", "H", "D", "cudnn", "fox"}   # cut off at path
