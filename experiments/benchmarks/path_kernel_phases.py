"""Where the PaTH kernel's time goes, on one GPU: each phase jitted and timed alone.

  python experiments/benchmarks/path_kernel_phases.py --cases 0,3 --prepass split_bf16,fold_bf16
  python experiments/benchmarks/path_kernel_phases.py --cases 3 --prepass split_bf16x3 --force-prepass

Phases: the pre-pass (forward), the forward kernel, the dk/dv kernel, the dq/dP kernel, the
pre-pass VJP (recompute + pullback), and the whole fwd+bwd for comparison. bf16, median ms;
one JSON line per (case, pre-pass variant) and a table last. --gate adds a log forget gate
(PaTH-FoX) to every phase; --kv-heads K < H runs grouped-query heads. --trace DIR also profiles
three whole fwd+bwd calls (jax.profiler) and lists every device kernel's ms per call: the split
the phases cannot give (inverse vs operands kernels, XLA's fusions).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.benchmarks.path_kernel import (OUT, _inputs, _median_ms,  # noqa: E402
                                                _prepass_as_requested, case_label, case_shape)


PHASES = ("prepass", "fwd_kernel", "dkv_kernel", "dq_kernel", "prepass_vjp", "fwd_bwd")
# BlockSizes(bwd_spans=True): the span-parallel backward's launches take the place of dkv_kernel
# and dq_kernel (calls_span.py, in launch order)
SPAN_PHASES = ("span_boundary", "span_far_dq", "span_far_dkv", "span_y", "span_bwd")


def _block_sizes(spec):
  """"dq_pairs=0,prepass_keep_inverse=true" -> BlockSizes keyword arguments (ints, booleans,
  else strings: posenc_jax._checks.kernel_options, as the model's "pallas:..." options)."""
  from posenc_jax._checks import kernel_options
  return kernel_options(spec)


def case_phases(ci, backend="gpu", variant=None, kv_heads=None, bs_spec="",
                phases=PHASES, reps=10, trace_dir=None, gate=False):
  import jax
  import jax.numpy as jnp
  from kernels_pallas.path_attention import api, calls, prepass, routing
  B, T, H, D = case_shape(ci)
  ci = case_label(ci)
  K = kv_heads or H
  q, k, v, w, beta, log_forget, do = _inputs(B, T, H, D)
  k, v, w, beta = k[:, :, :K], v[:, :, :K], w[:, :, :K], beta[:, :, :K]
  log_forget = log_forget if gate else None   # PaTH-FoX: the gate's share of every phase
  bs = calls.BlockSizes(**({"prepass": variant} if variant else {}), **_block_sizes(bs_spec))
  variant = bs.prepass
  cfg = api._Config(scale=D ** -0.5, T=T, backend=backend, block_sizes=bs)
  kw = dict(scale=cfg.scale, precision=None, backend=backend, bs=bs)
  args = (q, k, v, w, beta, log_forget)
  prepare = lambda *a: api._prepare(cfg, *a, None)   # the pre-pass the kernel itself runs
  prep = jax.jit(prepare)
  ops = prep(*args)
  fwd = jax.jit(lambda ops: calls.forward(ops, **kw))
  o, lse = fwd(ops)
  C, n = bs.block_q, ops.q.shape[2]
  do_b = prepass.chunked(prepass.pad_time(do, n * C), C)   # as api._attend_bwd passes it
  delta = prepass.heads_major(jnp.sum(o.astype(jnp.float32) * do_b.astype(jnp.float32), -1,
                                      keepdims=True))   # [B, H, n, C, 1], as lse
  span, kw["bs"] = routing.span_backward(ops, bs, backend)   # as calls.backward routes it
  if span:
    timed_span = _span_phases(ops, do_b, lse, delta, span=span, **kw)
    phases = [p for p in phases if p not in ("dkv_kernel", "dq_kernel")] + list(SPAN_PHASES)
  else:
    dq = jax.jit(lambda *a: calls.backward_dq(*a, **kw))
    qb = dq(ops, do_b, lse, delta).get("qb")   # the boundary states dk/dv reads (dkv_span)
    dkv = jax.jit(lambda *a: calls.backward_dkv(*a, qb=qb, **kw))
  ct = ops  # any cotangent of the right structure times the pullback

  def vjp(a, ct):
    _, pull = jax.vjp(prepare, *a)
    return pull(ct)

  pull = jax.jit(vjp)
  whole = jax.jit(jax.grad(lambda *a: jnp.sum(api.path_attention(
      *a, backend=backend, block_sizes=bs).astype(jnp.float32) * do),
      argnums=tuple(range(6 if gate else 5))))
  row = dict(case=ci, B=B, T=T, H=H, K=K, D=D, variant=variant, bs=bs_spec, gate=gate)

  def med(f, *a, n=reps):  # reps 0: one call, no timing (for a profiler: one launch per kernel)
    if not n:
      jax.block_until_ready(f(*a))
      return float("nan")
    return _median_ms(f, *a, n=n)

  timed = dict(prepass=lambda: med(prep, *args), fwd_kernel=lambda: med(fwd, ops),
               prepass_vjp=lambda: med(pull, args, ct),
               fwd_bwd=lambda: med(whole, *args, n=min(reps, 5)))
  if span:
    timed.update({name: (lambda f=f, a=a: med(f, *a)) for name, (f, a) in timed_span.items()})
  else:
    timed.update(dkv_kernel=lambda: med(dkv, ops, do_b, lse, delta),
                 dq_kernel=lambda: med(dq, ops, do_b, lse, delta))
  for name in phases:
    row[name] = timed[name]()
  if trace_dir:  # every kernel of the whole fwd+bwd, by name (the phases above cannot split one)
    from experiments.benchmarks.step_profile import top_ops
    jax.block_until_ready(whole(*args))
    tag = (bs_spec or "default").replace(",", "_").replace("=", "-") + ("_gate" if gate else "")
    run_dir = os.path.join(trace_dir, f"case{ci}_{tag}")
    with jax.profiler.trace(run_dir, create_perfetto_trace=True):
      for _ in range(3):
        jax.block_until_ready(whole(*args))
    row["kernels"] = [(name[:60], round(ms, 3), calls)
                      for name, ms, calls in top_ops(run_dir, steps=3, k=40)]
  row = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
  print(json.dumps(row), flush=True)
  return row


def _span_phases(ops, do_b, lse, delta, *, span, scale, precision, backend, bs):
  """{phase: (jitted launch, its arguments)} of calls_span.backward, each fed the outputs of
  the launches before it."""
  import jax
  from kernels_pallas.path_attention import calls_span
  nb = (ops.q.shape[2] - 1) // span
  kw = dict(precision=precision, backend=backend, bs=bs)
  boundary = jax.jit(lambda ops: calls_span._boundary(ops, span=span, nb=nb, **kw))
  kb, pi = boundary(ops)
  far_dq = jax.jit(lambda *a: calls_span._far_dq(*a, scale=scale, span=span, nb=nb, **kw))
  qb, a, *_ = far_dq(ops, do_b, lse, delta, kb, pi)
  far_dkv = jax.jit(lambda *a: calls_span._far_dkv(*a, scale=scale, span=span, **kw))
  y = jax.jit(lambda qb, a: calls_span.far_queries_y(qb, a, K=ops.k.shape[1], n=ops.q.shape[2],
                                                      chunk=ops.q.shape[3], span=span,
                                                      precision=precision, backend=backend,
                                                      bs=bs))
  whole = jax.jit(lambda *a: calls_span.backward(*a, scale=scale, span=span, **kw))
  return dict(span_boundary=(boundary, (ops,)),
              span_far_dq=(far_dq, (ops, do_b, lse, delta, kb, pi)),
              span_far_dkv=(far_dkv, (ops, do_b, lse, delta, kb, qb)),
              span_y=(y, (qb, a)),
              span_bwd=(whole, (ops, do_b, lse, delta)))   # all five (the span kernel: the rest)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--cases", default="0,3",
                 help="comma-separated indices into path_kernel.CASES, or shapes BxTxHxD")
  p.add_argument("--backend", default="gpu", help="interpret: a CPU smoke run of the script")
  p.add_argument("--prepass", default="",
                 help="comma-separated pre-pass variants (default: BlockSizes' default)")
  p.add_argument("--force-prepass", action="store_true",
                 help="run the requested pre-pass variant where usable_variant would route the "
                      "shape to the jnp one (shared memory): does it build, what does it gain")
  p.add_argument("--kv-heads", type=int, default=None, help="K < H: grouped-query heads")
  p.add_argument("--gate", action="store_true", help="PaTH-FoX: a log forget gate too")
  p.add_argument("--bs", action="append", default=None,
                 help="BlockSizes overrides, e.g. dq_pairs=0,bwd_num_warps=8; repeat to compare")
  p.add_argument("--phases", default=",".join(PHASES), help="which phases to time")
  p.add_argument("--reps", type=int, default=10,
                 help="timed calls per phase; 0: one untimed call each (under ncu)")
  p.add_argument("--trace", default=None,
                 help="also trace 3 whole fwd+bwd calls here and list every kernel's ms per call")
  a = p.parse_args()
  rows = []
  for c in a.cases.split(","):
    for variant in a.prepass.split(",") if a.prepass else [None]:
      for spec in a.bs or [""]:
        try:  # a configuration that does not build (e.g. shared memory) is reported, not fatal
          with _prepass_as_requested(a.force_prepass):
            rows.append(case_phases(c, a.backend, variant, a.kv_heads, spec,
                                    a.phases.split(","), a.reps, a.trace, a.gate))
        except Exception as e:
          print(json.dumps(dict(case=case_label(c), prepass=variant, bs=spec, error=type(e).__name__
                                + ": " + str(e).splitlines()[0][:300])), flush=True)
  with open(os.path.join(OUT, "path_kernel_phases.json"), "w") as f:
    json.dump(rows, f, indent=1)
  for r in rows:
    for name, ms, calls in r.pop("kernels", []):
      tag = (r['bs'] or 'default') + (' gate' if r['gate'] else '')
      print(f"case {r['case']} {tag}: {ms:8.3f} ms  x{calls}  {name}")
  keys = [k for k in rows[0] if k not in ("B", "T", "H", "K", "D")] if rows else []
  print("| " + " | ".join(keys) + " |")
  for r in rows:
    print("| " + " | ".join(str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
  main()
