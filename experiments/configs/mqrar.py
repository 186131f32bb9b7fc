r"""MQRAR-N-back (PaTH Fig. 2 top): recall accuracy for N = 1..4.

PaTH: 2-layer transformers, hidden size 256, 2 heads, 32 key-value pairs, length 768.
Every encoding trains the same model on the same streams and seeds for each N (a separate
model per N, as in the paper); accuracy is over the answer tokens of held-out streams.

  python -m experiments.sweeps --config=experiments/configs/mqrar.py \
      --workdir=workdirs/mqrar --results=experiments/results/mqrar

`arg`: runlocal, gpu, encodings=A+B (default ENCODINGS; GPU_ENCODINGS with gpu), seeds=N
(default 1), steps=N, num_pairs=P, seq_len=T, n_backs=1+2+..., lr=X (peak learning rate,
default 1e-3). The GPU list adds SBA, the paper's fourth baseline; on the CPU it costs about
what RoPE does (`encodings=sba` runs it).

`gpu`: the paper's sizes (hidden 256, 2 heads of 128, 2 layers, 32 pairs, length 768), 4000
steps of batch 64 in bfloat16, the attention implementation left to the GPU auto rule.
Scale gap (CPU): hidden size 128 (2 heads of 64), length 128 with 6 keys (the paper's
768 / 32 keep ~7 assignments per key at our query rate; 6 keys at 128 keep ~6), 1000
steps of batch 16.
"""
from __future__ import annotations

from experiments.configs import base

ENCODINGS = ("rope", "fox", "path")
GPU_ENCODINGS = ("rope", "fox", "path", "sba")


def get_config(arg: str | None = None):
  a = base.parse_arg(arg, runlocal=False, gpu=False, encodings="", seeds=1,
                     steps=0, num_pairs=0, seq_len=0, n_backs="1+2+3+4", lr=0.0)
  base.check_local_or_gpu(a)
  c = base.get_config()
  c.data.task = "mqrar"
  c.data.seq_len = a.seq_len or (768 if a.gpu else 128)
  c.data.update(num_pairs=a.num_pairs or (32 if a.gpu else 6), num_values=32, query_prob=0.3)
  c.model.update(num_layers=2, d_model=128, num_heads=2, head_dim=64, block="llama")
  c.train.update(steps=a.steps or 1000, batch_size=16, learning_rate=a.lr or 1e-3, warmup_steps=100,
                 weight_decay=0.1, checkpoint_every=100000, log_every=50)
  c.eval.update(num_batches=4, batch_size=64)
  # The blockwise implementations: on CPU PaTH's UT-chunked form is ~10x faster than the dense
  # walk at this length (same function; N = 1 rope/fox ran with the dense default).
  c.model.implementation = "chunked"
  c.sweep.encodings = tuple((a.encodings or "+".join(GPU_ENCODINGS if a.gpu else ENCODINGS))
                           .split("+"))
  c.sweep.seeds = tuple(range(a.seeds))
  c.sweep.axis = "data.n_back"
  c.sweep.axis_values = tuple(int(x) for x in a.n_backs.split("+"))
  c.sweep.experiment = "mqrar"
  if a.gpu:
    c.model.update(d_model=256, head_dim=128, dtype="bfloat16", implementation=None)
    c.train.update(steps=a.steps or 4000, batch_size=64, warmup_steps=200, log_every=100)
  if a.runlocal:
    c.data.seq_len = 32
    base.shrink_for_local(c, steps=a.steps or 6)
    c.sweep.axis_values = (2,)
  return c
