"""experiments/report.py's loss plot: losses of exactly 0 stay on the plot and are counted."""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments import report  # noqa: E402


def _records(train_losses, eval_losses):
  return ([{"kind": "train", "step": 10 * i, "loss": x} for i, x in enumerate(train_losses)]
          + [{"kind": "eval", "step": 10 * i, "set": "id", "length": 128, "loss": x}
             for i, x in enumerate(eval_losses)])


def _drawn(ax):
  """Every plotted (x, y) point in display coordinates; a log axis maps y = 0 to -inf/nan."""
  return np.concatenate([ax.transData.transform(line.get_xydata()) for line in ax.get_lines()])


def test_zero_losses_are_drawn_and_counted():
  fig, ax = report.loss_figure(_records([2.0, 0.5, 1e-4, 0.0, 0.0], [1.0, 0.0, 0.0]), "path")
  try:
    ys = np.concatenate([line.get_ydata() for line in ax.get_lines()])
    assert (ys == 0).sum() == 4
    assert ax.get_yscale() == "symlog"
    assert np.isfinite(_drawn(ax)).all()           # the zeros land on the axes, not at -inf
    notes = [t.get_text() for t in ax.texts]
    assert notes == ["4 loss values exactly 0: symlog axis, linear below 0.0001"], notes
    lo, hi = ax.get_ylim()
    assert lo <= 0 <= hi                           # 0 is inside the visible range
  finally:
    plt.close(fig)


def test_positive_losses_keep_a_plain_log_axis():
  fig, ax = report.loss_figure(_records([2.0, 0.5, 0.01], [1.0]), "rope")
  try:
    assert ax.get_yscale() == "log" and len(ax.texts) == 0
    assert np.isfinite(_drawn(ax)).all()
  finally:
    plt.close(fig)


def test_all_zero_and_negative_values_are_noted():
  fig, ax = plt.subplots()
  try:
    ax.plot([0, 1, 2], [0.0, 0.0, -1.0])
    note = report.log_or_symlog(ax, [0.0, 0.0, -1.0, math.nan])
    assert note == "2 loss values exactly 0, 1 < 0: symlog axis, linear below 1"
    assert np.isfinite(_drawn(ax)).all()
  finally:
    plt.close(fig)


def test_run_report_writes_the_plot_with_zero_losses(tmp_path):
  log = report.MetricsLog(str(tmp_path))
  for step, loss in enumerate([1.0, 0.1, 0.0]):
    log.train(step, {"loss": loss})
  log.close()
  summary = {"encoding": "path", "task": "flipflop", "seq_len": 128, "step": 2,
             "final_loss": 0.0, "wall_time_s": 1.0, "eval": []}
  report.write_run_report(str(tmp_path), summary)
  assert (tmp_path / "loss.png").stat().st_size > 0
