"""The span forward's far keys as a Mosaic GPU kernel (TMA, wgmma): BlockSizes(fwd_far="mosaic").

With the span forward (calls.forward_span), a query chunk c attends to the key chunks of every
earlier span J as plain attention: its boundary state qb_c^(s_J) against the keys moved to
that span's end, kb_m (bwd_span.boundary_kernel), m = J span .. (J + 1) span - 1. In the
Triton forward those far steps share one program with the near walk (kernels.fwd_kernel). Here
they are a launch of their own, a flash-attention forward whose query tile changes at each span
boundary; calls.forward merges its (o, lse) with the near kernel's (merge_far).

Why: at head_dim 128 the Triton forward ran at about half of cuDNN's rate (H200, 2026-11-26:
~230 TFLOP/s at 8,4096,16,128, ~260 at 4,16384,16,128, against cuDNN's ~400 / ~550), while
jax's own Mosaic GPU flash forward (ops/gpu/attention_mgpu.py) matched cuDNN's causal forward
there (1.38 against 1.39 ms at 8,4096,16,128). Far pairs are most of the causal triangle at
long sequences (7 / 8 of it at 4,16384,16,128).

One program per (query chunk c, query head, batch), one warpgroup, 64 query rows. Key chunks
m = 0 .. jc span - 1 (jc = c // span, the spans left of c's) stream through a ring of `slots`
shared-memory buffers filled by TMA, the copy of step i + slots issued as soon as step i's
products have read its slot; the boundary states come through a two-slot ring too, the next
span's issued while this one's keys run. Logits in log2 units, exp2 online softmax (as
fwd_mosaic.py). A row whose far keys are all masked (packed documents starting inside c's span)
ends with l = 0: o = 0 and lse = -inf, which merge_far weighs as nothing. Every far chunk pair
is walked (no prepass.chunk_bounds skipping yet); a masked tile contributes exp2(-inf) = 0.

Scope: bf16 or f16, chunk 64, head_dim a multiple of 64 (supported). plgpu's wgmma does not run
in interpret mode: lowering is tested on the CPU host, values by TestGPU on the device.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.path_attention import kernels

LOG2E = math.log2(math.e)


def supported(ops) -> str | None:
  """None if the far kernel takes these operands, else why not."""
  C, D = ops.q.shape[3], ops.q.shape[4]
  if ops.q.dtype not in (jnp.bfloat16, jnp.float16):
    return f"dtype {ops.q.dtype} (needs bfloat16 or float16)"
  if C != 64 or D % 64:
    return f"chunk {C}, head_dim {D} (needs 64 and a multiple of 64)"
  return None


def far_forward(ops, kb, qb, *, scale: float, span: int, slots: int = 2, wide: int = 1):
  """-> o [B, H, n, C, D] float32 (normalised over the far keys; 0 where a row has none),
  lse [B, H, n, C] float32 (natural log; -inf where none).

  ops: the pre-pass Operands (v, and the gate's fq / fk and the segment ids sq / sk where
  present); kb [B, K, n, C, D] the keys moved to their span's end; qb [B, H, R, D] the packed
  boundary states (kernels.boundary_offset), written by the near kernel. wide: key chunks a
  step (a span's chunk count is even, so 2 never crosses a span). H200, 2026-11-26, the
  kernel's ms at 8,4096,16,128 / 4,16384,16,128: 1.51 / 12.22 with 1, 1.84 / 12.53 with 2
  (160 KiB of shared memory at head_dim 128: one program an SM)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental import pallas as pl
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  dt = ops.q.dtype
  f32 = jnp.float32
  gate, segments = ops.fq is not None, ops.sq is not None
  wgmma_layout = plgpu.Layout.WGMMA
  rows_layout, cols_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

  # name -> array; "head": this program's query chunk, once, as [B, heads, n, C(, D)];
  # "ring": `wide` key chunks a step, W rows of [B, heads, n C(, D)] (chunks merged into time);
  # qb's packed rows as [B, H, R / C, C, D] chunks.
  W = wide * C
  if span % wide:
    raise ValueError(f"span {span} must be a multiple of wide={wide}")
  vec = lambda x: x.reshape(x.shape[:3] + (C,))
  keys = lambda x: x.reshape(x.shape[:2] + (n * C,) + x.shape[4:])
  head = {}
  ring = {"k": keys(kb), "v": keys(ops.v)}
  if gate:
    head["fq"] = vec(ops.fq)
    ring["fk"] = ops.fk.reshape(B, H, n * C)
  if segments:
    head["sq"] = vec(ops.sq)
    ring["sk"] = ops.sk.reshape(B, 1, n * C)
  qbc = qb.reshape(B, H, qb.shape[2] // C, C, D)
  per_query_head = {"fq", "fk"}   # the rest per kv head (segment ids: one)

  def body(refs, smem, bars):
    c, h, b = lax.axis_index("c"), lax.axis_index("heads"), lax.axis_index("batch")
    c = n - 1 - c   # the most far keys first (calls.chunk_grid's reverse)
    kh = lax.div(h, jnp.array(G, h.dtype))
    head_of = lambda name: h if name in per_query_head else 0 if name in ("sq", "sk") else kh
    jc = lax.div(c, jnp.array(span, c.dtype))
    steps = jc * (span // wide)   # far key rows 0 .. steps W - 1

    def fetch(i):   # key rows i W .. (i + 1) W - 1 into ring slot i % slots
      slot = lax.rem(i, jnp.array(slots, i.dtype))
      for name in ring:
        plgpu.copy_gmem_to_smem(refs[name].at[b, head_of(name), pl.ds(i * W, W)],
                                smem[name].at[slot], bars[name].at[slot])

    def fetch_state(j):   # qb^(s_j) of chunk c into state slot j % 2
      row = kernels.boundary_offset(j, n=n, span=span) + c - (j + 1) * span
      plgpu.copy_gmem_to_smem(refs["qb"].at[b, h, row], smem["qb"].at[lax.rem(j, 2)],
                              bars["qb"].at[lax.rem(j, 2)])

    for name in head:
      plgpu.copy_gmem_to_smem(refs[name].at[b, head_of(name), c], smem[name], bars[name])
    for j in range(2):
      pl.when(j < jc)(lambda j=j: fetch_state(jnp.int32(j)))
    for i in range(slots):
      pl.when(i < steps)(lambda i=i: fetch(jnp.int32(i)))
    for name in head:
      plgpu.barrier_wait(bars[name])

    rows = lambda x: lax.broadcast_in_dim(x, (C, W), [0])
    cols = lambda x: lax.broadcast_in_dim(x, (C, W), [1])
    load = lambda ref, layout: plgpu.load(ref, (), layout=layout)
    fq = load(smem["fq"], rows_layout) if gate else None
    sq = load(smem["sq"], rows_layout) if segments else None

    def key(J, qslot):
      def step(i, carry):
        m_i, l_i, acc = carry
        slot = lax.rem(i, jnp.array(slots, i.dtype))
        at = lambda name: smem[name].at[slot] if name in smem else None
        plgpu.barrier_wait(bars["k"].at[slot])
        for name in ("fk", "sk"):
          if name in ring:
            plgpu.barrier_wait(bars[name].at[slot])

        def qk(r):
          plgpu.wgmma(r, smem["qb"].at[qslot], plgpu.transpose_ref(at("k"), (1, 0)))
          return r[...]

        s = pl.run_scoped(qk, plgpu.ACC((C, W), f32)) * (scale * LOG2E)
        if gate:
          s = s + (rows(fq) - cols(load(at("fk"), cols_layout))) * LOG2E
        if segments:
          s = jnp.where(rows(sq) == cols(load(at("sk"), cols_layout)), s, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        # a row with every far key so far masked keeps m = -inf: exp2 against 0 there
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(s - rows(m_use))
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, (C, D), [0])
        plgpu.barrier_wait(bars["v"].at[slot])
        acc = pl.run_state(lambda r: plgpu.wgmma(r, p.astype(dt), at("v")))(plgpu.ACC.init(acc))
        # both products reading this slot have completed (their results were read): refill
        pl.when(i + slots < steps)(lambda: fetch(i + slots))
        return m_new, l_i, acc

      return step

    def far_span(J, carry):
      qslot = lax.rem(J, 2)
      plgpu.barrier_wait(bars["qb"].at[qslot])
      per = span // wide
      carry = lax.fori_loop(J * per, (J + 1) * per, key(J, qslot), carry)
      pl.when(J + 2 < jc)(lambda: fetch_state(J + 2))   # its slot's last reader is done
      return carry

    m_i = plgpu.layout_cast(jnp.full((C,), -jnp.inf, f32), rows_layout)
    l_i = plgpu.layout_cast(jnp.zeros((C,), f32), rows_layout)
    acc = plgpu.layout_cast(jnp.zeros((C, D), f32), wgmma_layout)
    return lax.fori_loop(0, jc, far_span, (m_i, l_i, acc))

  def store(refs, m_i, l_i, acc, o_smem, lse_smem):
    c, h, b = n - 1 - lax.axis_index("c"), lax.axis_index("heads"), lax.axis_index("batch")
    none = l_i == 0.0
    o_smem[...] = acc / lax.broadcast_in_dim(jnp.where(none, 1.0, l_i), (C, D), [0])
    lse_smem[...] = jnp.where(none, -jnp.inf, m_i + jnp.log2(jnp.where(none, 1.0, l_i))) * (
        1.0 / LOG2E)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, refs["o"].at[b, h, c])
    plgpu.copy_smem_to_gmem(lse_smem, refs["lse"].at[b, h, c])
    plgpu.wait_smem_to_gmem(0)

  def tile(dtype, *shape):   # a [.., C, D] operand tile as wgmma reads it (128-byte swizzle)
    cols = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, cols)),
                                                plgpu.SwizzleTransform(128)))

  def scratch_of(x, ring_slots=None):
    shape = x.shape[3:] if ring_slots is None else (ring_slots, W) + x.shape[3:]
    if len(shape) == (1 if ring_slots is None else 2):   # a vector: no tiling
      return plgpu.SMEM(shape, x.dtype)
    return tile(x.dtype, *shape)

  names_in = list(head) + list(ring) + ["qb"]
  arrays = {**head, **ring, "qb": qbc}

  def entry(*refs_flat):
    refs = dict(zip(names_in + ["o", "lse"], refs_flat))
    smem_types = {name: scratch_of(head[name]) for name in head}
    smem_types.update({name: scratch_of(ring[name], slots) for name in ring})
    smem_types["qb"] = tile(dt, 2, C, D)
    bar_types = {name: plgpu.Barrier(num_barriers=slots) for name in ring}
    bar_types["qb"] = plgpu.Barrier(num_barriers=2)
    bar_types.update({name: plgpu.Barrier() for name in head})
    smem_names, bar_names = list(smem_types), list(bar_types)

    def scoped(*scratch):
      smem = dict(zip(smem_names, scratch[:len(smem_names)]))
      bars = dict(zip(bar_names, scratch[len(smem_names):]))
      return body(refs, smem, bars)

    # The float32 output tile takes the walk's buffers once the walk is done (a scope after
    # its scope): 96 KiB of shared memory a program at head_dim 128 instead of 128, two
    # programs an SM instead of one.
    out = pl.run_scoped(scoped, *smem_types.values(), *bar_types.values())
    pl.run_scoped(lambda o_smem, lse_smem: store(refs, *out, o_smem, lse_smem),
                  tile(f32, C, D), plgpu.SMEM((C,), f32))

  o, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((B, H, n, C, D), f32),
                jax.ShapeDtypeStruct((B, H, n, C), f32)),
      grid=(n, H, B), grid_names=("c", "heads", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(*(arrays[name] for name in names_in))
  return o, lse


def far_reference(ops, kb, qb, *, scale: float, span: int):
  """far_forward's oracle in plain jnp (float32 products of the stored bf16 states and keys):
  the same (o, lse). The interpreter runs it in far_forward's place (plgpu's wgmma does not run
  in interpret mode), so the near kernel's far=False form and the merge are tested on the CPU;
  TestGPU compares the Mosaic kernel with it on the device."""
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  f32 = jnp.float32
  qbc = qb.reshape(B, H, qb.shape[2] // C, C, D).astype(f32)
  kbh = jnp.repeat(kb, G, axis=1).astype(f32)
  vh = jnp.repeat(ops.v, G, axis=1).astype(f32)
  os_, lses = [], []
  for c in range(n):
    jc = c // span
    if jc == 0:
      os_.append(jnp.zeros((B, H, C, D), f32))
      lses.append(jnp.full((B, H, C), -jnp.inf, f32))
      continue
    keys = slice(0, jc * span)
    s = jnp.concatenate([
        scale * jnp.einsum("bhqd,bhkd->bhqk",
                           qbc[:, :, kernels.boundary_offset(J, n=n, span=span) + c
                               - (J + 1) * span],
                           kbh[:, :, J * span:(J + 1) * span].reshape(B, H, span * C, D),
                           precision=lax.Precision.HIGHEST)
        for J in range(jc)], axis=-1)
    if ops.fq is not None:
      s = s + ops.fq[:, :, c] - ops.fk[:, :, keys].reshape(B, H, 1, jc * span * C)
    if ops.sq is not None:
      same = ops.sq[:, :, c] == ops.sk[:, :, keys].reshape(B, 1, 1, jc * span * C)
      s = jnp.where(same, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse)[..., None])
    os_.append(jnp.einsum("bhqk,bhkd->bhqd", p, vh[:, :, keys].reshape(B, H, jc * span * C, D),
                          precision=lax.Precision.HIGHEST))
    lses.append(lse)
  return jnp.stack(os_, axis=2), jnp.stack(lses, axis=2)


def merge_far(o_near, lse_near, o_far, lse_far, *, dtype):
  """One softmax over the near and far keys from the two partial ones: o_near [B, H, n, C, D],
  lse_near [B, H, n, C, 1] (every row has its diagonal: finite), o_far, lse_far [B, H, n, C]
  (far_forward's; -inf where a row has no far key) -> (o in `dtype`, lse [B, H, n, C, 1])."""
  lse_far = lse_far[..., None]
  lse = jnp.logaddexp(lse_near, lse_far)
  o = o_near * jnp.exp(lse_near - lse) + o_far * jnp.exp(lse_far - lse)
  return o.astype(dtype), lse
