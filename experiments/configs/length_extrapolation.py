r"""Length extrapolation on the byte-level code corpus (acc_rot Table 1, TAPA Tables 1-2, PaTH
Fig. 3).

Every encoding trains the same 2-layer model on the same stream of packed stdlib Python
source at a short length L, then is evaluated (perplexity per byte on held-out files) at
L, 2L, 4L, ..., 32L. The trained checkpoints also feed experiments 5 and 6 (distance_bias,
mixing_window), which read them from WORKDIR/<encoding>/seed0/.

  python -m experiments.sweeps --config=experiments/configs/length_extrapolation.py \
      --workdir=workdirs/length_extrapolation --results=experiments/results/length_extrapolation

`arg`: runlocal, gpu, encodings=A+B, seeds=N (default 1), steps=N, train_len=L (default 64;
512 with gpu), lr=X (peak learning rate; default 3e-3, 1e-3 with gpu), factors=N (evaluate at
L .. 2^(N-1) L; default 6, i.e. to 32x), table=acc_rot (the accumulated-rotations paper's
Table 1: rope, rope_v, acc_rot_random(_v), acc_rot_learned(_v) and alibi, to 128x; with gpu,
L = 512 and evaluation to 65,536: `gpu,table=acc_rot,seeds=3` with `--side_by_side=4` trains
four runs at a time on one GPU, and the same command resumes it). TAPA's paper trains
TAPA at a fifth of RoPE's rate (2e-5 against 1e-4). The GPU table's tapa row trained at gpu's
shared 1e-3, where its gradient norm grows from step 75 and the run does not learn
(length_extrapolation_gpu/NOTES.md); the run at that ratio, `encodings=tapa,lr=2e-4`, has its
own results directory (length_extrapolation_gpu/tapa_lr2e-4/) and did not learn either. TAPA's
phase starts random and moves too fast; with the paper's recipe and the phase started small it
trains (length_extrapolation_gpu/tapa_stable/, NOTES.md there):
`gpu,encodings=tapa,lr=2e-4,seeds=3 --config.model.encoding_kwargs.phase_scale=0.1
--config.train.warmup_steps=300 --config.train.weight_decay=0.0`. With its phase channels
normalised it learns at the shared rate (`encodings=tapa --config.model.encoding_kwargs.
phase_norm=True --config.model.encoding_kwargs.phase_scale=0.03`, tapa_norm/), and with
`steps=3000` it comes within 6% of RoPE trained as long (tapa_norm_3000/, rope_3000/).

`gpu` (one GPU; issue 15's scale): a 6-layer llama-style model (d_model 768, 12 heads x 64,
~43M parameters) in bfloat16, trained at L = 512 on batches of 64 rows (32,768 tokens a step)
for 600 steps (19.7M tokens, the same for every encoding), evaluated at 512 ... 16,384 (32x)
on the same 131,072 held-out tokens per length; the nine encodings of the GPU table. Each
encoding is one device call (<= 10 min with compile and evaluation); run them as separate
invocations with encodings=NAME and the same --results directory, which gathers them:

  python -m experiments.sweeps \
      --config=experiments/configs/length_extrapolation.py:gpu,encodings=rope \
      --workdir=workdirs/length_extrapolation_gpu \
      --results=experiments/results/length_extrapolation_gpu
Scale gap vs the papers: acc_rot trains at 512 and tests to 65,536 (128x); TAPA trains at
8K. Here L = 64 bytes, evaluation to 32L = 2048 bytes, a 2-layer d_model-64 model and 500
steps of batch 16 on a shared CPU (the papers: 125M-1B models, billions of tokens).
model.implementation None (auto) is, on CPU, dense up to the family's CPU_DENSE_MAX_T (at
most 2048 tokens; PaTH: never) and the memory-safe chunked form beyond, so longer eval lengths
only need a longer eval.lengths.
"""
from __future__ import annotations

from experiments.configs import base

# The accumulated-rotations paper's Table 1: six rotation variants and ALiBi, to 128x.
ACC_ROT_TABLE = ("rope", "rope_v", "acc_rot_random", "acc_rot_random_v", "acc_rot_learned",
                 "acc_rot_learned_v", "alibi")
GPU_ENCODINGS = ("rope", "alibi", "fox", "path", "path_fox", "acc_rot_learned_v",
                 "acc_rot_random_v", "grape_ap", "tapa")
ENCODINGS = ("rope", "rope_v", "acc_rot_random", "acc_rot_random_v", "acc_rot_learned",
             "acc_rot_learned_v", "alibi", "fox", "path", "path_fox", "grape_a_qk", "grape_ap",
             "tapa")


def get_config(arg: str | None = None):
  a = base.parse_arg(arg, runlocal=False, gpu=False, encodings="", seeds=1, steps=0,
                     train_len=0, factors=0, lr=0.0, table="")
  if a.table not in ("", "acc_rot"):
    raise ValueError(f"length_extrapolation.py: table={a.table!r} must be acc_rot (or unset)")
  factors = a.factors or (8 if a.table else 6)
  base.check_local_or_gpu(a)
  c = base.get_config()
  c.data.task = "text"
  train_len = a.train_len or (512 if a.gpu else 64)
  c.data.seq_len = train_len
  c.model.update(num_layers=2, d_model=64, num_heads=2, head_dim=32, block="llama")
  c.train.update(steps=a.steps or 500, batch_size=16, learning_rate=3e-3, warmup_steps=50,
                 weight_decay=0.1, checkpoint_every=100000, log_every=50)
  # Training evaluates only at L; afterwards every checkpoint is evaluated at 1x .. 32x L
  # (factors=6) on the same 32768 held-out tokens per length (experiments/probes/length_eval.py).
  c.eval.update(num_batches=2, batch_size=16)
  c.sweep.eval_lengths = tuple(train_len * 2**i for i in range(factors))
  c.sweep.eval_tokens = 32768
  c.sweep.eval_batch_tokens = 8192
  default = ACC_ROT_TABLE if a.table else GPU_ENCODINGS if a.gpu else ENCODINGS
  c.sweep.encodings = tuple((a.encodings or "+".join(default)).split("+"))
  c.sweep.seeds = tuple(range(a.seeds))
  c.sweep.experiment = "length_extrapolation"
  if a.gpu:
    c.model.update(num_layers=6, d_model=768, num_heads=12, head_dim=64, dtype="bfloat16")
    c.train.update(steps=a.steps or 600, batch_size=64, learning_rate=1e-3, warmup_steps=60,
                   checkpoint_every=200, log_every=25)
    c.eval.update(num_batches=2, batch_size=32)
    c.sweep.eval_tokens = 131072   # 8 rows at 16,384
    c.sweep.eval_batch_tokens = 65536
  if a.lr:
    c.train.learning_rate = a.lr
  if a.runlocal:
    c.data.seq_len = 16
    c.data.max_files = 20
    base.shrink_for_local(c, steps=a.steps or 6)
    c.sweep.eval_lengths = (16, 32, 64)
    c.sweep.eval_tokens, c.sweep.eval_batch_tokens = 256, 128
  return c
