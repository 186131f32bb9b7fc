r"""Exports a run's latest checkpoint as a transformers checkpoint (RoPE-family models).

  python -m experiments.export_hf --workdir=WD --out=DIR

DIR gets config.json and model.safetensors (float32) that transformers' AutoModelForCausalLM
loads: LlamaForCausalLM, or Qwen2ForCausalLM for a model with q/k/v biases. The model must be
a llama block without kv_shift or QK-norm, with rope, rope_llama3, rope_pi, rope_ntk
(variant="dynamic") or rope_yarn (ramp="hf"); anything else prints one `error: ...` line
naming the field and exits with status 2 (experiments/hf_interop.py: hf_config).
"""
from __future__ import annotations

import sys

from absl import app
from absl import flags

from experiments import cli_config

_WORKDIR = flags.DEFINE_string("workdir", None, "A run's workdir (holds checkpoints/).")
_OUT = flags.DEFINE_string("out", None, "The directory to write.")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv) -> None:
  cli_config.start(argv)
  from flax import nnx

  from experiments import errors
  from experiments import hf_interop
  from experiments import run_model
  try:
    model, cfg, step = run_model.load_model(_WORKDIR.value)
    config = hf_interop.export(cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), _OUT.value)
  except (ValueError, errors.RunError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"exported step {step} of {_WORKDIR.value} to {_OUT.value} "
        f"({config['architectures'][0]})")


if __name__ == "__main__":
  app.run(main)
