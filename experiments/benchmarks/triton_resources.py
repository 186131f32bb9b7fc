"""Shared memory, registers and spills of every Pallas kernel in PaTH's fwd+bwd, on a CPU host.

  pip install triton   # once; not a project dependency
  python experiments/benchmarks/triton_resources.py --shape 2,300,4,2,64 --dtype float32
  python experiments/benchmarks/triton_resources.py --shape 4,1024,16,16,128 --no-gate \
      --no-segments --block-sizes dq_pairs=0

Lowers jax.grad of `kernels_pallas.path_attention` for the GPU (no GPU needed: the Triton IR is
built at lowering time), catches each kernel's Triton module with the num_warps / num_stages
that calls.py chose, compiles it for sm_90a with the `triton` Python package and reads the
shared memory from its metadata, the registers and spill bytes from `ptxas -v`, and from the
PTX the count of Hopper (wgmma) and Ampere (mma.sync) MMA instructions and of ldmatrix /
stmatrix (register <-> shared layout round trips), and flags a kernel whose wgmmas ptxas
serialized for lack of registers (its info C7512). One table, one row per kernel launch, in
launch order.

Estimates, not the device's numbers: XLA compiles the same IR with its own pinned Triton, whose
passes differ from the package's. Measured against the H100 (jax 0.11.2, 2026-11-23), with
triton 3.9.0 here: grouped float32 heads at D = 64, dk/dv with two stages 241.8 KiB here and
257.8 on the device, the pre-pass operands VJP 256.0 here and 272.0 there (both ~+6.5%); at
D = 128 the VJP reports 416 KiB here but built on the device at G = 1. Use it to compare
variants and to see spill pressure before a device call, not as a pass/fail oracle.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def kernel_modules(B, T, H, K, D, *, dtype, gate, segments, block_sizes):
  """-> [(kernel name, Triton module text, num_warps, num_stages)] of PaTH's fwd+bwd."""
  import jax
  import jax.numpy as jnp
  from jax._src.interpreters import mlir
  from jax._src.pallas import pallas_call as pallas_call_lib
  from jax._src.pallas.triton import lowering
  from jax._src.pallas.triton import pallas_call_registration as registration

  import kernels_pallas as kp

  found, params = [], []
  to_triton = lowering.lower_jaxpr_to_triton_module

  def catch_module(jaxpr, *args, **kwargs):
    result = to_triton(jaxpr, *args, **kwargs)
    name = jaxpr.debug_info.func_name if jaxpr.debug_info else f"kernel{len(found)}"
    found.append((name, result.module.operation.get_asm()))
    return result

  def catch_params(ctx, *args, **kwargs):
    cp = kwargs.get("compiler_params")
    params.append((getattr(cp, "num_warps", None) or 4, getattr(cp, "num_stages", None) or 3))
    return registration.pallas_call_lowering(ctx, *args, **kwargs)

  registration.lowering.lower_jaxpr_to_triton_module = catch_module
  mlir.register_lowering(pallas_call_lib.pallas_call_p, catch_params, platform="cuda")
  try:
    sd = jax.ShapeDtypeStruct
    args = [sd((B, T, H, D), dtype), sd((B, T, K, D), dtype), sd((B, T, K, D), dtype),
            sd((B, T, K, D), jnp.float32), sd((B, T, K), jnp.float32)]
    if gate:
      args.append(sd((B, T, H), jnp.float32))
    bs = kp.BlockSizes(**block_sizes)

    def loss(*a):
      seg = a[-1] if segments else None
      o = kp.path_attention(*a[:-1], segment_ids=seg, backend="gpu", block_sizes=bs)
      return jnp.sum(o.astype(jnp.float32))

    grad = jax.grad(loss, argnums=tuple(range(len(args))))
    jax.jit(grad).trace(*args, sd((B, T), jnp.int32)).lower(lowering_platforms=("cuda",))
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = to_triton
    mlir.register_lowering(pallas_call_lib.pallas_call_p, registration.pallas_call_lowering,
                           platform="cuda")
  return [(name, text, warps, stages) for (name, text), (warps, stages) in zip(found, params)]


def resources(text: str, *, num_warps: int, num_stages: int) -> dict:
  """Compile one Triton module (text) for sm_90a: shared bytes, registers, spill bytes."""
  try:
    import triton
    from triton.backends.compiler import GPUTarget
  except ImportError as e:
    raise SystemExit("this script needs the triton package: pip install triton") from e
  with tempfile.TemporaryDirectory() as tmp:
    src = os.path.join(tmp, "kernel.ttir")
    with open(src, "w") as f:
      f.write(text)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = os.path.join(tmp, "kernel.ptx")
    with open(ptx, "w") as f:
      f.write(compiled.asm["ptx"])
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # The package's newest ptxas: its PTX version can be newer than the plain `ptxas` reads.
    ptxas = next(p for p in (os.path.join(bin_dir, "ptxas-blackwell"),
                             os.path.join(bin_dir, "ptxas")) if os.path.exists(p))
    report = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.devnull],
                            capture_output=True, text=True).stderr
  regs = re.search(r"Used (\d+) registers", report)
  spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
  ptx_text = compiled.asm["ptx"]
  count = lambda pattern: len(re.findall(pattern, ptx_text))
  return {"shared_kib": compiled.metadata.shared / 1024,
          "registers": int(regs.group(1)) if regs else None,
          "spill_store": int(spill.group(1)) if spill else None,
          "spill_load": int(spill.group(2)) if spill else None,
          # Hopper MMA (wgmma) against the Ampere one (mma.sync): a product whose M is below a
          # warpgroup's 64 rows falls back to the latter (NOTES_kernel round 24); ldmatrix /
          # stmatrix count register <-> shared-memory layout round trips
          "wgmma": count(r"wgmma\.mma_async"), "mma_sync": count(r"mma\.sync"),
          "ldmatrix": count(r"ldmatrix"), "stmatrix": count(r"stmatrix"),
          # ptxas's C7512: every wgmma of the kernel waits for the one before it (no two in
          # flight) because registers ran short. NOTES_kernel round 32: the one-kernel VJPs
          # carry it, but a three-kernel form without it was no faster on the H200
          "serialized": "C7512" in report}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shape", default="2,300,4,2,64", help="B,T,H,K,D")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  p.add_argument("--no-gate", dest="gate", action="store_false")
  p.add_argument("--no-segments", dest="segments", action="store_false")
  p.add_argument("--block-sizes", default="",
                 help="BlockSizes overrides, e.g. dq_pairs=0,num_stages=1,prepass=split_bf16")
  p.add_argument("--force-prepass", action="store_true",
                 help="the requested pre-pass even where usable_variant routes to jnp")
  a = p.parse_args()
  import jax.numpy as jnp
  from experiments.benchmarks.path_kernel import _prepass_as_requested
  from experiments.benchmarks.path_kernel_phases import _block_sizes
  B, T, H, K, D = (int(x) for x in a.shape.split(","))
  with _prepass_as_requested(a.force_prepass):
    mods = kernel_modules(B, T, H, K, D, dtype=jnp.dtype(a.dtype), gate=a.gate,
                          segments=a.segments, block_sizes=_block_sizes(a.block_sizes))
  limit_kib = 227  # per block on the H100 / H200
  print(f"{'kernel':20s} {'warps':>5s} {'stages':>6s} {'shared KiB':>10s} {'regs':>5s} "
        f"{'spill st/ld B':>14s} {'wgmma/mma.sync':>15s} {'ld/stmatrix':>12s}")
  for name, text, warps, stages in mods:
    r = resources(text, num_warps=warps, num_stages=stages)
    flag = ("  > 227 KiB" if r["shared_kib"] > limit_kib else "") + (
        "  wgmma serialized (C7512)" if r["serialized"] else "")
    print(f"{name:20s} {warps:5d} {stages:6d} {r['shared_kib']:10.1f} {r['registers'] or '?':>5} "
          f"{str(r['spill_store']) + '/' + str(r['spill_load']):>14s} "
          f"{str(r['wgmma']) + '/' + str(r['mma_sync']):>15s} "
          f"{str(r['ldmatrix']) + '/' + str(r['stmatrix']):>12s}{flag}")


if __name__ == "__main__":
  main()
