"""Where a command-line run's time goes before its first training step.

A `Timeline` holds the seconds from an origin (the command's start, or the run's for the
later runs of a sweep) to the end of each start-up stage, in the order they happen:

  imports     Python, JAX, Flax, Orbax and the project's modules imported
  devices     the backend started (`jax.devices()`: CUDA, the TPU runtime)
  checks      the config checked (`experiments.config_checks`)
  checkpoint  the checkpoint manager opened
  model       the model traced abstractly and its shardings laid out (`train.Trainer`)
  data        this process's training stream opened
  eval_sets   the held-out batches drawn
  state       the parameters and optimizer state initialised or restored, on the devices
  compile     the train step traced, lowered and compiled (or read from the cache)
  first_step  the first step's loss back on the host

and two more for the rest of the run's wall time:

  trained     the last step's metrics back on the host
  saved       the last checkpoint written (the manager closed)

The run's summary keeps them as `startup_s`; the command line prints the start-up's once, on
one line above the progress bar. `experiments/benchmarks/cli_startup.py` reads them.
"""
from __future__ import annotations

import time

STAGES = ("imports", "devices", "checks", "checkpoint", "model", "data", "eval_sets", "state",
          "compile", "first_step", "trained", "saved")


class Timeline:
  """Seconds from `origin` (a time.time()) to the end of each stage; a stage is timed once."""

  def __init__(self, origin: float | None = None):
    self.origin = time.time() if origin is None else origin
    self.marks: dict[str, float] = {}

  def mark(self, stage: str) -> None:
    if stage not in STAGES:
      raise ValueError(f"unknown start-up stage {stage!r}; one of {STAGES}")
    self.marks.setdefault(stage, round(time.time() - self.origin, 3))

  def durations(self) -> dict[str, float]:
    """Each marked stage's own seconds (from the previous mark, or the origin)."""
    out, last = {}, 0.0
    for stage in STAGES:
      if stage in self.marks:
        out[stage] = round(self.marks[stage] - last, 3)
        last = self.marks[stage]
    return out

  def line(self) -> str:
    """'start-up 57.1 s: imports 4.1, devices 3.2, ..., first_step 1.1' (own seconds)."""
    parts = ", ".join(f"{k} {v:.1f}" for k, v in self.durations().items())
    total = max(self.marks.values(), default=0.0)
    return f"start-up {total:.1f} s: {parts}"
