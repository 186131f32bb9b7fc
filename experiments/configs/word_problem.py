r"""A5 (or S5) word problems (PaTH Fig. 2 bottom): accuracy vs number of layers.

The model tags every prefix of a random word with its running product (see
experiments/tasks/word_problem.py); accuracy is per token over all positions. PaTH's
criterion: the minimum depth reaching 90% accuracy. Each encoding trains the same model
at 1, 2, 3 and 4 layers on the same data stream and seeds.

  python -m experiments.sweeps --config=experiments/configs/word_problem.py \
      --workdir=workdirs/word_problem --results=experiments/results/word_problem

`arg`: runlocal, gpu, group=A5|S5, encodings=A+B (default ENCODINGS; GPU_ENCODINGS with gpu:
the paper's SBA baseline too, which costs on the CPU about what RoPE does), seeds=N (default
1), steps=N, seq_len=T,
layers=1+2+..., lr=X (peak learning rate, default 1e-3), alphabet=group|generators (the words'
letters: every group element, Merrill et al.'s setup and the default, or PaTH §4.1's fixed
generators and their inverses; experiments/tasks/word_problem.py).

`gpu`: words of 64 elements, d_model 256 (4 heads x 64), 5000 steps of batch 128 in bfloat16
at 1-4 layers; steps=N raises the budget until PaTH reaches 90% (or shows where it stops).
Scale gap vs the paper (Merrill et al. setup, words of up to hundreds of elements, long
GPU training): words of 16 elements and 1500 steps of batch 32 on a shared CPU.
"""
from __future__ import annotations

from experiments.configs import base

ENCODINGS = ("rope", "fox", "path")
GPU_ENCODINGS = ("rope", "fox", "path", "sba")


def get_config(arg: str | None = None):
  a = base.parse_arg(arg, runlocal=False, gpu=False, group="A5", encodings="",
                     seeds=1, steps=0, seq_len=0, layers="1+2+3+4", lr=0.0,
                     alphabet="group")
  base.check_local_or_gpu(a)
  c = base.get_config()
  c.data.task = "word_problem"
  c.data.group = a.group
  if a.alphabet != "group":  # set only when chosen: the default leaves the results' fingerprint
    c.data.alphabet = a.alphabet
  c.data.seq_len = a.seq_len or (64 if a.gpu else 16)
  c.model.update(num_layers=1, d_model=128, num_heads=4, head_dim=32, block="llama")
  c.train.update(steps=a.steps or 1500, batch_size=32, learning_rate=a.lr or 1e-3, warmup_steps=100,
                 weight_decay=0.1, checkpoint_every=100000, log_every=50)
  c.eval.update(num_batches=4, batch_size=64)
  c.sweep.encodings = tuple((a.encodings or "+".join(GPU_ENCODINGS if a.gpu else ENCODINGS))
                           .split("+"))
  c.sweep.seeds = tuple(range(a.seeds))
  c.sweep.axis = "model.num_layers"
  c.sweep.axis_values = tuple(int(x) for x in a.layers.split("+"))
  c.sweep.experiment = "word_problem"
  if a.gpu:
    c.model.update(d_model=256, num_heads=4, head_dim=64, dtype="bfloat16")
    c.train.update(steps=a.steps or 5000, batch_size=128, warmup_steps=200, log_every=100)
  if a.runlocal:
    c.data.seq_len = 8
    base.shrink_for_local(c, steps=a.steps or 6)
    c.sweep.axis_values = (1,)
  return c
