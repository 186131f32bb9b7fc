"""PaTH forward as a Mosaic GPU kernel (Hopper: TMA copies, wgmma), beside the Triton one.

Same walk as kernels.fwd_kernel: one program per (query chunk c, head, batch), the diagonal
from the pre-computed in-chunk logits, then key chunks m = c-1 .. 0 with an online softmax,
the query state moving one chunk left after each: q~ <- q~ - q~ E_m. One warpgroup (64 query
rows, the chunk) computes; the k, v and E chunks of the walk come through a ring of `slots`
shared-memory buffers filled by TMA, so the copy of step i + 1 (issued at the end of step
i - 1) overlaps step i's products. The state q~ stays in float32 registers in the wgmma
accumulator layout and enters each product as its bf16 cast (the A operand from registers),
as the Triton kernel's dot(q~.astype(dt), .) does.

Scope: transport (PaTH, with or without the forget gate and packed documents), bf16 or f16,
chunk 64, head_dim a multiple of 64; calls.forward raises for anything else.
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

# The launches' time-major inputs: v (Operands.v) and dO, chunked [B, n, C, heads, D]
# (prepass.chunked); every other array is blocked [B, heads, n, ...].
TIME_MAJOR = frozenset({"v", "vd", "do"})


def chunk_of(refs, name, b, head, m):
  """The GMEM ref of chunk m of `head`'s rows in array `name`: a blocked array's [C, ...]
  block, or for TIME_MAJOR a strided [C, D] box (rows heads * D elements apart; TMA takes the
  stride, as jax's own Mosaic GPU attention reads its [B, T, H, D] operands)."""
  ref = refs[name]
  return ref.at[b, m, :, head] if name in TIME_MAJOR else ref.at[b, head, m]


def smem_tile(dtype, *shape):
  """A shared-memory [.., rows, cols] tile laid out as wgmma reads it: 128-byte swizzle, tiles of
  8 rows by 128 bytes."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  cols = 128 // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, cols)),
                                              plgpu.SwizzleTransform(128)))


def two_products(a1, b1, a2, b2, *, rows, cols):
  """a1 b1^T and a2 b2^T ([rows, cols] float32 each, wgmma layout; b1, b2 in shared memory, read
  transposed), both issued before either is waited for: a tile's logits and dP."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental import pallas as pl
  zeros = lambda: plgpu.layout_cast(jnp.zeros((rows, cols), jnp.float32), plgpu.Layout.WGMMA)

  def issue(accs):
    plgpu.wgmma(accs[0], a1, plgpu.transpose_ref(b1, (1, 0)))
    plgpu.wgmma(accs[1], a2, plgpu.transpose_ref(b2, (1, 0)))

  return pl.run_state(issue)((plgpu.ACC.init(zeros()), plgpu.ACC.init(zeros())))


def gate_and_mask(s, *, fq=None, fk_ref=None, sq=None, sk_ref=None, ok=None):
  """Logits s [R, S] (wgmma layout, already in log2 units) plus the gate, masked to -inf where
  `ok` is False or the segment ids differ: fq, sq the query rows' gate sums and ids [R] (row
  layout, loaded once per program); fk_ref, sk_ref the key chunk's [S] in shared memory, loaded
  here as column vectors. None where the feature is off."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  cols_layout = plgpu.Layout.WGMMA.reduce(0)
  rows = lambda x: lax.broadcast_in_dim(x, s.shape, [0])
  cols = lambda x: lax.broadcast_in_dim(x, s.shape, [1])
  if fq is not None:
    s = s + (rows(fq) - cols(plgpu.load(fk_ref, (), layout=cols_layout))) * LOG2E
  if sq is not None:
    same = rows(sq) == cols(plgpu.load(sk_ref, (), layout=cols_layout))
    ok = same if ok is None else ok & same
  return s if ok is None else jnp.where(ok, s, -jnp.inf)


def supported(ops, bs) -> str | None:
  """None if the Mosaic forward takes these operands, else why not (calls.forward's fallback)."""
  C, D = ops.q.shape[3], ops.q.shape[4]
  if ops.e is None:
    return "no transport (FoX runs on the Triton kernel)"
  if ops.q.dtype not in (jnp.bfloat16, jnp.float16):
    return f"dtype {ops.q.dtype}"
  if C != 64 or D % 64:
    return f"chunk {C}, head_dim {D} (needs 64 and a multiple of 64)"
  return None


def forward(ops, *, scale: float, slots: int = 2):
  """-> o [B, n, C, H, D] (chunked; v's dtype), lse [B, H, n, C, 1] float32, as calls.forward.

  The gate and segment ids travel as [.., n, C] vectors: the query chunk's once per program
  (a row vector), the key chunk's with each walk step's k, v, E (a column vector), so a tile's
  logits are s + F_i - F_j, masked where the ids differ. Every chunk pair is walked (no
  prepass.chunk_bounds skipping yet): a masked tile contributes exp2(-inf) = 0."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  dt = ops.q.dtype
  f32 = jnp.float32
  gate, segments = ops.fq is not None, ops.sq is not None
  wgmma_layout = plgpu.Layout.WGMMA
  rows_layout = plgpu.Layout.WGMMA.reduce(1)

  # name -> (array, index of the chunk this program reads: "head" the query / kv head's
  # query-side chunk, "ring" the walk's key chunk). Vectors are [B, heads, n, C].
  vec = lambda x: x.reshape(x.shape[:3] + (C,))
  head = {"q": ops.q, "d": ops.diag, "vd": ops.v}
  ring = {"k": ops.k, "v": ops.v, "e": ops.e}
  if gate:
    head.update(fq=vec(ops.fq), fkd=vec(ops.fk))
    ring["fk"] = vec(ops.fk)
  if segments:
    head.update(sq=vec(ops.sq), skd=vec(ops.sk))
    ring["sk"] = vec(ops.sk)
  per_query_head = {"q", "d", "fq", "fkd", "fk"}   # the rest are per kv head (segments: one)

  def body(refs, smem, bars):
    c, h, b = lax.axis_index("c"), lax.axis_index("heads"), lax.axis_index("batch")
    c = n - 1 - c  # longest walks first (calls.chunk_grid's reverse)
    kh = lax.div(h, jnp.array(G, h.dtype))
    head_of = lambda name: (h if name in per_query_head else
                            0 if name in ("sq", "skd", "sk") else kh)

    def fetch(i):  # walk step i (key chunk c - 1 - i) into ring slot i % slots
      m, slot = c - 1 - i, lax.rem(i, jnp.array(slots, i.dtype))
      for name in ring:
        plgpu.copy_gmem_to_smem(chunk_of(refs, name, b, head_of(name), m), smem[name].at[slot],
                                bars[name].at[slot])

    for name in head:
      plgpu.copy_gmem_to_smem(chunk_of(refs, name, b, head_of(name), c), smem[name], bars[name])
    for i in range(slots):
      pl.when(i < c)(lambda i=i: fetch(jnp.int32(i)))
    for name in head:
      plgpu.barrier_wait(bars[name])

    rows = lambda x: lax.broadcast_in_dim(x, (C, C), [0])
    load = lambda ref, layout: plgpu.load(ref, (), layout=layout)
    fq = load(smem["fq"], rows_layout) if gate else None
    sq = load(smem["sq"], rows_layout) if segments else None

    # Diagonal chunk: every row sees itself, so the running max is finite from here on.
    row = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=wgmma_layout)
    col = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=wgmma_layout)
    s = gate_and_mask(load(smem["d"], wgmma_layout).astype(f32) * LOG2E, fq=fq,
                      fk_ref=smem.get("fkd"), sq=sq, sk_ref=smem.get("skd"), ok=row >= col)
    m_i = s.max(axis=1)
    p = jnp.exp2(s - rows(m_i))
    l_i = p.sum(axis=1)

    def pv(acc, p16, v):
      return pl.run_state(lambda r: plgpu.wgmma(r, p16, v))(plgpu.ACC.init(acc))

    acc = pv(plgpu.layout_cast(jnp.zeros((C, D), f32), wgmma_layout), p.astype(dt), smem["vd"])
    qt = load(smem["q"], wgmma_layout).astype(f32)

    def step(i, carry):
      qt, acc, m_i, l_i = carry
      slot = lax.rem(i, jnp.array(slots, i.dtype))
      at = lambda name: smem[name].at[slot] if name in smem else None
      qt16 = qt.astype(dt)
      plgpu.barrier_wait(bars["k"].at[slot])
      for name in ("fk", "sk"):
        if name in ring:
          plgpu.barrier_wait(bars[name].at[slot])

      def qk(r):
        plgpu.wgmma(r, qt16, plgpu.transpose_ref(at("k"), (1, 0)))
        return r[...]

      s = gate_and_mask(pl.run_scoped(qk, plgpu.ACC((C, C), f32)) * (scale * LOG2E), fq=fq,
                        fk_ref=at("fk"), sq=sq, sk_ref=at("sk"))
      m_new = jnp.maximum(m_i, s.max(axis=1))
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(s - rows(m_new))
      l_i = l_i * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, (C, D), [0])
      plgpu.barrier_wait(bars["v"].at[slot])
      acc = pv(acc, p.astype(dt), at("v"))
      plgpu.barrier_wait(bars["e"].at[slot])
      # q~ - q~ E_m: the accumulator starts at q~, the A operand is -q~ in the kernel dtype
      qt = pl.run_state(lambda r: plgpu.wgmma(r, -qt16, at("e")))(plgpu.ACC.init(qt))
      # every product reading this slot has completed (their results were read): refill it
      pl.when(i + slots < c)(lambda: fetch(i + slots))
      return qt, acc, m_new, l_i

    _, acc, m_i, l_i = lax.fori_loop(0, c, step, (qt, acc, m_i, l_i))
    smem["q"][...] = (acc / lax.broadcast_in_dim(l_i, (C, D), [0])).astype(dt)  # q's tile, reused
    smem["lse"][...] = (m_i + jnp.log2(l_i)) * (1.0 / LOG2E)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem["q"], refs["o"].at[b, c, :, h])   # time-major: a strided box
    plgpu.copy_smem_to_gmem(smem["lse"], refs["lse"].at[b, h, c])
    plgpu.wait_smem_to_gmem(0)

  def scratch_of(name, x, ring_slots=None):
    tile = (x.shape[2], x.shape[4]) if name in TIME_MAJOR else x.shape[3:]
    shape = tile if ring_slots is None else (ring_slots,) + tile
    if x.ndim == 4:  # a [C] vector: no tiling
      return plgpu.SMEM(shape, x.dtype)
    return smem_tile(dt, *shape)

  names_in = list(head) + [name for name in ring if name not in head]
  arrays = {**head, **ring}

  def entry(*refs_flat):
    refs = dict(zip(names_in + ["o", "lse"], refs_flat))
    smem_types = {name: scratch_of(name, head[name]) for name in head}
    smem_types.update({name: scratch_of(name, ring[name], slots) for name in ring})
    smem_types["lse"] = plgpu.SMEM((C,), f32)
    bar_types = {name: plgpu.Barrier(num_barriers=slots) for name in ring}
    bar_types.update({name: plgpu.Barrier() for name in head})
    smem_names, bar_names = list(smem_types), list(bar_types)

    def scoped(*scratch):
      smem = dict(zip(smem_names, scratch[:len(smem_names)]))
      bars = dict(zip(bar_names, scratch[len(smem_names):]))
      body(refs, smem, bars)

    pl.run_scoped(scoped, *smem_types.values(), *bar_types.values())

  o, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((B, n, C, H, D), ops.v.dtype),
                jax.ShapeDtypeStruct((B, H, n, C), f32)),
      grid=(n, H, B), grid_names=("c", "heads", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(*(arrays[name] for name in names_in))
  return o, lse[..., None]
