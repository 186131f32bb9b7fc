"""The error a user can fix in a run's workdir or train config, reported as one line."""
from __future__ import annotations

import logging
import sys


class RunError(ValueError):
  """A workdir or train-config problem the user can fix; the message is one line saying what to do.

  experiments.main prints it as `error: ...` and exits with status 2; experiments.generate
  does the same for the workdir it reads.
  """


def exit_quietly(status: int) -> None:
  """sys.exit(status) after the one error line, silencing what failed background work reports
  while the process winds down: a failed checkpoint write leaves Orbax's other write tasks
  to be collected at exit, each logging its own traceback."""
  logging.disable(logging.CRITICAL)
  sys.unraisablehook = lambda _: None
  sys.exit(status)
