"""The plan (kernels_pallas/path_attention/plan.py): the default plan pinned at the anchor shapes
on the GPU (Hopper, assumed on this CPU host) and the TPU, the rules it is resolved by, and the
options' errors. Rules only, no kernel runs: the forms they pick are checked against the
oracles in test_path_kernel.py and test_tpu_kernels.py."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import pytest

import kernels_pallas as kp
from kernels_pallas.path_attention import plan as plan_lib
from posenc_jax import dispatch
from tests.kernels import kernel_check
from tests.kernels import test_path_kernel

SD = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32


def _plan(B, T, H, D, *, K=None, dtype=BF16, gate=False, segments=False, fox=False,
          backend="gpu", block_sizes=None):
  """explain(...) for abstract arguments of these shapes (PaTH, or FoX with fox)."""
  K = K or H
  q, kv = SD((B, T, H, D), dtype), SD((B, T, K, D), dtype)
  w = None if fox else SD((B, T, K, D), F32)
  beta = None if fox else SD((B, T, K), F32)
  return kp.explain(q, kv, kv, w, beta, SD((B, T, H), F32) if gate else None,
                    segment_ids=SD((B, T), jnp.int32) if segments else None,
                    block_sizes=block_sizes, backend=backend)


def _fields(plan):
  skip = ("spec", "device", "scale", "prepass_warps")
  return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name not in skip}


# The Triton launches' (warps, stages), by head_dim: plan._launches' rule at bf16.
LAUNCHES_64 = (("forward", 4, 2), ("dq", 8, 2), ("dkv", 4, 2), ("boundary", 4, 2),
               ("far_dq", 4, 2), ("far_dkv", 4, 2), ("far_y", 4, 2), ("span", 8, 2))
LAUNCHES_64_FAR_DKV = tuple(("far_dkv", 8, 2) if x[0] == "far_dkv" else x for x in LAUNCHES_64)
LAUNCHES_128 = (("forward", 4, 1), ("dq", 8, 1), ("dkv", 8, 2), ("boundary", 8, 2),
                ("far_dq", 8, 2), ("far_dkv", 8, 2), ("far_y", 4, 2), ("span", 8, 1))
TPU_LAUNCHES_64 = tuple(("span", 4, 2) if x[0] == "span" else x for x in LAUNCHES_64)

# Head_dim 64 on the GPU: the walk forward; the span backward with far dq and the near sweep
# on Mosaic GPU, far dk/dv inside the dk/dv kernel below 64 chunks and on Mosaic from there;
# the "uz" pre-pass keeping Y in bf16; chains at the kernels' own precision.
GPU_64 = dict(block=64, prepass="uz", keep_inverse="bf16", forward="walk", forward_far="none",
              backward="span", lanes=1, far_dq="mosaic", far_dq_pairs=False, far_dkv="dkv",
              far_dkv_pairs=False, sweep="mosaic", sweep_pairs=True, chain="kernel",
              launches=LAUNCHES_64)
GPU_64_LONG = dict(GPU_64, far_dkv="mosaic", far_dkv_pairs=True, launches=LAUNCHES_64_FAR_DKV)
# Head_dim 128 on the GPU: the span forward with its far keys on Mosaic, far dq and far dk/dv
# on Mosaic in pairs, the sweep on Triton in pairs, bf16x3 chains, the "split" pre-pass.
GPU_128 = dict(block=64, prepass="split", keep_inverse="bf16", forward="span",
               forward_far="mosaic", backward="span", lanes=1, far_dq="mosaic",
               far_dq_pairs=True, far_dkv="mosaic", far_dkv_pairs=True, sweep="triton",
               sweep_pairs=True, chain="bf16x3", launches=LAUNCHES_128)
# The TPU: its walks, the "uz" pre-pass recomputing Y, no spans. (chain and launches are the
# GPU's rule; no TPU launch reads them.)
TPU = dict(block=64, prepass="uz", keep_inverse=False, forward="tpu", forward_far="none",
           backward="tpu", span=0, lanes=1, far_dq="none", far_dq_pairs=False, far_dkv="none",
           far_dkv_pairs=False, sweep="none", sweep_pairs=False)
TPU_64 = dict(TPU, chain="kernel", launches=TPU_LAUNCHES_64)
TPU_128 = dict(TPU, chain="bf16x3", launches=LAUNCHES_128)

# (B, T, H, D), gate and segments, backend -> the default plan's fields.
ANCHORS = [
    ((4, 16384, 16, 128), False, "gpu", dict(GPU_128, chunks=256, span=16)),
    ((32, 2048, 32, 64), False, "gpu", dict(GPU_64, chunks=32, span=8)),
    ((8, 4096, 16, 128), False, "gpu", dict(GPU_128, chunks=64, span=8)),
    ((32, 4096, 32, 64), False, "gpu", dict(GPU_64_LONG, chunks=64, span=8)),
    ((8, 8192, 32, 64), False, "gpu", dict(GPU_64_LONG, chunks=128, span=16)),
    ((16, 2048, 12, 64), True, "gpu", dict(GPU_64, chunks=32, span=8)),   # the 125M layer
    ((4, 16384, 16, 128), False, "tpu", dict(TPU_128, chunks=256)),
    ((32, 2048, 32, 64), False, "tpu", dict(TPU_64, chunks=32)),
    ((8, 4096, 16, 128), False, "tpu", dict(TPU_128, chunks=64)),
    ((32, 4096, 32, 64), False, "tpu", dict(TPU_64, chunks=64)),
    ((8, 8192, 32, 64), False, "tpu", dict(TPU_64, chunks=128)),
    ((16, 2048, 12, 64), True, "tpu", dict(TPU_64, chunks=32)),
]


@pytest.mark.parametrize("shape,gate_segments,backend,expected", ANCHORS,
                         ids=[f"{b}-{'x'.join(map(str, s))}{'-gate-segments' * g}"
                              for s, g, b, _ in ANCHORS])
def test_default_plan_at_the_anchors(shape, gate_segments, backend, expected):
  """The default plan of a bf16 PaTH call (one query head a kv head) at each anchor shape. A
  change of a default changes a row here: measure it first (DESIGN.md, "Adding a form")."""
  plan = _plan(*shape, gate=gate_segments, segments=gate_segments, backend=backend)
  assert _fields(plan) == expected, plan
  assert plan.prepass_warps == plan_lib.prepass_warps(shape[3])
  text = str(plan)
  lines = text.splitlines()
  assert lines[0].startswith(f"PaTH on {backend}")
  assert f"T={shape[1]} H={shape[2]} K={shape[2]} D={shape[3]} bfloat16" in lines[0]
  assert ("gate, segments" if gate_segments else "no gate, no segments") in lines[0]
  assert f"chunks:    {expected['chunks']} of 64 tokens" in text
  assert f"pre-pass:  {expected['prepass']}" in text
  if backend == "tpu":
    assert "forward:   TPU walk (key chunks a grid axis)" in lines
    assert "backward:  TPU walks (query and key chunks grid axes)" in lines
    assert "launches" not in text
    return
  nb = (expected["chunks"] - 1) // expected["span"]
  assert f"spans of {expected['span']} chunks ({nb} boundaries)" in lines[1]
  assert "Y kept in bf16, refined by a Newton step" in text
  forward = ("walk (Triton)" if expected["forward"] == "walk"
             else "span walk (Triton), far keys on mosaic")
  assert f"forward:   {forward}" in lines
  assert f"far dq on mosaic{' (query pairs)' * expected['far_dq_pairs']}" in text
  assert ("dk/dv kernel (its far walk inside)" if expected["far_dkv"] == "dkv"
          else "far dk/dv on mosaic (key pairs)") in text
  assert f"near sweep on {expected['sweep']} (query pairs); chains {expected['chain']}" in text
  assert "launches:  forward " in lines[-1]


def test_plan_text_of_the_walks_and_fox():
  """str(plan) of the sequential backward (its lanes), of FoX (no pre-pass line) and of a GPU
  without Mosaic launches (the device named)."""
  walk = _plan(2, 300, 4, 64, K=2, block_sizes=dict(span=0))
  assert "backward:  walk: dq/dP on 2 lanes a kv head, then dk/dv" in str(walk)
  fox = _plan(2, 300, 4, 64, K=2, fox=True, gate=True)
  assert str(fox).startswith("FoX on gpu") and "pre-pass" not in str(fox)
  assert "backward:  walk: dq/dP on 5 lanes a kv head" in str(fox)   # a lane a chunk
  old = plan_lib.resolve(walk.spec, kp.BlockSizes(), scale=0.125, device=_ampere())
  assert "(A100, sm_80, 108 SMs)" in str(old).splitlines()[0]


def test_gpu_cases_run_the_forms_they_name():
  """Every TestGPU row's plan, resolved for "gpu" on this host (the H100 assumed), has the
  forms the row names: the class runs only on the device, so a default that moved under it
  shows here."""
  for param in test_path_kernel.GPU_CASES:
    kw = dict(param.values[0])
    B, D, K, H, T = kw.get("B", 2), kw["D"], kw["K"], kw["H"], kw["T"]
    fox, dtype = kw.get("fox", False), kw["dtype"]
    args = (SD((B, T, H, D), dtype), SD((B, T, K, D), dtype), SD((B, T, K, D), dtype),
            SD((B, T, K, D), F32), SD((B, T, K), F32),
            SD((B, T, H), F32) if kw.get("gate") else None)
    seg = SD((B, T), jnp.int32) if kw.get("segments") else None
    plan = kernel_check.resolve(args, seg, fox=fox, backend="gpu",
                                block_sizes=kw.get("block_sizes"), pins=kw.get("pins"),
                                expect=kw.get("expect"))
    assert plan.block == 64, param.id


def test_auto_span_bounds_boundaries_and_keeps_short_spans():
  """auto_span: the shortest even span with at most 7 boundaries inside n chunks (15 at head_dim
  > 64), never shorter than 8 chunks unless the span of at most 3 boundaries is (so short
  sequences keep that one)."""
  for head_dim, most in ((64, 7), (128, 15)):
    for n in range(2, 600):
      span = plan_lib.auto_span(n, head_dim=head_dim)
      at_most = lambda b: -(-n // (b + 1))   # shortest span with <= b boundaries (before evening)
      assert span % 2 == 0 and (n - 1) // span <= most, (head_dim, n)
      assert span >= min(at_most(3) + at_most(3) % 2, 8), (head_dim, n)
      assert span - 2 < max(at_most(most), min(at_most(3) + at_most(3) % 2, 8)), (head_dim, n)
  # the anchors' chunk counts (32, 64, 128, 256) and 512
  assert [plan_lib.auto_span(n, head_dim=64) for n in (32, 64, 128, 256, 512)] == [
      8, 8, 16, 32, 64]
  assert [plan_lib.auto_span(n, head_dim=128) for n in (32, 64, 128, 256, 512)] == [
      8, 8, 8, 16, 32]
  # where the sequence holds one span or less, the walks run
  assert _plan(2, 128, 2, 64).span == 0 and _plan(2, 128, 2, 64).backward == "walk"


def test_auto_lanes_fill_the_last_wave():
  """Lanes that minimise ceil(L programs / SMs) / L, fewest on ties, at most the units a head
  has and max_lanes."""
  assert plan_lib.auto_lanes(192, 16, 132) == 2   # the 125M model's layer: 2 waves -> 3 half
  assert plan_lib.auto_lanes(1024, 16, 132) == 1  # 8 full waves: lanes would only add memory
  assert plan_lib.auto_lanes(64, 128, 132) == 2   # 2 and 4 lanes tie, fewer wins
  assert plan_lib.auto_lanes(4, 3, 132) == 3      # capped by the units a head has
  assert plan_lib.auto_lanes(4, 16, 132) == 4     # and by max_lanes
  # the walk's units are query-chunk pairs with transport; without (FoX) a lane a chunk
  assert _plan(16, 2048, 12, 64, block_sizes=dict(span=0)).lanes == 2
  assert _plan(2, 300, 2, 64, K=1, block_sizes=dict(span=0)).lanes == 2   # 5 chunks: 2 pairs
  assert _plan(2, 300, 2, 64, K=1, fox=True).lanes == 5
  assert _plan(4, 8192, 12, 64, fox=True).lanes == 128


@pytest.mark.parametrize("requested,backend,dtype,G,D,expected", [
    (None, "gpu", BF16, 1, 64, "uz"),
    (None, "gpu", BF16, 2, 64, "uz"),
    (None, "gpu", BF16, 1, 128, "split"),    # the "uz" VJP spills at head_dim 128
    (None, "gpu", BF16, 2, 128, "jnp"),      # no pre-pass kernel fits grouped heads at 128
    (None, "gpu", F32, 1, 64, "split"),      # float32: "split" (uz not run in float32 there)
    (None, "gpu", F32, 2, 64, "jnp"),        # float32 kernels fit one query head a kv head
    (None, "gpu", F32, 1, 128, "jnp"),       # ... at head_dim <= 64 only
    ("uz", "gpu", BF16, 1, 128, "split"),
    ("split", "gpu", BF16, 2, 64, "split"),
    ("split", "gpu", BF16, 2, 128, "jnp"),
    ("split", "gpu", BF16, 1, 256, "jnp"),
    ("jnp", "gpu", BF16, 1, 64, "jnp"),
    (None, "interpret", F32, 2, 128, "uz"),  # elsewhere the requested form runs
    ("split", "interpret", BF16, 4, 128, "split"),
    (None, "tpu", BF16, 2, 128, "uz"),
    ("split", "tpu_interpret", F32, 2, 128, "split")])
def test_prepass_form_routes_what_does_not_fit_to_jnp(requested, backend, dtype, G, D, expected):
  """prepass_form: on the GPU grouped heads, float32 and head_dim 128 go where a kernel fits
  the 227 KiB of shared memory ("split", else "jnp"); other backends keep the requested form."""
  plan = _plan(2, 256, 2 * G, D, K=2, dtype=dtype, backend=backend,
               block_sizes=dict(prepass=requested))
  assert plan.prepass == expected
  assert _plan(2, 256, 2 * G, D, K=2, dtype=dtype, backend=backend, fox=True).prepass == "none"


@pytest.mark.parametrize("backend,dtype,prepass,keep,expected", [
    ("gpu", BF16, "uz", "bf16", "bf16"),        # the bf16 halves: the Newton step restores Y
    ("interpret", BF16, "split", "bf16", "bf16"),
    ("gpu", F32, "split", "bf16", False),       # three-pass TF32: Y recomputed
    ("tpu", BF16, "uz", "bf16", False),         # HIGHEST: Y recomputed
    ("interpret", F32, "uz", "bf16", False),
    ("gpu", BF16, "jnp", "bf16", False),        # the jnp pre-pass keeps nothing
    ("gpu", BF16, "jnp", True, False),
    ("gpu", BF16, "uz", True, True),            # a float32 Y only where asked
    ("gpu", F32, "split", True, True),
    ("tpu", BF16, "uz", True, True),
    ("gpu", BF16, "uz", False, False)])
def test_keep_inverse_bf16_only_with_bf16_halves(backend, dtype, prepass, keep, expected):
  plan = _plan(2, 256, 2, 64, dtype=dtype, backend=backend,
               block_sizes=dict(prepass=prepass, keep_inverse=keep))
  assert plan.keep_inverse is expected


def _ampere():
  return plan_lib.Device(name="A100", capability=(8, 0), sms=108)


@pytest.mark.parametrize("D", [64, 128])
def test_no_mosaic_launch_without_hopper(D):
  """On a GPU before Hopper the plan has no Mosaic GPU launch (every far walk and the sweep on
  Triton), and mosaic=True there raises one line naming the device."""
  spec = _plan(2, 1280, 2, D).spec   # 20 chunks: the span forms
  plan = plan_lib.resolve(spec, kp.BlockSizes(), scale=D ** -0.5, device=_ampere())
  assert plan.backward == "span" and plan.span > 0
  assert "mosaic" not in (plan.forward_far, plan.far_dq, plan.far_dkv, plan.sweep), plan
  assert "mosaic" not in str(plan)
  with pytest.raises(ValueError, match=r"^mosaic=True needs a Hopper GPU \(sm_90\+\); this is "
                                       r"A100, sm_80$"):
    plan_lib.resolve(spec, kp.BlockSizes(mosaic=True), scale=D ** -0.5, device=_ampere())
  with pytest.raises(ValueError, match=r"^mosaic=True needs a GPU \(or the interpreter\), not "
                                       r"backend 'tpu'$"):
    _plan(2, 1280, 2, D, backend="tpu", block_sizes=dict(mosaic=True))


def test_mosaic_falls_back_to_triton_per_launch():
  """mosaic=True asks for the Mosaic launches wherever they take the operands: float32, a block
  other than 64 or an odd chunk count (the sweep) leave the launch it concerns on Triton
  instead of raising. In the interpreter their oracles run only where asked."""
  f32 = _plan(2, 1280, 2, 128, dtype=F32, block_sizes=dict(mosaic=True))
  assert (f32.forward_far, f32.backward) == ("triton", "none")   # (no float32 backward there)
  f32 = _plan(2, 4160, 2, 64, dtype=F32, block_sizes=dict(mosaic=True))   # 65 chunks
  assert (f32.far_dq, f32.far_dkv, f32.sweep) == ("triton", "dkv", "triton")
  small = _plan(2, 1280, 2, 64, block_sizes=dict(mosaic=True, block=32))
  assert (small.far_dq, small.sweep) == ("triton", "triton")
  odd = _plan(2, 1300, 2, 64, block_sizes=dict(mosaic=True))   # 21 chunks
  assert (odd.far_dq, odd.sweep) == ("mosaic", "triton")
  interp = _plan(2, 1280, 2, 64, backend="interpret")
  assert (interp.far_dq, interp.sweep) == ("triton", "triton")
  interp = _plan(2, 1280, 2, 64, backend="interpret", block_sizes=dict(mosaic=True))
  assert (interp.far_dq, interp.sweep) == ("mosaic", "mosaic")
  off = _plan(2, 1280, 2, 128, block_sizes=dict(mosaic=False))
  assert "mosaic" not in (off.forward_far, off.far_dq, off.far_dkv, off.sweep)


def test_block_sizes_has_few_public_fields():
  fields = [f.name for f in dataclasses.fields(kp.BlockSizes)]
  assert len(fields) <= 8, fields
  assert fields == ["block", "span", "prepass", "mosaic", "keep_inverse"]


def test_block_sizes_of_every_form():
  want = kp.BlockSizes(span=8, mosaic=False, prepass="split")
  assert kp.BlockSizes.of("span=8, mosaic=false,prepass=split") == want
  assert kp.BlockSizes.of(dict(span=8, mosaic=False, prepass="split")) == want
  assert kp.BlockSizes.of(ml_collections.ConfigDict(dict(
      span=8, mosaic=False, prepass="split", block=None, keep_inverse=None))) == want
  assert kp.BlockSizes.of(want) is want
  assert kp.BlockSizes.of(None) == kp.BlockSizes()
  assert kp.BlockSizes.of("keep_inverse=true").keep_inverse is True
  assert kp.BlockSizes.of(dict(keep_inverse="bf16", block="32")) == kp.BlockSizes(
      keep_inverse="bf16", block=32)


@pytest.mark.parametrize("options,match", [
    (dict(bwd_lanes=2), r"^unknown kernel option bwd_lanes; the options are block, span, "
                        r"prepass, mosaic, keep_inverse$"),
    ("dkv_span=2,fwd_far=mosaic", r"^unknown kernel options dkv_span, fwd_far; the options are "
                                  r"block, span, prepass, mosaic, keep_inverse$"),
    ("span", r"^kernel option 'span' is not KEY=VALUE$"),
    (dict(block=24), r"^block=24 must be a power of two >= 16$"),
    (dict(block=8), r"^block=8 must be"),
    (dict(span=3), r"^span=3 must be None \(the plan's\), 0 \(the sequential walks\) or a "
                   r"positive even number of chunks$"),
    (dict(span=-2), r"^span=-2 must be"),
    (dict(prepass="split2_hilo"), r"^prepass='split2_hilo' must be None or one of \('uz', "
                                  r"'split', 'jnp'\)$"),
    (dict(mosaic="yes"), r"^mosaic='yes' must be None, True or False$"),
    (dict(keep_inverse="f16"), r"^keep_inverse='f16' must be one of \(False, True, 'bf16'\)$"),
    (dict(keep_inverse=1), r"^keep_inverse=1 must be one of"),
    (7, r"^kernel options must be a BlockSizes, a dict or 'key=value,...', got int$")])
def test_block_sizes_errors_are_one_line_naming_the_field(options, match):
  with pytest.raises(ValueError, match=match) as raised:
    kp.BlockSizes.of(options)
  assert "\n" not in str(raised.value)


def test_plan_must_match_the_call():
  """A plan passed back runs only the call it was resolved for (checked before anything is
  traced); block_sizes and a plan are not both taken."""
  x = jnp.zeros((1, 64, 2, 16), F32)
  w, beta = jnp.zeros((1, 64, 2, 16), F32), jnp.zeros((1, 64, 2), F32)
  plan = kp.explain(x, x, x, w, beta, interpret=True)
  y = x.astype(BF16)
  with pytest.raises(ValueError, match=r"^plan is for another call: dtype='float32' \(the "
                                       r"call's 'bfloat16'\)$"):
    kp.path_attention(y, y, y, w, beta, interpret=True, plan=plan)
  with pytest.raises(ValueError, match=r"^pass block_sizes or plan, not both"):
    kp.path_attention(x, x, x, w, beta, interpret=True, plan=plan, block_sizes=dict(span=0))
  with pytest.raises(ValueError, match=r"^backend='cuda' must be one of"):
    kp.explain(x, x, x, w, beta, backend="cuda")


def test_float32_path_at_head_dim_128_on_the_gpu_has_no_backward():
  """No backward form builds for float32 PaTH at head_dim 128 on the GPU (each asked for
  256-427 KiB of shared memory on the H200): the plan says so, the forward still runs (its
  forms are pinned), a gradient is one error naming the way out, and the model's automatic
  choice takes the blockwise jnp implementation there. FoX and head_dim 64 keep theirs."""
  plan = _plan(2, 620, 2, 128, dtype=F32, gate=True, segments=True)
  assert (plan.backward, plan.forward, plan.forward_far) == ("none", "span", "triton")
  assert "backward:  none (float32 at head_dim 128 on the GPU" in str(plan)
  assert _plan(2, 620, 2, 64, dtype=F32).backward == "span"
  assert _plan(2, 620, 2, 128, dtype=BF16).backward == "span"
  assert _plan(2, 620, 2, 128, dtype=F32, fox=True, gate=True).backward == "walk"
  assert _plan(2, 620, 2, 128, dtype=F32, backend="interpret").backward == "span"

  q = SD((1, 620, 2, 128), F32)
  w, beta = SD((1, 620, 2, 128), F32), SD((1, 620, 2), F32)
  loss = lambda q, w: jnp.sum(kp.path_attention(q, q, q, w, beta, backend="gpu"))
  with pytest.raises(ValueError, match=r"^PaTH's GPU kernels have no backward for float32 "
                                       r"inputs at head_dim 128 > 64: .*bfloat16"):
    jax.eval_shape(jax.grad(loss, argnums=1), q, w)

  assert dispatch.GPU_FLOAT32_PATH_MAX_HEAD_DIM == plan_lib.GPU_FLOAT32_BACKWARD_MAX_HEAD_DIM
  pick = lambda dtype, D, family="path": dispatch.auto_implementation(
      family, T=620, dtype=dtype, head_dim=D, backend="gpu").implementation
  assert (pick(F32, 128), pick(BF16, 128), pick(F32, 64), pick(F32, 128, "forgetting")) == (
      "chunked", "pallas", "pallas", "pallas")
