"""Which kernel form runs where: backward lanes by the GPU's wave count, the fused dk/dv sweep
and the pre-pass variant where their shared memory fits. Rules only: the kernels they pick are
tested against the oracles in test_path_kernel.py."""
import jax.numpy as jnp
import pytest

import kernels_pallas as kp


def test_auto_lanes_fill_the_last_wave():
  """bwd_lanes = 0: lanes that minimise ceil(L programs / SMs) / L, fewest on ties."""
  from kernels_pallas.path_attention.routing import auto_lanes
  assert auto_lanes(192, 16, 132) == 2   # the 125M model's layer: 2 waves -> 3 half waves
  assert auto_lanes(1024, 16, 132) == 1  # 8 full waves: lanes would only add memory
  assert auto_lanes(64, 128, 132) == 2   # 4,16384,16,128: 2 and 4 lanes tie, fewer wins
  assert auto_lanes(4, 3, 132) == 3      # capped by the units a head has
  assert auto_lanes(4, 16, 132) == 4     # and by max_lanes
  with pytest.raises(ValueError, match="bwd_lanes"):
    kp.BlockSizes(bwd_lanes=-1).validate(64)
  with pytest.raises(ValueError, match="prepass_num_warps"):
    kp.BlockSizes(prepass_num_warps=6).validate(64)


def test_kept_inverse_bf16_only_with_bf16_halves():
  """prepass_keep_inverse="bf16" keeps Y's bf16 rounding where the inverse's products are the
  bf16 halves (16-bit inputs on the GPU and in the interpreter); float32 inputs (three-pass
  TF32) and the TPU (HIGHEST) recompute Y, as with False: a float32 Y is kept only when asked
  for (True)."""
  from kernels_pallas.path_attention import calls
  from kernels_pallas.path_attention.prepass_variants import kept_inverse
  assert kept_inverse("bf16", calls.bf16x3_precision("gpu")) == "bf16"
  assert kept_inverse("bf16", calls.bf16x3_precision("interpret")) == "bf16"
  assert kept_inverse("bf16", calls.float32_precision("gpu")) is False
  assert kept_inverse("bf16", calls.bf16x3_precision("tpu")) is False
  assert kept_inverse(False, calls.bf16x3_precision("gpu")) is False
  assert kept_inverse(True, calls.bf16x3_precision("gpu")) is True
  with pytest.raises(ValueError, match="keep_inverse"):
    kept_inverse("f16", None)
  with pytest.raises(ValueError, match="prepass_keep_inverse"):
    kp.BlockSizes(prepass_keep_inverse="yes").validate(64)


@pytest.mark.parametrize("backend,dtype,G,D,transport,fused", [
    ("gpu", jnp.bfloat16, 2, 64, True, True),      # built on the H100
    ("gpu", jnp.bfloat16, 1, 128, True, False),    # asked for 240 KiB there
    ("gpu", jnp.float32, 2, 64, True, False),      # 337 KiB
    ("gpu", jnp.float32, 2, 64, False, True),      # FoX: no transport state, built
    ("interpret", jnp.float32, 2, 128, True, True)])
def test_fused_dkv_routing(backend, dtype, G, D, transport, fused):
  """dkv_in_dq runs fused only where the fused sweep fits the GPU's shared memory."""
  from kernels_pallas.path_attention.routing import fused_dkv_builds
  assert fused_dkv_builds(backend=backend, dtype=dtype, heads_per_kv=G, head_dim=D,
                          transport=transport) is fused


@pytest.mark.parametrize("requested,backend,dtype,G,D,expected", [
    ("split", "gpu", jnp.float32, 2, 64, "jnp"),   # operands VJP asked 272 of 227 KiB (H100)
    ("split", "gpu", jnp.bfloat16, 2, 64, "jnp"),  # float32-accurate products: the same tiles
    ("split", "gpu", jnp.bfloat16, 2, 128, "jnp"),
    ("split_bf16", "gpu", jnp.bfloat16, 2, 128, "split_bf16"),  # built (H200, round 4)
    ("split_bf16", "gpu", jnp.float32, 2, 64, "jnp"),  # float32 q keeps float32 operands
    ("split", "gpu", jnp.float32, 1, 64, "split"),
    ("split", "gpu", jnp.bfloat16, 1, 128, "jnp"),   # 288 of 227 KiB (H100)
    ("split_bf16", "gpu", jnp.bfloat16, 1, 128, "split_bf16"),
    ("split", "gpu", jnp.bfloat16, 1, 64, "split"),     # the 12-layer model's layer
    ("split_bf16x3", "gpu", jnp.bfloat16, 2, 64, "split_bf16x3"),  # built (H100, 2026-11-24)
    ("split_bf16x3", "gpu", jnp.bfloat16, 1, 128, "jnp"),  # operands VJP ~240 KiB (estimate)
    ("split_bf16x3", "gpu", jnp.float32, 1, 64, "split"),  # float32 keeps float32 accuracy
    ("split_bf16x3", "gpu", jnp.float32, 2, 64, "jnp"),
    ("split_bf16x3", "interpret", jnp.float32, 1, 64, "split"),
    ("split_bf16x3", "interpret", jnp.bfloat16, 2, 128, "split_bf16x3"),
    ("split_hilo", "gpu", jnp.bfloat16, 2, 64, "split_hilo"),
    ("split_hilo", "gpu", jnp.bfloat16, 1, 128, "jnp"),
    ("split_hilo", "gpu", jnp.float32, 1, 64, "split"),
    ("split2_hilo", "gpu", jnp.float32, 1, 64, "split2"),
    ("split2_bf16x3", "gpu", jnp.bfloat16, 1, 128, "split2_bf16x3"),
    ("split2_hilo", "gpu", jnp.bfloat16, 1, 128, "split2_hilo"),  # built (H200, 2026-11-25)
    ("split2_hilo", "gpu", jnp.bfloat16, 2, 128, "jnp"),    # not yet seen to build
    ("split2_hilo", "gpu", jnp.bfloat16, 1, 256, "jnp"),
    ("split2_hilo", "gpu", jnp.float32, 1, 128, "jnp"),
    ("split2_hilo", "gpu", jnp.bfloat16, 2, 64, "split2_hilo"),
    ("split", "interpret", jnp.float32, 2, 64, "split"),
    ("split", "tpu", jnp.float32, 2, 128, "split"),
    ("uz_hilo", "gpu", jnp.bfloat16, 1, 64, "uz_hilo"),   # measured faster (H200, 2026-11-26)
    ("uz_hilo", "gpu", jnp.bfloat16, 2, 64, "uz_hilo"),
    ("uz_hilo", "gpu", jnp.bfloat16, 1, 128, "split2_hilo"),   # its first kernel spills
    ("uz_hilo", "gpu", jnp.bfloat16, 2, 128, "jnp"),
    ("uz_hilo", "gpu", jnp.float32, 1, 64, "split2"),   # float32: not run on a GPU
    ("uz_bf16x3", "gpu", jnp.bfloat16, 1, 128, "split2_bf16x3"),
    ("uz_hilo", "interpret", jnp.float32, 1, 128, "uz"),
    ("uz_hilo", "tpu", jnp.bfloat16, 2, 128, "uz_hilo")])
def test_usable_variant_routes_grouped_heads_off_the_pallas_prepass(requested, backend, dtype, G,
                                                                     D, expected):
  """The GPU shapes whose Pallas pre-pass VJP overflows shared memory take the jnp pre-pass;
  every other backend and shape keeps the requested variant."""
  from kernels_pallas.path_attention.prepass_variants import usable_variant
  assert usable_variant(requested, backend=backend, dtype=dtype, heads_per_kv=G,
                        head_dim=D) == expected
  assert usable_variant("jnp", backend=backend, dtype=dtype, heads_per_kv=G, head_dim=D) == "jnp"


def test_auto_span_bounds_boundaries_and_keeps_short_spans():
  """auto_span: an even span with at most 7 boundaries inside n chunks (15 at head_dim > 64),
  never shorter than 8 chunks unless the span of at most 3 boundaries is (so short sequences
  keep that one), and the shortest such span; the span-parallel form by head_dim where
  BlockSizes leaves it None."""
  from kernels_pallas.path_attention import routing
  for head_dim, most in ((64, 7), (128, 15)):
    for n in range(2, 600):
      span = routing.auto_span(n, head_dim=head_dim)
      at_most = lambda b: -(-n // (b + 1))   # shortest span with <= b boundaries (before evening)
      assert span % 2 == 0 and (n - 1) // span <= most, (head_dim, n)
      assert span >= min(at_most(3) + at_most(3) % 2, 8), (head_dim, n)
      assert span - 2 < max(at_most(most), min(at_most(3) + at_most(3) % 2, 8)), (head_dim, n)
  # the anchors (32, 64, 128, 256 chunks) and 512
  assert [routing.auto_span(n) for n in (32, 64, 128, 256, 512)] == [8, 8, 16, 32, 64]
  assert [routing.auto_span(n, head_dim=128) for n in (32, 64, 128, 256, 512)] == [8, 8, 8, 16, 32]
  assert routing.span_form(kp.BlockSizes(), head_dim=128) == 3
  assert routing.span_form(kp.BlockSizes(), head_dim=64) == 2
  # at 64, form 3 from FORM3_MIN_CHUNKS chunks, and only where its far walk is the Mosaic launch
  many = routing.FORM3_MIN_CHUNKS
  assert routing.span_form(kp.BlockSizes(), head_dim=64, chunks=many, far_dkv_mosaic=lambda: True) == 3
  assert routing.span_form(kp.BlockSizes(), head_dim=64, chunks=many - 2,
                           far_dkv_mosaic=lambda: True) == 2
  assert routing.span_form(kp.BlockSizes(), head_dim=64, chunks=many, far_dkv_mosaic=lambda: False) == 2
  assert routing.span_form(kp.BlockSizes(bwd_spans=2), head_dim=64, chunks=many,
                           far_dkv_mosaic=lambda: True) == 2
  assert routing.span_form(kp.BlockSizes(bwd_spans=1), head_dim=128) == 1
  with pytest.raises(ValueError, match="far_dkv_rows"):
    kp.BlockSizes(far_dkv_rows=24).validate(64)
  with pytest.raises(ValueError, match="gate_colsum"):
    kp.BlockSizes(gate_colsum="carried").validate(64)
  with pytest.raises(ValueError, match="fwd_far"):
    kp.BlockSizes(fwd_far="cuda").validate(64)


def test_chain_products_precision():
  """BlockSizes.chain_products picks the span chains' precision for 16-bit inputs: three bf16
  passes, or "tf32", the kernels' own (None: one TF32 pass on the GPU); float32 inputs keep
  theirs either way; None resolves by head_dim. A name outside CHAIN_PRODUCTS is refused."""
  from kernels_pallas.path_attention import calls, calls_span, routing
  x3 = calls.bf16x3_precision("gpu")
  assert calls_span.fine_precision(jnp.bfloat16, None, "gpu") == x3
  assert calls_span.fine_precision(jnp.bfloat16, None, "gpu", "tf32") is None
  assert calls_span.fine_precision(jnp.float32, "f32", "gpu", "bf16x3") == "f32"
  assert calls_span.fine_precision(jnp.float32, "f32", "gpu", "tf32") == "f32"
  auto = kp.BlockSizes()
  assert routing.chain_products(auto, head_dim=64) == "tf32"
  assert routing.chain_products(auto, head_dim=128) == "bf16x3"
  assert routing.chain_products(kp.BlockSizes(chain_products="bf16x3"), head_dim=64) == "bf16x3"
  with pytest.raises(ValueError, match="chain_products"):
    kp.BlockSizes(chain_products="bf16").validate(64)


def test_far_launch_by_default():
  """BlockSizes.fwd_far None: the span forward's far keys go to the Mosaic GPU launch on the GPU
  where it takes the operands (bf16 / f16, chunk 64; packed documents too), else stay in the
  Triton kernel; the interpreter runs the launch's jnp oracle only
  when asked; "mosaic" where it cannot raises."""
  from kernels_pallas.path_attention import prepass, routing
  def ops(dtype, C=64, documents=False):
    x = jnp.zeros((1, 2, 4, C, 128), dtype)
    lo = jnp.zeros((1, 1, 4, 1, 1), jnp.int32) if documents else None
    return prepass.Operands(q=x, k=x, v=x, e=None, diag=None, fq=None, fk=None, sq=None, sk=None,
                            lo=lo)
  auto, mosaic, triton = kp.BlockSizes(), kp.BlockSizes(fwd_far="mosaic"), kp.BlockSizes(
      fwd_far="triton")
  assert routing.far_launch(ops(jnp.bfloat16), auto, "gpu", span=2)
  assert not routing.far_launch(ops(jnp.bfloat16), auto, "gpu", span=0)   # no span forward
  assert not routing.far_launch(ops(jnp.float32), auto, "gpu", span=2)
  assert not routing.far_launch(ops(jnp.bfloat16, C=32), auto, "gpu", span=2)
  assert not routing.far_launch(ops(jnp.bfloat16), auto, "interpret", span=2)
  assert routing.far_launch(ops(jnp.bfloat16, documents=True), auto, "gpu", span=2)
  assert routing.far_launch(ops(jnp.bfloat16, documents=True), mosaic, "gpu", span=2)
  assert not routing.far_launch(ops(jnp.bfloat16), triton, "gpu", span=2)
  assert routing.far_launch(ops(jnp.bfloat16, C=16), mosaic, "interpret", span=2)
  with pytest.raises(ValueError, match="fwd_far"):
    routing.far_launch(ops(jnp.float32), mosaic, "gpu", span=2)


@pytest.mark.parametrize("field", ["far_dq", "far_dkv"])
def test_far_backward_launch_by_default(field):
  """BlockSizes.far_dq / far_dkv None: the span backward's far walk goes to the Mosaic GPU launch
  on the GPU where it takes the operands (bf16 / f16, chunk 64; packed documents too), else
  stays in the Triton kernel; the interpreter runs the launch's jnp oracle only when asked;
  "mosaic" where it cannot raises."""
  from kernels_pallas.path_attention import prepass, routing
  def ops(dtype, C=64, documents=False):
    x = jnp.zeros((1, 2, 4, C, 128), dtype)
    lo = jnp.zeros((1, 1, 4, 1, 1), jnp.int32) if documents else None
    return prepass.Operands(q=x, k=x, v=x, e=None, diag=None, fq=None, fk=None, sq=None, sk=None,
                            lo=lo)
  auto, mosaic, triton = (kp.BlockSizes(**{field: x}) for x in (None, "mosaic", "triton"))
  launch = lambda *a: routing.mosaic_launch(*a, field)
  assert launch(ops(jnp.bfloat16), auto, "gpu")
  assert not launch(ops(jnp.float32), auto, "gpu")
  assert not launch(ops(jnp.bfloat16, C=32), auto, "gpu")
  assert not launch(ops(jnp.bfloat16), auto, "interpret")
  assert launch(ops(jnp.bfloat16, documents=True), auto, "gpu")
  assert launch(ops(jnp.bfloat16, documents=True), mosaic, "gpu")
  assert not launch(ops(jnp.bfloat16), triton, "gpu")
  assert launch(ops(jnp.float32, C=16), mosaic, "interpret")
  with pytest.raises(ValueError, match=field):
    launch(ops(jnp.float32), mosaic, "gpu")


def _transport_ops(dtype, D=64, n=4):
  """PaTH Operands of n chunks of 64 at head_dim D (zeros): what the span routing reads."""
  from kernels_pallas.path_attention import prepass
  x = jnp.zeros((1, 2, n, 64, D), dtype)
  return prepass.Operands(q=x, k=x, v=x, e=jnp.zeros((1, 2, n, D, D), dtype), diag=None,
                          fq=None, fk=None, sq=None, sk=None)


def test_span_sweep_launch_by_default():
  """BlockSizes.span_sweep None: the span backward's near sweep goes to the Mosaic GPU launch on
  the GPU where it takes the operands (bf16 / f16, chunk 64, head_dim 64, an even number of
  chunks, query tiles in pairs, no key-side parts), else stays in the Triton span kernel; the
  interpreter runs its jnp oracle only when asked; "mosaic" where it cannot raises."""
  from kernels_pallas.path_attention import routing
  ops = _transport_ops
  auto, mosaic, triton = (kp.BlockSizes(span_sweep=x) for x in (None, "mosaic", "triton"))
  launch = lambda o, bs, backend, kv=False, pairs=True: routing.sweep_launch(
      o, bs, backend, kv=kv, pairs=pairs)
  assert launch(ops(jnp.bfloat16), auto, "gpu")
  assert not launch(ops(jnp.float32), auto, "gpu")
  assert not launch(ops(jnp.bfloat16, D=128), auto, "gpu")
  assert not launch(ops(jnp.bfloat16, n=5), auto, "gpu")
  assert not launch(ops(jnp.bfloat16), auto, "gpu", kv=True)
  assert not launch(ops(jnp.bfloat16), auto, "gpu", pairs=False)
  assert not launch(ops(jnp.bfloat16), auto, "interpret")
  assert not launch(ops(jnp.bfloat16), triton, "gpu")
  assert launch(ops(jnp.float32, D=128), mosaic, "interpret")
  for o, backend, kw in ((ops(jnp.float32), "gpu", {}), (ops(jnp.bfloat16, D=128), "gpu", {}),
                         (ops(jnp.bfloat16), "gpu", dict(kv=True)),
                         (ops(jnp.float32, n=5), "interpret", {}),
                         (ops(jnp.bfloat16), "tpu", {})):
    with pytest.raises(ValueError, match="span_sweep"):
      launch(o, mosaic, backend, **kw)


def test_span_form_by_chunks_at_head_dim_64():
  """span_backward resolves BlockSizes.bwd_spans None at head_dim 64 to form 3 from
  FORM3_MIN_CHUNKS chunks where the far dk/dv walk is the Mosaic GPU launch (bf16 on the GPU),
  else 2 (fewer chunks, float32 inputs, the interpreter unless asked); 3 at head_dim 128; a
  BlockSizes choice stands."""
  from kernels_pallas.path_attention import routing
  ops = lambda dtype, n, D=64: _transport_ops(dtype, D=D, n=n)
  form = lambda o, backend, **kw: routing.span_backward(o, kp.BlockSizes(**kw), backend)[1] \
      .bwd_spans
  many = routing.FORM3_MIN_CHUNKS
  assert form(ops(jnp.bfloat16, many), "gpu") == 3
  assert form(ops(jnp.bfloat16, 2 * many), "gpu") == 3
  assert form(ops(jnp.bfloat16, many - 2), "gpu") == 2
  assert form(ops(jnp.float32, many), "gpu") == 2
  assert form(ops(jnp.bfloat16, many), "interpret") == 2
  assert form(ops(jnp.bfloat16, many), "interpret", far_dkv="mosaic") == 3
  assert form(ops(jnp.bfloat16, many - 2, D=128), "gpu") == 3
  assert form(ops(jnp.bfloat16, many), "gpu", bwd_spans=2) == 2
  # a far_dkv="mosaic" the launch cannot honour raises only where it would pick the form
  assert form(ops(jnp.float32, many), "gpu", bwd_spans=2, far_dkv="mosaic") == 2
  assert form(ops(jnp.float32, many - 2), "gpu", far_dkv="mosaic") == 2
  with pytest.raises(ValueError, match="far_dkv"):
    form(ops(jnp.float32, many), "gpu", far_dkv="mosaic")
  assert routing.span_backward(ops(jnp.bfloat16, many), kp.BlockSizes(), "tpu") == \
      (0, kp.BlockSizes())
