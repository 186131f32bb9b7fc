"""Checkpoints of a training run: everything needed to continue bit-for-bit, verified when read.

One Orbax CheckpointManager under WORKDIR/checkpoints holds, per step, three items:

  state   the train state pytree (params, optimizer state, step, RNG key data), restored
          straight into its shardings
  data    the grain iterator position (grain's own Orbax handler, one file per process;
          read back directly, so that a run under another number of processes resumes it)
  config  the model config as JSON, compared against the current config before anything
          compiles so that a workdir is never silently reused for a different model

Orbax writes the state asynchronously; `close` (or `wait`) must run before the process exits.
It deletes a step beyond the newest KEEP only once a newer step is completely written, and
never leaves a partly written step under its final name (a killed write stays in a
temporary directory, which the next run's Checkpointer removes).

Integrity: once a step is completely written, the run adds integrity.json to its directory,
the size and CRC32 of each of its files (a flipped byte in the state's data files would
otherwise restore silently). Readers take the newest intact step: its files match its
integrity.json, its three items are there, its JSON files parse, and (a step the run was
killed before sealing has no integrity.json) it reads back. Each newer, damaged step gets
one warning line naming it and what is wrong; a resuming run also moves it to
WORKDIR/damaged_checkpoints/ so that the step can be saved again. No intact step at all
is a RunError naming the damage.

Writes: the directory is probed when a run opens it, so an unwritable one stops the run
before its first step; a save that fails later (disk full, permissions) raises RunError
naming the step and the newest complete one, which it left intact.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import tempfile
import zlib
from typing import Any, Callable

import grain
import jax
import orbax.checkpoint as ocp

from experiments.errors import RunError

KEEP = 3
ITEMS = ("state", "data", "config")
INTEGRITY = "integrity.json"
DAMAGED = "damaged_checkpoints"


def _directory(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def _reader(path: str) -> ocp.CheckpointManager:
  # Not read_only=True: that mode logs three warnings per call; create=False never writes.
  return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=False))


def warn(message: str) -> None:
  print(f"warning: {message}", file=sys.stderr, flush=True)


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  line = text[0] if text else type(e).__name__
  return line


def has_checkpoint(workdir: str) -> bool:
  return latest_step(workdir) is not None


def all_steps(workdir: str) -> list[int]:
  """The steps written completely (intact or not), oldest first.

  Read from the directory names, not through an Orbax CheckpointManager: opening one is a
  barrier across processes, and processes may ask this at different moments (one before the
  directory exists, another after).
  """
  path = _directory(workdir)
  if not os.path.isdir(path):
    return []
  # Orbax writes a step under a temporary name and renames it to the bare number when done.
  return sorted(int(n) for n in os.listdir(path)
                if n.isdigit() and os.path.isdir(os.path.join(path, n)))


def latest_step(workdir: str) -> int | None:
  """The newest completely written step (not verified), or None."""
  steps = all_steps(workdir)
  return steps[-1] if steps else None


# --- integrity ---------------------------------------------------------------------


def _files(step_dir: str) -> list[str]:
  out = []
  for root, _, names in os.walk(step_dir):
    out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names]
  return sorted(f for f in out if not f.startswith(INTEGRITY))


def _crc32(path: str) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 24):
      crc = zlib.crc32(chunk, crc)
  return crc


def seal(step_dir: str) -> None:
  """Writes step_dir/integrity.json: each file's size and CRC32 (a step completely written)."""
  files = {f: [os.path.getsize(os.path.join(step_dir, f)), _crc32(os.path.join(step_dir, f))]
           for f in _files(step_dir)}
  tmp = os.path.join(step_dir, INTEGRITY + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"files": files}, f)
  os.replace(tmp, os.path.join(step_dir, INTEGRITY))


def damage(step_dir: str, *, items: tuple[str, ...] = ITEMS) -> str | None:
  """What is wrong with a completely written step, or None when it looks intact.

  Every item must be there; the files of `items` (and the step's own) must match
  integrity.json, which a reader of one item need not read whole for the others'.
  """
  for item in ITEMS:
    if not os.path.isdir(os.path.join(step_dir, item)):
      return f"{item}/ is missing"
  sealed = os.path.join(step_dir, INTEGRITY)
  if os.path.exists(sealed):
    try:
      with open(sealed) as f:
        files = dict(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
      return f"{INTEGRITY} is unreadable ({_first_line(e)})"
    for name, (size, crc) in sorted(files.items()):
      top = name.split(os.sep)[0]
      if top in ITEMS and top not in items:
        continue
      path = os.path.join(step_dir, name)
      if not os.path.isfile(path):
        return f"{name} is missing"
      if os.path.getsize(path) != size:
        return f"{name} has {os.path.getsize(path)} bytes, {size} were written"
      if _crc32(path) != crc:
        return f"{name} differs from what was written (CRC32)"
  # The JSON items are read whole; a step without integrity.json is at least checked here.
  json_files = [os.path.join("config", "metadata")] + [
      os.path.join("data", n) for n in sorted(os.listdir(os.path.join(step_dir, "data")))
      if n.endswith(".json")]
  for name in json_files:
    path = os.path.join(step_dir, name)
    if os.path.isfile(path):
      try:
        with open(path) as f:
          json.load(f)
      except (OSError, ValueError) as e:
        return f"{name} is not valid JSON ({_first_line(e)})"
  return None


def _data_state(step_dir: str):
  """The data iterator state saved in step_dir: this process's file, or, for a checkpoint
  that another number of processes wrote, process 0's (experiments.data keeps every
  process's state the same, so any process's file resumes the stream)."""
  directory = os.path.join(step_dir, "data")
  own = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
  names = sorted(n for n in os.listdir(directory) if n.startswith("process_0-of-"))
  name = own if os.path.isfile(os.path.join(directory, own)) else (names or [own])[0]
  with open(os.path.join(directory, name)) as f:
    return json.load(f)


@dataclasses.dataclass
class _Damaged:
  step: int
  reason: str


def _no_intact_step(directory: str, damaged: list[_Damaged]) -> RunError:
  if not damaged:
    return RunError(f"{directory} holds no checkpoint; train one first")
  shown = "; ".join(f"step {d.step}: {d.reason}" for d in damaged)
  return RunError(f"no intact checkpoint in {directory}: {shown}; move {directory} away "
                  f"to train from step 0, or use another --workdir")


def _read_newest_intact(directory: str, steps: list[int], read: Callable[[int], Any], *,
                        on_damaged: Callable[[_Damaged, int | None], None],
                        items: tuple[str, ...] = ITEMS) -> tuple[int, Any]:
  """(step, read(step)) for the newest step that passes `damage(items=items)` and reads back.

  on_damaged(damaged, fallback) runs for each newer step passed over, fallback being the
  step tried next (None: none left). RunError when no step is intact. Steps that fail
  `damage` are reported only once a candidate that passes is known, so when none passes,
  none is reported (or moved).
  """
  damaged: list[_Damaged] = []
  remaining = sorted(steps, reverse=True)
  while remaining:
    candidate, passed = None, []
    for step in remaining:
      reason = damage(os.path.join(directory, str(step)), items=items)
      if reason is None:
        candidate = step
        break
      passed.append(_Damaged(step, reason))
    damaged += passed
    if candidate is None:
      raise _no_intact_step(directory, damaged)
    for d in passed:
      on_damaged(d, candidate)
    try:
      return candidate, read(candidate)
    except Exception as e:  # pylint: disable=broad-except  # whatever Orbax/TensorStore raise
      bad = _Damaged(candidate, f"it does not read back: {_first_line(e)}")
      damaged.append(bad)
      remaining = [s for s in remaining if s < candidate]
      if not remaining:
        on_damaged(bad, None)
        raise _no_intact_step(directory, damaged) from None
      on_damaged(bad, remaining[0])
  raise _no_intact_step(directory, damaged)


def _warn_using(directory: str, warn_fn) -> Callable[[_Damaged, int | None], None]:
  def on_damaged(d: _Damaged, fallback: int | None) -> None:
    then = f"trying step {fallback}" if fallback is not None else "no earlier step left"
    warn_fn(f"checkpoint step {d.step} in {directory} is damaged ({d.reason}); {then}")
  return on_damaged


def stored_model_config(workdir: str, *, warn_fn: Callable[[str], None] | None = None
                        ) -> dict | None:
  """The model config saved with the newest intact checkpoint in `workdir`, or None if it
  holds no checkpoint. RunError naming the damage when no step is intact. warn_fn gets a line
  for each newer, damaged step (default: none; training and generation warn when they read
  the state)."""
  directory = _directory(workdir)
  steps = all_steps(workdir)
  if not steps:
    return None

  def read(step):  # the file Orbax's JsonSave wrote, read without a (cross-process) manager
    with open(os.path.join(directory, str(step), "config", "metadata")) as f:
      return json.load(f)
  return _read_newest_intact(directory, steps, read, items=("config",),
                             on_damaged=_warn_using(directory, warn_fn or (lambda _: None)))[1]


def restore_params(workdir: str, abstract_params: Any, *,
                   warn_fn: Callable[[str], None] = warn) -> tuple[int, Any]:
  """(step, the model parameters) of the newest intact checkpoint, without the optimizer state.

  abstract_params: the params tree of jax.ShapeDtypeStruct (nnx.to_pure_dict of the model's
  abstract nnx.Param state); only this part of the train state is read. Damaged newer steps
  are passed over with a warning line each; RunError when no step is intact.
  """
  # Onto this process's first device (the sharding is stated, so Orbax need not guess it).
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  item = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                                 abstract_params)}
  directory = _directory(workdir)
  mngr = _reader(directory)
  try:
    read = lambda step: mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True)))["state"]["params"]
    return _read_newest_intact(directory, list(mngr.all_steps()), read, items=("state",),
                               on_damaged=_warn_using(directory, warn_fn))
  finally:
    mngr.close()


def config_mismatch(stored: dict, current: dict) -> str | None:
  """A one-line description of the first field that differs, or None when equal."""
  for key in sorted(set(stored) | set(current)):
    a, b = stored.get(key, "<missing>"), current.get(key, "<missing>")
    if _normalise(a) != _normalise(b):
      return f"model.{key}={a!r} in the checkpoint, {b!r} in this config"
  return None


def _normalise(x):
  # JSON turns tuples into lists; compare by value.
  if isinstance(x, (list, tuple)):
    return [_normalise(v) for v in x]
  if isinstance(x, dict):
    return {k: _normalise(v) for k, v in x.items()}
  return x


# --- the training run's checkpointer -----------------------------------------------


class _DropOrbaxTracebacks(logging.Filter):
  """Orbax logs a failed background save's traceback from its thread; the Checkpointer
  re-raises the failure as one line, so the traceback is only noise."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname)


def _quiet_closed_loop(previous):
  """A sys.unraisablehook that drops what a failed save leaves behind: its other TensorStore
  writes finish after Orbax closed the asyncio loop awaiting them, and each completion's
  callback fails on the closed loop (a traceback apiece, after the one line that matters)."""
  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"):
      previous(unraisable)
  return hook


def _async_options() -> ocp.AsyncOptions:
  # Orbax creates the step's temporary directory in a thread by default; when that fails
  # (a read-only or full disk) the save waits 5 minutes for a directory that never comes.
  # Created in save() instead, a failure raises there at once.
  names = {f.name for f in dataclasses.fields(ocp.AsyncOptions)}
  return ocp.AsyncOptions(**({"create_directories_asynchronously": False}
                             if "create_directories_asynchronously" in names else {}))


class Checkpointer:
  """Saves every `every` steps (and on demand), keeps the newest KEEP, restores the newest
  intact step. Raises RunError (one line) when the directory cannot be written."""

  def __init__(self, workdir: str, *, every: int, primary: bool = True):
    self._workdir, self._every, self._primary = workdir, every, primary
    self._directory = _directory(workdir)
    self._probe()
    self._quiet = _DropOrbaxTracebacks()
    logging.getLogger("absl").addFilter(self._quiet)
    self._unraisablehook = sys.unraisablehook
    sys.unraisablehook = _quiet_closed_loop(self._unraisablehook)
    self._mngr = ocp.CheckpointManager(
        self._directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=KEEP, create=True,
                                             cleanup_tmp_directories=True,
                                             async_options=_async_options()),
        item_names=ITEMS)
    self._unsealed: int | None = None  # the step whose write may still be running
    self._closed = False

  def _probe(self) -> None:
    """RunError now, before any step, if the checkpoint directory cannot be written."""
    try:
      os.makedirs(self._directory, exist_ok=True)
      os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=self._directory))
    except OSError as e:
      raise RunError(f"{self._directory} is not writable ({e.strerror}); fix its permissions "
                     f"or free space there, or use another --workdir") from None

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def should_save(self, step: int) -> bool:
    return self._every > 0 and step % self._every == 0

  def _failed(self, step: int, e: BaseException) -> RunError:
    good = [s for s in all_steps(self._workdir) if s != step]
    kept = (f"step {max(good)} is the newest complete checkpoint" if good
            else "no checkpoint is complete")
    return RunError(f"saving checkpoint step {step} in {self._directory} failed "
                    f"({_first_line(e)}); {kept}; fix the cause (disk space, permissions) "
                    f"and run the same command to resume")

  def _finish_pending(self) -> None:
    """Waits for the running write; seals its step (RunError if the write failed)."""
    step, self._unsealed = self._unsealed, None
    try:
      self._mngr.wait_until_finished()
      step_dir = os.path.join(self._directory, str(step))
      if step is not None and self._primary and os.path.isdir(step_dir):
        seal(step_dir)
    except Exception as e:  # pylint: disable=broad-except  # Orbax's background failures
      raise self._failed(step, e) from None

  def save(self, step: int, state: Any, data_iter, model_config: dict) -> None:
    """Saves unless `step` is already saved (the final step may coincide with a periodic one)."""
    self._finish_pending()
    if step in self._mngr.all_steps():
      return
    try:
      self._mngr.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=grain.checkpoint.CheckpointSave(data_iter),
          config=ocp.args.JsonSave(model_config)), force=True)
    except Exception as e:  # pylint: disable=broad-except
      raise self._failed(step, e) from None
    self._unsealed = step

  def restore(self, abstract_state: Any, data_iter) -> tuple[int, Any] | None:
    """(step, state) of the newest intact checkpoint, `data_iter` moved to its saved position;
    None when there is no checkpoint. Newer, damaged steps are moved to WORKDIR/
    damaged_checkpoints/ with a warning line each; RunError when no step is intact.

    abstract_state: the state's tree of jax.ShapeDtypeStruct with shardings, so arrays land
    directly on their devices in their layout.
    """
    steps = list(self._mngr.all_steps())
    if not steps:
      return None

    def read(step):
      data_state = _data_state(os.path.join(self._directory, str(step)))
      state = self._mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state)))["state"]
      data_iter.set_state(data_state)
      data_iter.start_prefetch()
      return state

    def set_aside(d: _Damaged, fallback: int | None) -> None:
      moved = self._set_aside(d.step) if self._primary else None
      then = f"resuming from step {fallback}" if fallback is not None else "no earlier step left"
      warn(f"checkpoint step {d.step} in {self._directory} is damaged ({d.reason}); "
           f"{f'moved to {moved}; ' if moved else ''}{then}")

    step, state = _read_newest_intact(self._directory, steps, read, on_damaged=set_aside)
    self._mngr.reload()  # forget the steps moved away
    return step, state

  def _set_aside(self, step: int) -> str:
    root = os.path.join(os.path.dirname(self._directory), DAMAGED)
    os.makedirs(root, exist_ok=True)
    dest, n = os.path.join(root, str(step)), 1
    while os.path.exists(dest):
      dest, n = os.path.join(root, f"{step}.{n}"), n + 1
    os.replace(os.path.join(self._directory, str(step)), dest)
    return dest

  def wait(self) -> None:
    self._finish_pending()

  def close(self) -> None:
    """Waits for the running write and seals it; RunError if it failed. Idempotent."""
    if self._closed:
      return
    self._closed = True
    try:
      self._finish_pending()
    finally:
      self._mngr.close()
      logging.getLogger("absl").removeFilter(self._quiet)
      sys.unraisablehook = self._unraisablehook


def abstract(tree, shardings):
  """ShapeDtypeStructs of `tree` (arrays or shape structs) carrying `shardings`."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)
