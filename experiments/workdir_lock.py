"""One run per workdir: an exclusive lock on WORKDIR/run.lock, held while a run trains.

The lock is flock(2) on the open file, so the kernel drops it when its process ends however
it ends (SIGKILL included): a lock left by a dead run is simply taken, with no stale-lock
cleanup. A second run on the same workdir while the first is alive stops with one line
naming the holder (pid, host and start time, which the holder writes into the file).

A run over several processes locks on process 0 only (the others train the same run, and
flock over a network filesystem need not span hosts), and every process learns whether it
got the lock: when it did not, each stops with one line instead of waiting for process 0 at
the run's first collective step.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time

from experiments.errors import RunError

LOCK = "run.lock"


@contextlib.contextmanager
def hold(workdir: str, *, enabled: bool = True):
  """Holds WORKDIR/run.lock for the `with` block; RunError if a live run holds it.

  enabled=False (every process but process 0 of a run over several): takes no lock, but
  raises RunError too when process 0 did not get it.
  """
  if not enabled:
    if not _agree(True):
      raise RunError(f"--workdir={workdir}: process 0 could not take {LOCK} (its error line "
                     f"says why); this process stops with it")
    yield
    return
  with contextlib.ExitStack() as stack:
    try:
      stack.enter_context(_locked(workdir))
    except RunError:
      _agree(False)
      raise
    _agree(True)
    yield


def _agree(ok: bool) -> bool:
  """Process 0's `ok` in every process (itself when the run has one process)."""
  import jax

  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils
  return bool(multihost_utils.broadcast_one_to_all(ok))


@contextlib.contextmanager
def _locked(workdir: str):
  path = os.path.join(workdir, LOCK)
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise RunError(f"--workdir={workdir} is not writable ({e.strerror}: {path}); "
                   f"fix its permissions or use another --workdir") from None
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise RunError(f"--workdir={workdir} is in use by another run ({_holder(fd)}); wait for "
                     f"it to finish or stop it, or use another --workdir") from None
    # Rewritten in place, never unlinked: a run that opened the old file would lock an inode
    # nobody else sees.
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode(), 0)
    yield
  finally:
    os.close(fd)  # releases the lock


def _holder(fd: int) -> str:
  """'pid P on host H since T', from what the holder wrote (or why that is unknown)."""
  try:
    info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    return f"pid {info['pid']} on host {info['host']} since {info['started']}"
  except (OSError, ValueError, KeyError, TypeError):
    return "a process that has not yet written its pid"
