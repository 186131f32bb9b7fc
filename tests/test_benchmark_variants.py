"""The kernel benchmarks' command line (experiments/benchmarks/): --options strings become
kp.BlockSizes and a bad one fails before anything is timed, naming the valid options; --cases
takes anchor indices and shapes; and the phases path_kernel_phases.py times compose to
path_attention's gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from experiments.benchmarks import common
from experiments.benchmarks import path_kernel
from experiments.benchmarks import path_kernel_phases
from posenc_jax import householder

FIELDS = "block, span, prepass, mosaic, keep_inverse"


def test_option_strings_are_block_sizes():
  assert common.block_sizes("") == kp.BlockSizes()
  assert common.block_sizes("span=8,mosaic=false") == kp.BlockSizes(span=8, mosaic=False)
  assert common.block_sizes("prepass=split, keep_inverse=true,block=32") == kp.BlockSizes(
      prepass="split", keep_inverse=True, block=32)
  assert common.block_sizes("span=0,keep_inverse=bf16") == kp.BlockSizes(span=0,
                                                                         keep_inverse="bf16")
  assert common.variant_label("path", "") == "path"
  assert common.variant_label("path_fox", "span=8") == "path_fox[span=8]"


@pytest.mark.parametrize("bad", ["fwd_kernel=mosaic", "dkv_in_dq=true,span=8", "span"])
def test_a_deleted_or_malformed_option_names_the_valid_ones(bad):
  with pytest.raises(ValueError, match=f"--options '{bad}'.*the options are {FIELDS}"):
    common.block_sizes(bad)


def test_a_bad_value_names_the_valid_values():
  with pytest.raises(ValueError, match=r"--options 'prepass=fold'.*\('uz', 'split', 'jnp'\)"):
    common.block_sizes("prepass=fold")
  with pytest.raises(ValueError, match="--options 'span=3'.*even"):
    common.block_sizes("span=3")


def test_the_scripts_reject_bad_options_and_variants_before_running(capsys):
  """A bad --options or --cases entry ends the command with one line naming it (argparse's
  error), before any kernel runs."""
  for parse, argv, what in (
      (path_kernel.parse_args, ["--part", "jax", "--options", "", "--options", "bwd_lanes=2"],
       f"--options 'bwd_lanes=2': unknown kernel option bwd_lanes; the options are {FIELDS}"),
      (path_kernel_phases.parse_args, ["--options", "keep_operands=false"],
       "--options 'keep_operands=false'"),
      (path_kernel_phases.parse_args, ["--cases", "0,8x8192"], "--cases entry '8x8192'")):
    with pytest.raises(SystemExit):
      parse(argv)
    assert what in capsys.readouterr().err.strip().splitlines()[-1]
  with pytest.raises(ValueError, match="--variants path@l1rc: not one of path, path_fox, fox"):
    path_kernel.part_jax(["0"], ["cudnn", "path@l1rc"])
  a = path_kernel.parse_args(["--part", "jax", "--cases", "3,8x8192x16x128", "--options",
                              "span=8", "--options", ""])
  assert a.cases == ["3", "8x8192x16x128"] and a.options == ["span=8", ""]
  assert path_kernel.parse_args(["--part", "check"]).options == [""]


def test_cases_take_indices_and_shapes():
  """--cases: an index into CASES (the anchors), or a shape BxTxHxD beside them; a bad entry
  names itself."""
  assert common.case_shape("3") == common.CASES[3] and common.case_label("3") == 3
  assert common.case_shape("8x8192x16x128") == (8, 8192, 16, 128)
  assert common.case_label("8x8192x16x128") == "8x8192x16x128"
  assert common.parse_cases("0, 4,2x64x2x16") == ["0", "4", "2x64x2x16"]
  for bad in ("8x8192x16", "0x64x2x16", "8xTx16x64", str(len(common.CASES)), "big"):
    with pytest.raises(ValueError, match=bad):
      common.parse_cases(f"0,{bad}")
  with pytest.raises(ValueError, match="--cases is empty"):
    common.parse_cases(" , ")


def test_the_timed_phases_compose_to_path_attention_gradients():
  """path_kernel_phases.programs on tiny shapes in interpret mode: kp.phases runs the four
  phases, the script jits each as it times it, and the last one's output (the gradients of q,
  k, v, w, beta and log f) is path_attention's gradient: the dense float32 oracle's to the
  kernel tests' float32 tolerance. The backward reads the log-sum-exp the jitted forward makes,
  and the plan is the one these options resolve to."""
  B, T, H, D = 1, 32, 1, 16
  q, k, v, w, beta, log_forget, do = common.inputs(B, T, H, D, dtype=jnp.float32)
  bs = common.block_sizes("block=16,span=0,prepass=jnp")
  progs = path_kernel_phases.programs(q, k, v, w, beta, log_forget, do=do, block_sizes=bs,
                                      backend="interpret")
  assert list(progs) == list(path_kernel_phases.PHASES)
  f, args = progs["prepass_vjp"]
  grads = f(*args)
  oracle = lambda *a: householder.path_attention_reference(*a[:5], log_forget=a[5],
                                                           scale=D ** -0.5)
  with jax.default_matmul_precision("highest"):
    _, pull = jax.vjp(oracle, q, k, v, w, beta, log_forget)
    want = pull(do)
  assert len(grads) == len(want) == 6
  for name, g, ref in zip(("q", "k", "v", "w", "beta", "log_forget"), grads, want):
    assert g.shape == ref.shape and common.rel_rms(g, ref) < 1e-4, (name, common.rel_rms(g, ref))
  f, args = progs["forward"]
  _, lse = f(*args)
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(progs["backward"][1][2]))
  plan = str(kp.explain(q, k, v, w, beta, log_forget, block_sizes=bs, backend="interpret"))
  assert "pre-pass:  jnp" in plan and "backward:  walk" in plan


def test_plane_rotations_benchmark_times_every_tile_and_checks_it_against_the_scan(tmp_path):
  """plane_rotations.py in the interpreter at a small shape: a row per variant, the kernel at
  its default tiles and at every tile matching the scan (y rounded to bf16 once; float32
  gradients), the JSON written."""
  import json

  from experiments.benchmarks import plane_rotations

  out = tmp_path / "pr.json"
  rows = plane_rotations.main(["--interpret", "--shape", "1x40x2x16", "--planes", "5",
                               "--block-t", "16,32", "--reps", "1", "--out", str(out)])
  assert [r["variant"] for r in rows] == ["scan", "kernel default", "kernel bt=16",
                                          "kernel bt=32"]
  for r in rows[1:]:
    assert r["y_rel_rms"] < 1e-2 and r["grad_rel_rms"] < 1e-5, r
    assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0
  assert len(json.loads(out.read_text())["rows"]) == 4


def test_grad_fn_takes_the_cotangent_as_an_argument():
  """common.grad_fn: the gradient of sum(fn(*a) * do) in the first n arguments (here 1 of 2),
  equal to jax.vjp's, with do passed in rather than baked into the program as a constant, so
  the program's text does not grow with do (the closure did: 2 GiB at T 16384)."""
  key = jax.random.key(0)
  x, y, do = (jax.random.normal(k, (32, 48)) for k in jax.random.split(key, 3))
  fn = lambda x, y: jnp.sin(x) * y  # noqa: E731
  (gx,) = common.grad_fn(fn, 1)(x, y, do)
  _, pull = jax.vjp(lambda x: fn(x, y), x)
  np.testing.assert_allclose(np.asarray(gx), np.asarray(pull(do)[0]), rtol=1e-6, atol=1e-6)
  small = common.grad_fn(fn, 1).lower(x, y, do).as_text()
  big = [jnp.zeros((256, 256))] * 3
  assert len(common.grad_fn(fn, 1).lower(*big).as_text()) < 2 * len(small)


def test_sba_rows_time_the_chosen_form_the_dense_reference_and_the_kernel():
  """path_kernel's sba row runs what implementation=None picks (here the CPU's dense rule at
  T 64), sba_dense always the T x T reference, sba_pallas the kernel (interpreted here); each
  times a forward and a backward."""
  (row,) = path_kernel.part_jax(["1x64x2x16"], ["sba", "sba_dense", "sba_pallas"],
                                dtype="float32")
  assert row["sba"]["plan"].startswith("reference: cpu: dense jnp")
  assert row["sba_dense"]["plan"] == "reference: dense T x T jnp"
  assert row["sba_pallas"]["plan"] == "pallas: the Triton kernel"
  for name in ("sba", "sba_dense", "sba_pallas"):
    assert row[name]["fwd_ms"] > 0 and row[name]["fwdbwd_ms"] > 0
