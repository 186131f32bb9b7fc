"""The PaTH / FoX kernels lower for the hardware on a CPU host: Mosaic TPU through jax.export,
Pallas's Triton path and Mosaic GPU through lowering for "cuda". Interpret mode accepts more
than the hardware lowerings do, so an op they lack fails here, not on a device."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas as kp


def _tpu_mesh():
  from jax._src import mesh as mesh_lib  # abstract TPU device: lower for TPU on a CPU host
  device = mesh_lib.AbstractDevice(device_kind="TPU v5p", num_cores=1, platform="tpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


@pytest.mark.parametrize("gate,fox,D", [(False, False, 64), (True, False, 64), (True, True, 64),
                                        (True, False, 128)])
def test_lowers_for_tpu(gate, fox, D):
  """Forward and backward go through Mosaic lowering (interpret mode would accept more)."""
  B, T, H, K = 1, 200, 2, 1
  sd = jax.ShapeDtypeStruct
  args = [sd((B, T, H, D), jnp.bfloat16), sd((B, T, K, D), jnp.bfloat16),
          sd((B, T, K, D), jnp.bfloat16)]
  if not fox:
    args += [sd((B, T, K, D), jnp.float32), sd((B, T, K), jnp.float32)]
  if gate:
    args.append(sd((B, T, H), jnp.float32))
  seg = sd((B, T), jnp.int32)
  attend = kp.forgetting_attention if fox else kp.path_attention
  f = lambda *a: attend(*a[:-1], segment_ids=a[-1], backend="tpu")
  g = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=tuple(range(len(args))))
  with _tpu_mesh():
    for fn, kernels in ((f, ["fwd_kv_kernel"]), (g, ["dkv_tpu_kernel", "dq_tpu_kernel"])):
      module = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args, seg).mlir_module()
      assert "tpu_custom_call" in module
      for name in kernels:  # the TPU forms, not the GPU bodies with whole-sequence blocks
        assert f'kernel_name = "{name}"' in module, name


@pytest.mark.parametrize("prepass,pairs,D,dtype,K", [
    ("split", False, 64, jnp.bfloat16, 4),   # K = H: the Pallas pre-pass (G > 1 takes jnp)
    ("split", True, 64, jnp.bfloat16, 2), ("split_bf16", True, 64, jnp.bfloat16, 2),
    ("split_bf16x3", True, 64, jnp.bfloat16, 4), ("split_hilo", True, 64, jnp.bfloat16, 2),
    ("split2_hilo", True, 64, jnp.bfloat16, 2), ("split2_hilo", True, 128, jnp.bfloat16, 4),
    ("fold_bf16", True, 128, jnp.bfloat16, 2),
    ("split", True, 64, jnp.float32, 4),   # three-pass TF32 products everywhere
    ("split_hilo+dkv_in_dq", True, 128, jnp.bfloat16, 2),
    ("split2_hilo+dkv_span", True, 128, jnp.bfloat16, 2),
    ("split2_hilo+bwd_spans", True, 64, jnp.bfloat16, 2),
    ("split2_hilo+bwd_spans", False, 128, jnp.bfloat16, 4),
    ("split2_hilo+bwd_spans2", True, 64, jnp.bfloat16, 2),
    ("split2_hilo+bwd_spans2", False, 128, jnp.bfloat16, 4),
    ("split2_hilo+bwd_spans3", True, 64, jnp.bfloat16, 2),
    ("split2_hilo+bwd_spans3", False, 128, jnp.bfloat16, 4),
    ("split+bwd_spans", True, 64, jnp.float32, 2),
    ("split2_hilo+late_wk", True, 64, jnp.bfloat16, 2),
    ("split2_hilo+chain_tf32", True, 128, jnp.bfloat16, 4),   # spans by head_dim (form 3)
    ("uz_hilo", True, 64, jnp.bfloat16, 2), ("uz_hilo", True, 128, jnp.bfloat16, 4),
    ("uz", True, 64, jnp.float32, 4),
    ("uz_hilo+keep_off", True, 64, jnp.bfloat16, 2),   # Y recomputed in the VJP (the other
    ("split2_hilo+keep_off", True, 128, jnp.bfloat16, 4)])   # rows keep its bf16 rounding)
def test_lowers_for_gpu(prepass, pairs, D, dtype, K):
  """Forward and backward lower through Pallas's Triton path on a CPU host (the Triton IR is
  built at lowering time), so an op the GPU lowering lacks fails here, not on the device."""
  B, T, H = 1, 300, 4   # n = 5: query-chunk pairs and the odd tail (dkv_span 2: boundaries 2, 4)
  sd = jax.ShapeDtypeStruct
  args = [sd((B, T, H, D), dtype), sd((B, T, K, D), dtype),
          sd((B, T, K, D), dtype), sd((B, T, K, D), jnp.float32), sd((B, T, K), jnp.float32),
          sd((B, T, H), jnp.float32)]
  seg = sd((B, T), jnp.int32)
  prepass, _, option = prepass.partition("+")
  fused = option == "dkv_in_dq"
  chain = option == "chain_tf32"   # the span forward and backward at their auto forms
  bs = kp.BlockSizes(prepass=prepass, dq_pairs=pairs, dkv_in_dq=fused,
                     dkv_span=2 if chain or option.startswith(("dkv_span", "bwd_spans")) else 0,
                     bwd_spans=(int(option[9:] or 1) if option.startswith("bwd_spans")
                                else None if chain else 0),
                     bwd_lanes=0 if fused else None,   # (fused: with lanes, the harder layout)
                     prepass_late_wk=option == "late_wk",
                     prepass_keep_inverse=False if option == "keep_off" else "bf16",
                     chain_products="tf32" if chain else "bf16x3")
  f = lambda *a: kp.path_attention(*a[:-1], segment_ids=a[-1], backend="gpu", block_sizes=bs)
  g = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=tuple(range(len(args))))
  for fn in (f, g):
    text = jax.jit(fn).trace(*args, seg).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def _gpu_layer(D, gate_segments, bs, *, T):
  """A PaTH layer on the GPU backend with BlockSizes bs, for lowering on the CPU host: abstract
  bf16 q, k, v and float32 w, beta (B 1, 4 query heads over 2 kv heads), with gate_segments
  also a log forget gate and segment ids. -> (args, f, g): g differentiates every argument
  but the ids."""
  B, H, K = 1, 4, 2
  sd = jax.ShapeDtypeStruct
  args = [sd((B, T, H, D), jnp.bfloat16), sd((B, T, K, D), jnp.bfloat16),
          sd((B, T, K, D), jnp.bfloat16), sd((B, T, K, D), jnp.float32), sd((B, T, K), jnp.float32)]
  if gate_segments:
    args += [sd((B, T, H), jnp.float32), sd((B, T), jnp.int32)]   # log_forget, segment ids
  split = lambda a: (a[:-1], a[-1]) if gate_segments else (a, None)
  f = lambda *a: kp.path_attention(*split(a)[0], backend="gpu", block_sizes=bs,
                                   segment_ids=split(a)[1])
  g = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)),
               argnums=tuple(range(len(args) - gate_segments)))
  return args, f, g


def _float32_raises(args, bs, match, *, grad=False):
  """The same layer with float32 q, k, v raises a ValueError naming `match` (no Mosaic kernel
  takes float32), in the forward or (grad) the backward."""
  f32 = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in args[:5]]
  f = lambda *a: kp.path_attention(*a, backend="gpu", block_sizes=bs)
  fn = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=0) if grad else f
  with pytest.raises(ValueError, match=match):
    jax.jit(fn).trace(*f32).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("D,gate_segments", [(64, False), (128, False), (64, True)])
def test_mosaic_forward_lowers_for_gpu(D, gate_segments):
  """BlockSizes(fwd_kernel="mosaic"): the forward lowers through Mosaic GPU (TMA, wgmma) on a
  CPU host, inside jax.grad too (the backward stays on the Triton kernels); plgpu's wgmma does
  not run in interpret mode, so TestGPU.test_mosaic_forward_bf16 checks its values on the
  device."""
  bs = kp.BlockSizes(fwd_kernel="mosaic")
  args, f, g = _gpu_layer(D, gate_segments, bs, T=300)
  for fn in (f, g):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
  _float32_raises(args, bs, "fwd_kernel")   # float32 stays on the Triton kernel


@pytest.mark.parametrize("D,gate_segments", [(64, True), (128, False)])
def test_far_mosaic_forward_lowers_for_gpu(D, gate_segments):
  """BlockSizes(fwd_far="mosaic"): the span forward's near kernel lowers through Triton and its
  far keys through Mosaic GPU (fwd_far_mosaic.py) on a CPU host, inside jax.grad too;
  test_far_mosaic.test_far_mosaic_kernel_against_reference checks its values on the device."""
  bs = kp.BlockSizes(fwd_far="mosaic", fwd_spans=True, dkv_span=2)
  args, f, g = _gpu_layer(D, gate_segments, bs, T=700)   # n = 11, span 2: five boundaries
  for fn in (f, g):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "__gpu$xla.gpu.triton" in text
  _float32_raises(args, bs, "fwd_far")   # float32 has no Mosaic far kernel


@pytest.mark.parametrize("D,gate_segments", [(64, True), (128, False), (128, True)])
def test_far_backward_mosaic_lowers_for_gpu(D, gate_segments):
  """BlockSizes(far_dq="mosaic", far_dkv="mosaic"): the span backward's boundary states through
  Triton and its far dq and far dk/dv walks through Mosaic GPU (bwd_far_mosaic.py) on a CPU
  host, inside jax.grad; test_far_mosaic.py's *_mosaic_kernel_against_reference check their
  values on the device."""
  bs = kp.BlockSizes(far_dq="mosaic", far_dkv="mosaic", bwd_spans=3, dkv_span=2,
                     fwd_far="triton")
  args, _, g = _gpu_layer(D, gate_segments, bs, T=700)   # n = 11, span 2: five boundaries
  text = jax.jit(g).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 2 and "__gpu$xla.gpu.triton" in text
  _float32_raises(args, bs, "far_dq", grad=True)   # float32 has no Mosaic far dq


@pytest.mark.parametrize("gate_segments", [False, True])
def test_span_sweep_mosaic_lowers_for_gpu(gate_segments):
  """BlockSizes(span_sweep="mosaic"): the span kernel (Triton) without its sweeps, then the
  sweeps through Mosaic GPU (span_mosaic.py), adding to dL/dP in place (an aliased operand, no
  copy), on a CPU host inside jax.grad; test_far_mosaic.py's
  test_span_sweep_mosaic_kernel_against_reference checks its values on the device. Where it
  cannot take the operands (float32, head_dim 128, an odd number of chunks) "mosaic" raises."""
  bs = kp.BlockSizes(span_sweep="mosaic", dkv_span=4, far_dq="triton")
  args, _, g = _gpu_layer(64, gate_segments, bs, T=500)   # n = 8, span 4: one boundary
  text = jax.jit(g).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 1 and "__gpu$xla.gpu.triton" in text
  assert "output_operand_alias" in text.split("custom_call @mosaic_gpu")[1].split("\n")[0]
  _float32_raises(args, bs, "span_sweep", grad=True)
  for D, T in ((128, 500), (64, 440)):   # head_dim 128; n = 7
    args, _, g = _gpu_layer(D, gate_segments, bs, T=T)
    with pytest.raises(ValueError, match="span_sweep"):
      jax.jit(g).trace(*args).lower(lowering_platforms=("cuda",))


def test_prepass_inverse_mosaic_benchmark_lowers_for_gpu():
  """experiments/benchmarks/prepass_inverse_mosaic.py (the UT inverse as a Mosaic GPU kernel, a
  measured experiment, not a library path) still lowers for "cuda" in its accurate one-chunk
  and lockstep forms, and so does its Triton many-chunks variant: the script runs on the
  device without a debugging call first."""
  from experiments.benchmarks import prepass_inverse_mosaic as bench
  sd = jax.ShapeDtypeStruct
  w, beta = sd((1, 256, 2, 64), jnp.float32), sd((1, 2, 4, 64), jnp.float32)
  for f in (lambda w, b: bench.inverse_mosaic(w, b, wgs=1, per=1),
            lambda w, b: bench.inverse_mosaic(w, b, wgs=2, per=2, passes=1)):
    text = jax.jit(f).trace(w, beta).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
  text = jax.jit(lambda w, b: bench.inverse_triton_multi(w, b, per=2)).trace(w, beta).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
