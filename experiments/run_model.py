"""A run's model from its workdir: the config saved with the newest checkpoint, and its parameters.

Flag-free, so that every command line reading a workdir (experiments.generate,
experiments.export_hf) can use it.
"""
from __future__ import annotations

import os


def _runs_below(workdir: str) -> list[str]:
  """Subdirectories holding a run (a sweep's WORKDIR/<encoding>), to suggest one."""
  from experiments import checkpoint
  subs = sorted(os.path.join(workdir, d) for d in os.listdir(workdir))
  return [d for d in subs if os.path.isdir(d) and checkpoint.has_checkpoint(d)]


def load_model(workdir: str):
  """(model, model config, step) of the latest checkpoint in workdir; ValueError if none."""
  from flax import nnx

  from experiments import checkpoint
  from posenc_jax import model as model_lib

  if os.path.isfile(workdir):
    raise ValueError(f"--workdir={workdir} is a file; give the run's directory (the one "
                     f"holding checkpoints/)")
  if not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir} does not exist")
  stored = checkpoint.stored_model_config(workdir)
  if stored is None:
    runs = _runs_below(workdir)
    hint = (f"; it holds the runs {', '.join(runs)}" if runs else
            "; train one with python -m experiments.main --config=... --workdir=" + workdir)
    raise ValueError(f"--workdir={workdir} holds no checkpoint{hint}")
  fields = dict(stored)
  fields["encoding_kwargs"] = tuple((k, _frozen(v)) for k, v in fields["encoding_kwargs"])
  cfg = model_lib.ModelConfig(**fields)
  abstract = nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(params=0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  step, values = checkpoint.restore_params(workdir, nnx.to_pure_dict(params))
  nnx.replace_by_pure_dict(params, values)
  return nnx.merge(graphdef, params, rest), cfg, step


def _frozen(x):
  """JSON lists back to the tuples ModelConfig holds (hashable)."""
  return tuple(_frozen(v) for v in x) if isinstance(x, list) else x
