r"""Mixing window of accumulated transports (acc_rot §8.3): see experiments/probes/mixing_window.py.

Reads the length_extrapolation checkpoints of the encodings below (WORKDIR/<enc>/seed<N>,
N < seeds).

  python -m experiments.probes.mixing_window --config=experiments/configs/mixing_window.py \
      --results=experiments/results/mixing_window

`arg`: runlocal, gpu (the GPU sweep's models, rows of their 512-token training length),
seeds=N (default 1), encodings=A+B, source_workdir=DIR, source_arg=ARG (the
length_extrapolation config arg those checkpoints were trained with, for workdirs that predate
their config.json).
"""
from __future__ import annotations

import ml_collections

from experiments.configs import base


def get_config(arg: str | None = None):
  a = base.parse_arg(arg, runlocal=False, gpu=False, seeds=1,
                     source_workdir="workdirs/length_extrapolation", source_arg="",
                     encodings="acc_rot_random+acc_rot_learned+path")
  c = ml_collections.ConfigDict()
  c.runlocal = a.runlocal
  c.encodings = tuple(a.encodings.split("+"))
  c.source_workdir = a.source_workdir
  c.source_config = "length_extrapolation"
  c.source_arg = a.source_arg
  c.seeds = tuple(range(a.seeds))
  c.text_len, c.text_batch = 256, 4
  if a.gpu:
    # the GPU sweep's models at their training length (the statistics' loop is O(T) numpy
    # steps over [B, T, K, D] arrays, O(T D^2) each for PaTH)
    c.text_len, c.text_batch = 512, 2
    c.source_arg = a.source_arg or "gpu"
  if a.runlocal:
    c.text_len, c.text_batch = 32, 2
  return c
