r"""Entry point: train, evaluate and report one experiment config (or a sweep of encodings).

  python -m experiments.main --config=experiments/configs/quickstart.py[:arg] \
      --workdir=DIR [--config.model.encoding=path --config.train.steps=100 ...]

Over several processes (hosts), each runs the same command plus
  --config.distributed.coordinator=HOST0:PORT --config.distributed.num_processes=N
  --config.distributed.process_id=I
(experiments/distributed.py; process 0 writes the workdir's records and reports).

WORKDIR receives metrics.jsonl, tensorboard/, checkpoints/, config.json, report.md and plots.
Running the same command again resumes from the newest intact checkpoint, with the same
losses as an uninterrupted run; while a run trains it holds WORKDIR/run.lock, and a second
command on the same workdir stops. With config.sweep.encodings set, each encoding trains
into WORKDIR/<encoding>/ and WORKDIR/report.md compares them.

A config error (an unknown field or a value of the wrong type or range, an unknown encoding,
odd head_dim for a rotation, sequence too long, a workdir holding a different model, ...)
prints one `error: ...` line and exits with status 2 before anything compiles, as does a
workdir that cannot be used (in use by another run, not writable, no intact checkpoint,
trained under another config: see config.train.allow_config_change) or a checkpoint that
fails to save; a diverging loss prints "loss diverged at step N ..." and exits with status 1.
--config.model.encoding=NAME on a config that sweeps encodings trains NAME alone (into
WORKDIR/NAME/) and says so.
"""
from __future__ import annotations

import copy
import functools
import os
import sys
import time

_STARTED = time.time()  # the command's start: the origin of its start-up timeline

from absl import app
from absl import flags

from experiments import cli_config

_CONFIG = cli_config.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics, report.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Start jax.distributed from a cluster's environment that jax "
    "detects (SLURM, Open MPI, Cloud TPU); config.distributed names the processes otherwise.")
flags.mark_flags_as_required(["config", "workdir"])


def plan(config, workdir: str, *, data_module, num_devices: int) -> list[tuple]:
  """[(config, workdir, model_config)] for each run, every one validated up front."""
  from experiments import config_checks
  from experiments import config_fields

  config_fields.check_fields(config)
  if "convert" in config:
    raise ValueError("config.convert is read by experiments.convert, not experiments.main: run "
                     "python -m experiments.convert with this config")
  encodings = tuple(config.sweep.encodings)
  for field in ("axis", "seeds"):  # experiments.sweeps' fields: refused, not ignored
    value = config.sweep.get(field)
    if value and (field == "axis" or len(value) > 1):
      raise ValueError(f"config.sweep.{field}={value!r} is read by experiments.sweeps, not "
                       f"experiments.main: run python -m experiments.sweeps with this config")
  if not encodings:
    runs = [(config, workdir)]
  else:
    if len(set(encodings)) != len(encodings):
      raise ValueError(f"config.sweep.encodings={encodings} names an encoding twice")
    runs = []
    for name in encodings:
      c = copy.deepcopy(config)
      with c.unlocked():
        c.model.encoding = name
      runs.append((c, os.path.join(workdir, name)))
  return [(c, w, config_checks.check(c, workdir=w, data_module=data_module,
                                     num_devices=num_devices)) for c, w in runs]


def main(argv) -> None:
  cli_config.start(argv)
  from experiments import distributed

  try:  # before anything asks JAX for its devices
    several = distributed.initialize(_CONFIG.value.get("distributed"),
                                     detect=_DISTRIBUTED.value)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  _run(_CONFIG.value, _WORKDIR.value)
  if several:  # on an error, jax's own exit handler ends it as before
    distributed.shutdown()


def _run(config, workdir) -> None:
  """Trains every run that config names (one, or one per swept encoding) and reports."""
  import jax

  from experiments import compilation
  from experiments import data
  from experiments import report
  from experiments import startup
  from experiments import train

  timeline = startup.Timeline(origin=_STARTED)
  timeline.mark("imports")
  compilation.enable_cache(config.train.get("compile_cache_dir"))
  num_devices = jax.device_count()
  timeline.mark("devices")
  try:
    for note in cli_config.follow_explicit(config, cli_config.explicit_fields(),
                                           swept=cli_config.ENCODING_SWEEP):
      print(note, file=sys.stderr)
    runs = plan(config, workdir, data_module=data, num_devices=num_devices)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  timeline.mark("checks")
  summaries = []
  for i, (c, w, mcfg) in enumerate(runs):
    # A sweep's later runs time their start-up from their own start.
    summaries.append(cli_config.finish_run(
        functools.partial(train.run, c, w, data_module=data, mcfg=mcfg,
                          timeline=timeline if i == 0 else None), w))
  if jax.process_index() == 0:
    if config.sweep.encodings:
      table = report.write_sweep_report(workdir, summaries)
    else:
      table = report.comparison_table(summaries)
    print(f"\n{table}\n\nreport: {os.path.join(os.path.abspath(workdir), 'report.md')}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli_config.parse_flags)
