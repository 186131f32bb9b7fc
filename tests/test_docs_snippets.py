"""The README's code runs as printed, and the notebook's install cell does what it says."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent


def _block(text: str, needle: str) -> str:
  blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if needle in b]
  assert len(blocks) == 1, f"{len(blocks)} python blocks mention {needle}"
  return blocks[0]


def test_readme_from_hf_rope_snippet_runs(tmp_path, monkeypatch):
  """Pasted alone into a fresh interpreter, next to a Llama 3.1 config.json."""
  (tmp_path / "config.json").write_text(json.dumps({
      "hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 500000.0,
      "max_position_embeddings": 131072,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}))
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "__main__"}
  exec(_block((ROOT / "README.md").read_text(), "from_hf_rope("), namespace)
  assert namespace["name"] == "rope_llama3" and namespace["enc"] is not None


def _install_cell() -> str:
  cells = json.loads((ROOT / "notebooks" / "tour.ipynb").read_text())["cells"]
  found = [c["source"] for c in cells if c["cell_type"] == "code" and "REPO_URL" in c["source"]]
  assert len(found) == 1
  return found[0]


def test_notebook_install_cell(monkeypatch):
  """Installed: nothing. Missing without REPO_URL: one error saying what to put. Missing with
  it: pip installs from that URL."""
  calls = []
  monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw)))
  cell = _install_cell()
  exec(cell, {})
  assert calls == []
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(RuntimeError, match="put the posenc-jax repository's git URL in REPO_URL"):
    exec(cell, {})
  url = "https://example.org/owner/posenc-jax.git"
  assert cell.count('REPO_URL = ""') == 1
  exec(cell.replace('REPO_URL = ""', f'REPO_URL = "{url}"'), {})
  assert calls == [([sys.executable, "-m", "pip", "install", "-q", f"git+{url}"],
                    {"check": True})]
