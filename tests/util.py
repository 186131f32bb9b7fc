"""Comparison helpers for tests: relative RMS error, as DESIGN.md's tolerances are stated."""
import jax
import numpy as np


def rel_rms(actual, expected) -> float:
  a = np.asarray(actual, np.float64)
  e = np.asarray(expected, np.float64)
  assert a.shape == e.shape, (a.shape, e.shape)
  assert np.all(np.isfinite(a)), "non-finite values in the result"
  return float(np.sqrt(np.mean((a - e) ** 2)) / (np.sqrt(np.mean(e**2)) + 1e-30))


def assert_rel_rms(actual, expected, tol: float, what: str = "") -> None:
  err = rel_rms(actual, expected)
  assert err <= tol, f"{what} relative RMS error {err:.3e} > {tol:.1e}"


def assert_trees_rel_rms(actual, expected, tol: float, what: str = "") -> None:
  la, le = jax.tree.leaves(actual), jax.tree.leaves(expected)
  assert len(la) == len(le)
  for i, (a, e) in enumerate(zip(la, le)):
    assert_rel_rms(a, e, tol, f"{what}[leaf {i}]")
