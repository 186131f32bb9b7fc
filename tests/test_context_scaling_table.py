"""experiments/benchmarks/context_scaling.py's table: scaling against one GPU at T / context, and
the ideal scaling that the work per token allows."""
from __future__ import annotations

from experiments.benchmarks import context_scaling


def _row(T, context, tokens_per_s_per_gpu, flops_per_token, peak):
  return {"encoding": "path", "layers": 12, "scan_layers": True, "seq_len": T,
          "context": context, "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
          "step_ms": 1.0, "peak_gib": peak, "flops_per_token": flops_per_token,
          "comm_share": 0.1, "loss_first": 11.0, "loss_last": 3.0, "loss_falling": True,
          "device_kind": "H200", "date": "2026-11-29 00:00:00 UTC", "error": None}


def test_scaling_ideal_and_memory_ratio_against_the_one_gpu_row():
  rows = [_row(32768, 1, 100_000.0, 2.0e9, 30.0), _row(131072, 4, 20_000.0, 8.0e9, 45.0)]
  md = context_scaling.render_markdown(rows)
  line = next(l for l in md.splitlines() if l.startswith("| path | 12 (scan) | 131,072 | 4 |"))
  cells = [c.strip() for c in line.strip("|").split("|")]
  # scaling 20k / 100k, ideal 2e9 / 8e9 FLOPs a token, of ideal 0.2 / 0.25, memory 45 / 30
  assert cells[6:9] == ["0.20", "0.25", "0.80"]
  assert cells[11] == "1.50"


def test_rows_without_flops_leave_the_ideal_blank():
  rows = [_row(32768, 1, 100_000.0, None, 30.0), _row(65536, 2, 40_000.0, None, 40.0)]
  line = context_scaling.render_markdown(rows).splitlines()[-1]
  cells = [c.strip() for c in line.strip("|").split("|")]
  assert cells[6:9] == ["0.40", "-", "-"]
