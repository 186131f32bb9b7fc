"""Argument validation shared by the public functions.

Every error a user can cause raises one ValueError that names the argument and what was
expected. Value checks (beta range, unit w) only run on concrete arrays: under `jit` the
values are tracers and the check is skipped rather than forcing a host sync.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

IMPLEMENTATIONS = ("reference", "xla", "cudnn", "scan", "chunked", "pallas")


def check_rank(name: str, x, rank: int, letters: str) -> None:
  if x.ndim != rank:
    raise ValueError(f"{name} must have rank {rank} [{', '.join(letters)}], "
                     f"got shape {tuple(x.shape)}")


def check_shape(name: str, x, expected: Sequence[int], letters: str) -> None:
  """Checks `x.shape == expected`; `letters` spells the axes, e.g. "BTH"."""
  if tuple(x.shape) != tuple(expected):
    spelled = ", ".join(f"{l}={n}" for l, n in zip(letters, expected))
    raise ValueError(f"{name} must have shape [{spelled}], got {tuple(x.shape)}")


def check_qkv(q, k, v) -> tuple[int, int, int, int, int]:
  """Validates causal self-attention inputs; returns (B, T, H, K, D)."""
  check_rank("q", q, 4, "BTHD")
  check_rank("k", k, 4, "BTKD")
  check_rank("v", v, 4, "BTKD")
  B, T, H, D = q.shape
  K = k.shape[2]
  check_shape("k", k, (B, T, K, D), "BTKD")
  if v.shape[:3] != (B, T, K):
    raise ValueError(f"v must have shape [B={B}, T={T}, K={K}, Dv], got {tuple(v.shape)}")
  if K == 0 or H % K:
    raise ValueError(f"number of query heads H={H} must be a multiple of key/value heads "
                     f"K={K} (GQA)")
  return B, T, H, K, D


def check_segment_ids(segment_ids, B: int, T: int) -> None:
  if segment_ids is not None:
    check_shape("segment_ids", segment_ids, (B, T), "BT")


def check_even(name: str, d: int) -> None:
  if d % 2:
    raise ValueError(f"{name}={d} must be even: rotations act on pairs of channels")


def check_implementation(implementation, allowed: Sequence[str], *,
                         kernel_options: bool = False) -> None:
  """`implementation` names one of `allowed`; "pallas:key=value,..." (kernel_options: the
  PaTH / FoX kernels) also passes kernels_pallas.BlockSizes fields (kernel_block_sizes)."""
  name, _, options = str(implementation).partition(":")
  if name not in allowed:
    raise ValueError(f"implementation={implementation!r} is not one of {tuple(allowed)}")
  if options and not (kernel_options and name == "pallas"):
    raise ValueError(f"implementation={implementation!r}: options after ':' are the PaTH / FoX "
                     "Pallas kernels' ('pallas:span=8,...'; or pass kernel_options)")


def kernel_block_sizes(implementation: str | None, kernel_options=None):
  """The PaTH / FoX kernels' kernels_pallas.BlockSizes from "pallas:key=value,..." and a
  kernel_options mapping (a dict or ConfigDict of BlockSizes fields; both may be given, for
  different fields); None where neither sets anything. Errors name the argument at fault."""
  _, _, text = str(implementation or "").partition(":")
  given = dict(kernel_options.to_dict() if hasattr(kernel_options, "to_dict")
               else kernel_options or {})
  if not text and not any(v is not None for v in given.values()):
    return None
  import kernels_pallas  # imported lazily: importing the kernels costs a second or two
  from kernels_pallas.path_attention import options as kernel_opts
  try:
    fields = kernel_opts.parse(text)
    kernels_pallas.BlockSizes.of(fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f"implementation={implementation!r}: {e}") from None
  try:
    both = sorted(set(fields) & {k for k, v in given.items() if v is not None})
    if both:
      raise ValueError(f"{', '.join(both)} set both here and in implementation="
                       f"{implementation!r}")
    return kernels_pallas.BlockSizes.of({**given, **fields})
  except (TypeError, ValueError) as e:
    raise ValueError(f"kernel_options={given}: {e}") from None


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_range(name: str, x, lo: float, hi: float) -> None:
  """Raises if a concrete `x` has values outside [lo, hi]; silent under tracing."""
  if is_concrete(x):
    a = np.asarray(x, dtype=np.float64)
    if a.size and (a.min() < lo or a.max() > hi):
      raise ValueError(f"{name} must lie in [{lo}, {hi}], got values in "
                       f"[{a.min():.4g}, {a.max():.4g}]")


def check_unit_norm(name: str, x, *, atol: float = 1e-3) -> None:
  """Raises if a concrete `x` has rows (last axis) whose L2 norm is not 1."""
  if is_concrete(x):
    n = np.linalg.norm(np.asarray(x, dtype=np.float64), axis=-1)
    if n.size and np.abs(n - 1).max() > atol:
      raise ValueError(f"{name} must have unit L2 norm along its last axis, got norms in "
                       f"[{n.min():.4g}, {n.max():.4g}]")


def default_implementation(*, accelerated: str, cpu: str) -> str:
  """The implementation used when the caller passes None: kernels on GPU/TPU."""
  return accelerated if jax.default_backend() in ("gpu", "tpu") else cpu
