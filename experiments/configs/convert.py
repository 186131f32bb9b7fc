r"""Converting a trained RoPE (or NoPE / ALiBi) run into PaTH and other encodings by
distillation (the PaTH paper's §4.3), and the runs to compare the converted students with.

  python -m experiments.convert --config=experiments/configs/convert.py:teacher=TEACHER_WD \
      --workdir=STUDENT_WD

The config is the teacher's recorded run config (TEACHER_WD/config.json: its model, data and
evaluation) with model.encoding the student's and the two stages' budgets: convert.mse_* for
stage 1 (attention layers on the layer outputs' MSE), train.* for stage 2 (the whole student
on the KL of the outputs); experiments/convert.py runs them.

`arg` (comma-separated):
  teacher=WD       the teacher's workdir (required unless run=teacher / scratch / probe)
  encoding=NAME    the student (default path; path_fox, fox, grape_a_q/k/qk, grape_m from a
                   rope teacher)
  teacher_step=N   convert the teacher's checkpoint at step N (default: its newest)
  runlocal         a seconds-long smoke conversion (20 + 20 steps of 4 rows)
  gpu              the GPU experiment's scale (below)
  run=teacher      instead: the teacher's own training run, for experiments.main
  run=scratch      instead: model.encoding=encoding trained from scratch for as many tokens as
                   the teacher's training and the conversion together, for experiments.main
  run=probe,init=WD
                   instead: the state-tracking probe of a trained run WD (teacher, student or
                   scratch), for experiments.main: WD's model fine-tuned from its parameters
                   (train.init_from) on flip-flop in byte tokens (data.byte_tokens, the text
                   task's vocabulary), its read errors at 1x and 4x the probe's length

`gpu`: what conversion buys, on one GPU, sized so that every run below fits one session's
device time (about 25 minutes at the H200's measured 417k tokens/s for RoPE and 277k for PaTH
on this model). A 12-layer llama-style RoPE teacher (d_model 768, 12 heads x 64, ~125M
parameters, bfloat16) trains on the byte-level text corpus at T = 2048 for 1200 steps of 16
rows (39M tokens), keeping its checkpoints at steps 600 and 1200. It is converted to path and
to path_fox: stage 1 for 100 steps of 8 x 2048 (1.6M tokens, at 1e-3), stage 2 for 300 steps
of 16 x 2048 (9.8M tokens, at 3e-4). The comparison is at equal total tokens (1550 steps of
16 x 2048): the students, the teacher trained on (run=scratch,encoding=rope) and PaTH from
scratch (run=scratch,encoding=path), every run evaluated at 1x, 4x and 8x the training length
(2048, 8192, 16384), and each probed on flip-flop (run=probe: 300 steps of 32 x 512).
Converting the teacher's step-600 checkpoint as well (teacher_step=600) asks the paper's
question whether a teacher trained longer is harder to convert ("ossification"). Each
command is one run (experiments/convert_experiment.py runs them all, the early conversion's
stage 2 lengthened to equal tokens); none of the GPU runs has been run yet:

  python -m experiments.main --config=experiments/configs/convert.py:gpu,run=teacher \
      --workdir=W/rope
  python -m experiments.convert \
      --config=experiments/configs/convert.py:gpu,teacher=W/rope,encoding=path \
      --workdir=W/path_converted
  python -m experiments.convert \
      --config=experiments/configs/convert.py:gpu,teacher=W/rope,encoding=path,teacher_step=600 \
      --workdir=W/path_converted_at_600
  python -m experiments.main --config=experiments/configs/convert.py:gpu,run=scratch,encoding=path \
      --workdir=W/path_scratch
  python -m experiments.main \
      --config=experiments/configs/convert.py:gpu,run=probe,init=W/path_converted \
      --workdir=W/probe_path_converted
"""
from __future__ import annotations

import os

import ml_collections

from experiments import data
from experiments import run_config
from experiments.configs import base
from experiments.configs import from_workdir

# (steps, batch, seq_len) of the teacher's training and of the two stages; learning rates.
CPU = dict(teacher=(500, 16, 64), mse=(100, 16, 64), kl=(200, 16, 64), teacher_lr=3e-3,
           mse_lr=1e-3, kl_lr=3e-4)
LOCAL = dict(teacher=(20, 4, 16), mse=(20, 4, 16), kl=(20, 4, 16), teacher_lr=3e-3,
             mse_lr=3e-3, kl_lr=1e-3)
GPU = dict(teacher=(1200, 16, 2048), mse=(100, 8, 2048), kl=(300, 16, 2048), teacher_lr=1e-3,
           mse_lr=1e-3, kl_lr=3e-4)
SIZES = {"cpu": CPU, "runlocal": LOCAL, "gpu": GPU}   # by the arg that picks them (cpu: none)
# The flip-flop probe: (steps, batch, seq_len) and its learning rate.
PROBE = dict(cpu=(100, 16, 64), runlocal=(10, 4, 16), gpu=(300, 32, 512), lr=3e-4)
RUNS = ("convert", "teacher", "scratch", "probe")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  a = base.parse_arg(arg, teacher="", encoding="path", teacher_step=0, runlocal=False,
                     gpu=False, run="convert", init="")
  base.check_local_or_gpu(a)
  if a.run not in RUNS:
    raise ValueError(f"config arg run={a.run!r} must be one of {RUNS}")
  size = SIZES[size_name(a)]
  if a.run == "probe":
    return _probe(a)
  if a.run != "convert":
    return _pretraining(a, size)
  if not a.teacher:
    raise ValueError("convert.py needs the teacher's workdir: --config=experiments/configs/"
                     "convert.py:teacher=TEACHER_WORKDIR[,encoding=path]")
  c = _teacher_run_config(a.teacher)
  kwargs = {}
  if a.encoding == "grape_m":   # grape_m starts as the teacher's RoPE: its base too
    kwargs["base"] = float(c.model.encoding_kwargs.to_dict().get("base", 10000.0))
  c.model.encoding = a.encoding
  c.model.encoding_kwargs = ml_collections.ConfigDict(kwargs)
  c.sweep = ml_collections.ConfigDict(dict(encodings=()))
  (mse_steps, mse_batch, mse_len), (kl_steps, kl_batch, kl_len) = size["mse"], size["kl"]
  if not a.gpu:   # the teacher's own lengths and batch (a gpu teacher is the GPU one)
    mse_batch = kl_batch = c.train.batch_size if not a.runlocal else mse_batch
    mse_len = kl_len = c.data.seq_len
  c.data.seq_len = kl_len
  c.convert = ml_collections.ConfigDict(dict(
      teacher=a.teacher, teacher_step=a.teacher_step or None, mse_steps=mse_steps,
      mse_batch_size=mse_batch, mse_seq_len=mse_len, mse_learning_rate=size["mse_lr"],
      mse_warmup_steps=mse_steps // 10, init_beta=0.01, init_forget_time=1e4))
  c.train.update(steps=kl_steps, batch_size=kl_batch, learning_rate=size["kl_lr"],
                 warmup_steps=kl_steps // 10, checkpoint_every=max(kl_steps // 2, 1),
                 log_every=5 if a.runlocal else 25)
  if a.runlocal:
    c.train.checkpoint_every = 0   # at the stages' ends only
    c.eval.update(num_batches=1, batch_size=4, lengths=())
  if a.gpu:
    _eval_lengths(c)
  return c


def size_name(a) -> str:
  """The key of SIZES (and PROBE) that the parsed arg picks."""
  return "gpu" if a.gpu else "runlocal" if a.runlocal else "cpu"


def _teacher_run_config(teacher: str) -> ml_collections.ConfigDict:
  """base.get_config() overlaid with TEACHER/config.json (fields it predates keep their
  defaults)."""
  if not os.path.isdir(teacher):
    raise ValueError(f"convert.teacher={teacher!r} does not exist; give the workdir of a "
                     f"trained run")
  recorded = run_config.stored(teacher)
  if recorded is None:
    raise ValueError(f"convert.teacher={teacher!r} holds no config.json; give the workdir of a "
                     f"run trained by experiments.main or written by experiments.import_hf")

  return from_workdir.on_defaults(recorded)


def _pretraining(a, size) -> ml_collections.ConfigDict:
  """The teacher's run (run=teacher), or an encoding from scratch at the conversion's total
  tokens (run=scratch): both on the byte-level text corpus, for experiments.main."""
  c = base.get_config()
  steps, batch, seq_len = size["teacher"]
  c.data.update(task="text", seq_len=seq_len)
  c.model.update(num_layers=2, d_model=64, num_heads=2, head_dim=32, block="llama",
                 encoding="rope" if a.run == "teacher" else a.encoding)
  if a.run == "scratch":   # teacher + stage 1 + stage 2 tokens, in steps of this batch
    tokens = sum(s * b * n for s, b, n in (size["teacher"], size["mse"], size["kl"]))
    steps = tokens // (batch * seq_len)
  c.train.update(steps=steps, batch_size=batch, learning_rate=size["teacher_lr"],
                 warmup_steps=steps // 10, checkpoint_every=size["teacher"][0] // 2,
                 log_every=25)
  c.eval.update(num_batches=2, batch_size=batch)
  if a.runlocal:
    c.data.max_files = 20
    base.shrink_for_local(c, steps=steps)
    c.train.checkpoint_every = steps // 2
  if a.gpu:
    c.model.update(num_layers=12, d_model=768, num_heads=12, head_dim=64, dtype="bfloat16")
  if not a.runlocal:
    _eval_lengths(c)
  return c


def _probe(a) -> ml_collections.ConfigDict:
  """WD's recorded run config (its model as it was) fine-tuned on flip-flop in byte tokens
  from WD's parameters."""
  if not a.init or not os.path.isdir(a.init):
    raise ValueError(f"convert.py:run=probe needs init=WD, the workdir of a trained run "
                     f"(got init={a.init!r})")
  recorded = run_config.stored(a.init)
  if recorded is None:
    raise ValueError(f"init={a.init!r} holds no config.json; give the workdir of a run trained "
                     f"by experiments.main or experiments.convert")
  recorded = {k: v for k, v in recorded.items() if k != "convert"}   # a student's distillation
  c = from_workdir.on_defaults(recorded)
  steps, batch, seq_len = PROBE[size_name(a)]
  c.data = data.default_data_config()
  c.data.update(task="flipflop", byte_tokens=True, seq_len=seq_len)
  c.train.update(steps=steps, batch_size=batch, learning_rate=PROBE["lr"],
                 warmup_steps=steps // 10, checkpoint_every=steps, log_every=max(steps // 20, 1),
                 init_from=a.init)
  # 8 batches: the sparse set (98% distractors) has one read in about a hundred tokens
  c.eval.update(lengths=(seq_len, 4 * seq_len), num_batches=8, batch_size=min(batch, 16))
  c.sweep = ml_collections.ConfigDict(dict(encodings=()))
  return c


def _eval_lengths(c) -> None:
  """1x, 4x and 8x the training length, 8 rows a batch."""
  n = c.data.seq_len
  c.eval.update(lengths=(n, 4 * n, 8 * n), num_batches=2, batch_size=8)
