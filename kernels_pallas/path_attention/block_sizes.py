"""BlockSizes: the PaTH / FoX kernels' tile sizes, launch parameters and kernel-form choices,
each with what was measured when its default was chosen (calls.py reads them)."""
from __future__ import annotations

import dataclasses

GATE_COLSUMS = ("reduce", "carry", "mma")   # BlockSizes.gate_colsum
CHAIN_PRODUCTS = ("bf16x3", "tf32")          # BlockSizes.chain_products
KEEP_INVERSE = (False, True, "bf16")         # BlockSizes.prepass_keep_inverse


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes. The transport chunk, the query tile and the key tile are one size for now."""
  block_q: int = 64
  block_k: int = 64
  num_warps: int = 4             # the forward kernel's. At head_dim 128, 8 warps take its
                                 # spills (576 B a thread) and ptxas's wgmma serialization
                                 # (C7512) away (resource report) and still lose: H200, one
                                 # call (2026-11-27), the kernel 1.34 -> 1.78 ms at
                                 # 8,4096,16,128, fwd+bwd 19.78 -> 20.18 there and 89.97 ->
                                 # 92.45 at 4,16384,16,128
  num_stages: int | None = None  # None: 2 for head_dim <= 64, else 1 (shared memory); the
                                 # dk/dv kernel takes 2 at every head_dim without grouped heads,
                                 # the forward, boundary and far dq kernels with 16-bit inputs
                                 # (flash_stages)
  bwd_num_warps: int | None = None  # None: 4 for head_dim <= 64, else 8 (measured, H200)
  bwd_lanes: int | None = 0      # programs per kv head in the sequential dq/dW/dU backward
                                 # kernel (each lane adds a [T, D, D/C] float32 buffer); 0: as
                                 # many as fill the GPU's last wave best (auto_lanes; fwd+bwd
                                 # 8.81 -> 8.39 ms at 16,2048,12,64 on the H100, 52.68 -> 52.53
                                 # at 8,4096,16,128; 392.7 -> 288.1 with 2 lanes at
                                 # 4,16384,16,128 on the H200); None: 1
  prepass: str = "uz_hilo"       # prepass_variants.VARIANTS: float32-accurate products from bf16
                                 # hi / lo halves, split once, one half for bf16-exact operands,
                                 # the VJP from dU, dZ in two kernels (prepass_uz.py: its VJP
                                 # kernels 6.05 against 6.36 ms for "split2_hilo" at
                                 # 32,2048,32,64 on the H200, fwd+bwd 24.17 / 24.50); at
                                 # head_dim 128 and with float32 inputs it runs as "split2_hilo"
                                 # (usable_variant). "split2_hilo": the operands VJP as two
                                 # kernels and the inverse VJP (fwd+bwd 7.12 ms at
                                 # 16,2048,12,64 on the H200 against 7.80 for "split_hilo", one
                                 # VJP kernel, which does not build at head_dim 128; 44.95 against
                                 # 48.96 for the jnp pre-pass at 8,4096,16,128). "split_hilo":
                                 # 8.78 ms on the H100 against 11.71 for "split_bf16x3" (three
                                 # bf16 passes per product) and 20.71 for "split" (three TF32
                                 # passes); float32 inputs take "split2" / "split");
                                 # "*_bf16": bf16 operands, 2-4x the gradient error when the w of
                                 # a chunk share a direction; "fold*": -6% peak memory at
                                 # head_dim 64, +6% time; "jnp": batched jnp.
                                 # prepass_variants.usable_variant routes a shape that does not
                                 # build on the GPU to "jnp"
  prepass_num_warps: int | None = None  # the pre-pass kernels' warps; None: each kernel's
                                 # own by head_dim (prepass_variants.auto_warps, measured)
  prepass_keep_inverse: bool | str = "bf16"  # the split pre-pass keeps Y = (I + A)^{-1}
                                 # from the forward for its VJP instead of running the inverse
                                 # kernel again. True: Y in float32, [B, K, T, C] more per layer
                                 # (0.5 GiB at 32,2048,32,64) for one inverse kernel less.
                                 # "bf16": its bf16 rounding, half that, which the VJP refines
                                 # by one Newton step (a 7-pass kernel for the inverse's 33);
                                 # only where the inverse's products are bf16 halves (16-bit
                                 # inputs on the GPU), else recomputed as with False
                                 # (prepass_variants.kept_inverse). H200 (2026-11-27), fwd+bwd ms
                                 # (peak GiB), False / "bf16" / True in one call: 24.15 (4.70)
                                 # / 23.20 (4.95) / 22.59 (5.20) at 32,2048,32,64; 63.02
                                 # (11.17) / 61.56 (11.67) / 59.87 (12.17) at 32,4096,32,64;
                                 # 46.98 (5.56) / 45.57 (5.81) / 46.00 (6.06) at 8,8192,32,64;
                                 # 19.78 (3.25) / 19.63 (3.31) / 19.11 (3.38) at 8,4096,16,128;
                                 # 89.56 (6.42) / 89.00 (6.54) / 90.35 (6.67) at 4,16384,16,128.
                                 # The 125M model at T = 8192: 190,546 / 194,760 tok/s (+2.2%),
                                 # peak 23.28 / 23.32 GiB. True keeps twice "bf16"'s bytes for
                                 # -2.7% to +1.5% of its time. The default since the GPU class
                                 # passed with it (2026-11-27)
  prepass_late_wk: bool = False  # "split2_*" pre-pass: the q part of its VJP leaves WK's
                                 # pullback (two products) to the inverse-VJP kernel, dwk and
                                 # dk going through HBM as float32. The q part spills to DRAM
                                 # (ncu, H200, 32,2048,32,64: 8.3 GB of local traffic, tensor
                                 # pipe 14% busy, before its outputs were stored as formed).
                                 # Resource report, 2,2048,2,2,64, spill bytes a thread: q part
                                 # 240 with this option against 356, the inverse VJP none.
                                 # Lost on the H200 when the q part spilled 1,048 (28.32 /
                                 # 28.60 ms at 32,2048,32,64); not timed since
  keep_operands: bool = True     # keep the pre-pass's outputs from the forward for the backward
                                 # instead of running the pre-pass again there: fwd+bwd 8.81 ->
                                 # 8.24 ms at 16,2048,12,64 on the H100 (8.11 with auto lanes),
                                 # for ~4 q-sized arrays per layer of extra residuals
  dq_pairs: bool = True          # dq/dP kernel: two query chunks as one 2C-row tile per sweep
                                 # (bwd_kernels.py): half the dP read-modify-writes and key loads
  dq_num_warps: int | None = None  # dq/dP kernel's warps; None: 8 with dq_pairs (2C-row tiles),
                                   # else bwd_num_warps
  fwd_kernel: str = "triton"     # GPU forward: "triton", or "mosaic" (fwd_mosaic.py: TMA + wgmma;
                                 # PaTH with or without gate and segments, bf16/f16, chunk 64).
                                 # Whole forward on the H100: 1.57 (triton) vs 1.62 ms (mosaic)
                                 # at 16,2048,12,64; 9.27 vs 11.66 at 8,4096,16,128
  dkv_in_dq: bool = False        # GPU: the dq/dP sweep also accumulates dk^, dv, dfk from its
                                 # states (dS^T s_m = (dS^T q^) M_cm) and no dk/dv kernel runs:
                                 # per (query, key chunk) pair ~C^2 D more MACs in dq/dP instead
                                 # of the dk/dv kernel's ~3 C D^2 + D^3 (its D x D operator,
                                 # which spills at D = 128), for a [T, D] float32 read-modify-
                                 # write pair per step. Slower on the H100: fwd+bwd 8.81 ->
                                 # 10.25 ms at 16,2048,12,64. PaTH at D 128 or with float32
                                 # inputs runs the two kernels instead (fused_dkv_builds:
                                 # shared memory)
  dkv_span: int | None = None    # GPU: > 0 splits the dk/dv kernel's walk over query chunks at
                                 # span boundaries (every dkv_span chunks). The dq/dP sweep
                                 # stores each query chunk's transport state at every boundary
                                 # below it (q^_c P_{c-1} ... P_s: its state against key chunk
                                 # s - 1, which it computes anyway); key chunk m then carries
                                 # the D x D operator only to the end of its span, and walks the
                                 # later spans as plain attention against those stored states
                                 # with k~ = k^ M_sm^T (no operator product per step). Costs
                                 # the packed states of every boundary (about one q-sized
                                 # array per two boundaries, kernels.boundary_offset). Even (the
                                 # dq sweep's pairs start at even chunks). 0: off; None:
                                 # routing.auto_span (<= 7 boundaries, 15 at head_dim > 64,
                                 # spans of >= 8 chunks where the sequence has room: measured
                                 # there). Round 12's H200,
                                 # fwd+bwd: 44.58 -> 39.01 ms (+0.25 GiB) at 8,4096,16,128
                                 # (span 16; 8: 38.03, +0.75 GiB), 7.09 -> 6.75 at
                                 # 16,2048,12,64 (span 8, +0.14 GiB)
  bwd_spans: int | None = None   # GPU: > 0, the span-parallel backward (bwd_span.py) at the
                                 # spans above: the sequential dq/dP sweep walks only the pairs
                                 # inside a span, one program per (batch, kv head, span); far
                                 # pairs go to parallel flash-style kernels on the boundary
                                 # states, the far queries' share of dL/dP to two D x D chains
                                 # per span. 2: the dk/dv kernel gives dk, dv (its operator walk
                                 # inside the span); 1: the span sweep gives the near dk, dv from
                                 # its states; 0: the sequential sweep. H200, fwd+bwd, 2 / 1 / 0:
                                 # 33.18 / 39.51 / 39.82 ms at 8,4096,16,128; 6.63 / 6.40 / 6.98
                                 # at 16,2048,12,64; 29.52 / 31.60 / ~33.4 at 32,2048,32,64.
                                 # 3: as 2, but the far walk (query chunks right of the key's
                                 # span) is its own launch (bwd_span.far_dkv_kernel, 2C-row key
                                 # tiles with far_dkv_pairs) and the dk/dv kernel adds its sums.
                                 # None: 3 at head_dim > 64 and at 64 from 64 chunks where
                                 # the far walk is the Mosaic launch, else 2
                                 # (routing.span_form, measured)
  far_dq_pairs: bool | None = None  # the span backward's far dq kernel takes query chunks two
                                 # at a time as one 2C-row tile (bwd_span.far_dq_kernel); None:
                                 # at head_dim > 64. H200, fwd+bwd, pairs / single chunks (one
                                 # call): 27.66 / 29.65 ms at 8,4096,16,128; 29.05 / 28.23 at
                                 # 32,2048,32,64
  far_dq_num_warps: int | None = None  # the far dq kernel's warps; None: dq_num_warps, else 8
                                 # with far_dq_pairs (2C-row tiles), else bwd_num_warps. H200,
                                 # one call, fwd+bwd pairs at 8 warps / one chunk at 8 / one
                                 # chunk at 4: 23.29 / 26.23 / 24.93 ms at 8,4096,16,128,
                                 # 103.79 / 120.04 / 112.17 at 4,16384,16,128 (2026-11-26); pairs
                                 # at 4 warps spill 3.9 KB a thread (resource report)
  far_dkv_pairs: bool = True     # the far dk/dv kernel (bwd_spans 1 and 3) takes key chunks two
                                 # at a time as one 2C-row tile: each query chunk's operands are
                                 # read once for both, the products twice as wide
  far_dkv_rows: int | None = None  # query rows per step of the far dk/dv kernel (a divisor of
                                 # block_q); None: a chunk key-major (far_dkv_keys_major), else
                                 # half a chunk with key pairs at head_dim > 64
                                 # (resource report, bf16, 8 warps: 836 -> 244 B of spills a
                                 # thread at 128), else a chunk
  dkv_keys_major: bool = True    # the dk/dv kernel's tiles as [keys, queries]
                                 # (bwd_kernels.dkv_step_keys, as far_dkv_keys_major) instead
                                 # of [queries, keys]: fewer layout round trips through shared
                                 # memory (triton 3.9 PTX at head_dim 64: 12 / 8 ldmatrix /
                                 # stmatrix against 28 / 32). H200, one call, fwd+bwd
                                 # on / off: 27.84 / 28.45 ms at 32,2048,32,64, 56.04 / 57.09 at
                                 # 8,8192,32,64, PaTH-FoX 29.46 / 31.37 at 32,2048,32,64;
                                 # 23.02 / 23.01 and 103.14 / 103.43 at the head_dim-128
                                 # shapes (2026-11-26)
  far_dkv_keys_major: bool = True  # the far dk/dv kernel's tiles as [keys, queries]
                                 # (bwd_kernels.dkv_step_keys: every product's M is the key
                                 # rows, no register tile transposed, the gate's column sums
                                 # a reduction along rows) instead of [queries, keys]; its query
                                 # chunk then goes whole (far_dkv_rows None). With 32-row query
                                 # parts the query-major l and dP products fell back from wgmma
                                 # to mma.sync at head_dim 128 (triton 3.9 PTX: 128 mma.sync, 8
                                 # wgmma; key-major 24 wgmma, none). H200, one call,
                                 # fwd+bwd on / off / on with 32-row parts: 104.51 / 116.61 /
                                 # 108.40 ms at 4,16384,16,128, 23.27 / 24.86 / 23.72 at
                                 # 8,4096,16,128 (2026-11-26)
  gate_colsum: str = "mma"       # with a gate and query-major tiles (dkv_keys_major /
                                 # far_dkv_keys_major off; key-major tiles sum along their rows),
                                 # how the dk/dv kernels sum dS over query rows
                                 # for dfk (bwd_kernels.minus_col_sums): "reduce" every step;
                                 # "carry" a float32 tile of the logits' shape, reduced once at
                                 # the end; "mma" a [C, 16] float32 tile from tensor-core
                                 # products of dS^T (bf16 halves) with ones. H200, one call,
                                 # PaTH-FoX fwd+bwd mma / carry / reduce (PaTH without gate):
                                 # 31.63 / 32.08 / 33.06 (28.72) ms at 32,2048,32,64; 27.28 /
                                 # 29.17 / 27.88 (25.42) at 8,4096,16,128 (2026-11-25)
  fwd_spans: bool | None = None  # GPU, PaTH: the forward kernel moves the query tile chunk by
                                 # chunk only inside its own span (dkv_span's); key chunks of
                                 # earlier spans are plain attention against the keys moved to
                                 # their span's end, from the tile's states at the span
                                 # boundaries (D x D crossings, kernels.fwd_kernel). The boundary
                                 # launch it needs is the span backward's, run once in the
                                 # forward and kept. None: at head_dim > 64 (routing.forward_span).
                                 # H200, one call, fwd+bwd on / off: 116.22 / 122.53 ms at
                                 # 4,16384,16,128, 24.85 / 24.97 at 8,4096,16,128, 28.56 /
                                 # 28.09 at 32,2048,32,64 (2026-11-26). The forward's own peak
                                 # grows by the packed states (4,16384,16,128: 2.88 -> 4.04
                                 # GiB), fwd+bwd's does not
  fwd_far: str | None = None     # with the span forward (fwd_spans), the far keys (plain
                                 # attention against the boundary states) inside the Triton
                                 # forward kernel ("triton"), or a Mosaic GPU launch of their
                                 # own ("mosaic", fwd_far_mosaic.py: two compute warpgroups and a
                                 # copying one, TMA ring, wgmma) merged with the near kernel's
                                 # softmax; bf16/f16, chunk 64. None: "mosaic" on the GPU where
                                 # it takes the operands, packed documents too (both skip the
                                 # spans left of a chunk's documents) (routing.far_launch). H200,
                                 # one call,
                                 # 2026-11-26, forward (fwd+bwd) ms triton / mosaic: 26.03
                                 # (103.06) / 20.08 (98.01) at 4,16384,16,128, 6.11 (23.16) /
                                 # 5.64 (22.81) at 8,4096,16,128; the forward's own peak +0.25
                                 # / +0.12 GiB (float32 partial outputs), fwd+bwd's the same
  far_dq: str | None = None      # the span backward's far dq walk inside the Triton far dq
                                 # kernel ("triton", bwd_span.far_dq_kernel) or, after a Triton
                                 # launch that only stores the boundary states, as a Mosaic GPU
                                 # launch ("mosaic", bwd_far_mosaic.py: the far forward's three
                                 # warpgroups, the A chain's Pi products in three bf16 passes);
                                 # bf16/f16, chunk 64. None: "mosaic" where fwd_far's default
                                 # takes it (routing.mosaic_launch). H200, fwd+bwd, Triton /
                                 # Mosaic, one call each (2026-11-26): 97.88 / 93.77 ms at
                                 # 4,16384,16,128, 22.27 / 21.25 at 8,4096,16,128, 53.22 / 52.17
                                 # at 8,8192,32,64, 26.62 / 26.64 at 32,2048,32,64
  far_dkv: str | None = None     # the span backward's far dk/dv walk (bwd_spans 1 and 3) in the
                                 # Triton far dk/dv kernel ("triton", bwd_span.far_dkv_kernel)
                                 # or as a Mosaic GPU launch ("mosaic", bwd_far_mosaic.far_dkv:
                                 # key chunks m, m + 1 on two compute warpgroups, the far query
                                 # items streamed by a third); bf16/f16, chunk 64. None: as
                                 # far_dq (routing.mosaic_launch). H200, fwd+bwd, Triton /
                                 # Mosaic, one call (2026-11-26): 93.42 / 90.72 ms at
                                 # 4,16384,16,128, 21.39 / 20.60 at 8,4096,16,128; with
                                 # bwd_spans 3 at 32,2048,32,64 26.29 against form 2's 26.25
  span_sweep: str | None = None  # the span backward's near sweep (bwd_span.span_kernel's query
                                 # tiles inside a span: states, adjoint chain, dL/dP) in the
                                 # Triton span kernel ("triton") or as a Mosaic GPU launch after
                                 # it ("mosaic", span_mosaic.py: bf16/f16, chunk 64, head_dim 64,
                                 # an even number of chunks, bwd_spans 2 or 3). None: "mosaic"
                                 # where it takes the operands on the GPU (routing.sweep_launch).
                                 # H200, fwd+bwd, Mosaic / Triton, one call (2026-11-26): 25.40 /
                                 # 26.78 ms at 32,2048,32,64, 5.32 / 5.75 at 16,2048,12,64, 67.35
                                 # / 69.35 at 32,4096,32,64, 49.79 / 51.98 at 8,8192,32,64
  chain_products: str | None = None  # the span forward's and backward's products of
                                 # aggregated D x D operators (Pi crossings, the V and N chains;
                                 # float32 operands) with 16-bit inputs (calls_span.fine_precision):
                                 # "bf16x3", three bf16 passes, or "tf32", one pass (10 mantissa
                                 # bits, truncated: more than bf16 operands, whose effect on the
                                 # gradients was measured small); None: "tf32" at head_dim <= 64,
                                 # else "bf16x3" (routing.chain_products). H200, one call, fwd+bwd
                                 # bf16x3 / tf32 (2026-11-26): 27.03 / 26.33 ms at 32,2048,32,64,
                                 # 72.05 / 70.11 at 32,4096,32,64, 54.43 / 52.87 at 8,8192,32,64
                                 # (far dq 231 -> 168 registers: a third program an SM); 22.47 /
                                 # 23.65 at 8,4096,16,128, 102.42 / 104.76 at 4,16384,16,128
                                 # although the spills fall there (resource report, spill stores
                                 # a thread: forward 900 / 136, span kernel 1,400 / 1,160)

  def validate(self, head_dim: int) -> None:
    if self.block_q != self.block_k:
      raise ValueError(f"block_q={self.block_q} must equal block_k={self.block_k} "
                       "(the query tile, key tile and transport chunk are one size)")
    if self.block_q < 16 or self.block_q & (self.block_q - 1):
      raise ValueError(f"block_q={self.block_q} must be a power of two >= 16")
    from kernels_pallas.path_attention.prepass_variants import VARIANTS
    if self.prepass not in VARIANTS + ("jnp",):
      raise ValueError(f"prepass={self.prepass!r} must be one of {VARIANTS + ('jnp',)}")
    if self.fwd_kernel not in ("triton", "mosaic"):
      raise ValueError(f"fwd_kernel={self.fwd_kernel!r} must be 'triton' or 'mosaic'")
    for field in ("fwd_far", "far_dq", "far_dkv", "span_sweep"):
      if getattr(self, field) not in (None, "triton", "mosaic"):
        raise ValueError(f"{field}={getattr(self, field)!r} must be None (auto), 'triton' or "
                         "'mosaic'")
    if self.prepass_keep_inverse not in KEEP_INVERSE:
      raise ValueError(f"prepass_keep_inverse={self.prepass_keep_inverse!r} must be one of "
                       f"{KEEP_INVERSE} (True: float32 Y)")
    if self.prepass_num_warps not in (None, 1, 2, 4, 8, 16):
      raise ValueError(f"prepass_num_warps={self.prepass_num_warps} must be None (each "
                       "kernel's own), 1, 2, 4, 8 or 16")
    if self.bwd_lanes is not None and self.bwd_lanes < 0:
      raise ValueError(f"bwd_lanes={self.bwd_lanes} must be None (1 lane), 0 (auto) or >= 1")
    if self.far_dkv_rows is not None and (self.far_dkv_rows < 8 or
                                          self.block_q % self.far_dkv_rows):
      raise ValueError(f"far_dkv_rows={self.far_dkv_rows} must be None (auto) or a divisor of "
                       f"block_q={self.block_q} of at least 8 (16 on the GPU)")
    if self.gate_colsum not in GATE_COLSUMS:
      raise ValueError(f"gate_colsum={self.gate_colsum!r} must be one of {GATE_COLSUMS}")
    if self.chain_products not in (None,) + CHAIN_PRODUCTS:
      raise ValueError(f"chain_products={self.chain_products!r} must be None (by head_dim) or "
                       f"one of {CHAIN_PRODUCTS}")
    if self.bwd_spans not in (None, 0, 1, 2, 3):
      raise ValueError(f"bwd_spans={self.bwd_spans} must be None (auto), 0 (off), 1, 2 or 3")
    if self.dkv_span is not None and (self.dkv_span < 0 or self.dkv_span % 2):
      raise ValueError(f"dkv_span={self.dkv_span} must be None (auto), 0 (off) or a positive "
                       "even number of chunks")
    if head_dim < 16 or head_dim & (head_dim - 1):
      raise ValueError(f"head_dim={head_dim} must be a power of two >= 16")
