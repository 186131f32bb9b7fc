"""What the Mosaic GPU launches share (Hopper: TMA copies, wgmma, warp specialisation): their
shapes, shared-memory tiles, the gate and mask of a logits tile, the three-warpgroup launch and
the copying warpgroup's ring.

Every launch here is organised as jax's own Mosaic GPU flash attention
(jax/experimental/pallas/ops/gpu/attention_mgpu.py): two compute warpgroups (one 64-row chunk
each) and a third that only issues TMA copies into rings of shared-memory slots (copy_ring),
refilling a slot once both compute warpgroups have arrived at its "consumed" barrier. Logits
are in log2 units (exp2 online softmax). wgmma does not run in interpret mode: each launch has
a jnp oracle that the interpreter runs in its place; lowering is tested on a CPU host.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)

# The launches' time-major inputs: v (Operands.v) and dO, chunked [B, n, C, heads, D]
# (operands.chunked); every other array is blocked [B, heads, n, ...].
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
  cols = 128 // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, cols)),
                                              plgpu.SwizzleTransform(128)))


def two_products(a1, b1, a2, b2, *, rows, cols):
  """a1 b1^T and a2 b2^T ([rows, cols] float32 each, wgmma layout; b1, b2 in shared memory, read
  transposed), both issued before either is waited for: a tile's logits and dP."""
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
  cols_layout = plgpu.Layout.WGMMA.reduce(0)
  rows = lambda x: lax.broadcast_in_dim(x, s.shape, [0])
  cols = lambda x: lax.broadcast_in_dim(x, s.shape, [1])
  if fq is not None:
    s = s + (rows(fq) - cols(plgpu.load(fk_ref, (), layout=cols_layout))) * LOG2E
  if sq is not None:
    same = rows(sq) == cols(plgpu.load(sk_ref, (), layout=cols_layout))
    ok = same if ok is None else ok & same
  return s if ok is None else jnp.where(ok, s, -jnp.inf)


def dims(ops):
  """The Mosaic launches' shapes and flags from the pre-pass Operands: (B, H, K, G, n, C, D,
  kernel dtype, gate, segments), G = H // K query heads a kv head."""
  B, H, n, C, D = ops.q.shape
  K = ops.k.shape[1]
  return B, H, K, H // K, n, C, D, ops.q.dtype, ops.fq is not None, ops.sq is not None


def as_vector(x, C):
  """A per-row quantity [B, heads, n, C, 1] (or [.., 1, C]) as [B, heads, n, C]: one TMA copy of
  a chunk's C values."""
  return x.reshape(x.shape[:3] + (C,))


def gate_vectors(ops, C, *, query_side, key_side):
  """The gate sums and segment ids as [B, heads, n, C] vectors (as_vector), into two dicts:
  `query_side` gets fq, sq and `key_side` fk, sk (where present)."""
  vec = lambda x: as_vector(x, C)
  if ops.fq is not None:
    query_side["fq"] = vec(ops.fq)
    key_side["fk"] = vec(ops.fk)
  if ops.sq is not None:
    query_side["sq"] = vec(ops.sq)
    key_side["sk"] = vec(ops.sk)


def slot_types(arrays, slots, C, D):
  """Shared-memory rings of `slots` chunks for the [B, heads, n, C] vectors and the [C, D] tiles
  of [B, heads, n, C, D] or chunked [B, n, C, heads, D] arrays (name -> type): a [C] vector
  plain, a [C, D] tile as wgmma reads it (smem_tile)."""
  return {name: (plgpu.SMEM((slots, C), x.dtype) if x.ndim == 4
                 else smem_tile(x.dtype, slots, C, D)) for name, x in arrays.items()}


def first_span(refs, *, b, c0, n, span, jc):
  """The first far span a program of query chunks c0, c0 + 1 walks: with packed documents
  (refs has "lo", operands.chunk_bounds' [B, 1, n, 1, 1], read as scalars from GMEM) the span of
  the earliest key chunk either chunk's documents reach, at most jc; else 0. The spans before
  it hold only keys masked for every row of both chunks."""
  if "lo" not in refs:
    return jnp.int32(0)
  lo = jnp.minimum(refs["lo"][b, 0, c0, 0, 0], refs["lo"][b, 0, jnp.minimum(c0 + 1, n - 1), 0, 0])
  return jnp.minimum(lax.div(lo, jnp.array(span, lo.dtype)), jc)


def query_pair(refs, *, n, span, G, per_query_head):
  """The program of the far forward and far dq (grid ("c", "heads", "batch"), warpgroups "wg"):
  query chunks c0, c0 + 1 of query head h, batch b, the programs with the most far keys first.
  -> (wg, h, b, c0, kh its kv head, head_of(name): the head index of an input (h for those in
  `per_query_head`, 0 for the segment ids, else kh), jc c0's span, j0 first_span)."""
  pairs = (n + 1) // 2
  p, h, b = lax.axis_index("c"), lax.axis_index("heads"), lax.axis_index("batch")
  wg = lax.axis_index("wg")
  c0 = 2 * (pairs - 1 - p)
  kh = lax.div(h, jnp.array(G, h.dtype))
  head_of = lambda name: h if name in per_query_head else 0 if name in ("sq", "sk") else kh
  jc = lax.div(c0, jnp.array(span, c0.dtype))
  j0 = first_span(refs, b=b, c0=c0, n=n, span=span, jc=jc)
  return wg, h, b, c0, kh, head_of, jc, j0


def launch(body, arrays, out_type, *, smem_types, bar_types, consumed_types, grid, grid_names,
           mutable=()):
  """plgpu.kernel of body(refs, smem, bars, consumed) with three warpgroups (axis "wg": two
  compute, one copying) over `grid`: refs maps the names of `arrays` (inputs, in order) and of
  `out_type` (a dict of output shapes) to their GMEM refs, smem / bars / consumed the names of
  the scratch dicts to their allocations (consumed: the compute warpgroups' arrivals). -> the
  outputs, in out_type's order, then the final values of the `mutable` arrays: those the kernel
  updates in place (passed as JAX refs, so the launch aliases them to its outputs: no copy)."""
  names = list(arrays) + list(out_type)
  scratch = [smem_types, bar_types, consumed_types]

  def entry(*refs_flat):
    def scoped(*allocs):
      split, i = [], 0
      for kind in scratch:
        split.append(dict(zip(kind, allocs[i:i + len(kind)])))
        i += len(kind)
      body(dict(zip(names, refs_flat)), *split)

    pl.run_scoped(scoped, *(t for kind in scratch for t in kind.values()),
                  collective_axes="wg")

  params = plgpu.CompilerParams(approx_math=True)
  if not mutable:
    return plgpu.kernel(
        entry, out_type=tuple(out_type.values()), grid=grid, grid_names=grid_names,
        num_threads=3, thread_name="wg", compiler_params=params,
    )(*arrays.values())
  # plgpu.kernel's batching wrapper takes no refs; pl.kernel over the same mesh does
  refs = {name: jax.new_ref(arrays[name]) for name in mutable}
  mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=3, thread_name="wg")
  outs = pl.kernel(entry, out_type=tuple(out_type.values()), mesh=mesh, compiler_params=params)(
      *(refs.get(name, x) for name, x in arrays.items()))
  return tuple(outs) + tuple(refs[name][...] for name in mutable)


def copy_ring(*, start, stop, slots, fill, refill, before=None):
  """The copying warpgroup's loop over the ring's items t = start .. stop - 1, item t in slot
  t % slots: the first `slots` items at once (fill(t)), then each later one as soon as its
  slot's previous item is consumed (refill(t, slot): wait on the slot's consumed barriers,
  then copy). before(t), where given, runs ahead of each item's copies (a copy of another
  array that item t's position triggers). A Python int `start` gives int32 items."""
  for i in range(slots):
    t = start + i
    t = jnp.int32(t) if isinstance(t, int) else t

    @pl.when(t < stop)
    def _(t=t):
      if before is not None:
        before(t)
      fill(t)

  def step(i, carry):
    t = i + slots
    slot = lax.rem(i, jnp.array(slots, i.dtype))
    if before is not None:
      before(t)
    refill(t, slot)
    return carry

  lax.fori_loop(start, jnp.maximum(stop - slots, start), step, 0)


def key_value_ring(refs, smem, bars, consumed, *, ring, b, head_of, start, stop, slots,
                   before=None):
  """The far walks' key ring (far forward, far dq): key chunks start .. stop - 1 of the arrays
  `ring` names (k or kb, v, and the gate's fk / segment ids sk) into their slots by copy_ring.
  A slot's keys (all but v) are refilled once both compute warpgroups have read the logits
  (consumed["k"]), its v once they have taken p v (consumed["v"])."""
  keys = [name for name in ring if name != "v"]

  def fetch(t, names):
    slot = lax.rem(t, jnp.array(slots, t.dtype))
    for name in names:
      plgpu.copy_gmem_to_smem(chunk_of(refs, name, b, head_of(name), t), smem[name].at[slot],
                              bars[name].at[slot])

  def refill(t, slot):
    plgpu.barrier_wait(consumed["k"].at[slot])
    fetch(t, keys)
    plgpu.barrier_wait(consumed["v"].at[slot])
    fetch(t, ["v"])

  copy_ring(start=start, stop=stop, slots=slots, fill=lambda t: fetch(t, list(ring)),
            refill=refill, before=before)
