"""PaTH / FoX Pallas kernels against the dense oracles: forward, every gradient, determinism.
The base class runs on whatever backend its subclass names; the interpret subclass runs on CPU
at small shapes, the GPU subclass only where jax.default_backend() == "gpu"; test_tpu_kernels.py
runs its checks on the TPU interpreter.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas as kp
from kernels_pallas.path_attention import calls
from posenc_jax import householder
from posenc_jax import unipotent
from tests.kernels.transport_inputs import segment_ids, transport_vectors
from tests.util import assert_rel_rms


def _inputs(key, B, T, H, K, D, dtype, *, gate, segments, w_mode="random"):
  ks = jax.random.split(key, 8)
  q = jax.random.normal(ks[0], (B, T, H, D), dtype)
  k = jax.random.normal(ks[1], (B, T, K, D), dtype)
  v = jax.random.normal(ks[2], (B, T, K, D), dtype)
  w, beta = transport_vectors(ks[3], B, T, K, D, mode=w_mode)
  lf = jax.nn.log_sigmoid(jax.random.normal(ks[5], (B, T, H)) + 2.0) if gate else None
  seg = None
  if segments:  # True: "few"; else a _segments mode. Never attended across.
    seg = segment_ids(ks[6], B, T, "few" if segments is True else segments)
  do = jax.random.normal(ks[7], (B, T, H, D), dtype)
  return q, k, v, w, beta, lf, seg, do


class PathKernelBase:
  backend: str = "interpret"
  block: int = 16
  T: int = 37          # not a multiple of the block: exercises the internal padding
  D: int = 16
  tol = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}

  def _check(self, key, *, dtype, determinism=False, **kw):
    """The kernel against the oracle on fresh inputs (_cases), forward and every gradient at
    the dtype's tolerance; with `determinism`, the gradients bitwise equal over two runs."""
    run, oracle, names = self._cases(key, dtype=dtype, **kw)
    got, ref = run(), oracle()
    tol = self.tol[dtype]
    for name, a, b in zip(names, got, ref):
      assert_rel_rms(a, b, tol, name)
    if determinism:
      for name, a, b in zip(names[1:], got[1:], run()[1:]):
        assert bool(jnp.array_equal(a, b)), f"{name} differs between two runs"

  def _cases(self, key, *, H, K, dtype, gate, segments, fox=False, T=None, block_sizes=None,
             w_mode="random", B=2, chunked_oracle=False):
    """-> (run: the kernel's [output, *gradients] on one input, jitted and traced at its first
    call; oracle: the oracle's, at float32 precision; their names). Each call traces anew, so a
    monkeypatch made before it reaches the kernel. chunked_oracle: PaTH's oracle is
    householder.path_attention_chunked (the UT algorithm, no T x T array: long sequences)
    instead of the dense walk."""
    T, D = T or self.T, self.D
    q, k, v, w, beta, lf, seg, do = _inputs(key, B, T, H, K, D, dtype, gate=gate, segments=segments,
                                            w_mode=w_mode)
    bs = block_sizes or kp.BlockSizes(block_q=self.block, block_k=self.block)
    scale = D ** -0.5
    # The oracle takes the segment ids as an argument, and both gradients the cotangent, not
    # as constants: the oracle's programs are then one for every case of a shape, which the
    # session's compilation cache (tests/conftest.py) compiles once on the CPU (CI time).
    if fox:
      args = (q, k, v, lf)
      fast = lambda q, k, v, lf: kp.forgetting_attention(q, k, v, lf, segment_ids=seg,
                                                         block_sizes=bs, backend=self.backend)
      ref = lambda q, k, v, lf, seg: unipotent.forgetting_attention_reference(
          q, k, v, lf, segment_ids=seg, scale=scale)
    else:
      args = (q, k, v, w, beta) + ((lf,) if gate else ())
      fast = lambda *a: kp.path_attention(*a, segment_ids=seg, block_sizes=bs, backend=self.backend)
      dense = (householder.path_attention_chunked if chunked_oracle
               else householder.path_attention_reference)
      ref = lambda *a: dense(*a[:5], log_forget=a[5] if gate else None, segment_ids=a[-1],
                             scale=scale)
    # Everything runs jitted: one compile instead of eager op-by-op dispatch (the interpreter's
    # grid loops and the oracle's scans recompile at every eager call), and one program each
    # for the kernel and the oracle, forward and gradients together (CI time: the forward is
    # not compiled again apart from the gradients'; 17.4 -> 14.5 s of compiling for the kernel
    # of test_path_gate_segments_gqa_f32, 3.7 -> 2.4 s for its oracle).
    # grad(fn)(*args, *rest, do): d/d(args) of <fn(*args, *rest), do>.
    grad = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a[:-1]).astype(jnp.float32) * a[-1]),
                               argnums=tuple(range(len(args))))

    @jax.jit
    def oracle_program(args, seg, do):   # the oracle's output from its own VJP: not under test
      out, pull = jax.vjp(lambda *a: ref(*a, seg), *args)
      return [out, *pull(do.astype(out.dtype))]

    def oracle():
      with jax.default_matmul_precision("highest"):
        return oracle_program(args, seg, do)

    # The kernel's output from its own call, as a caller without gradients runs it (the
    # custom VJP's primal, not its forward rule), next to the gradients in the same program.
    program = jax.jit(lambda args, do: [fast(*args), *grad(fast)(*args, do)])
    names = ("q", "k", "v", "log_forget") if fox else ("q", "k", "v", "w", "beta", "log_forget")
    names = ("forward",) + tuple(f"d{name}" for name in names[:len(args)])
    return (lambda: program(args, do)), oracle, names

  def test_path_gate_segments_gqa_f32(self, key):
    self._check(key, H=4, K=2, dtype=jnp.float32, gate=True, segments=True)

  @pytest.mark.parametrize("fox", [False, True])
  def test_recomputed_operands_one_lane_bf16(self, key, fox):
    """BlockSizes(keep_operands=False, bwd_lanes=None, dkv_span=0): the backward runs the
    pre-pass again instead of reading the forward's outputs (the default keeps them), the dq/dP
    sweep takes one lane and the dk/dv walk carries the operator to the end (gate, segments,
    grouped heads)."""
    bs = kp.BlockSizes(block_q=self.block, block_k=self.block, keep_operands=False,
                       bwd_lanes=None, dkv_span=0)
    self._check(key, H=4, K=2, dtype=jnp.bfloat16, gate=True, segments=True, fox=fox,
                block_sizes=bs)

  @pytest.mark.parametrize("fox", [False, True])
  def test_dkv_in_dq_gqa_f32(self, key, fox):
    """BlockSizes(dkv_in_dq=True): the dq/dP sweep also gives dk, dv, dfk (no dk/dv kernel),
    over the lanes auto_lanes picks, with pairs (path) or single chunks (FoX); deterministic."""
    bs = kp.BlockSizes(block_q=self.block, block_k=self.block, dkv_in_dq=True, bwd_lanes=0)
    self._check(key, H=4, K=2, dtype=jnp.float32, gate=True, segments=True, fox=fox,
                block_sizes=bs, determinism=True)

  @pytest.mark.parametrize("dtype,lanes,alternating", [(jnp.float32, 2, False),
                                                        (jnp.float32, None, True)])
  def test_dkv_span(self, key, dtype, lanes, alternating):
    """BlockSizes(dkv_span=2, bwd_spans=0): the sequential sweep's dk/dv walk leaves the operator
    at each span's end and reads the dq/dP sweep's boundary states (n = 7: three boundaries, pairs and the odd tail; gate,
    grouped heads; float32 over two lanes, deterministic). Documents alternating every two
    chunks put query chunks of the other document inside a key chunk's walk; their sweeps
    start past the boundary, so no state was stored for them and the walk must skip them."""
    bs = kp.BlockSizes(block_q=self.block, block_k=self.block, dkv_span=2, bwd_lanes=lanes,
                       bwd_spans=0)
    self._check(key, H=4, K=2, dtype=dtype, gate=True, T=7 * self.block - 12, block_sizes=bs,
                segments=f"alternating:{2 * self.block}" if alternating else True,
                determinism=dtype == jnp.float32)

  @pytest.mark.parametrize("mode", [1, 2, 3])
  @pytest.mark.parametrize("dtype,pairs,alternating", [(jnp.float32, True, False),
                                                        (jnp.float32, False, True),
                                                        (jnp.bfloat16, True, False)])
  def test_bwd_spans(self, key, mode, dtype, pairs, alternating):
    """BlockSizes(bwd_spans=mode, dkv_span=2): the span-parallel backward (calls_span.py), with
    the near dk, dv from the dk/dv kernel (2, the default; 3: its far walk in a launch of its
    own) or the span sweep (1); n = 7: three boundaries, the last span a single chunk; gate,
    grouped heads; query chunks in pairs (with the odd tail) or one at a time, in the span
    sweep (on the GPU float32 takes single chunks: calls_span.span_pairs) and the far dq
    kernel, key chunks likewise in the far dk/dv kernel (form 3 with alternating documents:
    half-chunk query parts there, as at head_dim 128); float32 deterministic. Documents alternating every two chunks make
    far tiles that are wholly masked and adjoints that start past a boundary. (They run in
    float32: in bf16 the GPU's dlog_forget error there is 0.7-1.3e-2 for every backward form,
    the sequential sweep's included, NOTES_kernel round 17.) The dk/dv kernels take key-major
    tiles (the default), or in forms 1 and 2 with alternating documents query-major ones, which
    sum the gate's columns on the tensor cores (BlockSizes.gate_colsum's default)."""
    keys_major = not alternating or mode == 3
    bs = kp.BlockSizes(block_q=self.block, block_k=self.block, dkv_span=2, bwd_spans=mode,
                       dkv_keys_major=keys_major, far_dkv_keys_major=keys_major,
                       dq_pairs=pairs, far_dq_pairs=pairs, far_dkv_pairs=pairs,
                       far_dkv_rows=self.block // 2 if mode == 3 and alternating else None)
    self._check(key, H=4, K=2, dtype=dtype, gate=True, T=7 * self.block - 12, block_sizes=bs,
                segments=f"alternating:{2 * self.block}" if alternating else True,
                determinism=dtype == jnp.float32)

  def test_span_forward_f32(self, key):
    """BlockSizes(fwd_spans=True, dkv_span=2): the forward kernel walks chunk by chunk only
    inside its query chunk's span and attends to earlier spans through the boundary launch's
    moved keys and span operators, which the span backward then reads from the residuals
    (n = 7: three boundaries; gate, grouped heads, documents alternating every two chunks, so
    some far spans are wholly masked)."""
    bs = kp.BlockSizes(block_q=self.block, block_k=self.block, dkv_span=2, fwd_spans=True)
    self._check(key, H=4, K=2, dtype=jnp.float32, gate=True, T=7 * self.block - 12,
                block_sizes=bs, segments=f"alternating:{2 * self.block}")

  def test_far_mosaic_forward_bf16(self, key):
    """BlockSizes(fwd_far="mosaic"): the span forward's far keys in a launch of their own
    (fwd_far_mosaic.py; the interpreter runs its jnp oracle far_reference there), merged with
    the near kernel's softmax: n = 7 (three boundaries, so the boundary states' two-slot ring
    refills), grouped heads, documents alternating every two chunks (rows whose far keys are all
    masked: o 0, lse -inf). No gate here: with it, bf16 dlog_forget is 0.8e-2 - 1.7e-2 from the
    oracle at these inputs for every forward form, the Triton one included (H200, six seeds,
    NOTES_kernel round 27). The layout causes it, not the kernels (round 29): each document comes
    back after the other's run and the gate sum restarts at every run, so across the gap the gate
    grows the logits (up to ~+16 at 128-token runs), and our plain FoX kernel shows the same
    error there. The gate's far path is checked by the head_dim and reference cases."""
    bs = kp.BlockSizes(block_q=self.block, block_k=self.block, dkv_span=2, fwd_spans=True,
                       fwd_far="mosaic")
    self._check(key, H=4, K=2, dtype=jnp.bfloat16, gate=False, T=7 * self.block - 12,
                block_sizes=bs, segments=f"alternating:{2 * self.block}")

  def test_path_plain_f32_deterministic(self, key):
    self._check(key, H=2, K=2, dtype=jnp.float32, gate=False, segments=False, determinism=True)

  def test_path_gate_bf16(self, key):
    self._check(key, H=2, K=1, dtype=jnp.bfloat16, gate=True, segments=False)

  @pytest.mark.parametrize("colsum", ["keys_major", "reduce", "carry", "mma"])
  def test_fox_segments_gqa_f32(self, key, colsum):
    """FoX's dk/dv kernel in key-major tiles (the default), and query-major with each form of
    its gate column sums (BlockSizes.gate_colsum)."""
    tiles = {} if colsum == "keys_major" else dict(dkv_keys_major=False, gate_colsum=colsum)
    self._check(key, H=4, K=2, dtype=jnp.float32, gate=True, segments=True, fox=True,
                block_sizes=kp.BlockSizes(block_q=self.block, block_k=self.block, **tiles))

  @pytest.mark.parametrize("segments", ["short", "interleaved"])
  def test_path_skips_chunks_before_the_document(self, key, segments):
    """Short packed documents over 4 chunks: the walks stop at the document's first chunk
    (prepass.chunk_bounds), forward and every gradient still equal the oracle's; the
    interleaved layout (no chunk can be skipped soundly) takes the same code."""
    self._check(key, H=2, K=1, dtype=jnp.float32, gate=True, segments=segments, T=4 * self.block)

  def test_fox_skips_chunks_before_the_document(self, key):
    self._check(key, H=2, K=1, dtype=jnp.float32, gate=True, segments="short", fox=True,
                T=4 * self.block)

  @pytest.mark.parametrize("w_mode,dtype", [
      ("shared:1.0", jnp.bfloat16), ("shared:0.01", jnp.bfloat16), ("antiparallel", jnp.bfloat16),
      ("shared:0.01", jnp.float32)])
  def test_path_correlated_w(self, key, w_mode, dtype):
    """w sharing a direction, beta = 2: the bf16 training NaN's inputs (finite and accurate).

    Eight rows, not two: with every w of a row near one direction a, a chunk's dbeta errors are
    one coherent error (its dL/dP_c seen along a), so two rows hold only ~6 independent ones and
    their relative RMS is too noisy an estimate to hold to 1e-2. Interpret, bf16, shared:0.01,
    600 fresh draws: dbeta's median 3.9e-3 at every row count; over 1e-2 in 6 draws with 2 rows
    (max 1.27e-2; the sequential, fused and jnp-pre-pass backward forms alike), in none with 4
    (max 9.2e-3) or 8 (max 8.9e-3). NOTES_kernel round 23."""
    self._check(key, H=2, K=1, dtype=dtype, gate=False, segments=False, w_mode=w_mode, B=8)

  def test_path_layer_inputs_bf16(self, key):
    """The PaTH layer's own w, beta (low-rank projection, SiLU, short convolution, at init) through
    the kernel at the GPU chunk size (64), bf16 q, k, v: the inputs of the bf16 training NaN.

    At init neighbouring w share a direction only weakly (mean cosine 0.04-0.14: SiLU's positive
    mean). The interpreter's exact float32 products pass this even with the old Neumann inverse,
    while the GPU's TF32 products (8192x coarser) gave a NaN gradient on such inputs, so this
    case matters on the GPU subclass; the strongly correlated cases, which the old inverse fails
    in exact float32 too, are test_path_correlated_w and test_chunk_inverse_correlated_w."""
    from posenc_jax import encodings
    from posenc_jax.encodings import transport
    B, T, H, D, C_model = 1, 128, 2, 32, 64
    ks = jax.random.split(key, 6)
    dims = encodings.Dims(d_model=C_model, num_heads=H, num_kv_heads=H, head_dim=D)
    params = encodings.get("path").init(ks[0], dims)
    x = jax.random.normal(ks[1], (B, T, C_model))
    w, beta = transport.transport_inputs(params, x, num_kv_heads=H, head_dim=D)
    q, k, v, do = (jax.random.normal(k_, (B, T, H, D), jnp.bfloat16) for k_ in ks[2:])
    fast = lambda *a: kp.path_attention(*a, backend=self.backend)   # default chunk 64
    ref = lambda *a: householder.path_attention_reference(*a, scale=D ** -0.5)
    grad = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * do),
                                       argnums=tuple(range(5))))
    args = (q, k, v, w, beta)
    with jax.default_matmul_precision("highest"):
      o_ref, g_ref = jax.jit(ref)(*args), grad(ref)(*args)
    assert_rel_rms(jax.jit(fast)(*args), o_ref, 1e-2, "forward")
    for name, a, b in zip(("q", "k", "v", "w", "beta"), grad(fast)(*args), g_ref):
      assert_rel_rms(a, b, 1e-2, f"d{name}")

  @pytest.mark.parametrize("D", [64, 128])
  def test_prepass_uz_bf16(self, key, D):
    """BlockSizes(prepass="uz_hilo"): the pre-pass VJP from dU and dZ (prepass_uz.py) on the
    correlated w whose pre-pass products cancel, grouped heads at head_dim 64; at 128 one query
    head a kv head (where the two-kernel VJPs build), with the gate and segments."""
    bs = kp.BlockSizes(block_q=self.block, block_k=self.block, prepass="uz_hilo")
    if D == 64:
      self._check(key, H=4, K=2, dtype=jnp.bfloat16, gate=False, segments=False,
                  w_mode="shared:0.01", B=8, block_sizes=bs)
    else:
      self.D = 128
      self._check(key, H=2, K=2, dtype=jnp.bfloat16, gate=True, segments=True, T=520,
                  block_sizes=bs)


class TestInterpret(PathKernelBase):
  """Each case compiles the interpreter's kernels and the oracle, forward and backward (20-60 s
  on CI's 2 cores). The default (not slow) set keeps one interpret case per code path; the
  overrides below move cases that repeat one of them to -m slow. TestGPU runs every case."""
  backend = "interpret"

  # [False-far_dq]: its far_states_kernel without pairs (far_dq_pairs None is False at head_dim
  # 16) runs in test_span_sweep_mosaic_f32[mosaic], the far dq launch's wiring at n = 7 in
  # [True-far_dq] (CI time).
  @pytest.mark.parametrize("pairs,walk", [
      (True, "far_dq"), pytest.param(False, "far_dq", marks=pytest.mark.slow), (True, "far_dkv")])
  def test_far_backward_mosaic_f32(self, key, pairs, walk):
    """BlockSizes(far_dq="mosaic"): the span backward's boundary states from a launch of their
    own (bwd_span.far_states_kernel), the far dq walk and the A chain in another; or
    BlockSizes(far_dkv="mosaic"): the far dk/dv walk as its own launch (bwd_far_mosaic.py; the
    interpreter runs the jnp oracles far_dq_reference / far_dkv_reference there). bwd_spans 3,
    n = 7 (three boundaries), gate, grouped heads, documents alternating every two chunks
    (wholly masked far tiles), query chunks in pairs or alone; float32, deterministic.
    Interpreter only: on the GPU the Mosaic launches take 16-bit inputs
    (TestGPU.test_far_backward_mosaic_head_dim_bf16)."""
    bs = kp.BlockSizes(block_q=self.block, block_k=self.block, dkv_span=2, bwd_spans=3,
                       far_dq_pairs=pairs, **{walk: "mosaic"})
    self._check(key, H=4, K=2, dtype=jnp.float32, gate=True, T=7 * self.block - 12,
                block_sizes=bs, segments=f"alternating:{2 * self.block}", determinism=True)

  @pytest.mark.parametrize("far_dq", [None, "mosaic"])
  def test_span_sweep_mosaic_f32(self, key, far_dq):
    """BlockSizes(span_sweep="mosaic"): the span kernel writes the far queries' dL/dP and the
    diagonal tiles only, and the near sweeps run as their own launch, adding to dL/dP
    (span_mosaic.py; the interpreter runs its jnp oracle sweeps_reference there), from the far
    dq launch's adjoints (Triton or Mosaic). n = 8 at span 4 (a boundary; the tiles of chunks 2,
    3 and 6, 7 sweep two key chunks), gate, grouped heads, documents alternating every two
    chunks (sweeps that start inside the span) or none; float32,
    deterministic. Interpreter only: on the GPU the Mosaic launch takes 16-bit inputs
    (TestGPU.test_span_sweep_mosaic_bf16)."""
    bs = kp.BlockSizes(block_q=self.block, block_k=self.block, dkv_span=4, bwd_spans=3,
                       span_sweep="mosaic", far_dq=far_dq)
    segments = f"alternating:{2 * self.block}" if far_dq else None
    self._check(key, H=4, K=2, dtype=jnp.float32, gate=True, T=8 * self.block - 12,
                block_sizes=bs, segments=segments, determinism=True)

  @pytest.mark.parametrize("keep", [pytest.param("bf16", marks=pytest.mark.slow), False])
  def test_prepass_keep_inverse_interpret(self, key, monkeypatch, keep):
    """BlockSizes.prepass_keep_inverse through path_attention. "bf16" (the default): the
    forward keeps Y's bf16 rounding and the VJP's _refine_kernel restores it by a Newton step
    (the interpreter forms the GPU's bf16 halves, where it applies; the test sees the kernel
    run). False: the VJP runs the inverse kernel again and never the refining one. Correlated
    w, grouped heads, gate. ("bf16" is under -m slow: every bf16 case of the default set runs
    it already; this one checks that it did.)"""
    from kernels_pallas.path_attention import prepass_kernel
    ran, refine = [], prepass_kernel._refine_kernel

    def _refine_kernel(*refs, cfg):   # the same name: auto_warps looks kernels up by name
      ran.append(cfg)
      return refine(*refs, cfg=cfg)

    monkeypatch.setattr(prepass_kernel, "_refine_kernel", _refine_kernel)
    bs = kp.BlockSizes(block_q=self.block, block_k=self.block, prepass_keep_inverse=keep)
    self._check(key, H=4, K=2, dtype=jnp.bfloat16, gate=True, segments=False,
                w_mode="shared:0.01", block_sizes=bs)
    assert bool(ran) == (keep == "bf16"), f"refining kernel ran {len(ran)} times for {keep!r}"

  # The shared:0.01 bf16 case keeps this code path (no gate, no segments, one kv head);
  # test_tf32_products_correlated_w runs shared:0.01 and antiparallel with the GPU's TF32
  # rounding emulated, and test_chunk_inverse_correlated_w holds the inverse to float64 for
  # every w mode.
  @pytest.mark.parametrize("w_mode,dtype", [
      pytest.param("shared:1.0", jnp.bfloat16, marks=pytest.mark.slow),
      ("shared:0.01", jnp.bfloat16),
      pytest.param("antiparallel", jnp.bfloat16, marks=pytest.mark.slow),
      pytest.param("shared:0.01", jnp.float32, marks=pytest.mark.slow)])
  def test_path_correlated_w(self, key, w_mode, dtype):
    super().test_path_correlated_w(key, w_mode, dtype)

  # head_dim 128 repeats the 64 case's code path here (test_prepass_kernel_matches_jnp and
  # test_chunk_uz_vjp_matches_autodiff hold the chunk math at D > C): it matters on TestGPU.
  # "uz_hilo" is the default pre-pass, which the interpreter runs as asked
  # (usable_variant): test_path_correlated_w[shared:0.01-bfloat16] runs the 64 case's inputs
  # (bf16, shared:0.01, 8 rows, two query heads a kv head, no gate) through it (CI time).
  @pytest.mark.parametrize("D", [pytest.param(64, marks=pytest.mark.slow),
                                 pytest.param(128, marks=pytest.mark.slow)])
  def test_prepass_uz_bf16(self, key, D):
    super().test_prepass_uz_bf16(key, D)

  # The interpreter's exact float32 products pass it even with the old Neumann inverse (its
  # docstring): it matters on TestGPU, where it runs unmarked.
  @pytest.mark.slow
  def test_path_layer_inputs_bf16(self, key):
    super().test_path_layer_inputs_bf16(key)

  # "interleaved" reads the same chunk bounds as "short" (kept) in the kernels;
  # test_span_layout.py::test_chunk_bounds_cover_every_visible_pair[interleaved] holds the
  # bounds sound there.
  @pytest.mark.parametrize("segments", [
      "short", pytest.param("interleaved", marks=pytest.mark.slow)])
  def test_path_skips_chunks_before_the_document(self, key, segments):
    super().test_path_skips_chunks_before_the_document(key, segments)

  # The bf16 case repeats the float32 pairs case's code path (the interpreter takes pairs in
  # float32 too: calls_span.span_pairs); it matters on TestGPU, where float32 takes single chunks.
  # Forms 1 and 3 (not the default) keep an alternating-documents case in the default set (CI
  # time); form 3's takes pairs (key pairs with partly masked tiles).
  @pytest.mark.parametrize("mode,dtype,pairs,alternating", [
      (2, jnp.float32, True, False), (2, jnp.float32, False, True),
      (1, jnp.float32, False, True), (3, jnp.float32, True, True),
      pytest.param(1, jnp.float32, True, False, marks=pytest.mark.slow),
      pytest.param(3, jnp.float32, False, False, marks=pytest.mark.slow)] + [
      pytest.param(mode, jnp.bfloat16, True, False, marks=pytest.mark.slow) for mode in (1, 2, 3)])
  def test_bwd_spans(self, key, monkeypatch, mode, dtype, pairs, alternating):
    # With the rows the launches do not write poisoned (test_bwd_spans_read_only_written_rows)
    self._poison_unwritten_span_rows(monkeypatch, span=2)
    super().test_bwd_spans(key, mode, dtype, pairs, alternating)

  # No gate, no segments, one query head a kv head: the float32 default blocks run in the
  # default set through test_path_gate_segments_gqa_f32, the kernels without gate and segments
  # through test_path_correlated_w[shared:0.01-bfloat16]; the interpreter's repeats are one
  # executable run twice, so the bitwise check matters on TestGPU (CI time).
  @pytest.mark.slow
  def test_path_plain_f32_deterministic(self, key):
    super().test_path_plain_f32_deterministic(key)

  # The default BlockSizes in bf16 stays in the default set through
  # test_path_correlated_w[shared:0.01-bfloat16] (H = 2, K = 1, no gate); the gate in bf16
  # through test_prepass_keep_inverse_interpret[False] (the default blocks but the option, with
  # grouped heads) and test_recomputed_operands_one_lane_bf16. CI time.
  @pytest.mark.slow
  def test_path_gate_bf16(self, key):
    super().test_path_gate_bf16(key)

  # The alternating documents' walk of the sequential sweep (dkv_span 2, bwd_spans 0) stays in
  # the default set through test_dkv_span_reads_only_stored_states (the same layout, with the
  # unstored states poisoned), the gate, grouped heads and bitwise repeats through the
  # [float32-2-False] row, one lane through test_recomputed_operands_one_lane_bf16. CI time.
  @pytest.mark.parametrize("dtype,lanes,alternating", [
      (jnp.float32, 2, False), pytest.param(jnp.float32, None, True, marks=pytest.mark.slow)])
  def test_dkv_span(self, key, dtype, lanes, alternating):
    super().test_dkv_span(key, dtype, lanes, alternating)

  @pytest.mark.parametrize("pairs,lanes", [(True, 2), (False, 0)])
  def test_path_even_chunks_lanes_f32(self, key, pairs, lanes):
    """The sequential sweep (bwd_spans=0) at n = 4 (with pairs: query-chunk pairs only, no odd
    tail) split over backward lanes: 2, or 0 = auto_lanes, which at 2 programs takes 4 (one query chunk per lane without pairs)."""
    self._check(key, H=2, K=1, dtype=jnp.float32, gate=True, segments=False, T=64,
                block_sizes=kp.BlockSizes(block_q=16, block_k=16, bwd_lanes=lanes,
                                          dq_pairs=pairs, bwd_spans=0))

  def test_dkv_span_reads_only_stored_states(self, key, monkeypatch):
    """The dk/dv walk must not read a boundary state that the dq/dP sweep did not store (on the
    GPU that row is uninitialised memory). The interpreter's outputs start at zero, so the
    unstored rows are the all-zero ones before the padding: they are set to NaN on the way to
    dk/dv, and the gradients must stay exact (documents alternating every two chunks)."""
    real, T, span = calls.backward_dkv, 7 * self.block - 12, 2

    def poisoned(*args, qb=None, **kw):
      # qb is packed (kernels.boundary_offset): boundary j holds the chunks c >= (j + 1) span
      n = -(-T // self.block)
      t = jnp.concatenate([jnp.arange((j + 1) * span * self.block, n * self.block)
                           for j in range((n - 1) // span)])[:, None]
      unstored = jnp.all(qb == 0, axis=-1, keepdims=True) & (t < T)
      return real(*args, qb=jnp.where(unstored, jnp.nan, qb), **kw)

    monkeypatch.setattr(calls, "backward_dkv", poisoned)
    bs = kp.BlockSizes(block_q=self.block, block_k=self.block, dkv_span=span, bwd_spans=0)
    self._check(key, H=2, K=1, dtype=jnp.float32, gate=False, T=T, block_sizes=bs,
                segments=f"alternating:{2 * self.block}")

  def _poison_unwritten_span_rows(self, monkeypatch, span):
    """Rows the span-parallel backward's launches do not write (on the GPU, uninitialised
    memory) made NaN, so that a read of one shows in the gradients: the boundary kernel writes
    no kb for the last span, and the packed qb, A (kernels.boundary_offset) end with boundary
    nb - 1's last chunk. The kb rows are set to NaN and NaN rows are appended to qb and A past
    their end (a read there would clamp to real rows in the interpreter)."""
    from kernels_pallas.path_attention import calls_span
    real_dq, real_boundary = calls_span._far_dq, calls_span._boundary

    def far_dq(*args, **kw):
      qb, a, *rest = real_dq(*args, **kw)
      pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 2 * self.block), (0, 0)),
                              constant_values=jnp.nan)
      return (pad(qb), pad(a), *rest)

    def boundary(*args, **kw):
      kb, pi = real_boundary(*args, **kw)
      m = jnp.arange(kb.shape[2])[:, None, None]
      return jnp.where(m >= (kb.shape[2] - 1) // span * span, jnp.nan, kb), pi

    monkeypatch.setattr(calls_span, "_far_dq", far_dq)
    monkeypatch.setattr(calls_span, "_boundary", boundary)

  # Here every row of test_bwd_spans runs with the unwritten rows poisoned (forms 1, 2 and 3,
  # documents alternating or not), so this test's rows repeat them (CI time).
  @pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) for m in (1, 2, 3)])
  def test_bwd_spans_read_only_written_rows(self, key, monkeypatch, mode):
    """The span-parallel backward must not use a row its launches did not write
    (_poison_unwritten_span_rows): the gradients must stay exact (documents alternating every
    two chunks)."""
    T, span = 7 * self.block - 12, 2
    self._poison_unwritten_span_rows(monkeypatch, span)
    bs = kp.BlockSizes(block_q=self.block, block_k=self.block, dkv_span=span, bwd_spans=mode)
    self._check(key, H=2, K=1, dtype=jnp.float32, gate=True, T=T, block_sizes=bs,
                segments=f"alternating:{2 * self.block}")

  @pytest.mark.slow   # the call of test_path_gate_segments_gqa_f32 (n = 3) with 16-blocks
  def test_path_pairs_odd_tail_f32(self, key):
    """n = 3: one query-chunk pair and the odd last chunk alone."""
    self._check(key, H=4, K=2, dtype=jnp.float32, gate=True, segments=True,
                block_sizes=kp.BlockSizes(block_q=16, block_k=16))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
class TestGPU(PathKernelBase):
  backend = "gpu"
  block = 64
  T = 300
  D = 64

  @pytest.mark.parametrize("D,gate_segments", [(64, False), (128, False), (64, True)])
  def test_mosaic_forward_bf16(self, key, D, gate_segments):
    """BlockSizes(fwd_kernel="mosaic") (fwd_mosaic.py) against the oracle, gradients through
    the Triton backward; grouped heads, with and without the gate and packed documents."""
    self.D = D
    self._check(key, H=4, K=2, dtype=jnp.bfloat16, gate=gate_segments, segments=gate_segments,
                T=520, block_sizes=kp.BlockSizes(fwd_kernel="mosaic"))

  @pytest.mark.parametrize("D,walk", [(64, "far_dq"), (128, "far_dq"), (64, "far_dkv"),
                                      (128, "far_dkv")])
  def test_far_backward_mosaic_head_dim_bf16(self, key, D, walk):
    """BlockSizes(far_dq="mosaic") or BlockSizes(far_dkv="mosaic") (with the far dk/dv launch
    of bwd_spans 3) at the GPU's own tiles, head_dim 64 and 128: n = 9 chunks, span 2, gate,
    grouped heads, packed documents; forward and every gradient against the oracle, and the
    gradients bitwise the same over two runs (the launches have no atomics)."""
    self.D = D
    self._check(key, H=4, K=2, dtype=jnp.bfloat16, gate=True, segments=True, T=520,
                block_sizes=kp.BlockSizes(dkv_span=2, bwd_spans=3, **{walk: "mosaic"}),
                determinism=True)

  @pytest.mark.parametrize("span,gate_segments", [(4, True), (8, False)])
  def test_span_sweep_mosaic_bf16(self, key, span, gate_segments):
    """BlockSizes(span_sweep="mosaic") at the GPU's own tiles (head_dim 64): n = 10 chunks at
    span 4 (query tiles sweeping up to two key chunks) with a gate, grouped heads and packed
    documents, or at span 8 (up to six) without; forward and every gradient against the oracle,
    and the gradients bitwise the same over two runs (the dL/dP reductions are in a fixed
    order)."""
    self._check(key, H=4, K=2, dtype=jnp.bfloat16, gate=gate_segments, segments=gate_segments,
                T=10 * 64 - 20, block_sizes=kp.BlockSizes(dkv_span=span, span_sweep="mosaic"),
                determinism=True)

  @pytest.mark.parametrize("D", [64, 128])
  def test_far_mosaic_forward_head_dim_bf16(self, key, D):
    """BlockSizes(fwd_far="mosaic") at the GPU's own tiles, head_dim 64 and 128: n = 9 chunks,
    span 2, gate, grouped heads, packed documents; forward and every gradient against the
    oracle."""
    self.D = D
    self._check(key, H=4, K=2, dtype=jnp.bfloat16, gate=True, segments=True, T=520,
                block_sizes=kp.BlockSizes(dkv_span=2, fwd_spans=True, fwd_far="mosaic"))

  def test_head_dim_128_pallas_prepass_bf16(self, key):
    """head_dim 128 with one query head per kv head: the default pre-pass runs as
    "split2_hilo" there (the operands VJP as two kernels; usable_variant), on Pallas, where the
    one-kernel VJP did not fit."""
    self.D = 128
    self._check(key, H=2, K=2, dtype=jnp.bfloat16, gate=True, segments=True, T=520)

  @pytest.mark.parametrize("keep", [True, False])
  def test_prepass_keep_inverse_bf16(self, key, keep):
    """BlockSizes(prepass_keep_inverse=True): the pre-pass VJP reads the forward's float32 Y
    (False: runs the inverse kernel again) where the default refines Y's bf16 rounding by a
    Newton step; gradients against the oracle, grouped heads, gate."""
    self._check(key, H=4, K=2, dtype=jnp.bfloat16, gate=True, segments=False,
                block_sizes=kp.BlockSizes(prepass_keep_inverse=keep))

  @pytest.mark.parametrize("D", [64, 128])
  def test_prepass_keep_inverse_bf16_correlated(self, key, D):
    """prepass_keep_inverse="bf16" on the correlated w whose pre-pass products cancel
    (test_path_correlated_w's inputs), at both pre-pass forms ("uz_hilo" at 64, "split2_hilo"
    at 128): the Newton step must restore the float32 Y there."""
    self.D = D
    self._check(key, H=2, K=2, dtype=jnp.bfloat16, gate=False, segments=False,
                w_mode="shared:0.01", B=4,
                block_sizes=kp.BlockSizes(prepass_keep_inverse="bf16"))

  def test_prepass_late_wk_correlated_bf16(self, key):
    """BlockSizes(prepass_late_wk=True): the pre-pass VJP's q part leaves WK's pullback to the
    inverse-VJP kernel (dwk and a float32 dk through HBM); grouped heads, on the correlated w
    whose pre-pass products cancel (test_path_correlated_w's inputs and rows)."""
    self._check(key, H=4, K=2, dtype=jnp.bfloat16, gate=False, segments=False,
                w_mode="shared:0.01", B=8,
                block_sizes=kp.BlockSizes(prepass="split2_hilo", prepass_late_wk=True))

  @pytest.mark.parametrize("mode", [1, 2, 3])
  def test_bwd_spans_head_dim_128_bf16(self, key, mode):
    """The span-parallel backward at head_dim 128 with the default tiles (calls_span.span_pairs:
    one query chunk per tile with the near dk, dv in the span kernel, which asks for 240 KiB
    of shared memory with pairs), auto span (n = 13: three boundaries)."""
    self.D = 128
    self._check(key, H=2, K=1, dtype=jnp.bfloat16, gate=True, segments=True, T=800,
                block_sizes=kp.BlockSizes(bwd_spans=mode))

  def test_auto_span_long_sequence_head_dim_128_bf16(self, key):
    """The default span at head_dim 128 on a long sequence: T = 8192 is 128 chunks, where
    routing.auto_span takes 15 boundaries (spans of 8; 7 at head_dim 64), so every backward
    launch walks many packed boundary states. Gate; forward and every gradient against the
    chunked float32 oracle (the dense walk's T x T arrays do not fit here)."""
    from kernels_pallas.path_attention import routing
    assert routing.auto_span(8192 // self.block, head_dim=128) == 8
    self.D = 128
    self._check(key, H=2, K=1, dtype=jnp.bfloat16, gate=True, segments=False, T=8192, B=1,
                block_sizes=kp.BlockSizes(), chunked_oracle=True)


def test_argument_errors():
  x = jnp.zeros((1, 8, 2, 16))
  w, beta = jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 2))
  with pytest.raises(ValueError, match="beta must have shape"):
    kp.path_attention(x, x, x, w, beta[:, :4], interpret=True)
  with pytest.raises(ValueError, match="block_q=32 must equal block_k=64"):
    kp.path_attention(x, x, x, w, beta, block_sizes=kp.BlockSizes(block_q=32), interpret=True)
  with pytest.raises(ValueError, match="head_dim=24"):
    y = jnp.zeros((1, 8, 2, 24))
    kp.path_attention(y, y, y, y, beta, interpret=True)
