"""PaTH kernel benchmark on one GPU: this repository's Pallas kernel against cuDNN flash attention
(JAX) and flash-linear-attention's Triton PaTH kernel (PyTorch, fla-core 0.6.0), at the anchor
shapes (common.CASES). docs/benchmarks/path_kernel.md has the current table.

  python experiments/benchmarks/path_kernel.py --part check        # GPU correctness vs the dense
                                                                    # oracle, the correlated-w
                                                                    # rows, then ours vs FLA
  python experiments/benchmarks/path_kernel.py --part jax --cases 4,0,3,1,2 \
      --variants cudnn,path,path_fox
  python experiments/benchmarks/path_kernel.py --part jax --cases 4,8x8192x16x128 --variants path \
      --options "" --options span=8 --options "span=0,mosaic=false"
  python experiments/benchmarks/path_kernel.py --part fla --cases 4,0,3,1,2 --variants path
  python experiments/benchmarks/path_kernel.py --part jax --cases 3 --variants cudnn,fox,jax_mha
  python experiments/benchmarks/path_kernel.py --part jax --cases 4,0,3 --docs 512 \
      --variants cudnn,tapa,tapa_linear,tapa_auto,tapa_linear_auto

Variants of --part jax: cudnn (jax.nn.dot_product_attention), path, path_fox, fox (ours without
transport), sba (stick-breaking attention as implementation=None runs it on the device),
sba_dense (its T x T reference) and sba_pallas (its Pallas kernel; packed documents with
--docs), jax_mha (jax.experimental.pallas.ops.gpu.attention.mha: jax's own Pallas flash
attention, what Pallas on Triton reaches), jax_mgpu (its Mosaic GPU flash attention, forward
only where causal);
cudnn_nc, jax_mha_nc, jax_mgpu_nc without the causal mask; tapa, tapa_linear (TAPA on its
Pallas kernel, alpha 0.1, theta 0.5) and tapa_auto, tapa_linear_auto (what implementation=None
runs); grape_ap (GRAPE-AP on its Pallas kernel through attention.path_integral_attention, the
model's 16-channel RMS-normalised probes, differentiated too); grape_a (GRAPE-A, both gates
from q and k, on its Pallas kernel, implementation=None's choice on a GPU) and grape_a_lift
(the same lifted into extra q / k channels on cuDNN). Each --options string
(kp.BlockSizes fields, "key=value,..."; repeat the flag to compare several, "" the defaults)
runs every one of our variants (path, path_fox, fox) once, as
"path[span=8]" etc.; each such row holds the plan it ran (str(kp.explain(...))), which is also
printed.

Times: median ms of repeated runs after warm-up (JAX: wall clock around block_until_ready, the
anchors' convention; torch: triton.testing.do_bench, device time by CUDA events). Each side
also gets the other's measure: JAX `*_dev_ms`, device time a call from calls dispatched back to
back (common.pipelined_ms); FLA `fwdbwd_wall_ms`, wall clock around a synchronized call.
Memory: JAX compiled memory_analysis (arguments + outputs + temporaries) of the whole step;
torch max_memory_allocated. One JSON line per variant as it finishes, one per case, a table
last; all rows to OUT/path_kernel_PART.json (--out, default $OUT or .).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas.ops.gpu import attention as jax_attention  # noqa: E402
from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: E402

import kernels_pallas as kp  # noqa: E402
from experiments.benchmarks import common  # noqa: E402
from experiments.benchmarks import fla_parity  # noqa: E402
from posenc_jax import attention  # noqa: E402
from posenc_jax import dispatch  # noqa: E402
from posenc_jax import grape_a  # noqa: E402
from posenc_jax import householder  # noqa: E402
from posenc_jax import unipotent  # noqa: E402

OURS = ("path", "path_fox", "fox")
# TAPA on its Pallas kernel (quadratic and linear phase) and as implementation=None runs it
TAPA = ("tapa", "tapa_linear", "tapa_auto", "tapa_linear_auto")
# SBA as implementation=None runs it (sba), its T x T reference (sba_dense) and its Pallas
# kernel (sba_pallas): dispatch.SBA_GPU_KERNEL_MIN_T comes from these
SBA = {"sba": None, "sba_dense": "reference", "sba_pallas": "pallas"}
VARIANTS = OURS + TAPA + ("grape_ap", "grape_a", "grape_a_lift", *SBA, "cudnn", "jax_mha",
                          "jax_mgpu", "cudnn_nc", "jax_mha_nc", "jax_mgpu_nc")
# jax's Mosaic GPU flash attention's tiles, tried in this order until one fits shared memory
# (its backward needs all four backward blocks; jax 0.10-0.11 have no causal backward)
MGPU_TILES = ((64, 128, 64, 128, 64, 128), (64, 64, 64, 64, 64, 64))
# --part check: (dtype, (B, T, H, K, D), gate, segments, kernel options). The plans differ
# row by row (float32 with grouped heads takes the jnp pre-pass, without them a kernel); the
# last rows set each option away from the plan's choice at these shapes.
CHECK_ROWS = (
    (jnp.float32, (2, 300, 4, 2, 64), True, True, ""),
    (jnp.float32, (2, 300, 4, 4, 64), True, True, ""),
    (jnp.bfloat16, (2, 1024, 4, 4, 64), True, False, ""),
    (jnp.bfloat16, (1, 1000, 4, 4, 128), False, True, ""),
    (jnp.bfloat16, (1, 1000, 4, 2, 128), False, True, ""),
    (jnp.bfloat16, (2, 1024, 4, 4, 64), True, True, "span=0"),
    (jnp.bfloat16, (1, 1000, 4, 4, 128), False, False, "mosaic=false"),
    (jnp.bfloat16, (2, 1024, 4, 2, 64), True, True, "prepass=split,keep_inverse=false"),
    (jnp.bfloat16, (1, 1000, 4, 4, 128), False, True, "span=8,keep_inverse=true"),
)


def _error(e: Exception) -> str:
  return type(e).__name__ + ": " + (str(e).splitlines() or [""])[0][:200]


def _join(*options: str) -> str:
  """Option strings, later keys winning (BlockSizes.of reads "a=1,a=2" as a=2)."""
  return ",".join(o for o in options if o)


def _print_plan(what: str, plan) -> None:
  print(f"plan of {what}:\n  " + str(plan).replace("\n", "\n  "), flush=True)


def _correlated_w(B, T, H, D, *, eps, beta, key=1):
  """w_t = normalize(a + eps n_t) (one a per row and head): the PaTH layer's w share a direction
  like this, which overflowed an in-kernel inverse in bf16 training once. beta: a number, or
  "u" for uniform in (0, 2)."""
  ka, kn, kb = jax.random.split(jax.random.key(key), 3)
  w = jax.random.normal(ka, (B, 1, H, D)) + eps * jax.random.normal(kn, (B, T, H, D))
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  if beta == "u":
    return w, 2 * jax.random.uniform(kb, (B, T, H))
  return w, jnp.full((B, T, H), float(beta), jnp.float32)


def _finite(*arrays) -> bool:
  return all(bool(np.isfinite(np.asarray(x, np.float32)).all()) for x in arrays)


def part_correlated(options="", B=4, T=2048, H=12, D=64):
  """bf16 inputs, w sharing a direction, beta 1, 2 or uniform: forward and gradients must be
  finite and match the float32 blockwise oracle (householder.path_attention_chunked:
  triangular solves, highest precision)."""
  q, k, v, _, _, _, do = common.inputs(B, T, H, D)
  bs = common.block_sizes(options)
  f = lambda *a: kp.path_attention(*a, block_sizes=bs)
  r = lambda *a: householder.path_attention_chunked(
      *(x.astype(jnp.float32) for x in a), scale=D ** -0.5)
  fwd_f, fwd_r = jax.jit(f), jax.jit(r)
  grad_f, grad_r = common.grad_fn(f, 5), common.grad_fn(r, 5)
  rows = []
  for eps in (1.0, 0.1, 0.01):
    for beta in (1, 2, "u"):
      w, b = _correlated_w(B, T, H, D, eps=eps, beta=beta)
      args = (q, k, v, w, b)
      row = dict(part="correlated", shape=(B, T, H, D), eps=eps, beta=beta, options=options)
      try:
        row["plan"] = str(kp.explain(*args, block_sizes=bs))
        o, g = fwd_f(*args), grad_f(*args, do)
        with jax.default_matmul_precision("highest"):
          o_r, g_r = fwd_r(*args), grad_r(*args, do)
        row.update(finite=_finite(o, *g), fwd=f"{common.rel_rms(o, o_r):.1e}",
                   grads=[f"{common.rel_rms(a, c):.1e}" for a, c in zip(g, g_r)])
      except Exception as e:
        row["error"] = _error(e)
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


def part_check(options=""):
  """Forward and every gradient vs the dense oracle on the GPU (CHECK_ROWS, each with `options`
  under its own); bitwise determinism; then the correlated-w rows (part_correlated) and ours
  against FLA on identical inputs (fla_parity)."""
  rows = []
  for dtype, (B, T, H, K, D), gate, seg, row_options in CHECK_ROWS:
    q, k, v, w, beta, g, do = common.inputs(B, T, H, D, kv_heads=K, dtype=dtype)
    g = g if gate else None
    segs = (jnp.arange(T)[None] * 3 // T).astype(jnp.int32).repeat(B, 0) if seg else None
    opts = _join(options, row_options)
    row = dict(dtype=jnp.dtype(dtype).name, shape=(B, T, H, K, D), gate=gate, seg=seg,
               options=opts)
    try:  # one failing configuration (e.g. a compile error) does not hide the others
      bs = common.block_sizes(opts)
      f = lambda *a: kp.path_attention(*a, segment_ids=segs, block_sizes=bs)
      r = lambda *a: householder.path_attention_reference(
          *a[:5], log_forget=a[5], segment_ids=segs, scale=D ** -0.5)
      args = (q, k, v, w, beta, g)
      row["plan"] = str(kp.explain(*args, segment_ids=segs, block_sizes=bs))
      n = 6 if gate else 5
      o, o_ref = jax.jit(f)(*args), jax.jit(r)(*args)
      grad_f = common.grad_fn(f, n)  # one compile for both runs of the determinism check
      g1, g_ref, g2 = (grad_f(*args, do), common.grad_fn(r, n)(*args, do),
                       grad_f(*args, do))
      row.update(fwd=f"{common.rel_rms(o, o_ref):.1e}",
                 grads=[f"{common.rel_rms(a, b):.1e}" for a, b in zip(g1, g_ref)],
                 bitwise_deterministic=all(bool(jnp.array_equal(a, b)) for a, b in zip(g1, g2)))
    except Exception as e:
      row["error"] = _error(e)
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows + part_correlated(options) + fla_parity.run()


def _jax_mha(q, k, v, causal=True):
  return jax_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal)


def _jax_mgpu(q, k, v, causal=True):
  """jax's Pallas Mosaic GPU flash attention (TMA, wgmma, warp specialisation): what Pallas on
  Mosaic GPU reaches, beside _jax_mha's Pallas on Triton. The first of MGPU_TILES that builds
  (its scale is 1/sqrt(D) inside)."""
  err = None
  for bq, bkv, bq_dkv, bkv_dkv, bq_dq, bkv_dq in MGPU_TILES:
    cfg = attention_mgpu.TuningConfig(
        block_q=bq, block_kv=bkv, max_concurrent_steps=2, causal=causal, block_q_dkv=bq_dkv,
        block_kv_dkv=bkv_dkv, block_q_dq=bq_dq, block_kv_dq=bkv_dq)
    try:
      return attention_mgpu.attention(q, k, v, cfg)
    except ValueError as e:   # shared memory: the next tiles
      err = e
  raise err


def _reference_fns(q, k, v, q16, k16, v16) -> dict:
  """The variants that are not ours: name -> (function, arguments)."""
  cudnn = lambda causal: lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, implementation="cudnn")
  return {
      "cudnn": (cudnn(True), (q, k, v)),
      "jax_mha": (_jax_mha, (q, k, v)),
      # float16: its kernel's output dtype is fixed; the tensor cores' rate is bf16's
      "jax_mgpu": (_jax_mgpu, (q16, k16, v16)),
      # "_nc": without the causal mask (jax_mgpu has no causal backward), the same FLOPs x2
      "cudnn_nc": (cudnn(False), (q, k, v)),
      "jax_mha_nc": (lambda q, k, v: _jax_mha(q, k, v, causal=False), (q, k, v)),
      "jax_mgpu_nc": (lambda q, k, v: _jax_mgpu(q, k, v, causal=False), (q16, k16, v16)),
  }


def _ours(name, bs, segs, q, k, v, w, beta, g):
  """One of our variants with BlockSizes bs: (function, arguments, plan)."""
  if name == "fox":
    fn = lambda q, k, v, g: kp.forgetting_attention(q, k, v, g, block_sizes=bs,
                                                    segment_ids=segs)
    return fn, (q, k, v, g), kp.explain(q, k, v, None, None, g, block_sizes=bs,
                                        segment_ids=segs)
  args = (q, k, v, w, beta) + ((g,) if name == "path_fox" else ())
  fn = lambda *a: kp.path_attention(*a, block_sizes=bs, segment_ids=segs)
  return fn, args, kp.explain(*args, block_sizes=bs, segment_ids=segs)


def _sba(segs, q, v, *, implementation=None):
  """Stick-breaking attention as the model calls it (implementation None) or in the named
  form: (function, the implementation and why)."""
  reason = {"reference": "dense T x T jnp", "pallas": "the Triton kernel"}
  choice = dispatch.Choice(implementation, reason.get(implementation)) if implementation else (
      dispatch.auto_implementation("stick_breaking", T=q.shape[1], dtype=q.dtype,
                                    head_dim=q.shape[-1], v_head_dim=v.shape[-1],
                                    has_segments=segs is not None))
  fn = lambda q, k, v: attention.stick_breaking_attention(  # noqa: E731
      q, k, v, segment_ids=segs, implementation=implementation)
  return fn, f"{choice.implementation}: {choice.reason}"


def _tapa(name, segs, q, v):
  """TAPA (alpha 0.1, theta 0.5): the Pallas kernel, or with "_auto" what
  attention.tapa_attention runs with implementation None: (function, what it runs)."""
  linear = name.startswith("tapa_linear")
  impl = None if name.endswith("_auto") else "pallas"
  label = impl or dispatch.auto_implementation(
      "tapa", T=q.shape[1], dtype=q.dtype, head_dim=q.shape[-1], v_head_dim=v.shape[-1],
      has_segments=segs is not None).implementation
  fn = lambda q, k, v: attention.tapa_attention(q, k, v, linear_phase=linear, segment_ids=segs,
                                                implementation=impl)
  return fn, label


def _grape_ap(segs, q):
  """GRAPE-AP on its kernel as the model calls it: (function of q, k, v, p; p [B, T, H, 16])."""
  B, T, H, _ = q.shape
  p = jax.random.normal(jax.random.key(11), (B, T, H, 16), jnp.float32)
  p = p * jax.lax.rsqrt(jnp.mean(p * p, axis=-1, keepdims=True) + 1e-6)
  alpha = jnp.linspace(0.25, 1.0, H, dtype=jnp.float32)
  fn = lambda q, k, v, p: attention.path_integral_attention(  # noqa: E731
      q, k, v, p, alpha, segment_ids=segs, implementation="pallas")
  return fn, p


def _grape_a(name, segs, q):
  """GRAPE-A with both gates as the model computes it (gates from q and k, random gate
  vectors, ALiBi's omega), a function of q, k, v: on its Pallas kernel ("grape_a", what
  implementation=None runs on a GPU), or lifted into extra q / k channels on cuDNN
  ("grape_a_lift")."""
  B, T, H, D = q.shape
  kv, ku = jax.random.split(jax.random.key(12))
  vh, uh = (0.5 * jax.random.normal(x, (H, D), jnp.float32) for x in (kv, ku))
  omega = jnp.asarray(unipotent.alibi_slopes(H) / (2 * math.log(2.0)), jnp.float32)

  def fn(q, k, v):
    lam_q, lam_k = grape_a.grape_a_gates(q, k, vh, uh)
    if name == "grape_a":
      return kp.grape_a_attention(q, k, v, omega * lam_q, omega * lam_k, scale=D ** -0.5,
                                  segment_ids=segs)
    qa, ka, va = grape_a.grape_a_augment(q, k, v, omega=omega, lam_q=lam_q, lam_k=lam_k,
                                         segment_ids=segs, scale=D ** -0.5)
    return attention.softmax_attention(qa, ka, va, segment_ids=segs, implementation="cudnn")
  return fn


def _time(fn, args, do) -> dict:
  """Forward and forward+backward: wall and device ms, compiled GiB."""
  fwd = jax.jit(fn)
  fb = common.grad_fn(fn, len(args))
  t0 = time.time()
  gib = lambda f, *a: (lambda x: None if x is None else round(x, 2))(
      common.compiled_gib(f.lower(*a).compile()))
  out = dict(fwd_ms=round(common.median_ms(fwd, *args), 2), fwd_gib=gib(fwd, *args),
             fwd_dev_ms=round(common.pipelined_ms(fwd, *args), 2))
  try:   # a forward-only variant (jax_mgpu's causal backward) keeps its forward row
    out.update(fwdbwd_ms=round(common.median_ms(fb, *args, do, n=5), 2),
               fwdbwd_gib=gib(fb, *args, do),
               fwdbwd_dev_ms=round(common.pipelined_ms(fb, *args, do), 2))
  except Exception as e:
    out["fwdbwd"] = "ERR " + _error(e)
  out["wall_s"] = round(time.time() - t0, 1)
  return out


def part_jax(cases, variants, options=("",), dtype="bfloat16", docs=0):
  """docs > 0: our variants take packed documents of `docs` tokens (segment ids), the training
  data's layout; the others run without."""
  bad = [v for v in variants if v not in VARIANTS]
  if bad:
    raise ValueError(f"--variants {','.join(bad)}: not one of {', '.join(VARIANTS)}")
  for o in options:
    common.block_sizes(o)   # a bad string fails before anything is timed
  rows = []
  for case in cases:
    B, T, H, D = common.case_shape(case)
    label = common.case_label(case)
    q, k, v, w, beta, g, do = common.inputs(B, T, H, D, dtype=jnp.dtype(dtype))
    res = {"case": label, "B": B, "T": T, "H": H, "D": D, "dtype": dtype,
           **({"docs": docs} if docs else {})}
    segs = (jnp.arange(T) // docs).astype(jnp.int32)[None].repeat(B, 0) if docs else None
    # float16 copies only for jax_mgpu (three more q-sized arrays held through every variant)
    q16, k16, v16 = ((x.astype(jnp.float16) for x in (q, k, v))
                     if any(name.startswith("jax_mgpu") for name in variants) else (q, k, v))
    others = _reference_fns(q, k, v, q16, k16, v16)
    for name in variants:
      for opts in (options if name in OURS else ("",)):
        key = common.variant_label(name, opts)
        try:
          if name in OURS:
            fn, args, plan = _ours(name, common.block_sizes(opts), segs, q, k, v, w, beta, g)
            _print_plan(f"{key} at case {label}", plan)
            res[key] = {"plan": str(plan), **_time(fn, args, do)}
          elif name in TAPA:
            fn, plan = _tapa(name, segs, q, v)
            res[key] = {"plan": plan, **_time(fn, (q, k, v), do)}
          elif name == "grape_ap":
            fn, p = _grape_ap(segs, q)
            res[key] = {"plan": "pallas", **_time(fn, (q, k, v, p), do)}
          elif name in ("grape_a", "grape_a_lift"):
            res[key] = {"plan": "pallas" if name == "grape_a" else "cudnn (lifted)",
                        **_time(_grape_a(name, segs, q), (q, k, v), do)}
          elif name in SBA:
            fn, plan = _sba(segs, q, v, implementation=SBA[name])
            _print_plan(f"{key} at case {label}", plan)
            res[key] = {"plan": plan, **_time(fn, (q, k, v), do)}
          else:
            fn, args = others[name]
            res[key] = _time(fn, args, do)
        except Exception as e:  # record and go on
          res[key] = "ERR " + _error(e)
        # each variant as it finishes: a call cut off by its time limit keeps the rows it timed
        print(json.dumps({"case": label, key: res[key]}), flush=True)
    rows.append(res)
    print(json.dumps(res), flush=True)
  return rows


def part_fla(cases, *, gate=True):
  # torch, triton and fla are imported here only: the JAX parts run without them
  import torch
  import torch.nn.functional as F
  from fla.ops.path_attn.parallel import parallel_path_attn
  from triton.testing import do_bench
  rows = []
  for case in cases:
    B, T, H, D = common.case_shape(case)
    label = common.case_label(case)
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    q, k, v = (torch.randn(B, T, H, D, device=dev, dtype=bf, requires_grad=True)
               for _ in range(3))
    w = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).requires_grad_(True)
    beta = (2 * torch.rand(B, T, H, device=dev)).requires_grad_(True)
    g = common.fla_gate(torch.log(torch.empty(B, T, H, device=dev).uniform_(0.95, 1.0)),
                        D ** -0.5).requires_grad_(True)  # the same function as our path_fox
    res = {"case": label, "B": B, "T": T, "H": H, "D": D}
    runs = (("fla_path", (q, k, v, w, beta)), ("fla_path_fox", (q, k, v, w, beta, g)))
    for name, args in runs[:2 if gate else 1]:   # gate=False: no path_fox row (a shorter call)
      try:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        fn = lambda: parallel_path_attn(*args)[0]
        f_ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        do = torch.randn_like(fn())

        def fb():
          torch.autograd.grad(parallel_path_attn(*args)[0], args, do)

        fb_ms = do_bench(fb, warmup=25, rep=100, return_mode="median")
        res[name] = dict(fwd_ms=round(f_ms, 2), fwdbwd_ms=round(fb_ms, 2),
                         fwdbwd_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                         fwdbwd_wall_ms=round(_torch_wall_ms(fb), 2))
      except Exception as e:
        res[name] = "ERR " + _error(e)
    rows.append(res)
    print(json.dumps(res), flush=True)
  return rows


def _torch_wall_ms(f, n=10):
  """FLA timed as part_jax times ours: the wall clock around each call and a wait for the GPU
  (do_bench's CUDA events give its device time alone)."""
  import torch  # optional: only part_fla, which has imported it already, calls this
  f()
  torch.cuda.synchronize()
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    f()
    torch.cuda.synchronize()
    ts.append((time.perf_counter() - t) * 1e3)
  return sorted(ts)[len(ts) // 2]


def table(rows) -> str:
  """One markdown line per (case, variant): ms fwd / fwd+bwd (device ms), GiB."""
  lines = ["| case | variant | fwd ms | fwd+bwd ms | fwd+bwd device ms | fwd+bwd GiB |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    for key, cell in r.items():
      if isinstance(cell, dict) and "fwd_ms" in cell:
        lines.append(f"| {r['case']} | {key} | {cell['fwd_ms']} | {cell.get('fwdbwd_ms', '-')} | "
                     f"{cell.get('fwdbwd_dev_ms', cell.get('fwdbwd_wall_ms', '-'))} | "
                     f"{cell.get('fwdbwd_gib', '-')} |")
      elif isinstance(cell, str) and cell.startswith("ERR"):
        lines.append(f"| {r['case']} | {key} | {cell[:80]} | | | |")
  return "\n".join(lines)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--part", choices=["check", "correlated", "jax", "fla"], required=True)
  p.add_argument("--cases", default="0,1,2,3,4",
                 help="comma-separated indices into common.CASES, or shapes BxTxHxD")
  p.add_argument("--variants", default="cudnn,path,path_fox",
                 help=f"jax: some of {','.join(VARIANTS)}; fla: path_fox adds FLA's gated row")
  p.add_argument("--options", action="append", default=None,
                 help="kernel options 'key=value,...' (kp.BlockSizes fields: "
                      f"{', '.join(common.OPTION_FIELDS)}); jax: repeat to run each; check and "
                      "correlated: the first, under each row's own")
  p.add_argument("--dtype", default="bfloat16", help="jax: input dtype (cudnn needs bf16)")
  p.add_argument("--docs", type=int, default=0,
                 help="jax: packed documents of this many tokens for our variants")
  p.add_argument("--shape", default="4,2048,12,64", help="correlated: B,T,H,D")
  p.add_argument("--out", default=os.environ.get("OUT", "."),
                 help="folder of path_kernel_PART.json (default $OUT, else .)")
  a = p.parse_args(argv)
  a.variants = [v for v in a.variants.split(",") if v]
  a.options = a.options or [""]
  try:   # a bad entry fails here, in one line, before anything runs
    a.cases = common.parse_cases(a.cases)
    for o in a.options:
      common.block_sizes(o)
  except ValueError as e:
    p.error(str(e))
  return a


def main(argv=None):
  a = parse_args(argv)
  if a.part == "check":
    rows = part_check(a.options[0])
  elif a.part == "correlated":
    rows = part_correlated(a.options[0], *(int(x) for x in a.shape.split(",")))
  elif a.part == "jax":
    rows = part_jax(a.cases, a.variants, a.options, a.dtype, docs=a.docs)
  else:
    rows = part_fla(a.cases, gate="path_fox" in a.variants)
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, f"path_kernel_{a.part}.json"), "w") as f:
    json.dump(rows, f, indent=1)
  if a.part in ("jax", "fla"):
    print(table(rows))


if __name__ == "__main__":
  main()
