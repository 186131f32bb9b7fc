"""The PaTH / FoX kernels lower for the hardware on a CPU host: every GPU form through Pallas's
Triton path and Mosaic GPU (lowering for "cuda" builds their IR), the TPU forms through Mosaic
TPU (jax.export). Interpret mode accepts more than the hardware lowerings do, so an op they
lack fails here, not on a device. Each row pins its form on the plan and checks that the
lowered program runs the kernels the plan names, and no others."""
from __future__ import annotations

import dataclasses
import re
import sys

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas as kp

SD = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32
MOSAIC_CALL = "custom_call @mosaic_gpu"


def _call(D, dtype, *, T, H=4, K=2, gate_segments=True, fox=False, block_sizes=None):
  """(f, arrays, plan): f(*arrays, plan=...) -> the kernel's output on the GPU backend for
  abstract arguments of one call (B 1; q, k, v in `dtype`; w, beta float32 for PaTH; with
  gate_segments a log forget gate and segment ids, the ids the last array), and the plan
  block_sizes resolve for it."""
  arrays = [SD((1, T, H, D), dtype), SD((1, T, K, D), dtype), SD((1, T, K, D), dtype)]
  if not fox:
    arrays += [SD((1, T, K, D), F32), SD((1, T, K), F32)]
  if gate_segments:
    arrays += [SD((1, T, H), F32), SD((1, T), jnp.int32)]
  head = 3 if fox else 5

  def f(*a, plan):
    lf, seg = (a[head], a[head + 1]) if gate_segments else (None, None)
    if fox:
      return kp.forgetting_attention(*a[:3], lf, segment_ids=seg, backend="gpu", plan=plan)
    return kp.path_attention(*a[:5], lf, segment_ids=seg, backend="gpu", plan=plan)

  lf, seg = (arrays[head], arrays[head + 1]) if gate_segments else (None, None)
  qkv, w_beta = arrays[:3], (None, None) if fox else arrays[3:5]
  plan = kp.explain(*qkv, *w_beta, lf, segment_ids=seg, backend="gpu", block_sizes=block_sizes)
  return f, arrays, plan


def _lower(f, arrays, plan, *, grad):
  """StableHLO text of f (grad: of the gradient w.r.t. every float argument) for "cuda"."""
  floats = tuple(i for i, a in enumerate(arrays) if a.dtype != jnp.int32)
  fn = lambda *a: f(*a, plan=plan)
  if grad:
    fn = jax.grad(lambda *a: jnp.sum(f(*a, plan=plan).astype(F32)), argnums=floats)
  return jax.jit(fn).trace(*arrays).lower(lowering_platforms=("cuda",)).as_text()


def _triton_kernels(text):
  return set(re.findall(r'name = \\?"(\w+_kernel)', text))


# The Triton kernels each plan form runs (a kernel's function name), forward and backward.
PREPASS = {"uz": {"_inv_kernel", "_ops_kernel", "_ops_bwd_uz_kernel", "_t_pullback_kernel"},
           "split": {"_inv_kernel", "_ops_kernel", "_ops_bwd_kv_kernel", "_ops_bwd_q_kernel",
                     "_inv_bwd_kernel"},
           "jnp": set(), "none": set()}


def expected_kernels(plan):
  """(forward's Triton kernels, the gradient's Triton kernels, the gradient's Mosaic GPU
  launches) of a GPU plan: the forms of plan.py's Plan docstring."""
  fwd = {"fwd_kernel"} | ({"_inv_kernel", "_ops_kernel"} & PREPASS[plan.prepass])
  grad = fwd | PREPASS[plan.prepass]
  if plan.keep_inverse == "bf16":
    grad.add("_refine_kernel")
  mosaic = 0
  if plan.forward == "span":
    fwd.add("boundary_kernel")
    mosaic += plan.forward_far == "mosaic"
  fwd_mosaic = mosaic
  if plan.backward == "walk":
    grad |= {"dq_kernel", "dkv_kernel"}
  else:
    grad |= {"boundary_kernel", "dkv_kernel", "far_y_kernel", "span_kernel"}
    grad.add("far_dq_kernel" if plan.far_dq == "triton" else "far_states_kernel")
    if plan.far_dkv == "triton":
      grad.add("far_dkv_kernel")
    mosaic += (plan.far_dq == "mosaic") + (plan.far_dkv == "mosaic") + (plan.sweep == "mosaic")
  return fwd, fwd_mosaic, grad, mosaic


def gpu_row(id_, D, dtype, *, T, H=4, K=2, gate_segments=True, fox=False, block_sizes=None,
            pins=None, expect=None):
  return pytest.param(dict(D=D, dtype=dtype, T=T, H=H, K=K, gate_segments=gate_segments,
                           fox=fox), block_sizes, pins, expect, id=id_)


# T = 300: n = 5 (pairs and the odd tail); 620: n = 10 (span 4, an even n for the Mosaic
# sweep); 800: n = 13 (span 4, three boundaries, odd n). H = 4 over K = 2 (grouped heads)
# unless K = H.
GPU_ROWS = [
    gpu_row("walk-d64-bf16", 64, BF16, T=300, block_sizes=dict(span=0),
            expect=dict(backward="walk", prepass="uz", keep_inverse="bf16")),
    gpu_row("walk-d128-bf16", 128, BF16, T=300, K=4, block_sizes=dict(span=0),
            expect=dict(backward="walk", prepass="split")),
    gpu_row("walk-d64-f32", 64, F32, T=300, K=4, block_sizes=dict(span=0),
            expect=dict(backward="walk", prepass="split", keep_inverse=False)),
    # float32 at head_dim 128: the forward only (no backward form fits shared memory)
    gpu_row("walk-d128-f32-jnp-prepass", 128, F32, T=300, block_sizes=dict(span=0),
            expect=dict(forward="walk", backward="none", prepass="jnp")),
    gpu_row("fox-d64-bf16", 64, BF16, T=300, fox=True, expect=dict(backward="walk")),
    gpu_row("fox-d128-f32", 128, F32, T=300, fox=True, expect=dict(backward="walk")),
    gpu_row("span-d64-bf16-default", 64, BF16, T=620,
            expect=dict(forward="walk", backward="span", far_dq="mosaic", far_dkv="dkv",
                        sweep="mosaic")),
    gpu_row("span-d64-bf16-far-dkv-mosaic", 64, BF16, T=800,
            pins=dict(far_dkv="mosaic", far_dkv_pairs=True),
            expect=dict(far_dq="mosaic", far_dkv="mosaic", sweep="triton")),
    gpu_row("span-d64-bf16-triton", 64, BF16, T=620, block_sizes=dict(mosaic=False),
            expect=dict(far_dq="triton", far_dq_pairs=False, far_dkv="dkv", sweep="triton",
                        sweep_pairs=True)),
    gpu_row("span-d64-bf16-far-dkv-triton", 64, BF16, T=800, block_sizes=dict(mosaic=False),
            pins=dict(far_dkv="triton", far_dkv_pairs=True),
            expect=dict(far_dkv="triton", far_dkv_pairs=True)),
    gpu_row("span-d64-f32", 64, F32, T=620, K=4,
            expect=dict(backward="span", far_dq="triton", sweep="triton", sweep_pairs=False,
                        prepass="split")),
    gpu_row("span-d128-bf16-default", 128, BF16, T=800, K=4,
            expect=dict(forward="span", forward_far="mosaic", far_dq="mosaic",
                        far_dq_pairs=True, far_dkv="mosaic", far_dkv_pairs=True,
                        sweep="triton", chain="bf16x3", prepass="split")),
    gpu_row("span-d128-bf16-gqa-jnp-prepass", 128, BF16, T=620,
            expect=dict(forward="span", forward_far="mosaic", prepass="jnp")),
    gpu_row("span-d128-bf16-triton", 128, BF16, T=800, block_sizes=dict(mosaic=False),
            expect=dict(forward="span", forward_far="triton", far_dq="triton",
                        far_dq_pairs=True, far_dkv="triton", far_dkv_pairs=True)),
    gpu_row("span-d128-bf16-far-dq-single", 128, BF16, T=620, block_sizes=dict(mosaic=False),
            gate_segments=False, pins=dict(far_dq_pairs=False),
            expect=dict(far_dq="triton", far_dq_pairs=False)),
    gpu_row("span-d128-f32", 128, F32, T=620, K=4,
            expect=dict(forward="span", forward_far="triton", backward="none", prepass="jnp")),
    # float32 with mosaic=True: every launch falls back to Triton (none takes float32)
    gpu_row("span-d128-f32-mosaic-falls-back", 128, F32, T=800, K=4,
            block_sizes=dict(mosaic=True), expect=dict(forward_far="triton", backward="none")),
    gpu_row("span-d64-f32-mosaic-falls-back", 64, F32, T=620, K=4,
            block_sizes=dict(mosaic=True), expect=dict(far_dq="triton", sweep="triton")),
    gpu_row("prepass-uz-keep-f32", 64, BF16, T=300, block_sizes=dict(keep_inverse=True),
            expect=dict(prepass="uz", keep_inverse=True)),
    gpu_row("prepass-split-d64-recomputed", 64, BF16, T=300, gate_segments=False,
            block_sizes=dict(prepass="split", keep_inverse=False),
            expect=dict(prepass="split", keep_inverse=False)),
    gpu_row("prepass-jnp-d64", 64, BF16, T=300, block_sizes=dict(prepass="jnp"),
            expect=dict(prepass="jnp", keep_inverse=False)),
]


@pytest.mark.parametrize("call,block_sizes,pins,expect", GPU_ROWS)
def test_lowers_for_gpu(call, block_sizes, pins, expect):
  """Forward and gradient lower through Triton and Mosaic GPU on a CPU host, running the
  Triton kernels and as many Mosaic GPU launches as the plan's forms name."""
  f, arrays, plan = _call(**call, block_sizes=block_sizes)
  plan = dataclasses.replace(plan, **(pins or {}))
  for field, want in (expect or {}).items():
    assert getattr(plan, field) == want, (field, str(plan))
  fwd, fwd_mosaic, grad, grad_mosaic = expected_kernels(plan)
  text = _lower(f, arrays, plan, grad=False)
  assert _triton_kernels(text) == fwd and text.count(MOSAIC_CALL) == fwd_mosaic, str(plan)
  if plan.backward == "none":
    with pytest.raises(ValueError, match="no backward"):
      _lower(f, arrays, plan, grad=True)
    return
  text = _lower(f, arrays, plan, grad=True)
  assert _triton_kernels(text) == grad and text.count(MOSAIC_CALL) == grad_mosaic, str(plan)
  if plan.sweep == "mosaic":   # the sweep adds to dL/dP in place: an aliased operand, no copy
    calls = [line for line in text.splitlines() if MOSAIC_CALL in line]
    assert any("output_operand_alias" in line for line in calls)


def test_layers_share_one_lowering_of_the_kernels():
  """Three layers' calls of one plan lower their kernels once (the entry point jits the call,
  keyed by the plan), so a model's compile does not grow with its depth by the kernels' IR."""
  f, arrays, plan = _call(64, BF16, T=256)
  floats = tuple(i for i, a in enumerate(arrays) if a.dtype != jnp.int32)

  def stack(layers):
    def loss(*a):   # each layer's own inputs: a scaled copy, so no call is a common subterm
      return sum(jnp.sum(f(*[x * (i + 1) if j in floats else x for j, x in enumerate(a)],
                           plan=plan).astype(F32)) for i in range(layers))
    text = jax.jit(jax.grad(loss, argnums=floats)).trace(*arrays).lower(
        lowering_platforms=("cuda",)).as_text()
    return text.count("__gpu$xla.gpu.triton"), text.count(MOSAIC_CALL)

  one, three = stack(1), stack(3)
  assert one[0] > 0 and three == one, (one, three)


def test_lowering_a_kernel_leaves_the_tracing_context_as_it_was():
  """pallas_call imports its GPU lowerings at its first lowering; under jax 0.11 that import
  adds a config state to the tracing context, so a train step traced before it (its own first
  lowering reaches the kernels) misses its trace cache once and compiles twice. The package
  imports them itself, so a first lowering finds the context complete."""
  from jax._src import config as jax_config
  from kernels_pallas.common import launch
  assert all(name in sys.modules for name in launch._GPU_LOWERINGS)
  before = tuple(jax_config.trace_context_names())
  f, arrays, plan = _call(64, BF16, T=128, gate_segments=False)
  _lower(f, arrays, plan, grad=False)
  assert tuple(jax_config.trace_context_names()) == before


def _tpu_mesh():
  from jax._src import mesh as mesh_lib  # abstract TPU device: lower for TPU on a CPU host
  device = mesh_lib.AbstractDevice(device_kind="TPU v5p", num_cores=1, platform="tpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


@pytest.mark.parametrize("gate,fox,D,prepass", [
    (False, False, 64, None), (True, False, 64, None), (True, True, 64, None),
    (True, False, 128, None), (True, False, 64, "split")])
def test_lowers_for_tpu(gate, fox, D, prepass):
  """Forward and backward go through Mosaic TPU lowering (interpret mode would accept more):
  the TPU forms' kernels, with the pre-pass's ("uz", the TPU's default, or "split")."""
  B, T, H, K = 1, 200, 2, 1
  args = [SD((B, T, H, D), BF16), SD((B, T, K, D), BF16), SD((B, T, K, D), BF16)]
  if not fox:
    args += [SD((B, T, K, D), F32), SD((B, T, K), F32)]
  if gate:
    args.append(SD((B, T, H), F32))
  seg = SD((B, T), jnp.int32)
  attend = kp.forgetting_attention if fox else kp.path_attention
  bs = None if prepass is None else dict(prepass=prepass)
  f = lambda *a: attend(*a[:-1], segment_ids=a[-1], backend="tpu", block_sizes=bs)
  g = jax.grad(lambda *a: jnp.sum(f(*a).astype(F32)), argnums=tuple(range(len(args))))
  form = "none" if fox else prepass or "uz"
  names = {"fwd": {"fwd_kv_kernel"} | ({"_inv_kernel", "_ops_kernel"} & PREPASS[form]),
           "grad": {"fwd_kv_kernel", "dkv_tpu_kernel", "dq_tpu_kernel"} | PREPASS[form]}
  with _tpu_mesh():
    for fn, kernels in ((f, names["fwd"]), (g, names["grad"])):
      module = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args, seg).mlir_module()
      assert "tpu_custom_call" in module
      assert set(re.findall(r'kernel_name = "(\w+)"', module)) == kernels
