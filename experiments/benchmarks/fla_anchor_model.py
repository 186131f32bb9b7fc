"""The PyTorch anchor of train_throughput.py: a llama-style model around FLA's PaTH kernel.

Only this module imports torch (lazily, inside functions), so the JAX benchmark and its CPU tests
never need it. The model matches the JAX one of train_throughput.py block for block:

  token embedding [V, C] -> num_layers x (RMSNorm -> PaTH attention -> residual,
  RMSNorm -> SwiGLU MLP (no biases) -> residual) -> RMSNorm -> untied head [C, V]

float32 parameters, bf16 autocast (or float32), torch.optim.AdamW(fused=True) with the JAX
schedule (linear warmup, cosine decay to 10%), weight decay on matrices only, global-norm
clipping.

The attention layer. fla-core 0.6.0 (the wheel the GPU machine gets) ships the kernels
(`fla.ops.path_attn.parallel_path_attn`) but not `fla.layers`: the layer class
`fla.layers.PaTHAttention(hidden_size, num_heads, num_kv_heads, use_forget_gate, ...)` lives in
the separate flash-linear-attention package. `attention_layer` uses that class when it is
installed; otherwise `PathAttention` below, which has the same constructor keywords and the
same return convention (a tuple whose first element is the output) and calls FLA's kernel. Its
transport inputs follow this repository's `path` encoding (posenc_jax/encodings/transport.py),
so both models have the same parameters:

  w_t = L2norm(SiLU(ShortConv_3(x_t W_down)) W_up)   (rank 32, depthwise causal conv)
  beta_t = 2 sigmoid(x_t u + b)
  log f_t = log_sigmoid(x_t w_f + b_f)                (use_forget_gate)

Document masking: packed rows are flattened to one [1, B*T] sequence with `cu_seqlens` at every
document (and row) start, FLA's variable-length form; the short convolution restarts there too.
`varlen=False` keeps [B, T] rows without document boundaries.
"""
from __future__ import annotations

import math
import sys
import time

import numpy as np

from experiments.benchmarks.throughput_common import (
    loss_summary, steps_to_run, text_batches, timing_fields, train_flops)
from experiments.configs import base
from posenc_jax import model as model_lib

RANK, CONV_WIDTH = 32, 3  # posenc_jax/encodings/transport.py HPARAMS["path"]
FORGET_TIME = (16.0, 4096.0)  # HPARAMS["path_fox"]: gate decay times 1/(1-f) across heads
# The JAX optimizer decays leaves named "kernel" or "embedding": every nnx.Linear and the
# embedding, not the encoding's own parameters (w_down, beta, gate, ...).
DECAYED = tuple(f"{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up",
                                        "down", "head", "embed"))


def fla_attention_kernel():
  """FLA's parallel PaTH kernel (raises ImportError naming what is missing)."""
  try:
    from fla.ops.path_attn import parallel_path_attn
  except ImportError as e:
    raise ImportError(f"the FLA anchor needs torch, triton and fla-core 0.6.0 "
                      f"(pip install .whl/fla_core-0.6.0-py3-none-any.whl): {e}") from e
  return parallel_path_attn


def _modules():
  """The torch classes, defined on first use so importing this file never imports torch."""
  import torch
  import torch.nn.functional as F
  from torch import nn

  def short_conv(z_NTR, kernel_WR, doc_NT):
    # y_t = sum_m kernel[m] z_{t-m}, a tap reaching back only inside the same document.
    T = z_NTR.shape[1]
    out = kernel_WR[0] * z_NTR
    for m in range(1, kernel_WR.shape[0]):
      shifted = F.pad(z_NTR, (0, 0, m, 0))[:, :T]
      same = F.pad(doc_NT, (m, 0), value=-1)[:, :T] == doc_NT
      out = out + torch.where(same[..., None], kernel_WR[m] * shifted, 0.0)
    return out

  class PathAttention(nn.Module):
    """PaTH attention on FLA's kernel; constructor keywords as fla.layers.PaTHAttention."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 use_forget_gate: bool = False, head_dim: int | None = None, attn_fn=None):
      super().__init__()
      C, H = hidden_size, num_heads
      K = num_kv_heads or num_heads
      D = head_dim or C // H
      self.H, self.K, self.D = H, K, D
      self.q_proj = nn.Linear(C, H * D, bias=False)
      self.k_proj = nn.Linear(C, K * D, bias=False)
      self.v_proj = nn.Linear(C, K * D, bias=False)
      self.o_proj = nn.Linear(H * D, C, bias=False)
      # Transport inputs: float32 (FLA's kernel asserts w, beta, g are float32).
      self.w_down = nn.Parameter(torch.randn(C, RANK) * C**-0.5)
      self.w_conv = nn.Parameter(torch.randn(CONV_WIDTH, RANK) * CONV_WIDTH**-0.5)
      self.w_up = nn.Parameter(torch.randn(RANK, K * D) * RANK**-0.5)
      self.beta_proj = nn.Linear(C, K, bias=True)
      nn.init.normal_(self.beta_proj.weight, std=0.02)
      nn.init.zeros_(self.beta_proj.bias)
      self.forget_proj = None
      if use_forget_gate:
        self.forget_proj = nn.Linear(C, H, bias=True)
        nn.init.normal_(self.forget_proj.weight, std=0.02)
        tau = np.geomspace(*FORGET_TIME, H)
        with torch.no_grad():
          self.forget_proj.bias.copy_(torch.as_tensor(np.log(tau - 1.0), dtype=torch.float32))
      self.attn_fn = attn_fn or fla_attention_kernel()

    def forward(self, x_NTC, *, doc_NT, cu_seqlens=None):
      N, T, _ = x_NTC.shape
      q = self.q_proj(x_NTC).view(N, T, self.H, self.D)
      k = self.k_proj(x_NTC).view(N, T, self.K, self.D)
      v = self.v_proj(x_NTC).view(N, T, self.K, self.D)
      with torch.autocast(x_NTC.device.type, enabled=False):
        x = x_NTC.float()
        z = short_conv(x @ self.w_down, self.w_conv, doc_NT)
        w = F.normalize((F.silu(z) @ self.w_up).view(N, T, self.K, self.D), dim=-1, eps=1e-6)
        beta = 2.0 * torch.sigmoid(self.beta_proj(x))
        g = F.logsigmoid(self.forget_proj(x)) if self.forget_proj is not None else None
      o, _ = self.attn_fn(q, k, v, w, beta, g, cu_seqlens=cu_seqlens)
      return (self.o_proj(o.reshape(N, T, self.H * self.D).to(q.dtype)), None)

  class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
      super().__init__()
      self.gate = nn.Linear(d_model, hidden, bias=False)
      self.up = nn.Linear(d_model, hidden, bias=False)
      self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
      return self.down(F.silu(self.gate(x)) * self.up(x))

  class Block(nn.Module):
    def __init__(self, cfg: dict, attn_cls, attn_kwargs: dict):
      super().__init__()
      C = cfg["d_model"]
      self.attn_norm = nn.RMSNorm(C, eps=1e-6)  # nnx.RMSNorm's epsilon
      self.attn = attn_cls(hidden_size=C, num_heads=cfg["num_heads"],
                           use_forget_gate=cfg["forget_gate"], **attn_kwargs)
      self.mlp_norm = nn.RMSNorm(C, eps=1e-6)
      self.mlp = SwiGLU(C, cfg["mlp_dim"])

    def forward(self, x, *, doc_NT, cu_seqlens):
      x = x + self.attn(self.attn_norm(x), doc_NT=doc_NT, cu_seqlens=cu_seqlens)[0]
      return x + self.mlp(self.mlp_norm(x))

  class Model(nn.Module):
    def __init__(self, cfg: dict, attn_cls, attn_kwargs: dict):
      super().__init__()
      self.embed = nn.Embedding(cfg["vocab_size"], cfg["d_model"])
      nn.init.normal_(self.embed.weight, std=1.0)  # as the JAX model's nnx.Embed init
      self.blocks = nn.ModuleList(Block(cfg, attn_cls, attn_kwargs)
                                  for _ in range(cfg["num_layers"]))
      self.final_norm = nn.RMSNorm(cfg["d_model"], eps=1e-6)
      self.head = nn.Linear(cfg["d_model"], cfg["vocab_size"], bias=False)

    def forward(self, tokens_NT, *, doc_NT, cu_seqlens=None):
      x = self.embed(tokens_NT)
      for block in self.blocks:
        x = block(x, doc_NT=doc_NT, cu_seqlens=cu_seqlens)
      return self.head(self.final_norm(x))

  return PathAttention, Model


def attention_layer(*, attn_fn=None):
  """(layer class, its extra constructor kwargs, description). attn_fn replaces FLA's kernel
  (tests on CPU pass FLA's naive reference); then the local layer is always used."""
  PathAttention, _ = _modules()
  if attn_fn is None:
    try:
      from fla.layers import PaTHAttention  # the full flash-linear-attention package
      return PaTHAttention, {}, "fla.layers.PaTHAttention"
    except ImportError:
      pass
    fla_attention_kernel()  # fail here, clearly, when fla-core is missing
    return PathAttention, {}, "local layer on fla.ops.path_attn.parallel_path_attn"
  return PathAttention, {"attn_fn": attn_fn}, "local layer on a given attention function"


def build_model(*, vocab_size: int, num_layers: int, d_model: int, num_heads: int,
                head_dim: int, mlp_dim: int, forget_gate: bool, device: str, attn_fn=None):
  """(model, description of the attention layer). The JAX model's head_dim must be C / H for
  fla.layers' class (it derives head_dim); the local layer takes head_dim."""
  attn_cls, kwargs, what = attention_layer(attn_fn=attn_fn)
  if what.startswith("local"):
    kwargs = {**kwargs, "head_dim": head_dim}
  elif d_model != num_heads * head_dim:
    raise ValueError(f"fla.layers.PaTHAttention needs head_dim = d_model / num_heads, "
                     f"got {d_model} / {num_heads} != {head_dim}")
  _, Model = _modules()
  cfg = dict(vocab_size=vocab_size, num_layers=num_layers, d_model=d_model,
             num_heads=num_heads, mlp_dim=mlp_dim, forget_gate=forget_gate)
  return Model(cfg, attn_cls, kwargs).to(device), what


def count_params(model) -> tuple[int, int]:
  """(all parameters, the embedding table's)."""
  return (sum(p.numel() for p in model.parameters()), model.embed.weight.numel())


def make_optimizer(model, train_cfg):
  """AdamW (fused on CUDA) + the JAX schedule: linear warmup from 0, cosine to 10% of the peak.
  Weight decay on matrices (as experiments/train.py's mask: kernels and the embedding)."""
  import torch
  decay, no_decay = [], []
  for name, p in model.named_parameters():
    (decay if name.endswith(DECAYED) else no_decay).append(p)
  t = train_cfg
  opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                           {"params": no_decay, "weight_decay": 0.0}], lr=t.learning_rate,
                          betas=(0.9, 0.95), eps=1e-8, fused=next(model.parameters()).is_cuda)

  def factor(step):  # optax.warmup_cosine_decay_schedule(0, lr, warmup, steps, 0.1 lr) / lr
    if step < t.warmup_steps:
      return step / max(t.warmup_steps, 1)
    frac = min((step - t.warmup_steps) / max(t.steps - t.warmup_steps, 1), 1.0)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

  return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def to_torch_batch(batch: dict, *, device: str, varlen: bool) -> dict:
  """A packed numpy batch -> tensors; varlen flattens rows into one sequence with cu_seqlens at
  every document start (a row start is always one)."""
  import torch
  seg = np.asarray(batch["segment_ids"])
  starts = np.ones_like(seg, dtype=bool)
  starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
  doc = np.cumsum(starts.reshape(-1)).reshape(seg.shape).astype(np.int64)
  shape = (1, seg.size) if varlen else seg.shape
  if not varlen:  # no document boundaries: one document per row
    doc = np.zeros(seg.shape, np.int64)
  out = {k: torch.as_tensor(np.asarray(batch[k]).reshape(shape)).to(device)
         for k in ("tokens", "targets", "loss_mask")}
  out["tokens"], out["targets"] = out["tokens"].long(), out["targets"].long()
  out["doc"] = torch.as_tensor(np.ascontiguousarray(doc).reshape(shape)).to(device)
  out["cu_seqlens"] = None
  if varlen:
    cu = np.concatenate([np.flatnonzero(starts.reshape(-1)), [seg.size]]).astype(np.int64)
    out["cu_seqlens"] = torch.as_tensor(cu).to(device)
  return out


def make_train_step(model, opt, sched, *, dtype: str, grad_clip: float):
  """step(batch) -> loss tensor (not synchronised): forward, masked mean cross-entropy (as
  experiments/evaluate.loss_and_metrics), backward, clipping, AdamW."""
  import torch
  import torch.nn.functional as F
  device = next(model.parameters()).device.type
  autocast_dtype = {"bfloat16": torch.bfloat16, "float32": None}[dtype]
  params = [p for p in model.parameters()]

  def step(b):
    with torch.autocast(device, dtype=autocast_dtype or torch.float32,
                        enabled=autocast_dtype is not None):
      logits = model(b["tokens"], doc_NT=b["doc"], cu_seqlens=b["cu_seqlens"])
    ce = F.cross_entropy(logits.float().flatten(0, 1), b["targets"].flatten(), reduction="none")
    mask = b["loss_mask"].flatten().float()
    loss = (ce * mask).sum() / mask.sum().clamp_min(1.0)
    loss.backward()
    if grad_clip > 0:
      torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()

  return step


# --- one benchmark row (experiments/benchmarks/train_throughput.py's --one fla_path*) ---


def run_row(*, name: str, seq_len: int, batch: int, size, dtype: str, schedule,
            peak_tflops: float | None, measured_tflops: float | None, varlen: bool) -> dict:
  """The same measurement of the PyTorch model around FLA's PaTH kernel (needs CUDA); size and
  schedule are train_throughput's Size and Schedule."""
  try:
    import torch
  except ImportError as e:
    raise ImportError(f"the FLA anchor needs torch, triton, fla-core 0.6.0 and CUDA: {e}") from e
  anchor = sys.modules[__name__]
  if not torch.cuda.is_available():
    raise RuntimeError("the FLA anchor needs a CUDA GPU (FLA's kernels are Triton)")
  mlp_dim = model_lib.ModelConfig(vocab_size=size.vocab_size, d_model=size.d_model).mlp_width
  torch.manual_seed(0)
  model, layer = anchor.build_model(
      vocab_size=size.vocab_size, num_layers=size.num_layers, d_model=size.d_model,
      num_heads=size.num_heads, head_dim=size.head_dim, mlp_dim=mlp_dim,
      forget_gate=name == "fla_path_fox", device="cuda")
  train_cfg = base.get_config().train
  opt, sched = anchor.make_optimizer(model, train_cfg)
  step = anchor.make_train_step(model, opt, sched, dtype=dtype, grad_clip=train_cfg.grad_clip)
  host_batches, more = text_batches(seq_len=seq_len, batch=batch, count=schedule.num_batches)
  batches = [anchor.to_torch_batch(b, device="cuda", varlen=varlen) for b in host_batches]
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  losses, step_s, compile_s = [], [], None
  # Every step sees a new batch, as in training (and as the JAX rows do): cu_seqlens differ per
  # batch, so whatever FLA builds per batch on first sight is part of its step time.
  for i in range(steps_to_run(schedule) + 1):  # step 0: Triton JIT + autotuning ("compile")
    b = batches[i] if i < len(batches) else anchor.to_torch_batch(next(more), device="cuda",
                                                                  varlen=varlen)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = step(b)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if i == 0:
      compile_s = dt
    elif schedule.warmup < i <= schedule.warmup + schedule.steps:
      step_s.append(dt)
    if i < schedule.loss_steps:
      losses.append(float(loss))
  total, embedding = anchor.count_params(model)
  flops = train_flops(family="path", dense_params=total - embedding, num_layers=size.num_layers,
                      num_heads=size.num_heads, head_dim=size.head_dim, seq_len=seq_len,
                      batch=batch)
  import triton
  import fla
  return dict(
      compile_s=compile_s, params=total, params_dense=total - embedding, kernels=[],
      attention_impl="fla (" + layer + (", cu_seqlens" if varlen else ", no doc mask") + ")",
      peak_gib=torch.cuda.max_memory_allocated() / 2**30,
      device_kind=torch.cuda.get_device_name(),
      jax_version=None, torch_version=torch.__version__, triton_version=triton.__version__,
      fla_version=getattr(fla, "__version__", None), fla_varlen=varlen,
      warmup_steps=schedule.warmup,
      **timing_fields(step_s, tokens=batch * seq_len, flops=flops, peak_tflops=peak_tflops,
                      measured_tflops=measured_tflops),
      **loss_summary(losses))
