r"""Flip-flop language modelling (PaTH Table 1): error ID / sparse OOD / dense OOD.

PaTH's setting: 1 layer, 2 heads, model dim 64, trained on FFL(0.8); tested on fresh FFL(0.8)
("id"), FFL(0.98) ("sparse", long gaps between writes and reads) and FFL(0.1) ("dense").
Every encoding trains the same model, data stream, steps and seeds.

  python -m experiments.sweeps --config=experiments/configs/flipflop.py \
      --workdir=workdirs/flipflop --results=experiments/results/flipflop

`arg` (comma-separated): runlocal (seconds-long smoke run), gpu (one GPU, below),
encodings=A+B (subset), seeds=N (number of seeds, default 2), steps=N.

`gpu`: the paper's model (1 layer, 2 heads, dim 64) on Liu et al.'s length, 512 tokens, for
5000 steps of batch 64 (bfloat16), every encoding and both seeds; run subsets in separate
device calls with the same --results directory (it gathers the runs).
Scale gap vs the paper: sequences of 64 tokens (Liu et al.: 512) and 800 steps of batch
16 on a shared CPU instead of tens of thousands of steps on GPUs.
"""
from __future__ import annotations

from experiments.configs import base

ENCODINGS = ("nope", "rope", "alibi", "fox", "path", "path_fox", "grape_m_ctx", "grape_ap",
             "acc_rot_learned", "tapa", "sba")


def get_config(arg: str | None = None):
  a = base.parse_arg(arg, runlocal=False, gpu=False, encodings="+".join(ENCODINGS), seeds=2,
                     steps=0)
  base.check_local_or_gpu(a)
  c = base.get_config()
  c.data.task = "flipflop"
  c.data.seq_len = 64
  c.model.update(num_layers=1, d_model=64, num_heads=2, head_dim=32, block="llama")
  c.train.update(steps=a.steps or 800, batch_size=16, learning_rate=3e-3, warmup_steps=100,
                 weight_decay=0.1, checkpoint_every=100000, log_every=50)
  c.eval.update(num_batches=8, batch_size=64)
  c.sweep.encodings = tuple(a.encodings.split("+"))
  c.sweep.seeds = tuple(range(a.seeds))
  c.sweep.experiment = "flipflop"
  if a.gpu:
    c.data.seq_len = 512
    c.model.dtype = "bfloat16"
    c.train.update(steps=a.steps or 5000, batch_size=64, learning_rate=3e-3, warmup_steps=200,
                   log_every=100)
  if a.runlocal:
    c.data.seq_len = 32
    base.shrink_for_local(c, steps=a.steps or 6)
  return c
