"""A bad config fails before anything compiles: one `error:` line naming the field, exit 2."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from absl import flags

from experiments import cli_config
from experiments import config_fields
from experiments import train
from experiments.configs import base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = "experiments/configs/quickstart.py"
CONFIG = f"--config={QUICKSTART}:runlocal,encoding=rope"


def _main(workdir, *overrides):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "experiments.main", CONFIG, f"--workdir={workdir}",
                         *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)


def _assert_one_error_line(proc, *fragments):
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1, proc.stderr[-2000:]
  for f in fragments:
    assert f in errors[0], errors[0]


ROWS = [
    (["--config.model.encoding=bogus"], ["config.model.encoding='bogus'", "unknown"]),
    (["--config.model.encoding=kv_shift"], ["config.model.encoding='kv_shift'", "kv_shift=True"]),
    (["--config.model.head_dim=7"], ["config.model", "head_dim=7", "even"]),
    (["--config.model.num_kv_heads=3"], ["config.model.num_kv_heads=3", "multiple"]),
    (["--config.model.d_model=0"], ["config.model.d_model=0"]),
    (["--config.data.task=text", "--config.data.seq_len=1000000000"],
     ["config.data.seq_len=1000000000", "exceeds"]),
    (["--config.eval.lengths=(32,1000000000)", "--config.data.task=text"],
     ["config.eval.lengths", "1000000000"]),
    (["--config.train.warmup_steps=50"], ["config.train.warmup_steps=50"]),
    (["--config.mesh.data=3"], ["config.mesh"]),
    (["--config.model.implementation=pallas:span"],
     ["config.model.implementation='pallas:span'", "not KEY=VALUE"]),
    # Unknown fields, in any group, on the command line: named with the valid ones.
    (["--config.model.foo=1"], ["config.model has no field foo; fields: block, d_model,"]),
    (["--config.foo.bar=1"],
     ["config has no field foo; fields: data, distributed, eval, mesh, model, sweep"]),
    (["--config.train.warmup=3"], ["config.train has no field warmup (did you mean "
                                   "warmup_steps?); fields: allow_config_change, batch_size,"]),
    (["--config.model.encoding.x=1"], ["config.model.encoding='rope' is a str, not a group"]),
    (["--config.model.encoding_kwargs.bogus=3"], ["config.model.encoding_kwargs={'bogus': 3}",
                                                  "unknown hyperparameters ['bogus']"]),
    # A value of the wrong type or range names its field.
    (["--config.train.steps=abc"], ["--config.train.steps=abc: config.train.steps must be int"]),
    (["--config.eval.lengths=abc"], ["config.eval.lengths=('abc',) must be a tuple of integers"]),
    (["--config.train.grad_clip=nan"], ["config.train.grad_clip=nan must be a finite number"]),
    (["--config.data.text_dir="], ["config.data.text_dir='' must be a directory, a file or a "
                                   "glob"]),
    (["--config.train.learning_rate=inf"], ["config.train.learning_rate=inf must be a finite"]),
    (["--config.train.seed=-1"], ["config.train.seed=-1 must be an integer in [0,"]),
    # The PaTH / FoX kernels' options: an unknown one named with the valid ones, a bad value
    # naming its field, a field set twice.
    (["--config.model.kernel_options.bogus=1"],
     ["config.model.kernel_options={'bogus': 1}: unknown kernel option bogus; the options are "
      "block, span, prepass, mosaic, keep_inverse"]),
    (["--config.model.kernel_options.prepass=fold"],
     ["config.model.kernel_options={'prepass': 'fold'}: prepass='fold' must be None or one of "
      "('uz', 'split', 'jnp')"]),
    (["--config.model.kernel_options.keep_inverse=maybe"],
     ["keep_inverse='maybe' must be one of (False, True, 'bf16')"]),
    (["--config.model.implementation=pallas:span=2", "--config.model.kernel_options.span=4"],
     ["config.model.kernel_options={'span': 4}: span set both here and in "
      "implementation='pallas:span=2'"]),
]
# The CLI (a subprocess: ~5 s of CI time a row) runs a model, a data, a mesh and an unknown-
# field row (0, 5, 8, 10); the other rows take its same path (cli_config.parse's or main.plan's
# ValueError printed as one `error:` line, exit 2) under -m slow, and
# test_bad_config_is_refused_by_the_checks holds every row's message in-process.
CLI_ROWS = [row if i in (0, 5, 8, 10) else pytest.param(*row, marks=pytest.mark.slow)
            for i, row in enumerate(ROWS)]


def _parsed(config_arg, *overrides):
  """(config, fields set on the command line) as experiments.main's parser makes them."""
  values = flags.FlagValues()
  argv = ["main", f"--config={config_arg}", *overrides]
  cli_config.define_config_flag(flag_values=values, sys_argv=argv)
  cli_config.parse(argv, flag_values=values)
  return values["config"].value, cli_config.explicit_fields(flag_values=values)


@pytest.mark.parametrize("overrides,fragments", CLI_ROWS)
def test_bad_config_is_one_line(tmp_path, overrides, fragments):
  workdir = tmp_path / "run"
  proc = _main(workdir, *overrides)
  _assert_one_error_line(proc, *fragments)
  assert not workdir.exists(), "a rejected config must not start a run"


@pytest.mark.parametrize("overrides,fragments", ROWS)
def test_bad_config_is_refused_by_the_checks(tmp_path, overrides, fragments):
  """Each row in-process through the CLI's parser and config_checks.check, which
  experiments.main.plan runs on the config before anything compiles: one ValueError line
  naming the field, no workdir."""
  import jax

  from experiments import config_checks
  from experiments import data
  workdir = tmp_path / "run"
  with pytest.raises(ValueError) as raised:
    config, _ = _parsed(CONFIG.removeprefix("--config="), *overrides)
    config_checks.check(config, workdir=str(workdir), data_module=data,
                        num_devices=jax.device_count())
  message = str(raised.value)
  assert "\n" not in message, message
  for f in fragments:
    assert f in message, message
  assert not workdir.exists(), "a rejected config must not start a run"


@pytest.mark.parametrize("spec,fragment", [
    ("experiments/configs/nope.py", "--config=experiments/configs/nope.py: no such config file"),
    (f"{QUICKSTART}:bogus", "config arg 'bogus' is unknown; expected one of ('runlocal',"),
    (f"{QUICKSTART}:steps=abc", "config arg steps='abc' must be int"),
])
def test_bad_config_file_or_arg_is_one_line(spec, fragment):
  with pytest.raises(ValueError) as raised:
    _parsed(spec)
  assert fragment in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_every_field_is_checked():
  """The table covers every field of base.py (and those only some configs set are optional):
  a value of the wrong type in any of them is refused naming it; every shipped config's
  sizes pass."""
  import importlib

  plain = base.get_config().to_dict()
  rules = {(g, n): r for g, group in config_fields.FIELDS.items() for n, r in group.items()}
  assert {(g, n) for g in plain for n in plain[g]} == {k for k, r in rules.items()
                                                       if not r.optional}
  for group, name in rules:
    bad = {g: dict(fields) for g, fields in plain.items()}
    bad.setdefault(group, {})[name] = 1j   # a group only some configs have (convert)
    with pytest.raises(ValueError, match=rf"^config\.{group}\.{name}=1j must be "):
      config_fields.check_fields(bad)
  for mod in ("quickstart", "flipflop", "length_extrapolation", "mqrar", "word_problem"):
    get_config = importlib.import_module(f"experiments.configs.{mod}").get_config
    for arg in ("runlocal", None, "gpu") if mod != "quickstart" else ("runlocal", None):
      config_fields.check_fields(get_config(arg))


# --- what an override means beyond its field -------------------------------------------


def test_encoding_flag_narrows_the_quickstart_sweep():
  """--config.model.encoding=fox on the quickstart (a rope+path sweep) trains fox alone, with
  a note; with --config.sweep.encodings too it is ambiguous and refused."""
  config, explicit = _parsed(QUICKSTART, "--config.model.encoding=fox")
  notes = cli_config.follow_explicit(config, explicit, swept=cli_config.ENCODING_SWEEP)
  assert tuple(config.sweep.encodings) == ("fox",)
  assert len(notes) == 1 and notes[0].startswith(
      "note: --config.model.encoding=fox: runs fox alone, instead of the config's "
      "sweep.encodings=rope,path"), notes
  config, explicit = _parsed(QUICKSTART, "--config.model.encoding=fox",
                             "--config.sweep.encodings=rope,path")
  with pytest.raises(ValueError, match="--config.model.encoding=fox and --config.sweep."
                                       "encodings=rope,path both choose the runs"):
    cli_config.follow_explicit(config, explicit, swept=cli_config.ENCODING_SWEEP)
  config, explicit = _parsed(QUICKSTART, "--config.sweep.encodings=fox,")
  assert cli_config.follow_explicit(config, explicit, swept=cli_config.ENCODING_SWEEP) == []
  assert tuple(config.sweep.encodings) == ("fox",)
  config, _ = _parsed(QUICKSTART, "--config.sweep.encodings=fox,alibi")   # a list, not a name
  assert tuple(config.sweep.encodings) == ("fox", "alibi")


def test_encoding_flag_on_a_sweep_reaches_main(tmp_path):
  """The CLI applies it before its checks: the note, then the (single) run's encoding checked."""
  proc = subprocess.run([sys.executable, "-m", "experiments.main", f"--config={QUICKSTART}:"
                         "runlocal", f"--workdir={tmp_path / 'run'}",
                         "--config.model.encoding=bogus"], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  _assert_one_error_line(proc, "config.model.encoding='bogus' is unknown")
  assert "note: --config.model.encoding=bogus: runs bogus alone" in proc.stderr


def test_warmup_follows_the_steps_or_names_the_fix():
  """The quickstart's warmup is a tenth of its steps however they are set; a config with a
  fixed warmup gives the fix when the steps go below it."""
  import jax

  from experiments import config_checks
  from experiments import data
  config, _ = _parsed(QUICKSTART, "--config.train.steps=20")
  assert (config.train.steps, config.train.warmup_steps) == (20, 2)
  config_checks.check(config, workdir="", data_module=data, num_devices=jax.device_count())
  config, _ = _parsed(QUICKSTART, "--config.train.steps=20", "--config.train.warmup_steps=5")
  assert (config.train.steps, config.train.warmup_steps) == (20, 5)
  config, _ = _parsed("experiments/configs/flipflop.py", "--config.train.steps=20")
  with pytest.raises(ValueError, match=r"config.train.warmup_steps=100 must be below config."
                                       r"train.steps=20; set both, e.g. --config.train.steps=20 "
                                       r"--config.train.warmup_steps=2$"):
    config_checks.check_train(config)


@pytest.mark.slow
def test_main_refuses_the_sweeps_fields(tmp_path):
  """experiments.main trains encodings only: a config with several seeds is sent to sweeps."""
  proc = subprocess.run([sys.executable, "-m", "experiments.main",
                         "--config=experiments/configs/flipflop.py", f"--workdir={tmp_path}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  _assert_one_error_line(proc, "config.sweep.seeds=(0, 1) is read by experiments.sweeps")


def test_workdir_of_another_model_is_refused(tmp_path):
  from experiments.configs import quickstart
  config = quickstart.get_config("runlocal,encoding=rope,steps=1")
  config.eval.num_batches = 0
  train.run(config, str(tmp_path))
  proc = _main(tmp_path, "--config.model.num_layers=2")
  _assert_one_error_line(proc, f"--workdir={tmp_path}", "model.num_layers=1 in the checkpoint",
                         "2 in this config")
