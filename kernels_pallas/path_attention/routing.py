"""Which form of each PaTH kernel runs: BlockSizes' automatic (None) fields resolved for the
operands and backend, from measurements (each function's docstring has its numbers).

The span length and where the span forms apply (auto_span, dkv_span, forward_span,
span_backward, span_form), the Mosaic-GPU-or-Triton choices of the far walks and the span sweep
(choose_mosaic and its callers), the operator chains' precision (chain_products), the fused
dq/dP + dk/dv sweep (fused_dkv) and the dq/dP kernel's lanes (auto_lanes). calls.py and
calls_span.py launch what these choose.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.path_attention.block_sizes import BlockSizes
from kernels_pallas.path_attention.prepass import Operands


def far_launch(ops: Operands, bs: BlockSizes, backend: str, span: int) -> bool:
  """Whether the span forward (span > 0) sends its far keys to their own Mosaic GPU launch
  (BlockSizes.fwd_far, fwd_far_mosaic.py): mosaic_launch's choice."""
  return bool(span) and mosaic_launch(ops, bs, backend, "fwd_far")


def mosaic_launch(ops: Operands, bs: BlockSizes, backend: str, field: str) -> bool:
  """Whether the far walk that BlockSizes.`field` names runs as its own Mosaic GPU launch:
  fwd_far, the span forward's far keys (fwd_far_mosaic.py); far_dq, the span backward's far dq
  walk and adjoint chain, far_dk, its far dk/dv walk (bwd_far_mosaic.py): choose_mosaic, with
  the GPU's condition fwd_far_mosaic.supported (packed documents included: every launch skips
  the far spans outside a chunk's documents, as the Triton kernels do)."""
  from kernels_pallas.path_attention import fwd_far_mosaic
  return choose_mosaic(bs, backend, field,
                       why=fwd_far_mosaic.supported(ops) if backend == "gpu" else None)


def choose_mosaic(bs: BlockSizes, backend: str, field: str, *, why: str | None,
                  needs: str = "bf16/f16 and block 64") -> bool:
  """BlockSizes.`field`'s choice between a Triton kernel and a Mosaic GPU launch, whose jnp
  oracle the interpreter runs in its place. why: the reason the launch cannot take these
  operands on this backend (None: it can). None (the field): on the GPU where it can;
  "triton": no; "mosaic": yes, raising (naming the field and `needs`) where it cannot."""
  choice = getattr(bs, field)
  if choice == "triton":
    return False
  if choice is None:
    return backend == "gpu" and why is None
  if backend not in ("gpu", "interpret") or why:
    raise ValueError(f"{field}='mosaic' needs the GPU backend (or the interpreter), {needs} "
                     f"(got backend {backend!r}{', ' + why if why else ''})")
  return True


def forward_span(ops: Operands, bs: BlockSizes, backend: str) -> int:
  """The span of the forward kernel's far steps (BlockSizes.fwd_spans, None: at head_dim > 64;
  the backward's span, dkv_span, so that one boundary launch serves both), or 0."""
  on = ops.q.shape[-1] > 64 if bs.fwd_spans is None else bs.fwd_spans
  return dkv_span(ops, bs, backend) if on and bs.fwd_kernel != "mosaic" else 0


def span_backward(ops: Operands, bs: BlockSizes, backend: str) -> tuple[int, BlockSizes]:
  """(span, bs with bwd_spans resolved by span_form) where the span-parallel backward
  (calls_span.backward) runs: PaTH with a span boundary inside the sequence; else (0, bs)."""
  span = dkv_span(ops, bs, backend)
  if not span:
    return 0, bs
  form = span_form(bs, head_dim=ops.q.shape[-1], chunks=ops.q.shape[2],
                   far_dkv_mosaic=lambda: mosaic_launch(ops, bs, backend, "far_dkv"))
  return (span, dataclasses.replace(bs, bwd_spans=form)) if form else (0, bs)


# span_form: from this many chunks form 3 runs at head_dim 64 too, where its far dk/dv walk is
# the Mosaic GPU launch
FORM3_MIN_CHUNKS = 64


def span_form(bs: BlockSizes, *, head_dim: int, chunks: int = 0,
              far_dkv_mosaic=lambda: False) -> int:
  """BlockSizes.bwd_spans, None resolved: form 3 (the far dk/dv walk in its own launch on
  2C-row key tiles) at head_dim > 64, and at 64 from FORM3_MIN_CHUNKS chunks where that walk
  is the Mosaic GPU launch (far_dkv_mosaic(), called only there: choose_mosaic raises for a
  "mosaic" it cannot honour, which form 2 never runs); else 2.

  H200, 2026-11-25, one call, fwd+bwd 3 / 2 (the far walk a Triton kernel then): 122.74 /
  131.42 ms at 4,16384,16,128 (span 32), 25.05 / 25.78 at 8,4096,16,128 (span 8); 30.59 /
  28.29 at 32,2048,32,64 (span 8), 65.99 / 56.59 at 8,8192,32,64 (span 16). With the Mosaic
  far dk/dv launch (H200, 2026-11-27, one call each shape, 3 / 2, peak GiB): 63.01 / 64.37
  (11.17 both) at 32,4096,32,64 (64 chunks), 47.12 / 48.54 (5.56 both) at 8,8192,32,64 (128),
  24.09 / 24.14 (5.03 / 4.70) at 32,2048,32,64 (32 chunks: no faster, more memory)."""
  if bs.bwd_spans is not None:
    return bs.bwd_spans
  if head_dim > 64 or (chunks >= FORM3_MIN_CHUNKS and far_dkv_mosaic()):
    return 3
  return 2


def chain_products(bs: BlockSizes, *, head_dim: int) -> str:
  """BlockSizes.chain_products, None resolved: one TF32 pass at head_dim <= 64, where it frees
  the far dq kernel's registers for a third program an SM, else three bf16 passes (TF32 lost at
  128 in both directions; block_sizes.py has the times)."""
  if bs.chain_products is not None:
    return bs.chain_products
  return "tf32" if head_dim <= 64 else "bf16x3"


# auto_span: the shortest even span with at most DKV_SPAN_BOUNDARIES boundaries
# (DKV_SPAN_BOUNDARIES_WIDE at head_dim > 64), but no shorter than DKV_SPAN_MIN chunks unless
# the span of at most 3 boundaries is (short sequences)
DKV_SPAN_BOUNDARIES = 7
DKV_SPAN_BOUNDARIES_WIDE = 15
DKV_SPAN_MIN = 8


def auto_span(n: int, *, head_dim: int = 64) -> int:
  """Span length in chunks (DKV_SPAN_BOUNDARIES, DKV_SPAN_BOUNDARIES_WIDE, DKV_SPAN_MIN). More
  boundaries shorten the span kernel's sequential sweeps and the dk/dv kernel's operator walks
  for one more set of packed boundary states each (kernels.boundary_offset: about one q-sized
  array per two boundaries, two such arrays in the backward; transient, not residuals).

  At head_dim 64 the near work is cheap (the Mosaic sweep) and 7 boundaries stay: H200,
  2026-11-25, one call, fwd+bwd (peak GiB) with spans of <= 3 / <= 7 boundaries: 60.35 /
  56.59 at 8,8192,32,64 (32 / 16), but 28.29 / 29.17 at 32,2048,32,64 (8 / 4): hence the
  minimum of 8; on 2026-11-27's code spans of 8 / 32 at 8,8192,32,64 cost +0.3% / +4.0%.

  At head_dim 128 a near chunk pair costs ~9x a far one (the D x D transports of the span
  kernel's sweep and the dk/dv walk, Triton there), so shorter spans win until the far launches'
  extra boundaries catch up; 15 boundaries. H200, 2026-11-27, one call (session 34, call 2),
  fwd+bwd ms (peak GiB), spans:
  - 8,4096,16,128 (64 chunks): 8 (7 boundaries) 19.74 (3.26), 6 19.40 (3.43); on 2026-11-27's
    earlier code 4 / 8 / 16: 20.40 (3.94) / 19.73 (3.25) / 22.60 (2.97). The minimum keeps 8.
  - 8,8192,16,128 (128): 16 (7) 55.29 (6.52), 12 52.50 (6.87), 8 (15) 52.36 (7.75).
  - 4,16384,16,128 (256): 32 (7) 88.56 (6.52), 16 (15) 77.15 (7.64), 12 75.97 (9.02), 8 79.30
    (11.76); call 1: 32 / 24 / 16 89.51 / 83.09 / 79.05, with the gate 93.36 / - / 81.70.
  - 2,32768,16,128 (512): 64 (7) 156.75 (6.52), 32 (15) 125.87 (7.64), 16 119.28 (11.64).
  So -5% to -20% for ~+1.1 GiB of transient peak, the same at every length (the packed arrays
  stay at ~7.5 q-sized arrays each)."""
  boundaries = DKV_SPAN_BOUNDARIES_WIDE if head_dim > 64 else DKV_SPAN_BOUNDARIES
  even = lambda span: span + span % 2
  most = lambda boundaries: even((n - 1) // (boundaries + 1) + 1)
  return max(most(boundaries), min(most(3), DKV_SPAN_MIN))


def dkv_span(ops: Operands, bs: BlockSizes, backend: str) -> int:
  """The span the backward uses: BlockSizes.dkv_span (None: auto_span) where it applies (PaTH on
  the GPU or the interpreter, at least one span boundary inside the sequence), else 0."""
  n = ops.q.shape[2]
  span = auto_span(n, head_dim=ops.q.shape[-1]) if bs.dkv_span is None else bs.dkv_span
  use = span and ops.e is not None and backend in ("gpu", "interpret") and n > span and \
      not fused_dkv(ops, bs, backend)
  return span if use else 0


def fused_dkv(ops: Operands, bs: BlockSizes, backend: str) -> bool:
  """dkv_in_dq asked for and buildable: the dq/dP sweep gives dk, dv (and dfk) too."""
  return bs.dkv_in_dq and fused_dkv_builds(
      backend=backend, dtype=ops.q.dtype, heads_per_kv=ops.q.shape[1] // ops.k.shape[1],
      head_dim=ops.q.shape[-1], transport=ops.e is not None)


def fused_dkv_builds(*, backend: str, dtype, heads_per_kv: int, head_dim: int,
                     transport: bool) -> bool:
  """Whether BlockSizes(dkv_in_dq=True)'s fused dq/dP + dk/dv sweep fits the GPU's 227 KiB of
  shared memory per block; where it does not, the backward runs its two kernels instead.

  Seen on the H100 (2026-11-25): PaTH in bf16 built at G = 2, D = 64; it asked for 240 KiB at
  G = 1, D = 128 (bf16) and 337 KiB at G = 2, D = 64 with float32 inputs. FoX (no transport
  state) built in float32 at G = 2, D = 64. The interpreters have no such limit."""
  if backend != "gpu" or not transport:
    return True
  return jnp.dtype(dtype).itemsize <= 2 and head_dim <= 64


def auto_lanes(programs: int, units: int, sm_count: int, max_lanes: int = 4) -> int:
  """Lanes per kv head for the dq/dP kernel when BlockSizes.bwd_lanes = 0.

  Each of the `programs` = B K programs walks all `units` (query-chunk pairs) of its head, so
  they take equally long, and at one program per SM (the kernel's shared memory, ~150 KiB at
  head_dim 64, leaves no room for a second) the launch runs in ceil(programs / sm_count) waves.
  L lanes split each program's units L ways: time ~ ceil(L programs / sm_count) / L. At the 125M
  model's layer (B 16, K 12: 192 programs on 132 SMs) one lane runs 2 waves, the second 45%
  full; two lanes run 3 waves of half the work, 1.5 (predicted -25% on the kernel, not yet
  measured). Ties go to fewer lanes (less memory)."""
  lanes = range(1, max(1, min(max_lanes, units)) + 1)
  return min(lanes, key=lambda L: (-(-programs * L // sm_count) / L, L))


def gpu_sm_count(backend: str) -> int:
  """The GPU's SM count; 132 (the H100's and H200's) in the interpreter and when lowering for
  the GPU on a host without one."""
  if backend == "gpu":
    try:
      count = getattr(jax.devices("gpu")[0], "core_count", None)
    except RuntimeError:  # no GPU here (lowering only)
      count = None
    if count:
      return int(count)
  return 132


def sweep_launch(ops: Operands, bs: BlockSizes, backend: str, *, kv: bool,
                 pairs: bool) -> bool:
  """Whether the span backward's near sweep runs as its own Mosaic GPU launch
  (BlockSizes.span_sweep; span_mosaic.py) after span_kernel(sweeps=False): choose_mosaic,
  where it takes the operands (span_mosaic.supported on the GPU; an even number of chunks in
  the interpreter too, whose oracle also takes the query tiles in pairs), the query tiles in
  pairs and no key-side parts (bwd_spans 2 or 3)."""
  from kernels_pallas.path_attention import span_mosaic
  n = ops.q.shape[2]
  why = span_mosaic.supported(ops) if backend == "gpu" else (
      f"{n} chunks (needs an even number)" if n % 2 else None)
  if kv or not pairs:
    why = "bwd_spans=1 (the near dk, dv from the sweep)" if kv else "dq_pairs off"
  return choose_mosaic(bs, backend, "span_sweep", why=why,
                       needs="bf16/f16, block 64, head_dim 64 and an even number of chunks, "
                             "bwd_spans 2 or 3 and dq_pairs")
