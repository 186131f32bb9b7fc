"""Every notebook under notebooks/ runs top to bottom (code cells in one namespace, no display)."""
import json
import pathlib

import matplotlib
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
  assert NOTEBOOKS, "notebooks/ holds no .ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys):
  matplotlib.use("Agg")
  cells = json.loads(path.read_text())["cells"]
  namespace = {"__name__": "__main__"}
  for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
    src = "".join(cell["source"])
    assert not any(line.lstrip().startswith(("%", "!")) for line in src.splitlines()), \
        f"cell {i} uses IPython magics; keep them in markdown so the notebook runs as plain Python"
    exec(compile(src, f"{path.name}[cell {i}]", "exec"), namespace)
  out = capsys.readouterr().out
  # The tour states its own checks; they must hold, not just run.
  assert "max |logits(shift=0) - logits(shift=1000)| =" in out
  assert "product of reflections is the composed permutation: True" in out
