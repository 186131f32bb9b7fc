"""Two checkouts of this repository side by side in one process: are a refactor's outputs and
gradients bitwise the same, and is it as fast?

  python -m experiments.benchmarks.tree_ab --baseline DIR [--part kernel|model] [--cases ...]

DIR is another checkout (e.g. `git worktree add DIR REV`); its kernels_pallas and posenc_jax are
copied to a temporary directory as kernels_pallas_base / posenc_jax_base (their imports renamed)
and imported beside this tree's. Both then run the same inputs:

  kernel: PaTH forward+backward at the anchor shapes (bf16, the default plan, w and beta as the
          anchors draw them): bitwise comparison of the output and the five gradients, then
          forward and forward+backward ms, the two trees' calls interleaved (median of --reps);
  model:  the 12-layer, 768-wide, 12 x 64-head bf16 model's training step (loss, gradients and
          an AdamW update) at T 2048, batch 16, for each --encodings: loss and gradients
          compared bitwise, then ms a step interleaved.

One JSON line per row, and a table last. Interleaving makes the ratio robust to the machine's
drift; run it on one GPU (the Pallas kernels need one).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import kernels_pallas as kp_new
import posenc_jax as pj_new

ANCHORS = ((4, 16384, 16, 128), (32, 2048, 32, 64), (8, 4096, 16, 128), (32, 4096, 32, 64),
           (8, 8192, 32, 64))


def import_baseline(root: str, *, model: bool):
  """kernels_pallas_base (and with `model` posenc_jax_base) from the checkout at root, imported
  under those names (every import of either package inside them renamed)."""
  tmp = tempfile.mkdtemp(prefix="tree_ab_")
  rename = lambda text: re.sub(r"\bposenc_jax\b", "posenc_jax_base",
                               re.sub(r"\bkernels_pallas\b", "kernels_pallas_base", text))
  for pkg in ("kernels_pallas", "posenc_jax"):
    for dirpath, _, files in os.walk(os.path.join(root, pkg)):
      rel = os.path.relpath(dirpath, root).replace(pkg, pkg + "_base", 1)
      os.makedirs(os.path.join(tmp, rel), exist_ok=True)
      for name in files:
        if name.endswith(".py"):
          with open(os.path.join(dirpath, name)) as f:
            text = rename(f.read())
          with open(os.path.join(tmp, rel, name), "w") as f:
            f.write(text)
  sys.path.insert(0, tmp)
  return (importlib.import_module("kernels_pallas_base"),
          importlib.import_module("posenc_jax_base") if model else None)


def compare(a, b) -> dict:
  """Bitwise equality of two arrays, and where they differ, how much."""
  a, b = np.asarray(a), np.asarray(b)
  same = a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
  out = dict(bitwise=bool(same))
  if not same:
    x, y = a.astype(np.float64), b.astype(np.float64)
    out.update(differ=int(np.sum(x != y)), rel_rms=float(
        np.sqrt(np.sum((x - y) ** 2) / max(np.sum(y ** 2), 1e-300))))
  return out


def timed_pair(f_new, f_old, args, reps: int):
  """Median wall ms of f_new(*args) and f_old(*args), calls interleaved."""
  for f in (f_new, f_old):
    jax.block_until_ready(f(*args))
  t = {"new": [], "old": []}
  for _ in range(reps):
    for name, f in (("new", f_new), ("old", f_old)):
      start = time.perf_counter()
      jax.block_until_ready(f(*args))
      t[name].append(1e3 * (time.perf_counter() - start))
  return float(np.median(t["new"])), float(np.median(t["old"]))


def anchor_inputs(B, T, H, D, seed=0):
  """q, k, v (bf16), w (unit rows), beta in (0, 2) (float32), dO (bf16), as the anchors draw."""
  ks = jax.random.split(jax.random.key(seed), 6)
  q, k, v, do = (jax.random.normal(ks[i], (B, T, H, D), jnp.bfloat16) for i in (0, 1, 2, 5))
  w = jax.random.normal(ks[3], (B, T, H, D), jnp.float32)
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  beta = 2.0 * jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32))
  return q, k, v, w, beta, do


def part_kernel(kp_new, kp_old, cases, reps, *, interpret=False):
  rows = []
  for B, T, H, D in cases:
    q, k, v, w, beta, do = anchor_inputs(B, T, H, D)
    args = (q, k, v, w, beta)

    def programs(kp):
      attend = lambda *a: kp.path_attention(*a, interpret=interpret)
      fwd = jax.jit(attend)

      @jax.jit
      def both(*a):
        o, pull = jax.vjp(attend, *a)
        return (o,) + pull(do)
      return fwd, both

    (fwd_new, both_new), (fwd_old, both_old) = programs(kp_new), programs(kp_old)
    outs_new, outs_old = both_new(*args), both_old(*args)
    names = ("o", "dq", "dk", "dv", "dw", "dbeta")
    row = dict(part="kernel", shape=[B, T, H, D],
               plan=str(kp_new.explain(*args, interpret=interpret)),
               compare={n: compare(a, b) for n, a, b in zip(names, outs_new, outs_old)})
    del outs_new, outs_old
    row["fwd_ms_new"], row["fwd_ms_old"] = timed_pair(fwd_new, fwd_old, args, reps)
    row["fwdbwd_ms_new"], row["fwdbwd_ms_old"] = timed_pair(both_new, both_old, args, reps)
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def model_step(pj, encoding, *, T, batch, layers=12, d_model=768, seed=0):
  """(jitted step(params, opt_state, tokens) -> (loss, grads, params, opt_state), its
  arguments) of the 12-layer model in package pj (posenc_jax or its baseline copy)."""
  model_lib = importlib.import_module(pj.__name__ + ".model")
  cfg = model_lib.ModelConfig(vocab_size=256, encoding=encoding, num_layers=layers,
                              d_model=d_model, num_heads=d_model // 64, head_dim=64,
                              dtype="bfloat16")
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(params=seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adamw(1e-4)
  tokens = jax.random.randint(jax.random.key(seed + 1), (batch, T + 1), 0, 256)

  @jax.jit
  def step(params, opt_state, tokens):
    def loss_fn(params):
      logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1], train=True)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return loss, grads, optax.apply_updates(params, updates), opt_state

  return step, (params, tx.init(params), tokens)


def part_model(pj_new, pj_old, encodings, T, batch, reps, **sizes):
  rows = []
  for encoding in encodings:
    step_new, args_new = model_step(pj_new, encoding, T=T, batch=batch, **sizes)
    step_old, args_old = model_step(pj_old, encoding, T=T, batch=batch, **sizes)
    t0 = time.perf_counter()
    loss_n, grads_n, *_ = jax.block_until_ready(step_new(*args_new))
    compile_new = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss_o, grads_o, *_ = jax.block_until_ready(step_old(*args_old))
    compile_old = time.perf_counter() - t0
    flat_n, flat_o = jax.tree.leaves(grads_n), jax.tree.leaves(grads_o)
    diffs = [compare(a, b) for a, b in zip(flat_n, flat_o)]
    row = dict(part="model", encoding=encoding, T=T, batch=batch,
               loss=compare(loss_n, loss_o), grads_bitwise=sum(d["bitwise"] for d in diffs),
               grads=len(diffs), first_step_s_new=round(compile_new, 1),
               first_step_s_old=round(compile_old, 1))
    del grads_n, grads_o
    step = lambda f, a: (lambda: f(*a))
    row["step_ms_new"], row["step_ms_old"] = timed_pair(step(step_new, args_new),
                                                        step(step_old, args_old), (), reps)
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def table(rows) -> str:
  lines = ["| what | bitwise | fwd ms new / old | fwd+bwd (step) ms new / old | new / old |",
           "|---|---|---|---|---|"]
  for r in rows:
    if r["part"] == "kernel":
      same = all(c["bitwise"] for c in r["compare"].values())
      lines.append(f"| {','.join(map(str, r['shape']))} | {'yes' if same else 'NO'} | "
                   f"{r['fwd_ms_new']:.2f} / {r['fwd_ms_old']:.2f} | "
                   f"{r['fwdbwd_ms_new']:.2f} / {r['fwdbwd_ms_old']:.2f} | "
                   f"{r['fwdbwd_ms_new'] / r['fwdbwd_ms_old']:.3f} |")
    else:
      same = r["loss"]["bitwise"] and r["grads_bitwise"] == r["grads"]
      lines.append(f"| model {r['encoding']} T {r['T']} B {r['batch']} | "
                   f"{'yes' if same else 'NO'} ({r['grads_bitwise']}/{r['grads']}) | - | "
                   f"{r['step_ms_new']:.2f} / {r['step_ms_old']:.2f} | "
                   f"{r['step_ms_new'] / r['step_ms_old']:.3f} |")
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--baseline", required=True, help="another checkout of this repository")
  p.add_argument("--part", choices=("kernel", "model"), default="kernel")
  p.add_argument("--cases", default="0,1,2,3,4",
                 help="indices into ANCHORS, or shapes BxTxHxD")
  p.add_argument("--encodings", default="path", help="model part: comma-separated")
  p.add_argument("--seq_len", type=int, default=2048)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--layers", type=int, default=12, help="model part")
  p.add_argument("--d_model", type=int, default=768, help="model part (heads of 64)")
  p.add_argument("--interpret", action="store_true", help="kernel part on a CPU (a dry run)")
  p.add_argument("--out", default=None, help="also append the JSON lines here")
  a = p.parse_args()
  kp_old, pj_old = import_baseline(os.path.abspath(a.baseline), model=a.part == "model")
  if a.part == "kernel":
    cases = [tuple(int(x) for x in c.split("x")) if "x" in c else ANCHORS[int(c)]
             for c in a.cases.split(",")]
    rows = part_kernel(kp_new, kp_old, cases, a.reps, interpret=a.interpret)
  else:
    rows = part_model(pj_new, pj_old, a.encodings.split(","), a.seq_len, a.batch, a.reps,
                      layers=a.layers, d_model=a.d_model)
  if a.out:
    with open(a.out, "a") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  print(table(rows))
  shutil.rmtree(sys.path[0], ignore_errors=True)


if __name__ == "__main__":
  main()
