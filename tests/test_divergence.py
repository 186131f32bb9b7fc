"""The divergence rule (experiments/divergence.py) and a run that diverges (learning rate 10)."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from experiments import checkpoint
from experiments import data
from experiments import divergence
from experiments import errors
from experiments import report
from experiments import train
from experiments.configs import base
from experiments.configs import quickstart

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _guard(vocab_size=257, **kw):
  t = base.get_config().train
  fields = {"factor": t.divergence_factor, "margin": t.divergence_margin,
            "patience": t.divergence_patience, **kw}
  return divergence.Guard(vocab_size=vocab_size, **fields)


def _first_trip(guard, losses, first_step=1):
  for step, loss in enumerate(losses, first_step):
    why = guard.update(step, float(loss))
    if why is not None:
      return step, why
  return None


def test_nonfinite_loss_stops_at_once():
  for bad in (math.nan, math.inf):
    assert _first_trip(_guard(), [5.6, 5.0, bad]) == (
        3, f"loss diverged at step 3: the loss is {bad}")
  assert _first_trip(_guard(patience=0), [5.6, math.nan])[0] == 2


def test_sustained_blow_up_stops_after_patience_steps_naming_its_first():
  losses = [5.6, 5.2, 4.8, 4.5, 40.0, 90.0, 141.4, 120.0, 150.0, 160.0]
  step, why = _first_trip(_guard(), losses)
  assert step == 9  # the 5th high step in a row
  assert why.startswith("loss diverged at step 5: 150 at step 9, 5 steps above both 2x its "
                        "running level 5 and log(vocab) + 1 = 6.549")
  assert _first_trip(_guard(patience=0), losses) is None


def test_a_recovered_spike_resets_the_count():
  spike = [40.0] * 4 + [4.0]
  assert _first_trip(_guard(), [5.6, 5.0, 4.5] + spike * 5) is None


def test_healthy_spikes_never_stop_a_run():
  """Late in training the level is low and spikes are many times it, yet below a uniform guess."""
  rng = np.random.default_rng(0)
  steps = np.arange(3000)
  flipflop = np.log(5) * np.exp(-steps / 300) + 1e-3 + rng.exponential(0.01, steps.size)
  flipflop[rng.choice(steps.size, 40, replace=False)] *= 30  # isolated 30x spikes
  assert _first_trip(_guard(vocab_size=5), flipflop) is None
  # The start of a large-vocabulary model: above log(vocab) + margin, not above twice itself.
  start = [11.7, 11.5, 10.9, 10.2, 9.5, 9.0]
  assert _first_trip(_guard(vocab_size=50257), start) is None


def test_recorded_gpu_runs_never_trip():
  """Per-step losses of the text model's GPU training runs in the repository."""
  path = os.path.join(REPO, "docs", "benchmarks", "data", "train_losses_h200.jsonl")
  runs = [json.loads(line) for line in open(path)]
  assert runs and all(len(r["losses"]) >= 100 for r in runs)
  for r in runs:
    assert _first_trip(_guard(vocab_size=32000), r["losses"]) is None, r["encoding"]


def test_resumed_guard_starts_from_the_recorded_level():
  guard = _guard(recent=[1.0] * 10)  # a resumed run's recorded losses
  assert guard.level() == 1.0
  step, why = _first_trip(guard, [7.0] * 5, first_step=11)
  assert step == 15 and why.startswith("loss diverged at step 11: 7 at step 15")
  assert _first_trip(_guard(), [7.0] * 6) is None  # no level yet: the first loss sets it


@pytest.mark.parametrize("field, value", [("divergence_factor", 0.5), ("divergence_margin", -1.0),
                                          ("divergence_factor", math.nan),
                                          ("divergence_patience", -1),
                                          ("divergence_margin", math.inf)])
def test_bad_divergence_fields_are_named(field, value):
  t = base.get_config().train
  t[field] = value
  with pytest.raises(errors.RunError, match=rf"^config\.train\.{field}={value!r} must be "):
    divergence.check_config(t)


def test_learning_rate_10_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  c = quickstart.get_config("runlocal,encoding=rope")
  c.train.update(steps=40, learning_rate=10.0, warmup_steps=1, checkpoint_every=1, log_every=1)
  with pytest.raises(train.TrainingDiverged, match=r"^loss diverged at step (\d+): ") as e:
    train.run(c, str(tmp_path))
  first = int(e.value.args[0].split("at step ")[1].split(":")[0])
  records = [r for r in report.read_metrics(str(tmp_path)) if r["kind"] == "train"]
  floor = math.log(data.vocab_size(c.data)) + c.train.divergence_margin
  kept = checkpoint.all_steps(str(tmp_path))
  assert kept and max(kept) < first, (kept, first)
  assert f"checkpoint step {max(kept)} is from before it" in e.value.args[0]
  assert all(r["loss"] <= floor for r in records if r["step"] in kept), records
  assert not os.path.exists(tmp_path / "summary.json")
