"""The kernel benchmark's variant tokens (experiments/benchmarks/path_kernel.py): each token
changes one BlockSizes field from the library's defaults, and forcing a pre-pass bypasses the
shared-memory routing only while it is active."""
import jax.numpy as jnp
import pytest

import kernels_pallas as kp
from experiments.benchmarks.path_kernel import _block_sizes_of, _prepass_as_requested
from kernels_pallas.path_attention import prepass_variants


def test_tokens_change_the_defaults():
  bs, forced = _block_sizes_of("l1rc")
  assert bs == kp.BlockSizes(bwd_lanes=None, keep_operands=False) and not forced
  bs, forced = _block_sizes_of("b128w8s1l4bw8kvmg")
  assert bs == kp.BlockSizes(block_q=128, block_k=128, num_warps=8, num_stages=1, bwd_lanes=4,
                             bwd_num_warps=8, dkv_in_dq=True, fwd_kernel="mosaic")
  assert _block_sizes_of("pw8") == (kp.BlockSizes(prepass_num_warps=8), False)
  assert _block_sizes_of("l2sp16") == (kp.BlockSizes(bwd_lanes=2, dkv_span=16), False)
  assert _block_sizes_of("par") == (kp.BlockSizes(bwd_spans=1), False)
  assert _block_sizes_of("par2sp4") == (kp.BlockSizes(bwd_spans=2, dkv_span=4), False)
  assert _block_sizes_of("seqnp") == (kp.BlockSizes(bwd_spans=0, dq_pairs=False), False)
  assert _block_sizes_of("pre=split_bf16") == (kp.BlockSizes(prepass="split_bf16"), False)
  assert _block_sizes_of("pre!=split_bf16x3") == (kp.BlockSizes(prepass="split_bf16x3"), True)
  assert _block_sizes_of("ft") == (kp.BlockSizes(chain_products="tf32"), False)
  assert _block_sizes_of("fx") == (kp.BlockSizes(chain_products="bf16x3"), False)
  assert _block_sizes_of("mfar") == (kp.BlockSizes(fwd_far="mosaic"), False)
  assert _block_sizes_of("tfar") == (kp.BlockSizes(fwd_far="triton"), False)
  assert _block_sizes_of("ky") == (kp.BlockSizes(prepass_keep_inverse=True), False)
  assert _block_sizes_of("ky0") == (kp.BlockSizes(prepass_keep_inverse=False), False)
  assert _block_sizes_of("sp16kyb") == (kp.BlockSizes(dkv_span=16, prepass_keep_inverse="bf16"),
                                        False)


def test_forced_prepass_bypasses_the_routing_only_inside():
  ask = dict(backend="gpu", heads_per_kv=1, head_dim=128)
  assert prepass_variants.usable_variant("split_hilo", dtype=jnp.bfloat16, **ask) == "jnp"
  with _prepass_as_requested(True):
    assert prepass_variants.usable_variant("split_hilo", dtype=jnp.bfloat16, **ask) == "split_hilo"
    assert prepass_variants.usable_variant("split_hilo", dtype=jnp.float32, **ask) == "split"
    assert prepass_variants.usable_variant("split2_hilo", dtype=jnp.float32, **ask) == "split2"
  with _prepass_as_requested(False):
    assert prepass_variants.usable_variant("split_hilo", dtype=jnp.bfloat16, **ask) == "jnp"
  assert prepass_variants.usable_variant("split_hilo", dtype=jnp.bfloat16, **ask) == "jnp"


def test_phases_block_sizes_parse_like_the_model_options():
  """path_kernel_phases / path_kernel_memory / triton_resources --bs "K=V,...": integers,
  booleans and strings, as the model's "pallas:K=V,..." (posenc_jax._checks.kernel_options)."""
  from experiments.benchmarks.path_kernel_phases import _block_sizes
  assert _block_sizes("") == {}
  assert _block_sizes("bwd_lanes=0,prepass_keep_inverse=true,dq_pairs=False,prepass=uz") == dict(
      bwd_lanes=0, prepass_keep_inverse=True, dq_pairs=False, prepass="uz")
  assert kp.BlockSizes(**_block_sizes("prepass_keep_inverse=bf16")).prepass_keep_inverse == "bf16"
  with pytest.raises(ValueError, match="KEY=VALUE"):
    _block_sizes("bwd_lanes")


def test_cases_take_indices_and_shapes():
  """path_kernel.py / path_kernel_phases.py --cases: an index into CASES (the anchors), or a
  shape BxTxHxD beside them; a bad entry names itself."""
  from experiments.benchmarks.path_kernel import CASES, case_label, case_shape
  assert case_shape("3") == CASES[3] and case_label("3") == 3
  assert case_shape("8x8192x16x128") == (8, 8192, 16, 128)
  assert case_label("8x8192x16x128") == "8x8192x16x128"
  for bad in ("8x8192x16", "0x64x2x16", str(len(CASES)), "big"):
    with pytest.raises(ValueError, match=bad):
      case_shape(bad)
