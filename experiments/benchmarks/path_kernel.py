"""PaTH kernel benchmark on one GPU: this repo's Pallas kernel vs cuDNN flash attention (JAX) and
flash-linear-attention's Triton PaTH kernel (PyTorch, fla-core 0.6.0), at the anchor shapes.

  python experiments/benchmarks/path_kernel.py --part check        # GPU correctness vs dense oracle,
                                                                    # the correlated-w rows, then
                                                                    # ours vs FLA (fla_parity.py)
  python experiments/benchmarks/path_kernel.py --part jax --cases 0,1,2,3,4
  python experiments/benchmarks/path_kernel.py --part jax --cases 4,8x8192x16x128 --variants path,path@sp8
  python experiments/benchmarks/path_kernel.py --part jax --cases 3 --variants path,path@l1rc,path@pre!=split_bf16x3
  python experiments/benchmarks/path_kernel.py --part fla --cases 0,1,2,3,4
  python experiments/benchmarks/path_kernel.py --part jax --cases 3 --variants cudnn,fox,jax_mha

Variants of --part jax: cudnn (jax.nn.dot_product_attention), path, path_fox, fox (ours without
transport), jax_mha (jax.experimental.pallas.ops.gpu.attention.mha: jax's own Pallas flash
attention, a reference for what Pallas on Triton reaches), jax_mgpu (its Mosaic GPU flash
attention, forward only where causal); cudnn_nc, jax_mha_nc, jax_mgpu_nc without the causal
mask; `name@tokens` changes BlockSizes (_block_sizes_of).

Times: median ms of repeated runs after warm-up (JAX: wall clock around block_until_ready,
the anchors' convention; torch: triton.testing.do_bench, device time by CUDA events). Both sides
also get the other's measure: JAX `*_dev_ms`, device time a call from calls dispatched back to
back (_pipelined_ms); FLA `fwdbwd_wall_ms`, wall clock around a synchronized call. Memory: JAX compiled memory_analysis (arguments + outputs +
temporaries) of the whole step; torch max_memory_allocated. One JSON line per case; a table last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

CASES = [(32, 2048, 32, 64), (32, 4096, 32, 64), (8, 8192, 32, 64), (8, 4096, 16, 128),
         (4, 16384, 16, 128),
         (16, 2048, 12, 64)]   # 5: one layer of the GPU-training issue's 12-layer model
OUT = os.environ.get("OUT", ".")


def case_shape(case) -> tuple[int, int, int, int]:
  """A --cases entry -> (B, T, H, D): an index into CASES, or a shape "BxTxHxD" (e.g.
  8x8192x16x128: shapes beside the anchors, such as the span length's sweeps)."""
  token = str(case)
  if "x" in token:
    shape = tuple(int(v) for v in token.split("x"))
    if len(shape) != 4 or min(shape) < 1:
      raise ValueError(f"--cases entry {token!r}: a shape is BxTxHxD, four positive integers")
    return shape
  if not token.isdigit() or int(token) >= len(CASES):
    raise ValueError(f"--cases entry {token!r}: an index below {len(CASES)} or BxTxHxD")
  return CASES[int(token)]


def case_label(case):
  """The JSON rows' "case": the index as an int, a shape as its string."""
  return int(case) if str(case).isdigit() else str(case)


def _median_ms(f, *a, n=10):
  import jax
  jax.block_until_ready(f(*a))
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(f(*a))
    ts.append((time.perf_counter() - t) * 1e3)
  return sorted(ts)[len(ts) // 2]


def _pipelined_ms(f, *a, n=10):
  """Device time a call: n calls dispatched back to back and one wait at the end, so the
  host's dispatch and its wait overlap the GPU's work, as in a training loop, and as
  triton.testing.do_bench's CUDA events time FLA (part_fla). _median_ms's wall clock around
  each call adds that latency to each (~0.7 ms at 32,4096,32,64 on the H200: the idle gap
  between calls in a trace, none inside one)."""
  import jax
  jax.block_until_ready(f(*a))
  t = time.perf_counter()
  for _ in range(n):
    out = f(*a)
  jax.block_until_ready(out)
  return (time.perf_counter() - t) * 1e3 / n


def _gib(compiled):
  m = compiled.memory_analysis()
  return round((m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes) / 2**30, 2)


def _inputs(B, T, H, D, key=0, dtype=None):
  import jax
  import jax.numpy as jnp
  dtype = dtype or jnp.bfloat16
  ks = jax.random.split(jax.random.key(key), 7)
  q, k, v = (jax.random.normal(x, (B, T, H, D), dtype) for x in ks[:3])
  w = jax.random.normal(ks[3], (B, T, H, D), jnp.float32)
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  beta = 2 * jax.random.uniform(ks[4], (B, T, H), jnp.float32)
  g = jnp.log(jax.random.uniform(ks[5], (B, T, H), jnp.float32, 0.95, 1.0))
  do = jax.random.normal(ks[6], (B, T, H, D), dtype)
  return q, k, v, w, beta, g, do


def _correlated_w(B, T, H, D, *, eps, beta, key=1):
  """w_t = normalize(a + eps n_t) (one a per row and head): the PaTH layer's w share a direction
  like this, which overflowed the old in-kernel inverse in bf16 training. beta: a number, or
  "u" for uniform in (0, 2)."""
  import jax
  import jax.numpy as jnp
  ka, kn, kb = jax.random.split(jax.random.key(key), 3)
  w = jax.random.normal(ka, (B, 1, H, D)) + eps * jax.random.normal(kn, (B, T, H, D))
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  if beta == "u":
    return w, 2 * jax.random.uniform(kb, (B, T, H))
  return w, jnp.full((B, T, H), float(beta), jnp.float32)


def part_correlated(prepass=None, B=4, T=2048, H=12, D=64):
  """The bf16 NaN's reproduction (the GPU-training issue): bf16 inputs, w sharing a direction,
  beta 1, 2 or uniform. Forward and gradients must be finite and match the float32 blockwise jnp
  oracle (householder.path_attention_chunked: triangular solves, highest precision)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import kernels_pallas as kp
  from kernels_pallas.path_attention.prepass_variants import usable_variant
  from posenc_jax import householder
  q, k, v, _, _, _, do = _inputs(B, T, H, D)
  bs = kp.BlockSizes(**({"prepass": prepass} if prepass else {}))
  f = lambda *a: kp.path_attention(*a, block_sizes=bs)
  r = lambda *a: householder.path_attention_chunked(
      *(x.astype(jnp.float32) for x in a), scale=D ** -0.5)
  grad = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * do),
                                     argnums=tuple(range(5))))
  fwd_f, fwd_r, grad_f, grad_r = jax.jit(f), jax.jit(r), grad(f), grad(r)
  rows = []
  for eps in (1.0, 0.1, 0.01):
    for beta in (1, 2, "u"):
      w, b = _correlated_w(B, T, H, D, eps=eps, beta=beta)
      args = (q, k, v, w, b)
      used = usable_variant(bs.prepass, backend=jax.default_backend(), dtype=q.dtype,
                            head_dim=D)
      row = dict(part="correlated", shape=(B, T, H, D), eps=eps, beta=beta, prepass=used)
      try:
        o = fwd_f(*args)
        g = grad_f(*args)
        with jax.default_matmul_precision("highest"):
          o_r, g_r = fwd_r(*args), grad_r(*args)
        row.update(finite=bool(np.isfinite(np.asarray(o, np.float32)).all()
                               and all(np.isfinite(np.asarray(x, np.float32)).all() for x in g)),
                   fwd=f"{_rel(o, o_r):.1e}", grads=[f"{_rel(a, c):.1e}" for a, c in zip(g, g_r)])
      except Exception as e:
        row["error"] = type(e).__name__ + ": " + str(e).splitlines()[0][:200]
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


def _rel(a, b):
  import numpy as np
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def part_check(prepass=None):
  """Forward and every gradient vs the dense oracle on the GPU; bitwise determinism; then the
  correlated-w rows (part_correlated) and ours against FLA on identical inputs (fla_parity).
  prepass: the bf16 rows' pre-pass variant (default: BlockSizes' default)."""
  import jax
  import jax.numpy as jnp
  import kernels_pallas as kp
  from kernels_pallas.path_attention.prepass_variants import usable_variant
  from posenc_jax import householder

  rel = _rel
  rows = []
  pre16 = prepass or kp.BlockSizes().prepass
  # the last rows: the options not yet on by default (BlockSizes fields), at benchmark sizes
  mosaic, fused = dict(fwd_kernel="mosaic"), dict(dkv_in_dq=True, bwd_lanes=0)
  for dtype, (B, T, H, K, D), gate, seg, pre, *opts in [
      (jnp.float32, (2, 300, 4, 2, 64), True, True, "jnp"),
      (jnp.float32, (2, 300, 4, 2, 64), True, True, kp.BlockSizes().prepass),
      (jnp.bfloat16, (2, 1024, 4, 4, 64), True, False, pre16),
      (jnp.bfloat16, (1, 1000, 4, 4, 128), False, True, pre16),
      (jnp.bfloat16, (1, 1000, 4, 2, 128), False, True, pre16),
      (jnp.bfloat16, (2, 1024, 4, 4, 64), True, True, pre16, mosaic),
      (jnp.bfloat16, (1, 1000, 4, 4, 128), False, False, pre16, mosaic),
      (jnp.bfloat16, (2, 1024, 4, 2, 64), True, True, pre16, fused),
      (jnp.bfloat16, (1, 1000, 4, 4, 128), False, True, pre16, dict(fused, keep_operands=True))]:
    opts = opts[0] if opts else {}
    q, k, v, w, beta, g, do = _inputs(B, T, H, D, dtype=dtype)
    k, v, w, beta = k[:, :, :K], v[:, :, :K], w[:, :, :K], beta[:, :, :K]
    g = g if gate else None
    segs = (jnp.arange(T)[None] * 3 // T).astype(jnp.int32).repeat(B, 0) if seg else None
    bs = kp.BlockSizes(prepass=pre, **opts)
    f = lambda *a: kp.path_attention(*a, segment_ids=segs, block_sizes=bs)
    r = lambda *a: householder.path_attention_reference(*a[:5], log_forget=a[5], segment_ids=segs,
                                                        scale=D ** -0.5)
    args = (q, k, v, w, beta, g)
    n = 6 if gate else 5
    loss = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * do),
                                       argnums=tuple(range(n))))
    used = usable_variant(pre, backend=jax.default_backend(), dtype=dtype, heads_per_kv=H // K,
                          head_dim=D)
    row = dict(dtype=jnp.dtype(dtype).name, shape=(B, T, H, K, D), gate=gate, seg=seg, prepass=used,
               **({"options": opts} if opts else {}))
    try:  # one failing configuration (e.g. a compile error) does not hide the others
      o, orf = jax.jit(f)(*args), jax.jit(r)(*args)
      grad_f = loss(f)  # one compile for both runs of the determinism check
      g1, g2, g3 = grad_f(*args), loss(r)(*args), grad_f(*args)
      same = all(bool(jnp.array_equal(a, b)) for a, b in zip(g1, g3))
      row.update(fwd=f"{rel(o, orf):.1e}", grads=[f"{rel(a, b):.1e}" for a, b in zip(g1, g2)],
                 bitwise_deterministic=same)
    except Exception as e:
      row["error"] = type(e).__name__ + ": " + str(e).splitlines()[0][:200]
    rows.append(row)
    print(json.dumps(row), flush=True)
  from experiments.benchmarks import fla_parity
  return rows + part_correlated(prepass) + fla_parity.run()


def _block_sizes_of(spec):
  """A variant's spec -> (BlockSizes, force the pre-pass). Tokens change BlockSizes' defaults:
  b128 block 128, w8 forward warps, s1 stages, l2 backward lanes (l1: one lane, l0: auto),
  bw8 backward warps, pw8 the pre-pass kernels' warps, sp8 dkv_span, kv dkv_in_dq, par (par2) the
  span-parallel backward (bwd_spans 1 (2); seq: 0), np one query chunk per dq/dP tile, rc the
  backward runs the pre-pass again (keep_operands off), ko keep_operands on, mg the Mosaic GPU
  forward (PaTH without the gate), nfs the forward walking every chunk (fwd_spans off; fs:
  on),
  nfp one query chunk per far dq tile (far_dq_pairs off; fp: on), nkp one key chunk per far
  dk/dv tile (far_dkv_pairs off), nkm / km the far dk/dv kernel's tiles query-major / key-major
  (far_dkv_keys_major), ndm / dm the dk/dv kernel's likewise (dkv_keys_major), fr32 the far
  dk/dv kernel's query rows a step (far_dkv_rows), fdw4 the far dq kernel's warps
  (far_dq_num_warps), ky the pre-pass keeps its inverse Y in float32 for its VJP
  (prepass_keep_inverse True; kyb: its bf16 rounding, refined there, the default; ky0: none,
  the VJP runs the inverse again),
  lw the pre-pass VJP's WK pullback in its inverse-VJP kernel (prepass_late_wk), ft / fx the span
  forward's and backward's D x D operator chains in one TF32 pass / three bf16 passes
  (chain_products "tf32" / "bf16x3"), mfar / tfar the span forward's far keys on Mosaic GPU /
  in the Triton kernel (fwd_far), mdq / tdq the span backward's far dq walk on Mosaic GPU / in
  the Triton kernel (far_dq), mdk / tdk its far dk/dv walk likewise (far_dkv), msw / tsw its
  near sweep likewise (span_sweep), gc / gm the
  gate's column sums carried / on the tensor
  cores (gate_colsum "carry" / "mma"),
  pre=VARIANT the pre-pass, pre!=VARIANT that pre-pass even where
  prepass_variants.usable_variant would route the shape to the jnp one (shared memory): to time
  whether it builds and what it gains. E.g. path@l1rc is the seventh session's defaults."""
  import dataclasses
  import re
  import kernels_pallas as kp
  pre = re.search(r"pre(!?)=([a-z_0-9]+)", spec)
  spec = re.sub(r"pre!?=[a-z_0-9]+", "", spec)
  bs = kp.BlockSizes()
  num = lambda pattern: (lambda m: int(m[1]) if m else None)(re.search(pattern, spec))
  b, w, s, l, bw, pw, sp = (num(p) for p in (r"b(\d+)", r"(?<![bp])w(\d+)", r"s(\d+)",
                                               r"l(\d+)", r"bw(\d+)", r"pw(\d+)", r"sp(\d+)"))
  changes = {k: v for k, v in dict(block_q=b, block_k=b, num_warps=w, num_stages=s,
                                   bwd_num_warps=bw, prepass_num_warps=pw, dkv_span=sp).items()
             if v is not None}
  if l is not None:
    changes["bwd_lanes"] = l if l != 1 else None
  changes.update({"dkv_in_dq": True} if "kv" in spec else {})
  par = re.search(r"par(\d?)", spec)
  changes.update({"bwd_spans": int(par[1] or 1)} if par else {})
  changes.update({"bwd_spans": 0} if "seq" in spec else {})
  changes.update({"dq_pairs": False} if "np" in spec else {})
  changes.update({"keep_operands": False} if "rc" in spec else {})
  changes.update({"keep_operands": True} if "ko" in spec else {})
  changes.update({"fwd_kernel": "mosaic"} if "mg" in spec else {})
  changes.update({"fwd_spans": False} if "nfs" in spec else
                 {"fwd_spans": True} if "fs" in spec else {})
  changes.update({"far_dq_pairs": False} if "nfp" in spec else
                 {"far_dq_pairs": True} if "fp" in spec else {})
  changes.update({"far_dkv_pairs": False} if "nkp" in spec else {})
  changes.update({"far_dkv_keys_major": False} if "nkm" in spec else
                 {"far_dkv_keys_major": True} if "km" in spec else {})
  changes.update({"dkv_keys_major": False} if "ndm" in spec else
                 {"dkv_keys_major": True} if "dm" in spec else {})
  rows = num(r"fr(\d+)")
  changes.update({"far_dkv_rows": rows} if rows else {})
  fdw = num(r"fdw(\d+)")
  changes.update({"far_dq_num_warps": fdw} if fdw else {})
  changes.update({"prepass_keep_inverse": "bf16"} if "kyb" in spec else
                 {"prepass_keep_inverse": False} if "ky0" in spec else
                 {"prepass_keep_inverse": True} if "ky" in spec else {})
  changes.update({"prepass_late_wk": True} if "lw" in spec else {})
  changes.update({"chain_products": "tf32"} if "ft" in spec else
                 {"chain_products": "bf16x3"} if "fx" in spec else {})
  changes.update({"gate_colsum": "carry"} if "gc" in spec else
                 {"gate_colsum": "mma"} if "gm" in spec else {})
  for field, token in (("fwd_far", "far"), ("far_dq", "dq"), ("far_dkv", "dk"),
                       ("span_sweep", "sw")):   # m<token> / t<token>: Mosaic GPU / Triton
    changes.update({field: "mosaic"} if "m" + token in spec else
                   {field: "triton"} if "t" + token in spec else {})
  changes.update({"prepass": pre[2]} if pre else {})
  return dataclasses.replace(bs, **changes), bool(pre and pre[1])


@contextlib.contextmanager
def _prepass_as_requested(forced):
  """While active (forced=True), the kernel runs the requested pre-pass variant at every shape:
  prepass_variants.usable_variant keeps only its float32-inputs rule (variant_for_dtype)."""
  from kernels_pallas.path_attention import prepass_variants
  saved = prepass_variants.usable_variant
  if forced:
    prepass_variants.usable_variant = lambda requested, *, dtype, **_: (
        prepass_variants.variant_for_dtype(requested, dtype))
  try:
    yield
  finally:
    prepass_variants.usable_variant = saved


def _jax_mha(q, k, v, causal=True):
  from jax.experimental.pallas.ops.gpu import attention
  return attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal)


# jax's Mosaic GPU flash attention's tiles, tried in this order until one fits shared memory
# (its backward needs all four backward blocks; jax 0.10-0.11 have no causal backward)
MGPU_TILES = ((64, 128, 64, 128, 64, 128), (64, 64, 64, 64, 64, 64))


def _jax_mgpu(q, k, v, causal=True):
  """jax.experimental.pallas.ops.gpu.attention_mgpu (TMA, wgmma, warp specialisation): what
  Pallas on Mosaic GPU reaches, beside _jax_mha's Pallas on Triton. The first of MGPU_TILES
  that builds (its scale is 1/sqrt(D) inside)."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu as am
  err = None
  for bq, bkv, bq_dkv, bkv_dkv, bq_dq, bkv_dq in MGPU_TILES:
    cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=2, causal=causal,
                          block_q_dkv=bq_dkv, block_kv_dkv=bkv_dkv, block_q_dq=bq_dq,
                          block_kv_dq=bkv_dq)
    try:
      return am.attention(q, k, v, cfg)
    except ValueError as e:   # shared memory: the next tiles
      err = e
  raise err


def part_jax(cases, variants, dtype="bfloat16", docs=0):
  """docs > 0: the PaTH variants take packed documents of `docs` tokens (segment ids), the
  training data's layout; the other variants run as without."""
  import jax
  import jax.numpy as jnp
  import kernels_pallas as kp
  rows = []
  for ci in cases:
    B, T, H, D = case_shape(ci)
    ci = case_label(ci)
    q, k, v, w, beta, g, do = _inputs(B, T, H, D, dtype=jnp.dtype(dtype))
    res = {"case": ci, "B": B, "T": T, "H": H, "D": D, "dtype": dtype,
           **({"docs": docs} if docs else {})}
    segs = (jnp.arange(T) // docs).astype(jnp.int32)[None].repeat(B, 0) if docs else None
    path = lambda *a, bs=None: kp.path_attention(*a, block_sizes=bs, segment_ids=segs)
    # float16 copies only for jax_mgpu (three more q-sized arrays held through every variant)
    q16, k16, v16 = ((x.astype(jnp.float16) for x in (q, k, v))
                     if any(name.startswith("jax_mgpu") for name in variants) else (q, k, v))
    fns = {
        "cudnn": (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                               implementation="cudnn"), (q, k, v)),
        "path": (lambda q, k, v, w, beta: path(q, k, v, w, beta), (q, k, v, w, beta)),
        "path_fox": (lambda q, k, v, w, beta, g: path(q, k, v, w, beta, g),
                     (q, k, v, w, beta, g)),
        "fox": (lambda q, k, v, g: kp.forgetting_attention(q, k, v, g), (q, k, v, g)),
        # jax's own Pallas-Triton flash attention (no gate, no transport): tells a limit of
        # Pallas on Triton from one of our kernels
        "jax_mha": (_jax_mha, (q, k, v)),
        # jax's own Pallas Mosaic GPU flash attention: what Pallas reaches without Triton
        # (float16: its kernel's output dtype is fixed; the tensor cores' rate is bf16's)
        "jax_mgpu": (_jax_mgpu, (q16, k16, v16)),
        # "_nc": without the causal mask (jax_mgpu has no causal backward), the same FLOPs x2
        "cudnn_nc": (lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                  implementation="cudnn"),
                     (q, k, v)),
        "jax_mha_nc": (lambda q, k, v: _jax_mha(q, k, v, causal=False), (q, k, v)),
        "jax_mgpu_nc": (lambda q, k, v: _jax_mgpu(q, k, v, causal=False), (q16, k16, v16)),
    }
    for name in variants:
      base, _, spec = name.partition("@")
      fn, args = fns[base]
      bs, forced = _block_sizes_of(spec) if spec else (None, False)
      if bs is not None:
        fn = (lambda f0, bs: lambda *a: f0(*a, bs))(
            {"path": lambda q, k, v, w, beta, bs: path(q, k, v, w, beta, bs=bs),
             "path_fox": lambda q, k, v, w, beta, g, bs: path(q, k, v, w, beta, g, bs=bs)}[base],
            bs)
      try:
        fwd = jax.jit(fn)
        fb = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * do),
                              argnums=tuple(range(len(args)))))
        t0 = time.time()
        with _prepass_as_requested(forced):   # both traced (and compiled) inside
          f_ms = _median_ms(fwd, *args)
          res[name] = dict(fwd_ms=round(f_ms, 2), fwd_gib=_gib(fwd.lower(*args).compile()),
                           fwd_dev_ms=round(_pipelined_ms(fwd, *args), 2))
          try:   # a forward-only variant (jax_mgpu's causal backward) keeps its forward row
            fb_ms = _median_ms(fb, *args, n=5)
            res[name].update(fwdbwd_ms=round(fb_ms, 2), fwdbwd_gib=_gib(fb.lower(*args).compile()),
                             fwdbwd_dev_ms=round(_pipelined_ms(fb, *args), 2))
          except Exception as e:
            res[name]["fwdbwd"] = "ERR " + type(e).__name__ + ": " + str(e).splitlines()[0][:200]
        res[name]["wall_s"] = round(time.time() - t0, 1)
      except Exception as e:  # record and go on
        res[name] = "ERR " + type(e).__name__ + ": " + str(e).splitlines()[0][:200]
      # each variant as it finishes: a call cut off by its time limit keeps the rows it timed
      print(json.dumps({"case": ci, name: res[name]}), flush=True)
    rows.append(res)
    print(json.dumps(res), flush=True)
  return rows


def fla_gate(log_forget, scale):
  """FLA's `g` for our log forget gate. fla-core 0.6.0's parallel_path_attn scales the gate's
  cumulative sum G = cumsum(g) with the logits: l_ij = scale (q_i^T P k_j + G_i - G_j)
  (fla/ops/path_attn/parallel_path_fwd.py:106-107, intra_chunk_preprocess_fwd.py:122-125; its
  reference naive.py:94-95 adds the gate before `(A * scale).softmax`; its layer decodes with
  attn_decoding_one_step(..., do_gate_scale=True)). Ours adds sum_{s=j+1}^{i} log_forget_s
  unscaled; the index convention and the natural log are the same, so the same function needs
  g = log_forget / scale. Raw log f put FLA ~0.7 rel RMS off the oracle (RESULTS.md)."""
  return log_forget / scale


def _torch_wall_ms(f, n=10):
  """FLA timed as part_jax's _median_ms times ours: the wall clock around each call and a
  wait for the GPU (do_bench's CUDA events give its device time alone)."""
  import torch
  f()
  torch.cuda.synchronize()
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    f()
    torch.cuda.synchronize()
    ts.append((time.perf_counter() - t) * 1e3)
  return sorted(ts)[len(ts) // 2]


def part_fla(cases, *, gate=True):
  import torch
  import torch.nn.functional as F
  from triton.testing import do_bench
  from fla.ops.path_attn.parallel import parallel_path_attn
  rows = []
  for ci in cases:
    B, T, H, D = case_shape(ci)
    ci = case_label(ci)
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    q, k, v = (torch.randn(B, T, H, D, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
    w = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).requires_grad_(True)
    beta = (2 * torch.rand(B, T, H, device=dev)).requires_grad_(True)
    g = fla_gate(torch.log(torch.empty(B, T, H, device=dev).uniform_(0.95, 1.0)),
                 D ** -0.5).requires_grad_(True)  # same function as our path_fox
    res = {"case": ci, "B": B, "T": T, "H": H, "D": D}
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
        res[name] = "ERR " + type(e).__name__ + ": " + str(e).splitlines()[0][:200]
    rows.append(res)
    print(json.dumps(res), flush=True)
  return rows


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--part", choices=["check", "correlated", "jax", "fla"], required=True)
  p.add_argument("--cases", default="0,1,2,3,4",
                 help="comma-separated indices into CASES, or shapes BxTxHxD")
  p.add_argument("--variants", default="cudnn,path,path_fox")
  p.add_argument("--prepass", default=None, help="check: the bf16 rows' pre-pass variant")
  p.add_argument("--dtype", default="bfloat16", help="jax: input dtype (cudnn needs bf16)")
  p.add_argument("--docs", type=int, default=0,
                 help="jax: packed documents of this many tokens for the PaTH variants")
  p.add_argument("--shape", default="4,2048,12,64", help="correlated: B,T,H,D")
  a = p.parse_args()
  cases = [c for c in a.cases.split(",") if c]
  for c in cases:
    case_shape(c)   # a bad entry fails before anything is timed
  if a.part == "check":
    rows = part_check(a.prepass)
  elif a.part == "correlated":
    rows = part_correlated(a.prepass, *(int(x) for x in a.shape.split(",")))
  elif a.part == "jax":
    rows = part_jax(cases, a.variants.split(","), a.dtype, docs=a.docs)
  else:
    rows = part_fla(cases, gate="path_fox" in a.variants.split(","))
  with open(os.path.join(OUT, f"path_kernel_{a.part}.json"), "w") as f:
    json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
