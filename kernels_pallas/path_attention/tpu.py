"""The TPU forms: the forward and backward walks as grid axes, one chunk per block.

On the GPU the kernels index whole-sequence operands in HBM (`ref[m]`). A TPU kernel sees its
blocks in VMEM, so that form would hold every chunk of q, dO, k, v, E and the in-chunk logits of
one (batch, head) there at once. Here the walk is the last grid axis j ("arbitrary"): each
step's BlockSpec index map picks the one chunk of each operand it needs, the walk's state lives
in VMEM scratch, and a step past the walk's end keeps the previous block index, so it fetches
nothing.

fwd_kv_kernel, grid (batch, head, query chunk c, j): step j reads key chunk m = c - j; the query
  tile's state, running max, sum and accumulator live in scratch across j; steps j > c are
  skipped with pl.when.

dkv_tpu_kernel, grid (B, K, key chunk m, j): step j reads query chunk c = m + j (j = 0: the
  diagonal), carrying the operator M_cm, dk, dv and dfk in scratch (dkv_step).

dq_tpu_kernel, grid (B, K, query chunk c, j), c and j both "arbitrary": dL/dP_m sums over every
  query chunk, so it stays in HBM (memory space ANY) and each sweep step moves its [D, D]
  float32 tile by DMA (read, add, write back; the first contribution, from query chunk m + 1,
  writes it). With transport, steps 1 .. c store the states s_m = q^_c M_cm right to left
  (m = c - j) and steps c+1 .. 2c sweep left to right with the adjoint (m = j - c - 1,
  tiles.dq_step); FoX sweeps at steps 1 .. c. The G query heads of the kv head share each key
  block. The states go to HBM the same way, one [C, D] tile per store and load, so nothing in
  VMEM grows with T. The DMAs are synchronous (start, wait): their latency is not hidden yet.

No chunk skipping (operands.chunk_bounds) on the TPU: a loop bound read from VMEM is a vector
value there; the masked tiles are computed and contribute zero.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.common import launch
from kernels_pallas.common.tiles import dot
from kernels_pallas.path_attention import operands
from kernels_pallas.path_attention.tiles import (diagonal, dq_step, eye, move, softmax_step,
                                                 tile_grads, tile_mask, unpack, unpack_forward)


def fwd_kv_kernel(*refs, scale, transport, gate, segments, precision):
  """refs (one chunk each): q [C,D] (chunk c), k, v [C,D], (e [D,D]) (chunk c - j), (diag [C,C]),
  (fq [C,1], fk [1,C]), (sq [C,1], sk [1,C]) -> o [C,D], lse [C,1]; scratch qt, m, l, acc."""
  q_ref, k_ref, v_ref, e_ref, d_ref, fq_ref, fk_ref, sq_ref, sk_ref, _, _, rest = unpack_forward(
      refs, transport, gate, segments)
  o_ref, lse_ref, qt_ref, m_ref, l_ref, acc_ref = rest
  c, j = pl.program_id(2), pl.program_id(3)
  C = q_ref.shape[0]
  dt = q_ref.dtype
  fq = None if fq_ref is None else fq_ref[...]
  sq = None if sq_ref is None else sq_ref[...]
  fk = None if fk_ref is None else fk_ref[...]
  sk = None if sk_ref is None else sk_ref[...]

  @pl.when(j == 0)
  def _():
    q = q_ref[...]
    m_i, l_i, acc = diagonal(q, k_ref[...], v_ref[...], d_ref, fq, fk, sq, sk, scale=scale,
                          precision=precision)
    qt_ref[...] = q.astype(jnp.float32)
    m_ref[...], l_ref[...], acc_ref[...] = m_i, l_i, acc

  @pl.when((j > 0) & (j <= c))
  def _():
    qt = qt_ref[...]
    gate_, ok = tile_mask(C, causal=False, fq=fq, fk=fk, sq=sq, sk=sk)
    m_ref[...], l_ref[...], acc_ref[...] = softmax_step(
        qt, m_ref[...], l_ref[...], acc_ref[...], k_ref[...], v_ref[...], gate_, ok, scale=scale,
        dt=dt, precision=precision)
    if transport:
      qt_ref[...] = move(qt, e_ref[...], dt=dt, precision=precision)

  @pl.when(j == c)  # last useful step: the output block is written back when c changes
  def _():
    o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)
    lse_ref[...] = m_ref[...] + jnp.log(l_ref[...])


def forward(ops, plan):
  """-> o [B, n, C, H, D] (chunked, as the GPU forward's), lse [B, H, n, C, 1] float32. Grid
  (B, H, n, n) with the key-chunk axis j last ("arbitrary"); step j reads key chunk
  max(c - j, 0), so skipped steps (j > c) keep the block index and fetch nothing."""
  ops = ops._replace(v=operands.heads_major(ops.v))   # TPU blocks: [C, D] tiles of [.., n, C, D]
  B, H, n, C, D = ops.q.shape
  G = H // ops.k.shape[1]
  f = operands.features(ops)
  blk = lambda x: (None, None, None) + x.shape[3:]
  qspec = lambda x: pl.BlockSpec(blk(x), lambda b, h, c, j: (b, h, c, 0, 0))
  kspec = lambda x, head: pl.BlockSpec(
      blk(x), lambda b, h, c, j: (b, head(h), jnp.maximum(c - j, 0), 0, 0))
  kv = lambda x: kspec(x, lambda h: h // G)
  args, specs = [ops.q, ops.k, ops.v], [qspec(ops.q), kv(ops.k), kv(ops.v)]
  if f["transport"]:
    args += [ops.e, ops.diag]
    specs += [kv(ops.e), qspec(ops.diag)]
  if f["gate"]:
    args += [ops.fq, ops.fk]
    specs += [qspec(ops.fq), kspec(ops.fk, lambda h: h)]
  if f["segments"]:
    args += [ops.sq, ops.sk]
    specs += [pl.BlockSpec(blk(ops.sq), lambda b, h, c, j: (b, 0, c, 0, 0)),
              kspec(ops.sk, lambda h: 0)]
  out_shape = [jax.ShapeDtypeStruct((B, H, n, C, D), ops.v.dtype),
               jax.ShapeDtypeStruct((B, H, n, C, 1), jnp.float32)]
  out_specs = [qspec(out_shape[0]), qspec(out_shape[1])]
  f32 = jnp.float32
  scratch = [pltpu.VMEM((C, D), f32), pltpu.VMEM((C, 1), f32), pltpu.VMEM((C, 1), f32),
             pltpu.VMEM((C, D), f32)]
  kernel = functools.partial(fwd_kv_kernel, scale=plan.scale, precision=plan.precision, **f)
  o, lse = launch.call(kernel, (B, H, n, n), specs, out_specs, out_shape,
                       backend=plan.spec.backend, scratch=scratch, sequential_axes=1)(*args)
  return operands.time_major(o), lse


def dkv_step(query, kc, mop, dk, dv, dfk, *, scale, transport, precision):
  """Query chunk c > m of every head of the group (query(g): head g's dict, loaded when its
  turn comes, so that one head's tiles are live at a time) against key chunk m
  (kc: k^, v, fk (a list over heads), sk), mop = M_cm -> dk, dv, dfk with chunk c added (the
  caller moves the operator on: M <- P_c M)."""
  dt = kc["k"].dtype
  kt = dot(kc["k"], mop.astype(dt), tb=True, precision=precision).astype(dt) if transport \
      else kc["k"]
  # Without transport dS^T q^ goes straight into dk (scale taken into dS before its cast): a
  # product added to a carried tile becomes the product's accumulator, where a per-step sum
  # over heads would be one more [R, D] float32 tile (the far dk/dv kernel's 2C-row tiles
  # spill at head_dim 128).
  a = jnp.zeros(dk.shape, jnp.float32) if transport else None
  dfk = list(dfk)
  for g in range(len(dfk)):
    qc = query(g)
    p, ds = tile_grads(qc, dict(kc, fk=kc["fk"][g]), scale * dot(qc["q"], kt, tb=True,
                                                                  precision=precision),
                       False, precision=precision)
    dv += dot(p.astype(dt), qc["do"], ta=True, precision=precision)
    if transport:
      a += dot(ds.astype(dt), qc["q"], ta=True, precision=precision)   # dS^T q^, over heads
    else:
      dk += dot((scale * ds).astype(dt), qc["q"], ta=True, precision=precision)
    if qc["fq"] is not None:
      dfk[g] = dfk[g] - jnp.sum(ds, axis=0, keepdims=True)
  if transport:
    dk += scale * dot(a.astype(dt), mop.astype(dt), precision=precision)
  return dk, dv, tuple(dfk)


def dkv_diagonal(query, kc, diag, dk, dv, dfk, *, scale, transport, precision):
  """The diagonal chunk c = m of every head (query(g), diag(g): head g's tiles and in-chunk
  logits); with transport its dS goes to the pre-pass (the dq kernels write it), so only dv and
  dfk take it."""
  dt = kc["k"].dtype
  dfk = list(dfk)
  for g in range(len(dfk)):
    qc = query(g)
    s = diag(g).astype(jnp.float32) if transport else scale * dot(qc["q"], kc["k"], tb=True,
                                                                   precision=precision)
    p, ds = tile_grads(qc, dict(kc, fk=kc["fk"][g]), s, True, precision=precision)
    dv += dot(p.astype(dt), qc["do"], ta=True, precision=precision)
    if qc["fq"] is not None:
      dfk[g] = dfk[g] - jnp.sum(ds, axis=0, keepdims=True)
    if not transport:
      dk += scale * dot(ds.astype(dt), qc["q"], ta=True, precision=precision)
  return dk, dv, tuple(dfk)


def _refs(refs, *, transport, gate, segments, outs, scratch):
  spec = [("q", True), ("k", True), ("v", True), ("e", transport), ("do", True), ("lse", True),
          ("delta", True), ("fq", gate), ("fk", gate), ("sq", segments), ("sk", segments),
          ("diag", transport)]
  return unpack(refs, spec + outs + scratch)


def _query(r, g, gate, segments):
  """Head g's query-side tiles of this step's query chunk."""
  return dict(q=r["q"][g], do=r["do"][g], lse=r["lse"][g], delta=r["delta"][g],
              fq=r["fq"][g] if gate else None, sq=r["sq"][...] if segments else None)


def dkv_tpu_kernel(*refs, scale, transport, gate, segments, precision):
  """Blocks (one chunk each): q, do [G, C, D], lse, delta, (fq) [G, C, 1], (sq [C, 1]),
  (diag [G, C, C]) of query chunk c = min(m + j, n - 1); k, v [C, D], (fk [G, 1, C]),
  (sk [1, C]) of key chunk m; (e [D, D]) of chunk c. Out: dk, dv [C, D], (dfk [G, 1, C]) of key
  chunk m, written at the last step. Scratch: M [D, D], dk, dv [C, D], dfk [G, 1, C] float32."""
  r = _refs(refs, transport=transport, gate=gate, segments=segments,
            outs=[("dk", True), ("dv", True), ("dfk", gate)],
            scratch=[("mop", True), ("dk_acc", True), ("dv_acc", True), ("dfk_acc", True)])
  G = r["q"].shape[0]
  m, j, n = pl.program_id(2), pl.program_id(3), pl.num_programs(3)
  kc = dict(k=r["k"][...], v=r["v"][...], fk=[r["fk"][g] if gate else None for g in range(G)],
            sk=r["sk"][...] if segments else None)
  query = lambda g: _query(r, g, gate, segments)
  kw = dict(scale=scale, transport=transport, precision=precision)

  def load():
    return r["dk_acc"][...], r["dv_acc"][...], tuple(r["dfk_acc"][g] for g in range(G))

  def store(dk, dv, dfk):
    r["dk_acc"][...], r["dv_acc"][...] = dk, dv
    for g in range(G):
      r["dfk_acc"][g] = dfk[g]

  @pl.when(j == 0)
  def _():
    D = r["mop"].shape[0]
    r["mop"][...] = eye(D)
    zero = jnp.zeros(r["dk_acc"].shape, jnp.float32)
    store(*dkv_diagonal(query, kc, lambda g: r["diag"][g], zero, zero,
                                    tuple(jnp.zeros((1, zero.shape[0]), jnp.float32)
                                          for _ in range(G)), **kw))

  @pl.when((j > 0) & (m + j < n))
  def _():
    mop = r["mop"][...]
    store(*dkv_step(query, kc, mop, *load(), **kw))
    if transport:
      r["mop"][...] = mop - dot(r["e"][...], mop.astype(r["q"].dtype), precision=precision)

  @pl.when(j == n - 1)
  def _():
    dk, dv, dfk = load()
    r["dk"][...] = dk.astype(r["dk"].dtype)
    r["dv"][...] = dv.astype(r["dv"].dtype)
    if gate:
      for g in range(G):
        r["dfk"][g] = dfk[g]


def dq_tpu_kernel(*refs, scale, transport, gate, segments, precision):
  """Blocks: the query-side ones (as dkv_tpu_kernel's) of query chunk c; k, v, (fk), (sk) of
  key chunk key_chunk(c, j), (e) of transport_chunk(c, j) (backward below). Out: dq [G, C, D],
  (ddiag [G, C, C]), (dfq [G, C, 1]) of chunk c. With transport two outputs stay in HBM
  (memory space ANY) and move by DMA one chunk at a time: dP [B, K, n, D, D] float32 and the
  states [B, K, G, n, C, D] (kernel dtype; scratch, dropped by the caller). Scratch: adj
  [G, C, D], dfq [G, C, 1] float32; with transport the moving state [G, C, D] float32, one
  state tile [C, D], one dP tile [D, D] and a DMA semaphore."""
  r = _refs(refs, transport=transport, gate=gate, segments=segments,
            outs=[("dq", True), ("ddiag", transport), ("dp", transport), ("st", transport),
                  ("dfq", gate)],
            scratch=[("adj", True), ("dfq_acc", True), ("qt", transport), ("st_tile", transport),
                     ("dp_tile", transport), ("sem", transport)])
  G, C, D = r["q"].shape
  b, kh, c, j = (pl.program_id(i) for i in range(4))
  n = pl.num_programs(2)
  dt = r["q"].dtype
  f32 = jnp.float32
  off = c if transport else 0   # the sweep's first step is off + 1
  kc = lambda g: dict(k=r["k"][...], v=r["v"][...], e=r["e"][...] if transport else None,
                      fk=r["fk"][g] if gate else None, sk=r["sk"][...] if segments else None)

  def copy(src, dst):  # one synchronous DMA (HBM <-> VMEM)
    cp = pltpu.make_async_copy(src, dst, r["sem"])
    cp.start()
    cp.wait()

  if transport:
    # dP_m's first contribution comes from query chunk m + 1 (chunks run in order), which
    # writes it; the last key chunk has none and is zeroed by the last query chunk.
    @pl.when((c == n - 1) & (j == 0))
    def _():
      r["dp_tile"][...] = jnp.zeros((D, D), f32)
      copy(r["dp_tile"], r["dp"].at[b, kh, n - 1])

  @pl.when(j == 0)
  def _():  # the diagonal (key chunk c)
    for g in range(G):
      qc = _query(r, g, gate, segments)
      if transport:
        _, ds = tile_grads(qc, kc(g), r["diag"][g].astype(f32), True,
                                       precision=precision)
        r["ddiag"][g] = ds.astype(r["ddiag"].dtype)
        r["adj"][g] = jnp.zeros((C, D), f32)
        r["qt"][g] = qc["q"].astype(f32)
      else:
        _, ds = tile_grads(
            qc, kc(g), scale * dot(qc["q"], r["k"][...], tb=True, precision=precision), True,
            precision=precision)
        r["adj"][g] = scale * dot(ds.astype(dt), r["k"][...], precision=precision)
      r["dfq_acc"][g] = jnp.sum(ds, axis=1, keepdims=True)

  if transport:
    @pl.when((j > 0) & (j <= c))
    def _():  # the state against key chunk m = c - j, then across it
      m = c - j
      for g in range(G):
        qt = r["qt"][g]
        r["st_tile"][...] = qt.astype(dt)
        copy(r["st_tile"], r["st"].at[b, kh, g, m])
        r["qt"][g] = qt - dot(qt.astype(dt), r["e"][...], precision=precision)

  @pl.when((j > off) & (j <= off + c))
  def _():  # the sweep: key chunk m = j - off - 1
    m = j - off - 1
    dp = None
    for g in range(G):
      if transport:
        copy(r["st"].at[b, kh, g, m], r["st_tile"])
        qt = r["st_tile"][...]
      else:
        qt = r["q"][g]
      adj, dfq, dpg = dq_step(_query(r, g, gate, segments), kc(g), qt, r["adj"][g],
                              r["dfq_acc"][g], scale=scale, transport=transport,
                              precision=precision)
      r["adj"][g], r["dfq_acc"][g] = adj, dfq
      dp = dpg if dp is None or dpg is None else dp + dpg
    if transport:
      first = c == m + 1

      @pl.when(jnp.logical_not(first))
      def _():
        copy(r["dp"].at[b, kh, m], r["dp_tile"])

      r["dp_tile"][...] = jnp.where(first, 0.0, r["dp_tile"][...]) + dp
      copy(r["dp_tile"], r["dp"].at[b, kh, m])

  @pl.when(j == off + c)
  def _():  # the last useful step of chunk c: the output blocks leave when c changes
    for g in range(G):
      r["dq"][g] = r["adj"][g].astype(r["dq"].dtype)
      if gate:
        r["dfq"][g] = r["dfq_acc"][g]


def backward(ops, do, lse, delta, plan):
  """The TPU backward: backward.backward's gradients (dict(q, k, v, diag?, dp?, fq?, fk?)),
  v chunked as the GPU form's; do chunked [B, n, C, H, D]."""
  ops = ops._replace(v=operands.heads_major(ops.v))
  do = operands.heads_major(do)
  scale, precision, backend = plan.scale, plan.precision, plan.spec.backend
  B, H, n, C, D = ops.q.shape
  K = ops.k.shape[1]
  G = H // K
  f = operands.features(ops)
  transport = f["transport"]
  f32 = jnp.float32
  dt = ops.q.dtype
  blk = lambda x, heads: (None, heads, None) + x.shape[3:]

  def specs(q_chunk, k_chunk, e_chunk):
    """BlockSpecs of the operands (tiles.backward_spec's order) given program ids -> chunk maps."""
    grp = lambda x: pl.BlockSpec(blk(x, G), lambda b, h, i, j: (b, h, q_chunk(i, j), 0, 0))
    at = lambda x, head, chunk: pl.BlockSpec(
        blk(x, None), lambda b, h, i, j: (b, head(h), chunk(i, j), 0, 0))
    args = [ops.q, ops.k, ops.v] + ([ops.e] if transport else []) + [do, lse, delta]
    sp = [grp(ops.q), at(ops.k, lambda h: h, k_chunk), at(ops.v, lambda h: h, k_chunk)]
    sp += [at(ops.e, lambda h: h, e_chunk)] if transport else []
    sp += [grp(do), grp(lse), grp(delta)]
    if f["gate"]:
      args += [ops.fq, ops.fk]
      sp += [grp(ops.fq), pl.BlockSpec(blk(ops.fk, G),
                                       lambda b, h, i, j: (b, h, k_chunk(i, j), 0, 0))]
    if f["segments"]:
      args += [ops.sq, ops.sk]
      sp += [at(ops.sq, lambda h: 0, q_chunk), at(ops.sk, lambda h: 0, k_chunk)]
    if transport:
      args.append(ops.diag)
      sp.append(grp(ops.diag))
    return args, sp

  kw = dict(scale=scale, precision=precision, **f)

  # dk / dv: program (b, kv head, key chunk m), step j reads query chunk min(m + j, n - 1).
  q_of = lambda m, j: jnp.minimum(m + j, n - 1)
  args, sp = specs(q_of, lambda m, j: m, q_of)
  out_spec = lambda x, heads: pl.BlockSpec(blk(x, heads), lambda b, h, m, j: (b, h, m, 0, 0))
  out_shape = [jax.ShapeDtypeStruct((B, K, n, C, D), dt)] * 2
  out_specs = [out_spec(out_shape[0], None)] * 2
  if f["gate"]:
    out_shape.append(jax.ShapeDtypeStruct((B, H, n, 1, C), f32))
    out_specs.append(out_spec(out_shape[2], G))
  scratch = [pltpu.VMEM((D, D), f32), pltpu.VMEM((C, D), f32), pltpu.VMEM((C, D), f32),
             pltpu.VMEM((G, 1, C), f32)]
  outs = launch.call(functools.partial(dkv_tpu_kernel, **kw), (B, K, n, n), sp, out_specs,
                     out_shape, backend=backend, scratch=scratch, sequential_axes=1)(*args)
  grads = dict(k=outs[0], v=outs[1])
  if f["gate"]:
    grads["fk"] = outs[2]

  # dq / dP: program (b, kv head, query chunk c), step j; see dq_tpu_kernel for the phases.
  if transport:
    steps = 2 * n - 1
    sweep = lambda c, j: jnp.clip(j - c - 1, 0, jnp.maximum(c - 1, 0))
    # k, v stay on chunk c while the states are stored (steps 1 .. c), then follow the sweep;
    # E follows the store right to left, then the sweep (one fetch at the turn: both read 0).
    k_of = lambda c, j: jnp.where(j <= c, c, sweep(c, j))
    e_of = lambda c, j: jnp.where(j == 0, jnp.maximum(c - 1, 0),
                                  jnp.where(j <= c, c - j, sweep(c, j)))
  else:
    steps = n
    k_of = lambda c, j: jnp.where(j == 0, c, jnp.clip(j - 1, 0, jnp.maximum(c - 1, 0)))
    e_of = None
  args, sp = specs(lambda c, j: c, k_of, e_of)
  q_out = lambda x: pl.BlockSpec(blk(x, G), lambda b, h, c, j: (b, h, c, 0, 0))
  names, out_shape = ["q"], [jax.ShapeDtypeStruct((B, H, n, C, D), dt)]
  if transport:
    names += ["diag", "dp", "states"]
    out_shape += [jax.ShapeDtypeStruct((B, H, n, C, C), dt),
                  jax.ShapeDtypeStruct((B, K, n, D, D), f32),
                  jax.ShapeDtypeStruct((B, K, G, n, C, D), dt)]
  if f["gate"]:
    names.append("fq")
    out_shape.append(jax.ShapeDtypeStruct((B, H, n, C, 1), f32))
  # left in HBM, moved by the kernel's own DMAs (pl.ANY; its TPU spelling where that is gone)
  hbm = pl.BlockSpec(memory_space=getattr(pl, "ANY", None) or pltpu.MemorySpace.HBM)
  out_specs = [hbm if name in ("dp", "states") else q_out(s)
               for name, s in zip(names, out_shape)]
  scratch = [pltpu.VMEM((G, C, D), f32), pltpu.VMEM((G, C, 1), f32)]
  if transport:
    scratch += [pltpu.VMEM((G, C, D), f32), pltpu.VMEM((C, D), dt), pltpu.VMEM((D, D), f32),
                pltpu.SemaphoreType.DMA(())]
  outs = launch.call(functools.partial(dq_tpu_kernel, **kw), (B, K, n, steps), sp, out_specs,
                     out_shape, backend=backend, scratch=scratch, sequential_axes=2)(*args)
  grads.update(zip(names, outs))
  grads.pop("states", None)
  return {**grads, "v": operands.time_major(grads["v"])}
