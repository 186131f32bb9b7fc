r"""Distance bias of RoPE vs TAPA (TAPA App. 15): see experiments/probes/distance_bias.py.

  python -m experiments.probes.distance_bias --config=experiments/configs/distance_bias.py \
      --results=experiments/results/distance_bias

Random-vector histograms need nothing; the trained ones read the length_extrapolation
checkpoints of rope and tapa (WORKDIR/<encoding>/seed<N> of that sweep, N < seeds).
`arg`: runlocal, gpu (the GPU sweep's models: head dim 64, trained at 512 tokens), seeds=N
(default 1), encodings=A+B, source_workdir=DIR ("" skips the trained part), source_arg=ARG (the
length_extrapolation config arg those checkpoints were trained with, for workdirs that predate
their config.json).

  python -m experiments.probes.distance_bias \
      --config=experiments/configs/distance_bias.py:gpu,seeds=3,source_workdir=W \
      --results=experiments/results/distance_bias_gpu
"""
from __future__ import annotations

import ml_collections

from experiments.configs import base


def get_config(arg: str | None = None):
  a = base.parse_arg(arg, runlocal=False, gpu=False, seeds=1,
                     source_workdir="workdirs/length_extrapolation", source_arg="",
                     encodings="rope+tapa")
  c = ml_collections.ConfigDict()
  c.runlocal = a.runlocal
  c.encodings = tuple(a.encodings.split("+"))
  # (label, short range, long range): the paper's, and one scaled to our models, trained at
  # 64 tokens: short within the training length, long at 32x it.
  c.intervals = (("paper", (0, 100), (10000, 10100)), ("scaled", (0, 32), (2048, 2080)))
  c.num_pairs = 10000
  c.rhos = (0.0, 0.5)
  c.head_dim = 32            # the length_extrapolation models' head_dim
  c.seed = 0
  c.seeds = tuple(range(a.seeds))
  c.source_workdir = a.source_workdir
  c.source_config = "length_extrapolation"
  c.source_arg = a.source_arg
  c.text_len, c.text_batch = 512, 4
  if a.gpu:
    # short within the training length (512), long at 32x it
    c.intervals = (("paper", (0, 100), (10000, 10100)), ("scaled", (0, 256), (16384, 16640)))
    c.head_dim = 64
    c.source_arg = a.source_arg or "gpu"
  if a.runlocal:
    c.num_pairs, c.text_len, c.text_batch = 500, 64, 2
  return c
