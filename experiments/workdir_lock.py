"""One run per workdir: an exclusive lock on WORKDIR/run.lock, held while a run trains.

The lock is flock(2) on the open file, so the kernel drops it when its process ends however
it ends (SIGKILL included): a lock left by a dead run is simply taken, with no stale-lock
cleanup. A second run on the same workdir while the first is alive stops with one line
naming the holder (pid, host and start time, which the holder writes into the file).

Multi-host runs lock on process 0 only: the other processes train the same run, and flock
over a network filesystem need not span hosts.
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
  """Holds WORKDIR/run.lock for the `with` block; RunError if a live run holds it."""
  if not enabled:
    yield
    return
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
