"""experiments/plot_style.py: one look per encoding, the same in every plot."""
from experiments import plot_style
from posenc_jax import encodings


def test_every_encoding_has_its_own_colour():
  names = list(encodings.NAMES)
  missing = [n for n in names if n not in plot_style.ENCODINGS]
  assert not missing, f"add {missing} to experiments/plot_style.ENCODINGS"
  colours = [plot_style.ENCODINGS[n][0] for n in names]
  assert len(set(colours)) == len(colours)


def test_looks_are_stable_and_kv_shift_keeps_the_base():
  assert plot_style.encoding("path") == {"color": "#d62728", "marker": "o", "linestyle": "-"}
  assert plot_style.encoding("path + kv_shift") == plot_style.encoding("path")
  # A name without an entry gets one look, the same at every call.
  assert plot_style.encoding("not_an_encoding") == plot_style.encoding("not_an_encoding")


def test_dodge_and_marker_sizes_separate_series():
  offsets = [plot_style.dodge(i, 3) for i in range(3)]
  assert offsets == sorted(offsets) and abs(sum(offsets)) < 1e-12 and len(set(offsets)) == 3
  assert plot_style.dodge(0, 1) == 0.0
  sizes = [plot_style.marker_size(i) for i in range(3)]
  assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3
  assert plot_style.set_order(["dense", "zzz", "id", "sparse"]) == ["id", "sparse", "dense", "zzz"]
