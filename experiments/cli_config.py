"""The experiment CLIs' --config flag: loading, overrides, and what an override means.

  _CONFIG = cli_config.define_config_flag()
  app.run(main, flags_parser=cli_config.parse_flags)

`parse_flags` turns every flag error (a missing config file, a bad config arg, an override
of a field that does not exist or with a value of the wrong type) into one `error: ...`
line and exit status 2, before anything is imported or compiled. New leaf fields are
accepted while parsing so that `--config.model.encoding_kwargs.base=5e5` reaches the
encoding; experiments/config_fields.py then refuses any unknown field, naming the valid
ones.

`follow_explicit` gives an override of a swept field its obvious meaning: with a config
that sweeps encodings, `--config.model.encoding=fox` trains fox alone (the sweep narrowed to
it), with a note on stderr, rather than being overwritten by the sweep.
"""
from __future__ import annotations

import os
import re
import runpy
import sys

from absl import flags
from ml_collections import config_flags


# experiments.main's sweep: the encodings (experiments.sweeps adds seeds and its axis).
ENCODING_SWEEP = {"model.encoding": "sweep.encodings"}


def define_config_flag(name: str = "config", *, flag_values=flags.FLAGS, sys_argv=None):
  """DEFINE_config_file as the experiment CLIs use it (see the module docstring)."""
  return config_flags.DEFINE_config_file(
      name, None, "Experiment config file[:arg].", flag_values=flag_values,
      lock_config=False, accept_new_attributes=True, sys_argv=sys_argv)


def parse(argv: list[str], *, flag_values=flags.FLAGS, names=("config",)) -> list[str]:
  """flag_values(argv); raises one-line ValueError for any flag error. Returns the rest.

  names: the config flags (define_config_flag) among flag_values.
  """
  for name in names:
    spec = _flag_value(argv, name)
    if spec is not None and not os.path.isfile(spec.split(":", 1)[0]):
      raise ValueError(f"--{name}={spec}: no such config file")
  try:
    rest = flag_values(argv)
  except Exception as e:  # absl's, config_flags' and ConfigDict's errors alike
    for name in names:
      reason = _diagnose(argv, name)
      if reason:
        raise ValueError(reason) from None
    raise ValueError(_last_line(e)) from None
  for name in names:
    if flag_values[name].value is not None:
      _split_name_lists(flag_values[name].value, explicit_fields(name, flag_values=flag_values))
  return rest


def _split_name_lists(config, fields) -> None:
  """--config.sweep.encodings=rope,path reaches a tuple field as ('rope,path',): split it."""
  for field in fields:
    value = _get(config, field)
    if (isinstance(value, tuple) and value and all(isinstance(x, str) for x in value)
        and any("," in x for x in value)):
      _set(config, field, tuple(p for x in value for p in x.split(",") if p))


def start(argv: list[str]) -> None:
  """What every command line does first: refuse positional arguments, and log at WARNING
  unless --verbosity was given (Orbax and absl log every restore and save at INFO)."""
  from absl import app
  from absl import logging
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


def finish_run(run, workdir: str, *, config_errors: tuple = ()) -> dict:
  """run() -> its summary, as a command line ends a training run: a workdir or train-field
  problem (errors.RunError, or one of `config_errors`) is one `error:` line and exit 2, a
  diverged loss exit 1, an interrupted run (SIGTERM) the resume hint and exit 143."""
  from experiments import errors
  from experiments import train
  try:
    summary = run()
  except (errors.RunError, *config_errors) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    errors.exit_quietly(2)
  except train.TrainingDiverged as e:
    print(f"error: {workdir}: {e}", file=sys.stderr)
    sys.exit(1)
  if summary["interrupted"]:
    print(f"stopped at step {summary['step']} (SIGTERM); run the same command to resume",
          file=sys.stderr)
    sys.exit(143)
  return summary


def parse_flags(argv: list[str]) -> list[str]:
  """absl.app.run's flags_parser: a flag error prints `error: ...` and exits with status 2."""
  try:
    return parse(argv)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def explicit_fields(name: str = "config", *, flag_values=flags.FLAGS) -> frozenset[str]:
  """The dotted fields the command line set (`--config.model.encoding=fox` -> model.encoding)."""
  return frozenset(config_flags.get_override_values(flag_values[name]))


def follow_explicit(config, explicit, *, swept: dict[str, str]) -> list[str]:
  """Narrows the config's sweeps to the values the command line set; returns notes for stderr.

  swept maps a field to the sweep field listing its values ({"model.encoding":
  "sweep.encodings"}). A field set on the command line while the config lists several values
  for it runs that value only. Both set on the command line: ValueError (ambiguous).
  """
  notes = []
  for field, sweep_field in swept.items():
    values = tuple(_get(config, sweep_field) or ())
    if field not in explicit or not values:
      continue
    value = _get(config, field)
    if sweep_field in explicit:
      raise ValueError(f"--config.{field}={value} and --config.{sweep_field}="
                       f"{','.join(map(str, values))} both choose the runs; give one of them")
    if values == (value,):
      continue
    _set(config, sweep_field, (value,))
    notes.append(f"note: --config.{field}={value}: runs {value} alone, instead of the "
                 f"config's {sweep_field}={','.join(map(str, values))} (to sweep, set "
                 f"--config.{sweep_field}=A,B)")
  return notes


def _get(config, dotted: str):
  node = config
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node:
      return None
    node = node[part]
  return node


def _set(config, dotted: str, value) -> None:
  *parents, leaf = dotted.split(".")
  node = config
  for part in parents:
    node = node[part]
  node[leaf] = value


def _flag_value(argv: list[str], name: str) -> str | None:
  """The value given to --name (as --name=V or --name V), or None."""
  for i, arg in enumerate(argv):
    m = re.fullmatch(rf"--?{re.escape(name)}(=(.*))?", arg, re.S)
    if m:
      if m.group(1) is not None:
        return m.group(2)
      return argv[i + 1] if i + 1 < len(argv) else None
  return None


def _overrides(argv: list[str], name: str) -> list[tuple[str, str | None]]:
  """(dotted field, value or None) of each --name.FIELD[=VALUE] / --noname.FIELD in argv."""
  out = []
  for arg in argv:
    m = re.fullmatch(rf"--?(no)?{re.escape(name)}\.([^=]+)(=(.*))?", arg, re.S)
    if m:
      out.append((m.group(2), m.group(4)))
  return out


def _diagnose(argv: list[str], name: str) -> str | None:
  """Why --name or one of its overrides failed to parse, in one line (None: not theirs)."""
  spec = _flag_value(argv, name)
  if spec is None:
    return None
  path, _, arg = spec.partition(":")
  try:
    get_config = runpy.run_path(path)["get_config"]
    config = get_config(arg) if arg else get_config()
  except Exception as e:  # the config file's own error (a bad arg, a typo in the file)
    return f"--{name}={spec}: {_last_line(e)}"
  for field, value in _overrides(argv, name):
    reason = _path_error(config, field, name)
    if reason:
      return reason
  for field, value in _overrides(argv, name):
    current = _get(config, field)
    if value is None or not isinstance(current, (int, float)) or isinstance(current, bool):
      continue
    try:
      type(current)(value)
    except ValueError:
      return (f"--{name}.{field}={value}: config.{field} must be {type(current).__name__} "
              f"(the config has {current!r})")
  return None


def _path_error(config, field: str, name: str) -> str | None:
  """Why `field` cannot be set in config: a missing group on its path, or a value in the way."""
  from experiments import config_fields
  node, where = config, "config"
  parts = field.split(".")
  for i, part in enumerate(parts):
    if not hasattr(node, "keys"):
      return (f"--{name}.{field}: {where}={node!r} is a {type(node).__name__}, not a group "
              f"of fields")
    if part not in node:
      if i == len(parts) - 1:
        return None  # a new leaf: config_fields names it if it is not a field
      return str(config_fields.unknown_field(where, part, node.keys()))
    node, where = node[part], f"{where}.{part}"
  return None


def _last_line(e: BaseException) -> str:
  lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
  return lines[-1] if lines else type(e).__name__
