"""The probes' README sections and plots, drawn from their results.json alone: what
experiments/results_pages.py puts in a probe folder's README (the probes themselves write
results.json and provenance.json, then call results_pages.write_page).
"""
from __future__ import annotations

import os

import numpy as np

from experiments import plot_style
from experiments import report

# mixing_window's statistics, shown in its README (experiments/probes/mixing_window.py computes
# them)
MIXING_WINDOW_STATISTICS = """\
For a trained model (length_extrapolation checkpoints) and each layer and kv head, on
held-out text rows of T bytes. The per-token transport G_t is the encoding's own:
  accumulated rotations  G_t = R(delta_t), block-diagonal 2x2 rotations by the step angles
                         (read back from the encoding: phi_t = angle of the rotated unit
                         pair, delta_t = phi_t - phi_{t-1}); T(j -> i) = R(phi_i - phi_j)
  PaTH                   G_t = H_t = I - beta_t w_t w_t^T; T(j -> i) = H_i ... H_{j+1}
Three statistics, each averaged over layers and kv heads (per layer in results.json):

  first moment    m(r) = || E_routes[T(j -> j + r)] ||_2, the spectral norm of the mean
                  transport over all routes of length r in the rows (every start j), and
                  the bulk version f(r) = ||E[T]||_F / sqrt(D) (rms over directions). A
                  geometric decay m(r) ~ rho^r is the "spectral gap"; m stays 1 for a
                  route-independent transport such as RoPE (it is a fixed rotation).
  attention mass  mass(bin) = mean over query positions i >= T/2 of sum_{j: i - j in bin} a_ij,
                  distance bins {0}, [1,2), [2,4), ..., per query head (a_ij the model's own
                  attention weights, read by attending to one-hot values).
  cancellation    c_transported = E_i || sum_j a_ij T(j -> i) v_j || / sum_j a_ij ||v_j||,
                  c_plain = the same without T: how much of the attended value mass survives
                  averaging (1 = aligned values, ~1/sqrt(#attended) = random directions).
                  The _v encodings apply T to values; the plain ones attend c_plain."""


HISTOGRAMS = "histograms.png"   # drawn from results.json's binned histograms


def _has_histograms(results: dict) -> bool:
  return all("histogram" in s for panel in results.values() for by_name in panel.values()
             for s in by_name.values())


def _plot_histograms(results: dict, path: str) -> None:
  """One panel per interval and source: each encoding's density over the panel's bins."""
  import matplotlib   # (only where a plot is drawn: its backend is set first)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ivs = list(results)
  sources = list(results[ivs[0]])
  fig, axes = plt.subplots(len(ivs), len(sources), figsize=(4.2 * len(sources), 3.4 * len(ivs)),
                           squeeze=False)
  for row, iv in zip(axes, ivs):
    for ax, source in zip(row, sources):
      for name, s in results[iv][source].items():
        h = s["histogram"]
        ax.stairs(h["density"], h["edges"], fill=True, alpha=0.55,
                  color=plot_style.encoding(name)["color"],
                  label=f"{name} (mu {s['mean']:.2f}, sd {s['std']:.2f})")
      ax.axvline(0, color="k", lw=0.6)
      ax.set_title(f"{source}\n{iv}", fontsize=8)
      ax.set_xlabel("Delta = s(short) - s(long)", fontsize=8)
      ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def distance_bias_section(c, results: dict, prov: dict, out_dir: str | None, *,
                          img: str = "", has_image: bool = False) -> list[str]:
  """The README's setting lines, table and histograms, from results.json alone (drawn into
  out_dir when given). Folders from before the histograms were binned into results.json keep
  the image they have (has_image); without either the README says so."""
  binned = _has_histograms(results)
  if out_dir and binned:
    _plot_histograms(results, os.path.join(out_dir, HISTOGRAMS))
  ivs = list(results)
  sources = list(results[ivs[0]])
  rows = [[iv, source, name, f"{s['mean']:.3f}", f"{s['std']:.3f}",
           f"{100 * s['frac_positive']:.1f}%", s["n"]]
          for iv in ivs for source in sources for name, s in results[iv][source].items()]
  return [
      f"- command: `{prov['command']}`",
      f"- setting: {'runlocal (smoke test only)' if c.runlocal else 'full'}",
      f"- intervals: {', '.join(ivs)}; {c.num_pairs} pairs per source (trained: split over the "
      f"heads of each layer); random content in head_dim {c.head_dim}",
      f"- trained q/k: checkpoints of `{c.source_config}` ({c.source_arg or 'full setting'}) in "
      f"`{c.source_workdir}`, held-out text rows of {c.text_len} bytes" if c.source_workdir
      else "- trained q/k: not run",
      f"- machine: {prov['machine']}, jax {prov['jax']}; date {prov['date']}; wall time "
      f"{prov['wall_time_s']} s", "",
      report.markdown_table(["intervals", "source", "encoding", "mean Delta", "std Delta",
                             "Delta > 0", "n"], rows), "",
      "Delta = s(q, k; lambda) - s(q, k; Lambda) with s the encoding's attention logit for key "
      "at position 0 and query at position lambda ~ U(short) or Lambda ~ U(long) (the same "
      "content pair at both distances). Paper (trained 8K models, PG19): RoPE mean 4.1 / std "
      "0.85, TAPA mean 0.03 / std 3.3.", "",
      f"![histograms]({img}{HISTOGRAMS})" if binned or has_image else
      "This run's histograms were not kept: it predates their bins in results.json.", ""]


def _plot(results: dict, path: str) -> None:
  import matplotlib   # (only where a plot is drawn: its backend is set first)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(14, 4))
  names = list(results)
  for name, r in results.items():
    st = plot_style.encoding(name)
    rs = [int(k) for k in r["first_moment_spectral"]]
    axes[0].plot(rs, list(r["first_moment_spectral"].values()), label=f"{name} ||.||_2", **st)
    axes[0].plot(rs, list(r["first_moment_frobenius"].values()), markerfacecolor="none",
                 label=f"{name} ||.||_F/sqrt(D)", **{**st, "linestyle": ":"})
    bins = list(r["attention_mass"])
    axes[1].plot(range(len(bins)), list(r["attention_mass"].values()), label=name, **st)
    axes[1].set_xticks(range(len(bins)), bins, rotation=45, fontsize=7)
  axes[0].set(xscale="log", yscale="log", xlabel="route length r", ylabel="||E[T_route]||",
              title="first moment of the route transport")
  axes[1].set(yscale="log", xlabel="distance bin", ylabel="attention mass",
              title="attention mass vs distance (queries i >= T/2)")
  for i, n in enumerate(names):
    color = plot_style.encoding(n)["color"]
    axes[2].bar(i - 0.2, results[n]["cancellation_plain"], 0.4, color=color, alpha=0.45,
                label="plain values" if i == 0 else None)
    axes[2].bar(i + 0.2, results[n]["cancellation_transported"], 0.4, color=color,
                label="transported" if i == 0 else None)
  axes[2].set_xticks(np.arange(len(names)), names, rotation=20)
  axes[2].set(ylabel="||sum a T v|| / sum a ||v||",
              title="value-side cancellation\n(light: plain values, dark: transported)")
  for ax in axes:
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def mixing_window_section(c, results: dict, prov: dict, out_dir: str | None, *,
                          img: str = "") -> list[str]:
  """The README's setting lines, definitions, tables and plot, from results.json alone."""
  if out_dir:
    _plot(results, os.path.join(out_dir, "mixing_window.png"))
  names = list(results)
  rs = list(next(iter(results.values()))["first_moment_spectral"])
  rows = [[n] + [f"{results[n]['first_moment_spectral'][k]:.3f} / "
                 f"{results[n]['first_moment_frobenius'][k]:.3f}" for k in rs] for n in names]
  bins = list(next(iter(results.values()))["attention_mass"])
  mrows = [[n] + [f"{results[n]['attention_mass'][b]:.3f}" for b in bins] for n in names]
  crows = [[n, f"{results[n]['cancellation_plain']:.3f}",
            f"{results[n]['cancellation_transported']:.3f}"] for n in names]
  doc = MIXING_WINDOW_STATISTICS.split("\n\n")
  return [f"- command: `{prov['command']}`",
          f"- setting: {'runlocal (smoke test only)' if c.runlocal else 'full'}",
          f"- checkpoints: `{c.source_config}` ({c.source_arg or 'full setting'}) in "
          f"`{c.source_workdir}`; {c.text_batch} held-out rows of {c.text_len} bytes",
          f"- machine: {prov['machine']}, jax {prov['jax']}; date {prov['date']}; wall time "
          f"{prov['wall_time_s']} s", "", "### Definitions", "", *doc, "",
          "### First moment of the route transport: spectral / Frobenius-rms norm vs r", "",
          report.markdown_table(["encoding"] + [f"r={k}" for k in rs], rows), "",
          "### Attention mass per distance bin", "",
          report.markdown_table(["encoding"] + bins, mrows), "",
          "### Value-side cancellation", "",
          report.markdown_table(["encoding", "c_plain", "c_transported"], crows), "",
          f"![mixing window]({img}mixing_window.png)", ""]
