"""Validates a run's config before anything is built or compiled.

Every problem a user can cause by editing a config raises one ValueError whose message
names the config field and what was expected; main.py prints it as a single
`error: ...` line (no traceback) and exits with status 2. Each field's own type and range
(and unknown fields) are the table in experiments/config_fields.py; this module checks what
depends on several fields, the encoding registry, the data and the devices.
"""
from __future__ import annotations

import dataclasses
import os

import jax

from experiments import checkpoint
from experiments import config_fields
from experiments import sharding
from posenc_jax import _checks
from posenc_jax import encodings
from posenc_jax import model as model_lib


def _plain(x):
  """ConfigDict / list values -> hashable plain Python (tuples), for ModelConfig."""
  if hasattr(x, "to_dict"):
    x = x.to_dict()
  if isinstance(x, dict):
    return tuple(sorted((k, _plain(v)) for k, v in x.items()))
  if isinstance(x, (list, tuple)):
    return tuple(_plain(v) for v in x)
  return x


def model_config(config, vocab_size: int) -> model_lib.ModelConfig:
  """The ModelConfig a run's config.model describes."""
  m = config.model
  kwargs = m.encoding_kwargs.to_dict() if hasattr(m.encoding_kwargs, "to_dict") else dict(
      m.encoding_kwargs or {})
  return model_lib.ModelConfig(
      vocab_size=vocab_size, encoding=m.encoding,
      encoding_kwargs=tuple(sorted((k, _plain(v)) for k, v in kwargs.items())),
      kv_shift=bool(m.kv_shift), num_layers=m.num_layers, d_model=m.d_model,
      num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
      mlp_dim=m.mlp_dim, block=m.block, qk_norm=bool(m.qk_norm), dropout=float(m.dropout),
      tie_embeddings=bool(m.tie_embeddings), dtype=m.dtype, implementation=m.implementation,
      kernel_options=tuple(sorted((k, _plain(v)) for k, v in _kernel_options(m).items())),
      scan_layers=bool(m.scan_layers),
      # Optional fields (imported checkpoints set them): absent means the model's default.
      **{k: m[k] for k in _OPTIONAL_MODEL_FIELDS if m.get(k) is not None})


# ModelConfig fields a config may leave out, and a checkpoint omits at their default, so that
# configs and checkpoints written before they existed read the same.
_OPTIONAL_MODEL_FIELDS = ("qkv_bias", "norm_eps", "scale_tied_logits")


def _kernel_options(m) -> dict:
  """config.model.kernel_options' set fields (None: the kernels' default)."""
  options = m.get("kernel_options") or {}
  options = options.to_dict() if hasattr(options, "to_dict") else dict(options)
  return {k: v for k, v in options.items() if v is not None}


def stored_form(mcfg: model_lib.ModelConfig) -> dict:
  """What a checkpoint records of the model: everything but the speed-only choices (kernel,
  layer scan, embedding lookup), which leave the parameters as they are."""
  d = dataclasses.asdict(mcfg)
  for speed_only in ("implementation", "kernel_options", "scan_layers", "embed_one_hot"):
    d.pop(speed_only)
  defaults = model_lib.ModelConfig(vocab_size=mcfg.vocab_size)
  for field in _OPTIONAL_MODEL_FIELDS:
    if d[field] == getattr(defaults, field):
      d.pop(field)
  d["encoding_kwargs"] = [list(kv) for kv in d["encoding_kwargs"]]
  return d


def check_model(config, vocab_size: int) -> model_lib.ModelConfig:
  m = config.model
  kv = m.num_kv_heads or m.num_heads
  if m.num_heads % kv:
    raise ValueError(f"config.model.num_heads={m.num_heads} must be a multiple of "
                     f"config.model.num_kv_heads={kv} (grouped-query attention)")
  if m.implementation is not None:
    try:  # "pallas:key=value,..." passes options to the PaTH / FoX kernels
      _checks.check_implementation(m.implementation, _checks.IMPLEMENTATIONS,
                                   kernel_options=True)
      _checks.kernel_block_sizes(m.implementation)
    except ValueError as e:
      raise ValueError(f"config.model.implementation={m.implementation!r} must be None (auto) "
                       f"or one of {_checks.IMPLEMENTATIONS} ({e})") from None
  try:
    _checks.kernel_block_sizes(m.implementation, _kernel_options(m))
  except ValueError as e:
    raise ValueError(f"config.model.{e}") from None
  if m.encoding in encodings.MODIFIERS:
    raise ValueError(f"config.model.encoding={m.encoding!r} is a modifier, not an encoding; "
                     f"set config.model.kv_shift=True and pick an encoding")
  if m.encoding not in encodings.NAMES:
    raise ValueError(f"config.model.encoding={m.encoding!r} is unknown; expected one of "
                     f"{tuple(n for n in encodings.NAMES if n not in encodings.MODIFIERS)}")
  if m.kv_shift and model_lib.kv_shift_init is None:
    raise ValueError("config.model.kv_shift=True but the kv_shift modifier is not available")
  mcfg = model_config(config, vocab_size)
  try:
    enc = mcfg.encoding_fn()
  except ValueError as e:
    raise ValueError(f"config.model.encoding={m.encoding!r}: {e}") from None
  try:
    enc.check(mcfg.dims)
  except ValueError as e:
    raise ValueError(f"config.model: {e}") from None
  try:  # unknown or ill-typed encoding_kwargs surface here, traced but not compiled
    jax.eval_shape(lambda k: enc.init(k, mcfg.dims), jax.random.key(0))
  except (TypeError, ValueError) as e:
    raise ValueError(f"config.model.encoding_kwargs={dict(mcfg.encoding_kwargs)} do not fit "
                     f"encoding {m.encoding!r}: {e}") from None
  return mcfg


def check_train(config) -> None:
  t = config.train
  if t.warmup_steps >= t.steps:
    raise ValueError(f"config.train.warmup_steps={t.warmup_steps} must be below "
                     f"config.train.steps={t.steps}; set both, e.g. --config.train.steps="
                     f"{t.steps} --config.train.warmup_steps={t.steps // 10}")


def eval_lengths(config) -> tuple[int, ...]:
  """config.eval.lengths, defaulting to the training length."""
  return tuple(int(n) for n in (config.eval.lengths or (config.data.seq_len,)))


def check_lengths(config, data_module) -> None:
  longest = data_module.max_seq_len(config.data)
  task = config.data.task
  if longest is not None and config.data.seq_len > longest:
    raise ValueError(f"config.data.seq_len={config.data.seq_len} exceeds {longest}, the longest "
                     f"sequence data.task={task!r} supports with this config")
  for n in eval_lengths(config):
    if n < 1 or (longest is not None and n > longest):
      raise ValueError(f"config.eval.lengths contains {n}: each must be in [1, {longest}] "
                       f"for data.task={task!r}")


def check_mesh(config, num_devices: int) -> tuple[int, int, int]:
  """-> (data, fsdp, context) sizes, after checking the batch and lengths split over them."""
  data_n, fsdp_n, context_n = sharding.mesh_shape(
      data=config.mesh.data, fsdp=config.mesh.fsdp, context=config.mesh.get("context", 1),
      num_devices=num_devices)
  split = data_n * fsdp_n  # the default rules split the batch over both axes
  for field, b in (("train.batch_size", config.train.batch_size),
                   ("eval.batch_size", config.eval.batch_size or config.train.batch_size)):
    if b % split:
      raise ValueError(f"config.{field}={b} must be a multiple of the {split} devices the "
                       f"batch is split over (mesh data={data_n} x fsdp={fsdp_n})")
  if context_n > 1:   # each device holds T / context tokens of every sequence
    if config.data.seq_len % context_n:
      raise ValueError(f"config.data.seq_len={config.data.seq_len} must be a multiple of "
                       f"config.mesh.context={context_n} (each device holds T / context tokens)")
    bad = [n for n in eval_lengths(config) if n % context_n]
    if bad:
      raise ValueError(f"config.eval.lengths {bad} must be multiples of "
                       f"config.mesh.context={context_n}")
  return data_n, fsdp_n, context_n


def _stored_model_mismatch(workdir: str, mcfg: model_lib.ModelConfig, *, ignore=()):
  """(whether workdir holds a checkpoint, the first model field in which it differs from mcfg
  or None), leaving out the fields `ignore` names."""
  stored = checkpoint.stored_model_config(workdir) if os.path.isdir(workdir) else None
  if stored is None:
    return False, None
  keep = lambda d: {k: v for k, v in d.items() if k not in ignore}  # noqa: E731
  return True, checkpoint.config_mismatch(keep(stored), keep(stored_form(mcfg)))


def check_workdir(workdir: str, mcfg: model_lib.ModelConfig) -> None:
  _, diff = _stored_model_mismatch(workdir, mcfg)
  if diff:
    raise ValueError(f"--workdir={workdir} holds a checkpoint of a different model ({diff}); "
                     f"use a new --workdir or restore the config")


def check_init_from(config, mcfg: model_lib.ModelConfig) -> None:
  """train.init_from names a workdir with a checkpoint of a model with these parameters (the
  compute dtype and dropout may differ: they leave the parameters as they are)."""
  source = config.train.get("init_from") or ""
  if not source:
    return
  found, diff = _stored_model_mismatch(source, mcfg, ignore=("dtype", "dropout"))
  if not found:
    raise ValueError(f"train.init_from={source!r} holds no checkpoint; give the workdir of a "
                     f"trained run")
  if diff:
    raise ValueError(f"train.init_from={source!r} holds a different model ({diff}): its "
                     f"parameters cannot start this run")


def check(config, *, workdir: str, data_module, num_devices: int) -> model_lib.ModelConfig:
  """Runs every check; returns the ModelConfig to build. Raises ValueError naming the field."""
  config_fields.check_fields(config)
  check_train(config)
  vocab = data_module.vocab_size(config.data)
  check_lengths(config, data_module)
  mcfg = check_model(config, vocab)
  check_mesh(config, num_devices)
  check_workdir(workdir, mcfg)
  check_init_from(config, mcfg)
  return mcfg
