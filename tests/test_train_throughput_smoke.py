"""CPU smoke test of experiments/benchmarks/train_throughput.py: the child's measurement of one
(encoding, T), run in-process at a tiny size for rope and path, the FLOP counts, the table, the
kernel plan a row records, and step_profile.py on a real run."""
from __future__ import annotations

import math

import pytest

from experiments.benchmarks import common
from experiments.benchmarks import step_profile
from experiments.benchmarks import throughput_common as shared
from experiments.benchmarks import throughput_tables as tables
from experiments.benchmarks import train_throughput as tt
from posenc_jax import model as model_lib

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--head-dim", "16", "--vocab", "300",
        "--tokens-per-step", "128", "--steps", "2", "--loss-steps", "3", "--warmup", "0",
        "--num-batches", "2", "--matmul-size", "0"]
T = 64


@pytest.fixture(scope="module")
def rows():
  args = tt.parse_args(TINY)
  return {name: tt.one_row(args, name=name, seq_len=T) for name in ("rope", "path")}


@pytest.mark.parametrize("name", ["rope", "path"])
def test_one_row_measures(rows, name):
  row = rows[name]
  assert row["error"] is None, row["error"]
  assert (row["encoding"], row["seq_len"], row["batch"]) == (name, T, 2)
  assert len(row["losses"]) == 3 and row["loss_finite"]
  assert all(math.isfinite(x) for x in row["losses"])
  assert row["tokens_per_s"] > 0 and len(row["step_ms_all"]) == 2
  assert row["compile_s"] > 0 and row["params"] > row["params_dense"] > 0
  assert row["mfu"] > 0 and row["peak_gib"] is None  # CPU has no memory_stats
  # The auto rule on CPU at T=64 (dispatch.CPU_DENSE_MAX_T): dense softmax, chunked PaTH;
  # neither is a Pallas kernel, so neither row has a plan.
  assert row["attention_impl"] == {"rope": "reference", "path": "chunked"}[name]
  assert row["plan"] is None


def test_path_counts_more_flops_than_rope(rows):
  size = dict(num_layers=2, num_heads=2, head_dim=16, seq_len=T, batch=2)
  rope = shared.train_flops(family="softmax", dense_params=rows["rope"]["params_dense"], **size)
  path = shared.train_flops(family="path", dense_params=rows["rope"]["params_dense"], **size)
  assert path["total"] > rope["total"] and path["attention"] == rope["attention"]
  assert rows["path"]["flops"]["total"] > rows["rope"]["flops"]["total"]
  # At the benchmark's size the transport grows as T^2 / C: 2 H D^2 T^2 / (2 C) per forward.
  big = dict(num_layers=1, num_heads=12, head_dim=64, seq_len=8192, batch=1, dense_params=0)
  fwd = shared.train_flops(family="path", **big)["transport"] / 3
  assert fwd == pytest.approx(2 * 12 * 64**2 * 8192**2 / (2 * 64), rel=0.01)


def test_markdown_has_both_encodings(rows):
  md = tables.render_markdown(list(rows.values()), command="pytest")
  table = [line for line in md.splitlines() if line.startswith("| ")]
  assert table[0].startswith("| encoding")
  names = [line.split("|")[1].strip() for line in table[1:]]
  assert names == ["rope", "path"]
  assert "1.00" in table[1]  # rope's ratio to itself


def test_anchor_without_torch_or_cuda_is_an_error_row():
  """On a machine without torch, fla-core or CUDA the anchor is a row with a clear error."""
  row = tt.one_row(tt.parse_args(TINY), name="fla_path", seq_len=T)
  assert row["implementation"] == "fla" and row["batch"] == 2
  if row["error"] is not None:  # (a GPU machine with FLA runs it)
    assert "FLA anchor" in row["error"], row["error"]


def test_scanned_rows_are_keyed_apart_and_compared_with_scanned_rope():
  args = tt.parse_args(TINY + ["--scan-layers"])
  ident = shared.row_identity(args, name="path", seq_len=T)
  loop = shared.row_identity(tt.parse_args(TINY), name="path", seq_len=T)
  assert ident["scan_layers"] is True and loop["scan_layers"] is None
  assert tables.row_key(ident) != tables.row_key(loop)
  row = lambda name, impl, scan, tps: {"encoding": name, "seq_len": T, "dtype": "bfloat16",
                                       "implementation": impl, "scan_layers": scan,
                                       "tokens_per_s": tps}
  rows = [row("rope", "cudnn", None, 100.0), row("rope", "cudnn", True, 80.0),
          row("path", "auto", True, 40.0), row("path", "auto", None, 60.0)]
  by_label_t = {(tables.label(r), T): r for r in rows}
  assert tables.label(rows[2]) == "path [scan]" and tables.label(rows[1]) == "rope [cudnn, scan]"
  assert tables._ratio_to_rope(rows[2], by_label_t) == pytest.approx(0.5)
  assert tables._ratio_to_rope(rows[3], by_label_t) == pytest.approx(0.6)


def _benchmark_model(encoding, **kw):
  return model_lib.ModelConfig(vocab_size=32000, encoding=encoding, num_layers=12, d_model=768,
                               num_heads=12, head_dim=64, block="llama", dtype="bfloat16", **kw)


def test_a_gpu_row_records_the_plan_its_layers_run():
  """The plan a GPU row stores (common.model_plan, as run_jax calls it): the 125M model's PaTH
  layer at T 8192 with its segments, PaTH-FoX's gate, FoX's kernel; no plan where cuDNN runs
  (rope) or no kernel exists (tapa); kernel options from "pallas:..." and kernel_options."""
  plan = lambda enc, **kw: common.model_plan(_benchmark_model(enc, **kw), batch=4, seq_len=8192,
                                             segments=True, backend="gpu")
  path = plan("path")
  assert path.startswith("PaTH on gpu") and "B=4 T=8192 H=12 K=12 D=64 bfloat16" in path
  assert "; segments" in path and "gate" not in path.splitlines()[0]
  assert "chunks:    128 of 64 tokens; spans of" in path
  assert "gate, segments" in plan("path_fox").splitlines()[0]
  assert plan("fox").startswith("FoX on gpu")
  assert plan("rope") is None and plan("tapa") is None
  walks = plan("path", implementation="pallas:span=0",
               kernel_options=(("keep_inverse", False),))
  assert "spans of" not in walks and "backward:  walk" in walks
  assert "Y recomputed in its backward" in walks


def test_step_profile_times_each_part_of_a_real_run(capsys):
  """experiments/benchmarks/step_profile.py on the flip-flop runlocal config: the run's own
  Trainer and data stream, each part timed, and the kernel plan line (none on a CPU); an
  encoding outside the sweep is named."""
  step_profile.main(["--config=experiments/configs/flipflop.py:runlocal", "--encoding", "rope",
                     "--steps", "2"])
  table = capsys.readouterr().out.splitlines()
  assert "tokens/step 128" in table[0]                 # runlocal: batch 4 x length 32
  assert table[1] == "attention kernel plan: none (no Pallas kernel)"
  values = [float(x.replace(",", "")) for x in table[-1].strip("| ").split(" | ")]
  assert len(values) == 5 and all(v > 0 for v in values)
  with pytest.raises(SystemExit, match="--encoding='xpos' is not in the config's"):
    step_profile.main(["--config=experiments/configs/flipflop.py:runlocal", "--encoding", "xpos"])
