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


def pytest_addoption(parser):
  parser.addoption("--shard", default=None, metavar="I/N",
                   help="run every N-th collected test from the I-th on (1-based): splits a run "
                        "that does not fit one device call into N calls (.ci/gpu)")


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: long tests; deselect with -m 'not slow'")
  config.addinivalue_line("markers", "gpu: needs a GPU (runs on the device machine)")


def pytest_collection_modifyitems(config, items):
  shard = config.getoption("--shard")
  if not shard:
    return
  i, _, n = shard.partition("/")
  if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
    raise pytest.UsageError(f"--shard={shard!r}: expected I/N with 1 <= I <= N, e.g. 1/2")
  i, n = int(i), int(n)
  config.hook.pytest_deselected(items=[x for idx, x in enumerate(items) if idx % n != i - 1])
  items[:] = [x for idx, x in enumerate(items) if idx % n == i - 1]
