"""When a training run has diverged: the rule train.run applies to every step's loss.

A step's loss is *high* when it lies above both
  config.train.divergence_factor x the running level (the median of the last 64 losses
      that were not high), and
  log(vocab_size) + config.train.divergence_margin (worse than guessing uniformly);
the run has diverged at a NaN or inf loss, or after config.train.divergence_patience high
steps in a row (0: only at NaN / inf). Both bounds are needed: early in training the loss
sits near log(vocab_size) and a factor alone would not tell a rise from noise; late in
training the level is low and a healthy spike can be many times it, but not worse than a
uniform guess for several steps in a row. While a run of high steps lasts, train.run saves no
checkpoint, so the last checkpoint is from before the divergence.
"""
from __future__ import annotations

import collections
import math
import statistics

from experiments.errors import RunError

LEVEL_WINDOW = 64  # losses in the running level's median


def check_config(t) -> None:
  """Raises RunError naming the config.train.divergence_* field that is out of range."""
  for field in ("divergence_factor", "divergence_margin"):
    v = t[field]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < (
        1 if field == "divergence_factor" else 0):
      bound = "a finite number >= 1" if field == "divergence_factor" else "a finite number >= 0"
      raise RunError(f"config.train.{field}={v!r} must be {bound}")
  p = t.divergence_patience
  if isinstance(p, bool) or not isinstance(p, int) or p < 0:
    raise RunError(f"config.train.divergence_patience={p!r} must be an integer >= 0 "
                   f"(0: stop only at a NaN / inf loss)")


class Guard:
  """Feeds on one loss per step (`update`); says when the run has diverged."""

  def __init__(self, *, vocab_size: int, factor: float, margin: float, patience: int,
               recent=()):
    """recent: the losses of the steps before this one (a resumed run's records), oldest first."""
    self.floor = math.log(vocab_size) + margin
    self.factor, self.margin, self.patience = factor, margin, patience
    self._level = collections.deque((float(x) for x in recent if math.isfinite(x)),
                                    maxlen=LEVEL_WINDOW)
    self._streak: list[tuple[int, float]] = []  # the high steps in a row, (step, loss)

  @property
  def in_streak(self) -> bool:
    """Whether the latest steps were high (a checkpoint now could hold a diverging state)."""
    return bool(self._streak)

  def level(self) -> float:
    return statistics.median(self._level) if self._level else math.inf

  def update(self, step: int, loss: float) -> str | None:
    """None while the run is healthy; else why it diverged, starting "loss diverged at step N"."""
    if not math.isfinite(loss):
      return f"loss diverged at step {step}: the loss is {loss}"
    level = self.level()
    if self.patience and loss > self.floor and loss > self.factor * level:
      self._streak.append((step, loss))
      if len(self._streak) >= self.patience:
        first = self._streak[0][0]
        return (f"loss diverged at step {first}: {loss:.4g} at step {step}, {len(self._streak)} "
                f"steps above both {self.factor:g}x its running level {level:.4g} and "
                f"log(vocab) + {self.margin:g} = {self.floor:.4g}")
      return None
    self._streak.clear()
    self._level.append(loss)
    return None
