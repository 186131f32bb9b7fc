r"""Imports a transformers Llama / Mistral / Qwen2 checkpoint as a run's workdir.

  python -m experiments.import_hf --checkpoint=DIR --workdir=WD \
      [--config=experiments/configs/quickstart.py:runlocal --config.data.task=text ...]

DIR holds config.json and *.safetensors (experiments/hf_interop.py lists what is mapped and
what is refused). WD gets what a training run leaves at step 0, written by the same
Checkpointer: the imported parameters with a fresh AdamW state, the data stream's position
and the model config, plus WD/config.json: the run config (--config, default
experiments/configs/base.py) with its model fields replaced by the checkpoint's. Then

  python -m experiments.generate --workdir=WD --prompt=...
  python -m experiments.main --config=experiments/configs/from_workdir.py:WD --workdir=WD

sample from it and continue training it. The data must have the checkpoint's vocabulary
(the text task's byte-level 257 tokens, say): experiments.main trains only such data. A
checkpoint's tokenizer.json is copied into WD, and under data.task="text" it tokenizes the
corpus (experiments/hf_interop.py: write_workdir).

A checkpoint or config that cannot be imported, or a WD that already holds a checkpoint,
prints one `error: ...` line and exits with status 2.
"""
from __future__ import annotations

import sys

from absl import app
from absl import flags

from experiments import cli_config

_CONFIG = cli_config.define_config_flag()
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A save_pretrained directory.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The workdir to write (must hold no checkpoint).")
flags.mark_flags_as_required(["checkpoint", "workdir"])


def main(argv) -> None:
  cli_config.start(argv)
  from experiments import errors
  from experiments import hf_interop
  try:
    stored = hf_interop.write_workdir(_CHECKPOINT.value, _WORKDIR.value, _CONFIG.value)
  except (ValueError, errors.RunError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"imported {_CHECKPOINT.value} into {_WORKDIR.value}: {stored['encoding']}, "
        f"{stored['num_layers']} layers, d_model {stored['d_model']}, vocab {stored['vocab_size']}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli_config.parse_flags)
