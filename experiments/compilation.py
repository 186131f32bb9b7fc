"""The command line's compilation: a persistent cache shared by runs, and how long the first
step spent compiling.

`train.compile_cache_dir` (None: `default_cache_dir()`; "": off) holds XLA's executables
between runs, so a rerun, a resumed run or a sweep of one shape compiles in seconds. Only
programs that took at least `MIN_COMPILE_SECONDS` to compile are stored.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import jax

# Programs that compile faster than this are not written to the cache (JAX's own default is
# also 1 s); JAX's environment variable for it, where set, wins.
MIN_COMPILE_SECONDS = 1.0
MIN_COMPILE_SECONDS_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"

# JAX's duration events for one jit compile, by the phase they time.
_PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "xla",
           "/jax/compilation_cache/cache_retrieval_time_sec": "cache"}
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def default_cache_dir() -> str:
  """$XDG_CACHE_HOME/posenc-jax/jax, or ~/.cache/posenc-jax/jax."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "posenc-jax", "jax")


def enable_cache(path: str | None) -> str | None:
  """Points JAX's persistent compilation cache at `path` (None: the default; "": off).
  Returns the directory in use, or None."""
  if path == "":
    return None
  # An entry that cannot be written (a full disk) or read back (one truncated by a full disk)
  # costs a compile, nothing else; JAX compiles instead and the run goes on.
  warnings.filterwarnings("ignore", message="Error writing persistent compilation cache entry")
  warnings.filterwarnings("ignore", message="Error reading persistent compilation cache entry")
  path = os.path.abspath(os.path.expanduser(path or default_cache_dir()))
  jax.config.update("jax_compilation_cache_dir", path)
  if MIN_COMPILE_SECONDS_ENV not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  return path


@contextlib.contextmanager
def timed():
  """Yields a dict that sums, while inside, the seconds JAX reports per compile phase
  (trace, lower, xla, cache) and counts the persistent cache's hits."""
  totals = {"trace": 0.0, "lower": 0.0, "xla": 0.0, "cache": 0.0, "cache_hits": 0}

  def on_duration(event: str, duration: float, **_):
    if event in _PHASES:
      totals[_PHASES[event]] += duration

  def on_event(event: str, **_):
    if event == _CACHE_HIT:
      totals["cache_hits"] += 1

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  jax.monitoring.register_event_listener(on_event)
  try:
    yield totals
  finally:
    jax.monitoring.unregister_event_duration_listener(on_duration)
    jax.monitoring.unregister_event_listener(on_event)


def describe(totals: dict) -> str:
  """One line for the log: 'compiled the train step in 12.3 s (trace 1.0, lower 2.1, XLA
  9.2)', or '... from the compilation cache' when XLA's work was read back."""
  spent = totals["trace"] + totals["lower"] + totals["xla"] + totals["cache"]
  parts = f"trace {totals['trace']:.1f}, lower {totals['lower']:.1f}"
  if totals["cache_hits"]:
    return (f"compiled the train step in {spent:.1f} s ({parts}, read from the compilation "
            f"cache {totals['cache']:.1f})")
  return f"compiled the train step in {spent:.1f} s ({parts}, XLA {totals['xla']:.1f})"
