"""Our Pallas PaTH kernel against flash-linear-attention's (fla-core 0.6.0, `parallel_path_attn`)
on identical inputs: the forward and every gradient, each side also measured against the
float32 dense oracle (householder.path_attention_reference on upcast inputs, highest precision),
with and without the forget gate, with grouped kv heads, and with packed documents (ours:
segment_ids; FLA: cu_seqlens, which needs B = 1).

  python experiments/benchmarks/fla_parity.py            # GPU with torch and fla-core
  python experiments/benchmarks/fla_parity.py --small    # CPU: ours in interpret mode only
  (also the last rows of `path_kernel.py --part check`)

FLA's gate is passed as common.fla_gate(log f, scale) = log f / scale: FLA scales the gate's
prefix sums with the logits, so the gradient of our log f is FLA's dg / scale. bf16 q, k, v,
dO are the same bf16 numbers on both sides (bf16 -> float32 is exact); w, beta, log f are
float32 as both kernels want them. One JSON line per case: relative RMS errors (ours vs oracle,
FLA vs oracle, ours vs FLA) of o, dq, dk, dv, dw, dbeta, dlog_f, and the plan our kernel ran.
docs/benchmarks/fla_parity.md has the current table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kernels_pallas as kp  # noqa: E402
from experiments.benchmarks import common  # noqa: E402
from posenc_jax import householder  # noqa: E402

# B, T, H (query heads), K (kv heads), D, gate, packed documents
CASES = [(2, 1024, 4, 4, 64, False, False), (2, 1024, 4, 4, 64, True, False),
         (2, 777, 4, 2, 64, True, False), (1, 1024, 4, 2, 128, True, True)]
SMALL = [(2, 70, 2, 2, 16, False, False), (1, 77, 4, 2, 32, True, True)]   # CPU, interpret
NAMES = ("o", "dq", "dk", "dv", "dw", "dbeta", "dlog_f")


def make_inputs(B, T, H, K, D, gate, segments, *, seed=0):
  """-> dict of numpy arrays: q, k, v, do (bf16 values held as float32), w (unit rows), beta in
  (0, 2), log_f = log U(0.9, 1) or None, seg [B, T] int32 (three documents) or None."""
  ks = jax.random.split(jax.random.key(seed), 7)
  bf = lambda k_, shape: np.asarray(jax.random.normal(k_, shape, jnp.bfloat16), np.float32)
  w = np.asarray(jax.random.normal(ks[3], (B, T, K, D), jnp.float32))
  seg = None
  if segments:  # three documents of uneven length
    cuts = np.array([0, T // 5, (3 * T) // 5, T])
    seg = np.repeat(np.arange(3, dtype=np.int32), np.diff(cuts))[None].repeat(B, 0)
  return dict(
      q=bf(ks[0], (B, T, H, D)), k=bf(ks[1], (B, T, K, D)), v=bf(ks[2], (B, T, K, D)),
      w=w / np.linalg.norm(w, axis=-1, keepdims=True),
      beta=2 * np.asarray(jax.random.uniform(ks[4], (B, T, K), jnp.float32)),
      log_f=np.log(np.asarray(jax.random.uniform(ks[5], (B, T, H), jnp.float32, 0.9, 1.0)))
      if gate else None,
      seg=seg, do=bf(ks[6], (B, T, H, D)))


def _args(x):
  return [x[n] for n in ("q", "k", "v", "w", "beta", "log_f") if x[n] is not None]


def _ours_args(x):
  seg = None if x["seg"] is None else jnp.asarray(x["seg"])
  cast = [jnp.bfloat16] * 3 + [jnp.float32] * 3
  return [jnp.asarray(a, t) for a, t in zip(_args(x), cast)], seg


def ours(x, *, backend=None):
  """Our kernel (bf16 q, k, v): o and the gradients of sum(o * dO), as float32 numpy."""
  args, seg = _ours_args(x)
  f = lambda *a: kp.path_attention(*a, segment_ids=seg, backend=backend)
  o, vjp = jax.vjp(f, *args)
  grads = vjp(jnp.asarray(x["do"], o.dtype))
  return [np.asarray(t, np.float32) for t in (o, *grads)]


def plan(x, *, backend=None) -> str:
  """The plan our kernel runs on these inputs."""
  args, seg = _ours_args(x)
  return str(kp.explain(*args, segment_ids=seg, backend=backend))


def oracle(x):
  """The dense float32 reference on the same numbers, highest matmul precision."""
  seg = None if x["seg"] is None else jnp.asarray(x["seg"])
  D = x["q"].shape[-1]
  args = [jnp.asarray(a, jnp.float32) for a in _args(x)]
  gate = x["log_f"] is not None
  f = lambda *a: householder.path_attention_reference(
      *a[:5], log_forget=a[5] if gate else None, segment_ids=seg, scale=D ** -0.5)
  with jax.default_matmul_precision("highest"):
    o, vjp = jax.vjp(f, *args)
    grads = vjp(jnp.asarray(x["do"], jnp.float32))
  return [np.asarray(t, np.float32) for t in (o, *grads)]


def fla(x):
  """FLA's parallel_path_attn on the same numbers (torch, CUDA): o and the same gradients."""
  # torch and fla are imported here only: the JAX side and the --small run go without them
  import torch
  from fla.ops.path_attn.parallel import parallel_path_attn
  dev = "cuda"
  D = x["q"].shape[-1]
  scale = D ** -0.5
  t = lambda a, dt: torch.tensor(a, device=dev, dtype=torch.float32).to(dt).requires_grad_(True)
  q, k, v = (t(x[n], torch.bfloat16) for n in ("q", "k", "v"))
  w, beta = t(x["w"], torch.float32), t(x["beta"], torch.float32)
  ins = [q, k, v, w, beta]
  g = None
  if x["log_f"] is not None:
    log_f = t(x["log_f"], torch.float32)
    g = common.fla_gate(log_f, scale)
    ins.append(log_f)
  cu = None
  if x["seg"] is not None:  # B = 1: document boundaries -> cu_seqlens
    s = x["seg"][0]
    starts = np.flatnonzero(np.diff(s)) + 1
    cu = torch.tensor(np.concatenate([[0], starts, [len(s)]]), device=dev, dtype=torch.long)
  o, _ = parallel_path_attn(q, k, v, w, beta, g, scale=scale, cu_seqlens=cu)
  do = torch.tensor(x["do"], device=dev, dtype=torch.float32).to(o.dtype)
  grads = torch.autograd.grad(o, ins, do)   # through g = log_f / scale: the chain rule is done
  return [a.detach().float().cpu().numpy() for a in (o, *grads)]


def _errors(names, got, want) -> dict:
  return {n: f"{common.rel_rms(a, b):.1e}" for n, a, b in zip(names, got, want)}


def case_row(case, *, backend=None, with_fla=True, seed=0):
  B, T, H, K, D, gate, segments = case
  x = make_inputs(B, T, H, K, D, gate, segments, seed=seed)
  names = NAMES[:6 + gate]
  row = dict(part="fla_parity", shape=(B, T, H, K, D), gate=gate, segments=segments,
             plan=plan(x, backend=backend))
  ref = oracle(x)
  sides = {"ours": lambda: ours(x, backend=backend)}
  if with_fla:
    sides["fla"] = lambda: fla(x)
  got = {}
  for side, run in sides.items():
    try:  # one side failing (no torch, no CUDA, a kernel error) does not hide the other
      got[side] = run()
      row[f"{side}_vs_oracle"] = _errors(names, got[side], ref)
    except Exception as e:
      row[f"{side}_error"] = type(e).__name__ + ": " + (str(e).splitlines() or [""])[0][:200]
  if len(got) == 2:
    row["ours_vs_fla"] = _errors(names, got["ours"], got["fla"])
  print(json.dumps(row), flush=True)
  return row


def run(cases=CASES, **kw):
  return [case_row(c, **kw) for c in cases]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--small", action="store_true",
                 help="CPU: small shapes, our kernel in interpret mode, no FLA")
  a = p.parse_args()
  if a.small:
    rows = run(SMALL, backend="interpret", with_fla=False)
  else:
    rows = run()
  with open(os.path.join(os.environ.get("OUT", "."), "fla_parity.json"), "w") as f:
    json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
