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


def _train_records(losses, *, every):
  """Train records as train.py logs them: each step `every`, with its window's mean loss."""
  return [{"kind": "train", "step": every * (i + 1), "loss": x[-1],
           "loss_window_mean": sum(x) / len(x)}
          for i, x in enumerate(losses)]


def test_train_loss_tail_is_the_mean_over_the_last_steps():
  # Windows of 25 steps: the last window's mean, not its last step's (one batch's) loss.
  recs = _train_records([[3.0] * 25, [1.0] * 24 + [2.0]], every=25)
  mean, n = report.train_loss_tail(recs)
  assert n == 25 and abs(mean - 26.0 / 25) < 1e-12
  # Windows of 10: three windows reach 25 steps (30 covered), weighted by their lengths.
  recs = _train_records([[9.0] * 10, [1.0] * 10, [2.0] * 10, [3.0] * 10], every=10)
  mean, n = report.train_loss_tail(recs)
  assert n == 30 and abs(mean - 2.0) < 1e-12
  # Old records without window means: one step each.
  old = [{"kind": "train", "step": s, "loss": float(s)} for s in range(1, 31)]
  assert report.train_loss_tail(old) == (sum(range(6, 31)) / 25, 25)
  assert report.train_loss_tail([]) is None


def test_comparison_table_names_what_its_loss_column_is(tmp_path):
  summaries = [{"encoding": e, "task": "flipflop", "final_loss": 0.6326, "wall_time_s": 1.0,
                "seq_len": 64, "step": 100,
                "eval": [{"set": "id", "length": 64, "error": 0.5}]} for e in ("rope", "path")]
  for s, last in zip(summaries, (0.6, 0.0)):
    log = report.MetricsLog(str(tmp_path / s["encoding"]))
    for step in range(25, 101, 25):
      log.train(step, {"loss": last, "loss_window_mean": last + step / 1000})
    log.close()
  table = report.write_sweep_report(str(tmp_path), summaries)
  head, _, rope, path = table.splitlines()
  assert "train loss (mean of last 25 steps)" in head
  assert "0.7000" in rope and "0.1000" in path          # the last window's means, not 0.6326
  bare = report.comparison_table(summaries).splitlines()
  assert "train loss (last logged step)" in bare[0] and "0.6326" in bare[2]


def _final(errors: dict, lengths=(64,)):
  return [{"set": s, "length": n, "loss": 0.0, "perplexity": 1.0, "accuracy": 1 - e, "error": e}
          for s, e in errors.items() for n in lengths]


def test_one_eval_length_draws_labelled_bars():
  fig, ax = report.vs_length_figure(_final({"dense": 0.0, "id": 0.0, "sparse": 0.25}), "error",
                                    "path")
  try:
    assert len(ax.patches) == 3 and not ax.get_lines()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["id", "sparse", "dense"]
    assert sorted(t.get_text() for t in ax.texts) == ["0.00%", "0.00%", "25.00%"]
    assert "the only evaluation length" in ax.get_title()
  finally:
    plt.close(fig)


def test_equal_values_at_several_lengths_do_not_hide_each_other():
  from experiments import plot_style

  fig, ax = report.vs_length_figure(_final({"id": 0.0, "sparse": 0.0, "dense": 0.0}, (64, 128)),
                                    "error", "path")
  try:
    lines = ax.get_lines()
    xs = [tuple(l.get_xdata()) for l in lines]
    assert len(set(xs)) == 3                                  # nudged apart sideways
    assert [l.get_color() for l in lines] == [plot_style.eval_set(s)["color"]
                                              for s in ("id", "sparse", "dense")]
    assert len({l.get_markersize() for l in lines}) == 3     # nested rings where they meet
  finally:
    plt.close(fig)


def test_each_eval_set_keeps_its_colour_in_both_plots():
  from experiments import plot_style

  recs = [{"kind": "eval", "step": s, "set": n, "length": 64, "loss": 0.1}
          for s in (10, 20) for n in ("dense", "id")]
  fig, ax = report.loss_figure(recs, "rope")
  fig2, ax2 = report.vs_length_figure(_final({"dense": 0.1, "id": 0.2}), "error", "rope")
  try:
    by_label = {l.get_label(): l.get_color() for l in ax.get_lines()}
    bars = [matplotlib.colors.to_hex(p.get_facecolor()) for p in ax2.patches]   # id, dense
    assert by_label["dense"] == bars[1] == plot_style.eval_set("dense")["color"]
    assert by_label["id"] == bars[0] == plot_style.eval_set("id")["color"]
  finally:
    plt.close(fig)
    plt.close(fig2)
