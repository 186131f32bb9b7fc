"""Runs over several processes: starting jax.distributed, and each process's rows of a batch.

A run spans processes (one per host, or several on one host) when config.distributed names
them, every process getting the same command but its own process_id:

  --config.distributed.coordinator=HOST:PORT   process 0's address, reachable from all
  --config.distributed.num_processes=N
  --config.distributed.process_id=I            0 .. N-1

or, with those fields unset, when the environment names them: JAX_COORDINATOR_ADDRESS
(which jax.distributed.initialize reads itself) with JAX_NUM_PROCESSES and JAX_PROCESS_ID,
or a cluster that jax detects on its own (SLURM, Open MPI, Cloud TPU, Kubernetes) when
experiments.main runs with --distributed. `initialize` must run before anything asks JAX
for its devices: after that the process has committed to being alone.
"""
from __future__ import annotations

import os
import time

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


def _port(address: str) -> int | None:
  host, colon, port = address.rpartition(":")
  if not (host and colon and port.isdigit() and 0 < int(port) < 65536):
    return None
  return int(port)


def settings(cfg, environ=os.environ) -> dict | None:
  """jax.distributed.initialize's arguments for config.distributed (`cfg`, None or absent:
  off) or, when its fields are unset, the environment; None when neither names a run over
  several processes. One ValueError naming the field (or variable) when a value is wrong."""
  fields = {k: (cfg.get(k) if cfg is not None else None) for k in ENV}
  if all(v is None for v in fields.values()):
    if ENV["coordinator"] not in environ:
      return None
    values, where = {}, {}
    for key, var in ENV.items():
      raw = environ.get(var)
      if raw is None:
        raise ValueError(f"{ENV['coordinator']} is set but {var} is not; set {var} too (or "
                         f"use --config.distributed.{key})")
      values[key] = raw if key == "coordinator" else (int(raw) if raw.isdigit() else raw)
      where[key] = f"{var}={raw!r}"
  else:
    values = fields
    where = {k: f"config.distributed.{k}={v!r}" for k, v in fields.items()}
    for key, v in fields.items():
      if v is None:
        given = ", ".join(where[k] for k, x in fields.items() if x is not None)
        raise ValueError(f"config.distributed.{key} is unset while {given} is set; a run "
                         f"over several processes needs coordinator, num_processes and "
                         f"process_id (or none of them)")
  if not isinstance(values["coordinator"], str) or _port(values["coordinator"]) is None:
    raise ValueError(f"{where['coordinator']} must be HOST:PORT (process 0's address and a "
                     f"free port, e.g. 127.0.0.1:12355)")
  n = values["num_processes"]
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    raise ValueError(f"{where['num_processes']} must be an integer >= 1")
  i = values["process_id"]
  if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
    raise ValueError(f"{where['process_id']} must be an integer in [0, {n - 1}] "
                     f"(num_processes={n})")
  return {"coordinator_address": values["coordinator"], "num_processes": n, "process_id": i}


def initialize(cfg, *, detect: bool = False) -> bool:
  """Starts jax.distributed when `settings` (or, with detect, a cluster jax recognises)
  names several processes; True when it started. ValueError (one line) on a bad value or
  a failed start."""
  args = settings(cfg)
  if args is None and not detect:
    return False
  import jax

  try:
    jax.distributed.initialize(**(args or {}))
  except Exception as e:  # pylint: disable=broad-except  # RuntimeError / XlaRuntimeError
    lines = str(e).strip().splitlines() or [type(e).__name__]
    shown = (", ".join(f"{k}={v!r}" for k, v in args.items()) if args
             else "the cluster's environment")
    raise ValueError(f"jax.distributed.initialize({shown}) failed: {lines[0]}; check that "
                     f"process 0 runs and that every process names its address") from None
  return True


# How long process 0 keeps the coordination service up after every client has passed the
# shutdown barrier. The peers still cancel their calls then; XLA's gRPC server aborts the
# process (`Check failed: queue.Pop() == nullptr`) when one of them arrives while it is
# being destroyed, which jax.distributed.shutdown does right after the barrier.
SERVICE_GRACE_S = 1.0


def shutdown() -> None:
  """Ends jax.distributed: the clients (a barrier of all processes), then, SERVICE_GRACE_S
  later, process 0's coordination service. Safe to call when it never started."""
  import jax
  from jax._src import distributed as jax_distributed  # the service is not public API

  state = getattr(jax_distributed, "global_state", None)
  service = getattr(state, "service", None)
  if service is not None:
    state.service = None  # jax.distributed.shutdown below leaves it to us
  jax.distributed.shutdown()
  if service is not None:
    time.sleep(SERVICE_GRACE_S)
    service.shutdown()


def process_rows(batch_sharding, shape: tuple[int, ...]) -> tuple[int, int]:
  """(first, end) of the rows of a batch array of `shape` that this process's devices hold.

  Data loading reads exactly these rows (experiments.data's block process_index = first /
  (end - first) of global_batch / (end - first) blocks). One ValueError when they are not
  one contiguous block, which a mesh whose devices do not follow the processes would give.
  """
  global_batch = shape[0]
  index = batch_sharding.addressable_devices_indices_map(tuple(shape))
  spans = sorted({(s[0].start or 0, global_batch if s[0].stop is None else s[0].stop)
                  for s in index.values()})
  first, end = spans[0][0], spans[0][1]
  for lo, hi in spans[1:]:
    if lo > end:
      break
    end = max(end, hi)
  else:
    if (end - first) and global_batch % (end - first) == 0 and first % (end - first) == 0:
      return first, end
  raise ValueError(f"this process's devices hold rows {spans} of the batch of {global_batch}, "
                   f"not one block of it; order config.mesh so that each process's devices "
                   f"are neighbours along the batch axes")
