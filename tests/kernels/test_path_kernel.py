"""Every form of the PaTH / FoX kernels against the dense oracles: forward, every gradient,
determinism. Each case pins the form it names on the plan (kernel_check.check: `pins` replace
plan fields, `expect` asserts them before anything runs).

TestInterpret runs the GPU forms in the generic interpreter on the CPU, at the smallest shapes
that reach each code path (chunk 16, head_dim 16; n = 7 or 8 chunks for three span
boundaries); TestGPU runs them at the GPU's own tiles on a GPU (.ci/gpu). The TPU forms are
test_tpu_kernels.py's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas as kp
from kernels_pallas.path_attention import span_backward
from kernels_pallas.path_attention import spans
from posenc_jax import householder
from tests.kernels import kernel_check
from tests.util import assert_rel_rms

F32, BF16 = jnp.float32, jnp.bfloat16
C = 16          # the interpreter cases' chunk (BlockSizes.block)
T3 = 3 * C - 11   # n = 3: one query-chunk pair and the odd tail; padded to whole chunks
T4 = 4 * C        # n = 4: pairs only, no padding
T7 = 7 * C - 12   # n = 7 at span 2: three boundaries, the last span a single chunk
T8 = 8 * C - 12   # n = 8 at span 2: three boundaries, every span whole (the Mosaic sweep)
ALTERNATING = f"alternating:{2 * C}"   # two documents in turns of two chunks: far tiles that
                                       # are wholly masked, adjoints that start past a boundary

# The default plan at these shapes in the interpreter is the span backward (n > its span of
# 2) with far dk/dv inside the dk/dv kernel, far dq one chunk a tile, the near sweep in pairs.
SPAN_FORM2 = dict(backward="span", far_dkv="dkv", far_dq="triton", far_dq_pairs=False,
                  sweep="triton", sweep_pairs=True)


def poison_unwritten_span_rows(monkeypatch, span):
  """Rows the span backward's launches do not write (on the GPU, uninitialised memory) made NaN,
  so that a read of one shows in the gradients: the boundary launch writes no kb for the last
  span, and the packed qb, A (tiles.boundary_offset) end with boundary nb - 1's last chunk. The
  kb rows are set to NaN and NaN rows appended to qb and A past their end (a read there would
  clamp to real rows in the interpreter)."""
  real_far_dq, real_boundary = span_backward._far_dq, spans.boundary

  def far_dq(*args, **kw):
    qb, a, *rest = real_far_dq(*args, **kw)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 2 * C), (0, 0)), constant_values=jnp.nan)
    return (pad(qb), pad(a), *rest)

  def boundary(*args, **kw):
    kb, pi = real_boundary(*args, **kw)
    m = jnp.arange(kb.shape[2])[:, None, None]
    return jnp.where(m >= (kb.shape[2] - 1) // span * span, jnp.nan, kb), pi

  monkeypatch.setattr(span_backward, "_far_dq", far_dq)
  monkeypatch.setattr(spans, "boundary", boundary)


def case(id_, *, slow=False, **kw):
  return pytest.param(kw, id=id_, marks=[pytest.mark.slow] if slow else [])


# Each row: one code path; (slow) a repeat of a default row's path on other inputs or dtype.
INTERPRET_CASES = [
    # The sequential backward (span 0): dq/dP over auto_lanes' 3 lanes (3 pairs and the odd
    # tail at n = 7), then dk/dv; float32, bitwise repeatable.
    case("walk-3lanes-pairs-odd-tail-f32", dtype=F32, H=4, K=2, T=T7, gate=True, segments=True,
         block_sizes=dict(block=C, span=0), determinism=True,
         expect=dict(backward="walk", forward="walk", lanes=3)),
    # One lane, pairs only (n = 4), bf16.
    case("walk-1lane-pairs-bf16", dtype=BF16, H=4, K=2, T=T4, gate=True, segments=True,
         block_sizes=dict(block=C, span=0), pins=dict(lanes=1),
         expect=dict(backward="walk", lanes=1)),
    case("walk-plain-f32", slow=True, dtype=F32, H=2, K=2, T=T3, block_sizes=dict(block=C, span=0),
         determinism=True, expect=dict(backward="walk")),
    # One chunk in all (T = block, and T < block: padded): the walk has no query pair to trace.
    case("walk-one-chunk-f32", dtype=F32, H=2, K=1, T=C, gate=True, segments=True,
         block_sizes=dict(block=C), expect=dict(backward="walk", span=0)),
    case("walk-part-of-a-chunk-bf16", dtype=BF16, H=2, K=2, T=C - 7,
         block_sizes=dict(block=C), expect=dict(backward="walk", span=0)),
    # Packed documents of ~8 tokens: the walks stop at the document's first chunk.
    case("walk-skips-chunks-short-documents", dtype=F32, H=2, K=1, T=T4, gate=True,
         segments="short", block_sizes=dict(block=C, span=0), expect=dict(backward="walk")),
    # Ids at random (no chunk can be skipped): the bounds only over-count.
    case("walk-skips-chunks-interleaved", slow=True, dtype=F32, H=2, K=1, T=T4, gate=True,
         segments="interleaved", block_sizes=dict(block=C, span=0)),
    # FoX: the walk with single query chunks (no transport to pair them) over 3 lanes.
    case("fox-3lanes-f32", fox=True, dtype=F32, H=4, K=2, T=T3, gate=True, segments=True,
         block_sizes=dict(block=C), determinism=True,
         expect=dict(prepass="none", backward="walk", lanes=3)),
    case("fox-1lane-bf16", fox=True, dtype=BF16, H=4, K=2, T=T3, gate=True, segments=True,
         block_sizes=dict(block=C), pins=dict(lanes=1), expect=dict(backward="walk", lanes=1)),
    case("fox-skips-chunks-short-documents", fox=True, dtype=F32, H=2, K=1, T=T4, gate=True,
         segments="short", block_sizes=dict(block=C)),
    # The span backward, form 2 (far dk/dv inside the dk/dv kernel), the default here: three
    # boundaries, alternating documents, the unwritten rows poisoned.
    case("span-form2-f32", dtype=F32, H=4, K=2, T=T7, gate=True, segments=ALTERNATING,
         block_sizes=dict(block=C, span=2), determinism=True, poison=True,
         expect=dict(SPAN_FORM2, span=2, forward="walk")),
    case("span-form2-bf16", slow=True, dtype=BF16, H=4, K=2, T=T7, gate=True, segments=True,
         block_sizes=dict(block=C, span=2), expect=SPAN_FORM2),
    # Form 3: the far dk/dv walk as a Triton launch of its own, key chunks in pairs (the odd
    # last one alone); far dq in query pairs, the near sweep one chunk at a time.
    case("span-form3-pairs-f32", dtype=F32, H=4, K=2, T=T7, gate=True, segments=ALTERNATING,
         block_sizes=dict(block=C, span=2), determinism=True, poison=True,
         pins=dict(far_dkv="triton", far_dkv_pairs=True, far_dq_pairs=True, sweep_pairs=False),
         expect=dict(backward="span", far_dkv="triton", far_dkv_pairs=True, far_dq="triton",
                     far_dq_pairs=True, sweep="triton", sweep_pairs=False)),
    case("span-form3-single-f32", slow=True, dtype=F32, H=4, K=2, T=T7, gate=True,
         segments=True, block_sizes=dict(block=C, span=2), poison=True,
         pins=dict(far_dkv="triton", far_dkv_pairs=False),
         expect=dict(far_dkv="triton", far_dkv_pairs=False, far_dq_pairs=False)),
    case("span-form3-bf16", slow=True, dtype=BF16, H=4, K=2, T=T7, gate=True, segments=True,
         block_sizes=dict(block=C, span=2),
         pins=dict(far_dkv="triton", far_dkv_pairs=True, far_dq_pairs=True),
         expect=dict(far_dkv="triton")),
    # The span forward: the walk inside the query chunk's span, earlier spans as plain
    # attention against the boundary launch's moved keys (which the span backward then reads).
    case("span-forward-f32", dtype=F32, H=4, K=2, T=T7, gate=True, segments=ALTERNATING,
         block_sizes=dict(block=C, span=2), poison=True,
         pins=dict(forward="span", forward_far="triton"),
         expect=dict(forward="span", forward_far="triton", backward="span")),
    # mosaic=True: the Mosaic GPU launches' jnp oracles in their place, all four at once (far
    # forward keys, far dq, far dk/dv, the near sweep; the sweep takes an even n).
    case("mosaic-oracles-f32", dtype=F32, H=4, K=2, T=T8, gate=True, segments=ALTERNATING,
         block_sizes=dict(block=C, span=2, mosaic=True), determinism=True,
         pins=dict(forward="span", forward_far="mosaic", far_dkv="mosaic"),
         expect=dict(forward_far="mosaic", far_dq="mosaic", far_dkv="mosaic", sweep="mosaic")),
    # The Mosaic sweep from the Triton far dq's adjoints, no documents.
    case("mosaic-sweep-triton-far-dq-f32", slow=True, dtype=F32, H=4, K=2, T=T8, gate=True,
         block_sizes=dict(block=C, span=2, mosaic=True), pins=dict(far_dq="triton"),
         expect=dict(far_dq="triton", sweep="mosaic", far_dkv="dkv")),
    # The jnp pre-pass (its VJP through jax.vjp, dL/dE from dL/dP in XLA), with the default
    # span backward at n = 3 (one boundary).
    case("prepass-jnp-f32", dtype=F32, H=4, K=2, T=T3, gate=True, segments=True,
         block_sizes=dict(block=C, prepass="jnp"),
         expect=dict(SPAN_FORM2, prepass="jnp", keep_inverse=False)),
    # The three-kernel pre-pass VJP with the forward's float32 Y kept.
    case("prepass-split-keep-f32-bf16", dtype=BF16, H=4, K=2, T=T3, gate=True,
         block_sizes=dict(block=C, prepass="split", keep_inverse=True),
         expect=dict(prepass="split", keep_inverse=True)),
    # w sharing a direction, beta = 2: the bf16 training NaN's inputs, through the default
    # plan ("uz", Y kept in bf16). Eight rows: with every w of a row near one direction, a
    # chunk's dbeta errors are one coherent error, and two rows are too few for the relative
    # RMS to estimate it within the tolerance.
    case("correlated-w-shared-0.01-bf16", dtype=BF16, H=2, K=1, T=T3, B=8,
         w_mode="shared:0.01", block_sizes=dict(block=C),
         expect=dict(prepass="uz", keep_inverse="bf16")),
    case("correlated-w-shared-1-bf16", slow=True, dtype=BF16, H=2, K=1, T=T3, B=8,
         w_mode="shared:1.0", block_sizes=dict(block=C)),
    case("correlated-w-antiparallel-bf16", slow=True, dtype=BF16, H=2, K=1, T=T3, B=8,
         w_mode="antiparallel", block_sizes=dict(block=C)),
    case("correlated-w-shared-0.01-f32", slow=True, dtype=F32, H=2, K=1, T=T3, B=8,
         w_mode="shared:0.01", block_sizes=dict(block=C)),
]


class TestInterpret:
  """Each case compiles the interpreter's kernels and the oracle, forward and backward (20-60 s
  on CI's 2 cores): the default set keeps one case per code path, -m slow the repeats."""

  @pytest.mark.parametrize("kw", INTERPRET_CASES)
  def test_form_against_oracle(self, key, monkeypatch, kw):
    kw = dict(kw)
    if kw.pop("poison", False):
      poison_unwritten_span_rows(monkeypatch, span=2)
    kernel_check.check(key, backend="interpret", D=16, **kw)

  @pytest.mark.parametrize("keep", [pytest.param("bf16", marks=pytest.mark.slow), False])
  def test_keep_inverse_runs_the_refining_kernel_only_for_bf16(self, key, monkeypatch, keep):
    """keep_inverse="bf16" (the default with bf16 inputs): the forward keeps Y's bf16 rounding
    and the VJP's refining kernel restores it by a Newton step; False: the VJP runs the inverse
    kernel again and never the refining one. Correlated w, grouped heads, gate, through the
    "split" VJP. ("bf16" is under -m slow: the default set's bf16 cases run it already; this
    one checks that it does.)"""
    from kernels_pallas.path_attention.prepass import kernels
    ran, refine = [], kernels._refine_kernel

    def _refine_kernel(*refs, cfg):   # the same name: the plan's warps are looked up by it
      ran.append(cfg)
      return refine(*refs, cfg=cfg)

    monkeypatch.setattr(kernels, "_refine_kernel", _refine_kernel)
    kernel_check.check(key, backend="interpret", dtype=BF16, H=4, K=2, D=16, T=T3, gate=True,
                       w_mode="shared:0.01",
                       block_sizes=dict(block=C, prepass="split", keep_inverse=keep),
                       expect=dict(prepass="split", keep_inverse=keep))
    assert bool(ran) == (keep == "bf16"), f"refining kernel ran {len(ran)} times for {keep!r}"

  # The interpreter's exact float32 products pass this even with the old Neumann inverse: it
  # matters on TestGPU, where it runs unmarked.
  @pytest.mark.slow
  def test_path_layer_inputs_bf16(self, key):
    path_layer_inputs_bf16(key, backend="interpret")


def path_layer_inputs_bf16(key, *, backend):
  """The PaTH layer's own w, beta (low-rank projection, SiLU, short convolution, at init) through
  the kernel's default plan at the GPU's chunk (64), bf16 q, k, v: the inputs of the bf16
  training NaN. At init neighbouring w share a direction only weakly; the GPU's TF32 products
  gave a NaN gradient on such inputs while the interpreter's exact ones did not."""
  from posenc_jax import encodings
  from posenc_jax.encodings import transport
  B, T, H, D, d_model = 1, 128, 2, 32, 64
  ks = jax.random.split(key, 6)
  dims = encodings.Dims(d_model=d_model, num_heads=H, num_kv_heads=H, head_dim=D)
  params = encodings.get("path").init(ks[0], dims)
  x = jax.random.normal(ks[1], (B, T, d_model))
  w, beta = transport.transport_inputs(params, x, num_kv_heads=H, head_dim=D)
  q, k, v, do = (jax.random.normal(k_, (B, T, H, D), BF16) for k_ in ks[2:])
  args = (q, k, v, w, beta)
  assert kp.explain(*args, backend=backend).block == 64
  fast = lambda *a: kp.path_attention(*a, backend=backend)
  ref = lambda *a: householder.path_attention_reference(*a, scale=D ** -0.5)
  grad = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(F32) * do),
                                     argnums=tuple(range(5))))
  with jax.default_matmul_precision("highest"):
    o_ref, g_ref = jax.jit(ref)(*args), grad(ref)(*args)
  assert_rel_rms(jax.jit(fast)(*args), o_ref, 1e-2, "forward")
  for name, a, b in zip(("q", "k", "v", "w", "beta"), grad(fast)(*args), g_ref):
    assert_rel_rms(a, b, 1e-2, f"d{name}")


# TestGPU: every form at the GPU's own tiles (chunk 64), head_dim 64 and 128, bf16 and float32.
# T = 620 is n = 10 (auto span 4 at either head_dim: two boundaries, an even n for the Mosaic
# sweep); 800 is n = 13 (span 4: three boundaries, the last span one chunk, odd n); 300 is n = 5.
# test_plan.py::test_gpu_cases_run_the_forms_they_name resolves each row's plan for "gpu" on the
# CPU host and checks `expect` there too, so a row that stopped naming its form fails in CI.
GPU_CASES = [
    # Head_dim 64, bf16, the default plan: span backward with far dq and the near sweep on
    # Mosaic GPU, far dk/dv inside the dk/dv kernel, the walk forward, the "uz" pre-pass.
    case("d64-default-bf16", dtype=BF16, D=64, H=4, K=2, T=620, gate=True, segments=True,
         determinism=True,
         expect=dict(forward="walk", backward="span", span=4, far_dq="mosaic", far_dkv="dkv",
                     sweep="mosaic", sweep_pairs=True, prepass="uz", keep_inverse="bf16",
                     chain="kernel")),
    # ... with Mosaic off: far dq one chunk a tile and the sweep in pairs, on Triton.
    case("d64-triton-bf16", dtype=BF16, D=64, H=4, K=2, T=620, gate=True, segments=True,
         block_sizes=dict(mosaic=False),
         expect=dict(backward="span", far_dq="triton", far_dq_pairs=False, far_dkv="dkv",
                     sweep="triton", sweep_pairs=True)),
    # The far dk/dv walk as its own launch at head_dim 64 (the default from 64 chunks): Mosaic
    # and Triton (key pairs). Alternating documents make wholly masked far tiles; no gate with
    # them in bf16: the layout itself puts the bf16 dlog_forget error near 1e-2 for every form
    # (each document's gate sum restarts after the other's run), the Triton walk's included.
    case("d64-far-dkv-mosaic-bf16", dtype=BF16, D=64, H=4, K=2, T=800,
         segments="alternating:128", determinism=True,
         pins=dict(far_dkv="mosaic", far_dkv_pairs=True),
         expect=dict(far_dq="mosaic", far_dkv="mosaic", sweep="triton")),
    case("d64-far-dkv-triton-bf16", dtype=BF16, D=64, H=4, K=2, T=620, gate=True,
         segments=True, block_sizes=dict(mosaic=False),
         pins=dict(far_dkv="triton", far_dkv_pairs=True),
         expect=dict(far_dq="triton", far_dkv="triton", far_dkv_pairs=True)),
    # The sequential walk (span 0): lanes by auto_lanes (2 at 2 x 2 programs), and one lane.
    case("d64-walk-bf16", dtype=BF16, D=64, H=4, K=2, T=300, gate=True, segments=True,
         block_sizes=dict(span=0), determinism=True,
         expect=dict(backward="walk", lanes=2)),
    case("d64-walk-1lane-f32", dtype=F32, D=64, H=2, K=2, T=300, block_sizes=dict(span=0),
         pins=dict(lanes=1), determinism=True, expect=dict(backward="walk", lanes=1)),
    # float32 at head_dim 64: the span backward all on Triton, the sweep one chunk a tile
    # (2C-row tiles do not fit in float32); the "split" pre-pass (one query head a kv head).
    case("d64-default-f32", dtype=F32, D=64, H=2, K=2, T=620, gate=True, segments=True,
         determinism=True,
         expect=dict(backward="span", far_dq="triton", far_dkv="dkv", sweep="triton",
                     sweep_pairs=False, prepass="split", keep_inverse=False)),
    # float32 with grouped heads: the jnp pre-pass (no pre-pass kernel fits).
    case("d64-gqa-f32", dtype=F32, D=64, H=4, K=2, T=300, gate=True,
         expect=dict(prepass="jnp")),
    # Head_dim 128, bf16, the default plan: the span forward with its far keys on Mosaic, far
    # dq and far dk/dv on Mosaic (pairs), the sweep on Triton (pairs), bf16x3 chains, the
    # "split" pre-pass (one query head a kv head); T = 800: three boundaries, odd n.
    case("d128-default-bf16", dtype=BF16, D=128, H=2, K=2, T=800, gate=True, segments=True,
         determinism=True,
         expect=dict(forward="span", forward_far="mosaic", backward="span", span=4,
                     far_dq="mosaic", far_dkv="mosaic", sweep="triton", sweep_pairs=True,
                     chain="bf16x3", prepass="split", keep_inverse="bf16")),
    # ... with grouped heads: the jnp pre-pass.
    case("d128-gqa-bf16", dtype=BF16, D=128, H=4, K=2, T=620, gate=True,
         expect=dict(prepass="jnp", forward="span", far_dkv="mosaic")),
    # ... with Mosaic off: the span forward's far keys in its Triton kernel, far dq and far
    # dk/dv Triton launches in pairs.
    case("d128-triton-bf16", dtype=BF16, D=128, H=2, K=2, T=800, gate=True, segments=True,
         block_sizes=dict(mosaic=False), determinism=True,
         expect=dict(forward="span", forward_far="triton", far_dq="triton", far_dq_pairs=True,
                     far_dkv="triton", far_dkv_pairs=True, sweep="triton")),
    # far dq one chunk a tile at head_dim 128 (pairs are the default there).
    case("d128-far-dq-single-bf16", dtype=BF16, D=128, H=2, K=2, T=620,
         block_sizes=dict(mosaic=False), pins=dict(far_dq_pairs=False),
         expect=dict(far_dq="triton", far_dq_pairs=False)),
    # float32 at head_dim 128: the jnp pre-pass and the span forward on Triton; no backward
    # fits shared memory there (test_plan's test_float32_path_at_head_dim_128_...).
    case("d128-forward-f32", dtype=F32, D=128, H=2, K=2, T=620, gate=True, segments=True,
         forward_only=True, expect=dict(prepass="jnp", forward="span", forward_far="triton",
                                        backward="none")),
    case("d128-walk-bf16", dtype=BF16, D=128, H=2, K=2, T=300, gate=True,
         block_sizes=dict(span=0), expect=dict(backward="walk", forward="walk")),
    # FoX (the walk) at both head_dims and dtypes, with the short documents it skips.
    case("fox-d64-bf16", fox=True, dtype=BF16, D=64, H=4, K=2, T=620, gate=True,
         segments=True, expect=dict(backward="walk", prepass="none")),
    case("fox-d128-f32", fox=True, dtype=F32, D=128, H=4, K=2, T=300, gate=True,
         segments="short", determinism=True, expect=dict(backward="walk")),
    # The pre-pass forms and what they keep: "split" at head_dim 64 (uz is the default there),
    # keep_inverse True / False, and the bf16 Y's Newton step on the correlated w whose
    # pre-pass products cancel, at both head_dims' forms.
    case("prepass-split-d64-bf16", dtype=BF16, D=64, H=4, K=2, T=300, w_mode="shared:0.01",
         B=8, block_sizes=dict(prepass="split"),
         expect=dict(prepass="split", keep_inverse="bf16")),
    case("prepass-keep-f32-bf16", dtype=BF16, D=64, H=4, K=2, T=300, gate=True,
         block_sizes=dict(keep_inverse=True), expect=dict(prepass="uz", keep_inverse=True)),
    case("prepass-recompute-bf16", dtype=BF16, D=128, H=2, K=2, T=300, gate=True,
         block_sizes=dict(keep_inverse=False), expect=dict(prepass="split", keep_inverse=False)),
    case("prepass-keep-bf16-correlated-d64", dtype=BF16, D=64, H=2, K=2, T=300,
         w_mode="shared:0.01", B=4, expect=dict(prepass="uz", keep_inverse="bf16")),
    case("prepass-keep-bf16-correlated-d128", dtype=BF16, D=128, H=2, K=2, T=300,
         w_mode="shared:0.01", B=4, expect=dict(prepass="split", keep_inverse="bf16")),
    case("prepass-jnp-bf16", dtype=BF16, D=64, H=4, K=2, T=300, gate=True, segments=True,
         block_sizes=dict(prepass="jnp"), expect=dict(prepass="jnp")),
    # The inputs of the bf16 training NaN (kernel_check's correlated modes), eight rows.
    case("correlated-shared-1-bf16", dtype=BF16, D=64, H=2, K=1, T=300, B=8,
         w_mode="shared:1.0"),
    case("correlated-antiparallel-bf16", dtype=BF16, D=64, H=2, K=1, T=300, B=8,
         w_mode="antiparallel"),
    case("correlated-shared-0.01-f32", dtype=F32, D=64, H=2, K=1, T=300, B=8,
         w_mode="shared:0.01"),
]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
class TestGPU:

  @pytest.mark.parametrize("kw", GPU_CASES)
  def test_form_against_oracle(self, key, kw):
    kernel_check.check(key, backend="gpu", **kw)

  def test_path_layer_inputs_bf16(self, key):
    path_layer_inputs_bf16(key, backend="gpu")

  def test_long_sequence_head_dim_128_bf16(self, key):
    """The default plan at head_dim 128 on a long sequence: T = 8192 is 128 chunks, spans of 8
    (15 boundaries), so every backward launch walks many packed boundary states. Gate; forward
    and every gradient against the chunked float32 oracle (the dense walk's T x T arrays do not
    fit here)."""
    kernel_check.check(key, backend="gpu", dtype=BF16, D=128, H=2, K=1, T=8192, B=1, gate=True,
                       chunked_oracle=True,
                       expect=dict(span=8, forward="span", far_dq="mosaic", far_dkv="mosaic"))


def test_argument_errors():
  """A shape the kernels cannot take is one error naming the argument (the plan's and the
  options' errors are test_plan.py's)."""
  x = jnp.zeros((1, 8, 2, 16))
  w, beta = jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 2))
  with pytest.raises(ValueError, match=r"^beta must have shape \[1, 8, 2\], got \[1, 4, 2\]$"):
    kp.path_attention(x, x, x, w, beta[:, :4], interpret=True)
  with pytest.raises(ValueError, match=r"^head_dim=24 must be a power of two >= 16$"):
    y = jnp.zeros((1, 8, 2, 24))
    kp.path_attention(y, y, y, y, beta, interpret=True)
  with pytest.raises(ValueError, match=r"^w and beta are required"):
    kp.path_attention(x, x, x, None, beta, interpret=True)
