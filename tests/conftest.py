"""Shared fixtures: a fresh random key per test (seed printed on failure), tolerance helpers."""
import os
import secrets

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture
def key(request):
  """A fresh jax PRNG key each run; the seed is shown in the failure report to reproduce it."""
  import jax
  seed = int(os.environ.get("POSENC_TEST_SEED", secrets.randbits(31)))
  request.node.user_properties.append(("seed", seed))
  print(f"POSENC_TEST_SEED={seed}")
  return jax.random.key(seed)


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: long tests; deselect with -m 'not slow'")
  config.addinivalue_line("markers", "gpu: needs a GPU (runs on the device machine)")
