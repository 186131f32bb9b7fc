"""What a verdict, a README section and a page are (experiments/claims/ holds one module per
family of experiments; experiments/results_pages.py turns them into READMEs)."""
from __future__ import annotations

import dataclasses
from typing import Callable

from experiments import results_render


@dataclasses.dataclass(frozen=True)
class Verdict:
  paper: str      # "PaTH Table 1": the paper's short name first (PAPER_ORDER)
  claim: str      # what the paper says, with its numbers
  verdict: str    # reproduced | partly | contradicted | untested
  evidence: str   # our numbers
  seeds: int = 0  # seeds behind the evidence (0: not a trained result)


@dataclasses.dataclass(frozen=True)
class Section:
  folder: str | None = "."   # a results folder relative to the page's; None: text only
  heading: str | None = None
  intro: str = ""
  notes: tuple = ()          # (encoding, text appended to its row and legend label)
  extra: Callable | None = None   # Loader -> generated markdown lines after the table


@dataclasses.dataclass(frozen=True)
class Page:
  title: str
  claims: Callable            # Loader -> [Verdict]
  deviations: tuple
  sections: tuple = (Section(),)
  index: bool = True          # list its verdicts in experiments/results/README.md


PAPER_ORDER = ("PaTH", "acc_rot", "GRAPE", "TAPA")


def pct(x: float) -> str:
  return f"{100 * x:.2f}%"


def seeds(values, fmt=".2f", scale=1.0, unit="") -> str:
  return results_render.seeds_cell(values, fmt, scale=scale, unit=unit)
