"""PaTH forward as a Mosaic GPU kernel (Hopper: TMA copies, wgmma), beside the Triton one.

Same walk as kernels.fwd_kernel: one program per (query chunk c, head, batch), the diagonal
from the pre-computed in-chunk logits, then key chunks m = c-1 .. 0 with an online softmax,
the query state moving one chunk left after each: q~ <- q~ - q~ E_m. One warpgroup (64 query
rows, the chunk) computes; the k, v and E chunks of the walk come through a ring of `slots`
shared-memory buffers filled by TMA, so the copy of step i + 1 (issued at the end of step
i - 1) overlaps step i's products. The state q~ stays in float32 registers in the wgmma
accumulator layout and enters each product as its bf16 cast (the A operand from registers),
as the Triton kernel's dot(q~.astype(dt), .) does.

Scope of this first version: transport without the gate or packed documents, bf16 or f16,
chunk 64, head_dim a multiple of 64 (calls.forward routes everything else to Triton).
Selected by BlockSizes(fwd_kernel="mosaic"); lowering is tested on the CPU host, the kernel
has not run on a GPU yet.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

LOG2E = math.log2(math.e)


def supported(ops, bs) -> str | None:
  """None if the Mosaic forward takes these operands, else why not (calls.forward's fallback)."""
  C, D = ops.q.shape[3], ops.q.shape[4]
  if ops.e is None:
    return "no transport (FoX runs on the Triton kernel)"
  if ops.fq is not None or ops.sq is not None:
    return "gate or segments"
  if ops.q.dtype not in (jnp.bfloat16, jnp.float16):
    return f"dtype {ops.q.dtype}"
  if C != 64 or D % 64:
    return f"chunk {C}, head_dim {D} (needs 64 and a multiple of 64)"
  return None


def forward(ops, *, scale: float, slots: int = 2):
  """-> o [B, H, n, C, D] (v's dtype), lse [B, H, n, C, 1] float32, as calls.forward."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  dt = ops.q.dtype
  f32 = jnp.float32
  wgmma_layout = plgpu.Layout.WGMMA

  def body(q_ref, k_ref, v_ref, e_ref, d_ref, o_ref, lse_ref, scratch):
    (q_smem, d_smem, vd_smem, k_smem, v_smem, e_smem, lse_smem), bars = scratch
    head_bars, k_bars, v_bars, e_bars = bars
    c, h, b = lax.axis_index("c"), lax.axis_index("heads"), lax.axis_index("batch")
    c = n - 1 - c  # longest walks first (calls.chunk_grid's reverse)
    kh = lax.div(h, jnp.array(G, h.dtype))

    def fetch(i):  # the k, v, E chunks of walk step i (key chunk c - 1 - i) into slot i % slots
      m, slot = c - 1 - i, lax.rem(i, jnp.array(slots, i.dtype))
      plgpu.copy_gmem_to_smem(k_ref.at[b, kh, m], k_smem.at[slot], k_bars.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[b, kh, m], v_smem.at[slot], v_bars.at[slot])
      plgpu.copy_gmem_to_smem(e_ref.at[b, kh, m], e_smem.at[slot], e_bars.at[slot])

    for j, (src, dst) in enumerate(((q_ref.at[b, h, c], q_smem), (d_ref.at[b, h, c], d_smem),
                                    (v_ref.at[b, kh, c], vd_smem))):
      plgpu.copy_gmem_to_smem(src, dst, head_bars.at[j])
    for i in range(slots):
      pl.when(i < c)(lambda i=i: fetch(jnp.int32(i)))
    for j in range(3):
      plgpu.barrier_wait(head_bars.at[j])

    # Diagonal chunk: every row sees itself, so the running max is finite from here on.
    s = plgpu.load(d_smem, (), layout=wgmma_layout).astype(f32)
    row = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=wgmma_layout)
    col = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=wgmma_layout)
    s = jnp.where(row >= col, s * LOG2E, -jnp.inf)   # log2 units: exp2 below
    m_i = s.max(axis=1)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_i, (C, C), [0]))
    l_i = p.sum(axis=1)

    def pv(acc, p16, v):
      return pl.run_state(lambda r: plgpu.wgmma(r, p16, v))(plgpu.ACC.init(acc))

    acc = pv(plgpu.layout_cast(jnp.zeros((C, D), f32), wgmma_layout), p.astype(dt), vd_smem)
    qt = plgpu.load(q_smem, (), layout=wgmma_layout).astype(f32)

    def step(i, carry):
      qt, acc, m_i, l_i = carry
      slot = lax.rem(i, jnp.array(slots, i.dtype))
      qt16 = qt.astype(dt)
      plgpu.barrier_wait(k_bars.at[slot])

      def qk(r):
        plgpu.wgmma(r, qt16, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
        return r[...]

      s = pl.run_scoped(qk, plgpu.ACC((C, C), f32)) * (scale * LOG2E)
      m_new = jnp.maximum(m_i, s.max(axis=1))
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, (C, C), [0]))
      l_i = l_i * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, (C, D), [0])
      plgpu.barrier_wait(v_bars.at[slot])
      acc = pv(acc, p.astype(dt), v_smem.at[slot])
      plgpu.barrier_wait(e_bars.at[slot])
      # q~ - q~ E_m: the accumulator starts at q~, the A operand is -q~ in the kernel dtype
      qt = pl.run_state(lambda r: plgpu.wgmma(r, -qt16, e_smem.at[slot]))(plgpu.ACC.init(qt))
      # every product reading this slot has completed (their results were read): refill it
      pl.when(i + slots < c)(lambda: fetch(i + slots))
      return qt, acc, m_new, l_i

    _, acc, m_i, l_i = lax.fori_loop(0, c, step, (qt, acc, m_i, l_i))
    q_smem[...] = (acc / lax.broadcast_in_dim(l_i, (C, D), [0])).astype(dt)   # reuse q's tile
    lse_smem[...] = (m_i + jnp.log2(l_i)) * (1.0 / LOG2E)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, h, c])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, c])
    plgpu.wait_smem_to_gmem(0)

  def entry(q_ref, k_ref, v_ref, e_ref, d_ref, o_ref, lse_ref):
    tile = lambda *shape: plgpu.SMEM(shape, dt, transforms=(
        plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    smem = (tile(C, D), tile(C, C), tile(C, D), tile(slots, C, D), tile(slots, C, D),
            tile(slots, D, D), plgpu.SMEM((C,), f32))
    bars = (plgpu.Barrier(num_barriers=3), plgpu.Barrier(num_barriers=slots),
            plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots))
    pl.run_scoped(lambda *scratch: body(q_ref, k_ref, v_ref, e_ref, d_ref, o_ref, lse_ref,
                                        (scratch[:7], scratch[7:])), *smem, *bars)

  o, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((B, H, n, C, D), ops.v.dtype),
                jax.ShapeDtypeStruct((B, H, n, C), f32)),
      grid=(n, H, B), grid_names=("c", "heads", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(ops.q, ops.k, ops.v, ops.e, ops.diag)
  return o, lse[..., None]
