"""Shared defaults for every experiment config: each field a run can set, with its default.

Experiment files start from `base.get_config()` and override what they study. Fields:

  model.encoding          a name of posenc_jax.encodings.NAMES (not a modifier)
  model.encoding_kwargs   the encoding's hyperparameters (e.g. {"base": 500000.0} for rope)
  model.kv_shift          compose the kv_shift modifier with the encoding
  model.num_layers, d_model, num_heads, head_dim
  model.num_kv_heads      0 = num_heads (no grouping)
  model.mlp_dim           0 = auto (8/3 d_model for SwiGLU, 4 d_model for GELU)
  model.block             "llama" (RMSNorm, SwiGLU, optional qk_norm) | "acc_rot" (LayerNorm,
                          GELU, dropout)
  model.dtype             "float32" | "bfloat16" compute (parameters stay float32)
  model.implementation    None = auto (posenc_jax.dispatch.auto_implementation: Pallas or
                          cuDNN on GPU, Pallas / blockwise on TPU; on CPU the faster of dense
                          jnp and blockwise by measurement, CPU_DENSE_MAX_T), or one
                          of reference / xla / cudnn / scan / chunked / pallas
  model.kernel_options    the PaTH / FoX Pallas kernels' options, kernels_pallas.BlockSizes
                          fields (block, span, prepass, mosaic, keep_inverse; None = the
                          default; kernels_pallas.explain prints the plan; speed-only)
  model.scan_layers       run the blocks as one lax.scan (compiles one layer instead of
                          num_layers; same parameters and checkpoints; speed-only)
  train.*                 AdamW with linear warmup, cosine decay to 10%, global-norm clipping
                          (grad_clip 0 turns it off); batch_size is global (all devices)
  train.divergence_factor, divergence_margin, divergence_patience
                          stop the run ("loss diverged at step N") at a NaN / inf loss, or after
                          `patience` steps in a row whose loss is above both `factor` x its
                          running level and log(vocab) + `margin` (experiments/divergence.py);
                          patience 0 stops only at NaN / inf
  train.init_from         a workdir whose newest checkpoint's parameters start this run instead
                          of a draw from train.seed (a fine-tuning start: the optimizer starts
                          afresh; the model must have the same parameters, e.g. a text model
                          fine-tuned on flip-flop with data.byte_tokens); "" = none
  train.compile_cache_dir the persistent compilation cache (None: ~/.cache/posenc-jax/jax, or
                          under $XDG_CACHE_HOME; "": off): reruns of a shape skip XLA's compile
  train.allow_config_change
                          resuming a workdir under a config whose training fields differ from
                          its config.json stops with the changed fields named; True continues
                          under the new values (the old config is kept as config.<step>.json;
                          experiments/run_config.py lists the fields that may always change)
  eval.lengths            evaluate at these sequence lengths (() = data.seq_len only)
  eval.every              also evaluate every this many steps (0 = only at the end)
  eval.num_batches        batches per eval set and length (0 = no evaluation)
  eval.batch_size         0 = train.batch_size
  mesh.data, mesh.fsdp    device mesh; -1 fills with the remaining devices
  mesh.context            devices one sequence is split over (context parallelism: T /
                          context tokens a device; data.seq_len and eval.lengths multiples of it)
  mesh.rules              logical axis name -> mesh axes (see experiments/sharding.py)
  distributed.coordinator, num_processes, process_id
                          a run over several processes (None: one process, or the
                          environment's JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
                          JAX_PROCESS_ID; see experiments/distributed.py)
  sweep.encodings         non-empty: train one run per encoding into WORKDIR/<encoding>/ and
                          write a comparison table to WORKDIR/report.md
  convert.*               only in configs/convert.py (experiments.convert's distillation):
                          teacher, teacher_step, stage 1's mse_steps, mse_batch_size,
                          mse_seq_len (0 = data.seq_len), mse_learning_rate, mse_warmup_steps,
                          the student's init_beta / init_forget_time; train.* is stage 2
  data.*                  see experiments/data.py (task, seq_len and the task's fields)
"""
from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from experiments import data
from experiments import sharding


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = ml_collections.ConfigDict(dict(
      encoding="rope", encoding_kwargs=ml_collections.ConfigDict(), kv_shift=False,
      num_layers=2, d_model=64, num_heads=2, num_kv_heads=0, head_dim=32, mlp_dim=0,
      block="llama", qk_norm=False, dropout=0.0, tie_embeddings=False, dtype="float32",
      implementation=config_dict.placeholder(str), kernel_options=ml_collections.ConfigDict(dict(
          block=config_dict.placeholder(int), span=config_dict.placeholder(int),
          prepass=config_dict.placeholder(str), mosaic=config_dict.placeholder(bool),
          keep_inverse=config_dict.placeholder(str))),
      scan_layers=False))
  c.train = ml_collections.ConfigDict(dict(
      steps=1000, batch_size=32, learning_rate=1e-3, warmup_steps=100, weight_decay=0.1,
      grad_clip=1.0, checkpoint_every=500, log_every=50, seed=0,
      divergence_factor=2.0, divergence_margin=1.0, divergence_patience=5,
      allow_config_change=False, compile_cache_dir=config_dict.placeholder(str), init_from=""))
  c.eval = ml_collections.ConfigDict(dict(
      lengths=(), every=0, num_batches=4, batch_size=0, seed=1234))
  c.data = data.default_data_config()
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, context=1,
                                         rules=sharding.DEFAULT_RULES))
  c.sweep = ml_collections.ConfigDict(dict(encodings=()))
  c.distributed = ml_collections.ConfigDict(dict(
      coordinator=config_dict.placeholder(str), num_processes=config_dict.placeholder(int),
      process_id=config_dict.placeholder(int)))
  return c


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """big_vision-style `arg`: "runlocal,encoding=path" -> {runlocal: True, encoding: "path"}.

  Keys must appear in `defaults` (which also gives each value's type).
  """
  out = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, eq, value = item.partition("=")
    if key not in defaults:
      raise ValueError(f"config arg {key!r} is unknown; expected one of {tuple(defaults)}")
    kind = type(defaults[key])
    if kind is bool:
      out[key] = not eq or value.lower() in ("1", "true", "yes")
      continue
    try:
      out[key] = kind(value)
    except ValueError:
      raise ValueError(f"config arg {key}={value!r} must be {kind.__name__}") from None
  return out


def check_local_or_gpu(a: ml_collections.ConfigDict) -> None:
  """The paper experiments' two size switches: `runlocal` (CI smoke size) or `gpu` (one GPU)."""
  if a.runlocal and a.gpu:
    raise ValueError("config arg: runlocal and gpu exclude each other; pick one size")


def shrink_for_local(c: ml_collections.ConfigDict, *, steps: int) -> None:
  """The paper experiments' shared `runlocal` size: a 16-wide model, a few steps, one seed.

  Sequence lengths and task sizes stay with each experiment (they differ per task).
  """
  c.model.update(d_model=16, num_heads=2, head_dim=8)
  c.train.update(steps=steps, batch_size=4, warmup_steps=2, log_every=3)
  c.eval.update(num_batches=1, batch_size=4)
  c.sweep.seeds = (0,)
