r"""Quickstart: flip-flop language modelling, RoPE vs PaTH, on one CPU in a few minutes.

The PaTH paper's flip-flop experiment (Table 1) at toy scale: a 1-layer, 2-head model
learns to recall the most recent written bit. Two runs, one per encoding, into
WORKDIR/rope/ and WORKDIR/path/; then WORKDIR/report.md compares them: final loss and the
read error on the "id" (training distribution), "sparse" (98% ignores: long gaps) and
"dense" (10% ignores) test sets, and wall time.

What to expect (600 steps on a 2-core CPU, about 4 minutes, almost all of it PaTH): PaTH
reaches ~0% error on all three sets; RoPE is still near 35% / 45% / 25%. Given 2000 steps
at learning rate 1e-3, RoPE gets the dense set right (~0.5%) but stays near chance on the
sparse one (~46%): the pattern of the PaTH paper's Table 1.

  python -m experiments.main --config=experiments/configs/quickstart.py --workdir=/tmp/qs

`arg` (after a colon, comma-separated) selects variants:
  runlocal         shrink everything to a seconds-long smoke run
  encoding=NAME    one run with this encoding instead of the RoPE/PaTH pair
  encodings=A+B+C  a sweep over these encodings
  steps=N          train N steps (default 600; runlocal 10), warming up for a tenth of them
                   (so does --config.train.steps=N; --config.train.warmup_steps sets its own)
e.g. --config=experiments/configs/quickstart.py:runlocal,encodings=rope+fox+path
"""
from __future__ import annotations

from ml_collections import config_dict

from experiments.configs import base


def get_config(arg: str | None = None):
  a = base.parse_arg(arg, runlocal=False, encoding="", encodings="rope+path", steps=0)
  c = base.get_config()
  c.data.task = "flipflop"
  c.data.seq_len = 128
  c.model.update(num_layers=1, d_model=64, num_heads=2, head_dim=32, block="llama")
  # A reference: the warmup stays a tenth of the steps when --config.train.steps changes them.
  steps = config_dict.FieldReference(a.steps or (10 if a.runlocal else 600))
  c.train.update(steps=steps, batch_size=16, learning_rate=3e-3, warmup_steps=steps // 10,
                 weight_decay=0.1, checkpoint_every=200, log_every=25)
  c.eval.update(num_batches=4, batch_size=32)
  if a.runlocal:
    c.data.seq_len = 32
    c.model.update(d_model=16, head_dim=8)
    c.train.update(batch_size=4, checkpoint_every=5, log_every=5)
    c.eval.update(num_batches=1, batch_size=4)
  if a.encoding:
    c.model.encoding = a.encoding
  else:
    c.sweep.encodings = tuple(a.encodings.split("+"))
  return c
