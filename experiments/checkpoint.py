"""Checkpoints of a training run: everything needed to continue bit-for-bit.

One Orbax CheckpointManager under WORKDIR/checkpoints holds, per step, three items:

  state   the train state pytree (params, optimizer state, step, RNG key data), restored
          straight into its shardings
  data    the grain iterator position (grain's own Orbax handler, one file per process)
  config  the model config as JSON, compared against the current config before anything
          compiles so that a workdir is never silently reused for a different model

Orbax writes the state asynchronously; `close` (or `wait`) must run before the process exits.
"""
from __future__ import annotations

import os
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

KEEP = 3


def _directory(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def _reader(path: str) -> ocp.CheckpointManager:
  # Not read_only=True: that mode logs three warnings per call; create=False never writes.
  return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=False))


def has_checkpoint(workdir: str) -> bool:
  return latest_step(workdir) is not None


def latest_step(workdir: str) -> int | None:
  path = _directory(workdir)
  if not os.path.isdir(path):
    return None
  mngr = _reader(path)
  try:
    return mngr.latest_step()
  finally:
    mngr.close()


def stored_model_config(workdir: str) -> dict | None:
  """The model config saved with the latest checkpoint in `workdir`, or None."""
  path = _directory(workdir)
  if not os.path.isdir(path):
    return None
  mngr = _reader(path)
  try:
    step = mngr.latest_step()
    if step is None:
      return None
    return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
  finally:
    mngr.close()


def restore_params(workdir: str, abstract_params: Any) -> tuple[int, Any]:
  """(step, the model parameters) of the latest checkpoint, without the optimizer state.

  abstract_params: the params tree of jax.ShapeDtypeStruct (nnx.to_pure_dict of the model's
  abstract nnx.Param state); only this part of the train state is read.
  """
  # Onto this process's first device (the sharding is stated, so Orbax need not guess it).
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  item = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                                 abstract_params)}
  mngr = _reader(_directory(workdir))
  try:
    step = mngr.latest_step()
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True)))
    return step, restored["state"]["params"]
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


class Checkpointer:
  """Saves every `every` steps (and on demand), keeps the last three, restores the latest."""

  def __init__(self, workdir: str, *, every: int):
    self._every = every
    self._mngr = ocp.CheckpointManager(
        _directory(workdir),
        options=ocp.CheckpointManagerOptions(max_to_keep=KEEP, create=True),
        item_names=("state", "data", "config"))

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def should_save(self, step: int) -> bool:
    return self._every > 0 and step % self._every == 0

  def save(self, step: int, state: Any, data_iter, model_config: dict) -> None:
    """Saves unless `step` is already saved (the final step may coincide with a periodic one)."""
    if step in self._mngr.all_steps():
      return
    self._mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iter),
        config=ocp.args.JsonSave(model_config)), force=True)

  def restore(self, abstract_state: Any, data_iter) -> tuple[int, Any]:
    """(step, state) of the latest checkpoint; `data_iter` is moved to its saved position.

    abstract_state: the state's tree of jax.ShapeDtypeStruct with shardings, so arrays land
    directly on their devices in their layout.
    """
    step = self._mngr.latest_step()
    restored = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(data_iter)))
    return step, restored["state"]

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.close()


def abstract(tree, shardings):
  """ShapeDtypeStructs of `tree` (arrays or shape structs) carrying `shardings`."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)
