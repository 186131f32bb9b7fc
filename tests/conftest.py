"""Shared fixtures: a fresh random key per test (seed printed on failure), tolerance helpers."""
import os
import secrets
import shutil
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# On the CPU (CI: 2 cores) compiling is most of the default set's time: the interpreted
# kernels, the oracles and the train steps are large programs run once at small shapes. Three
# settings cut it, only on the CPU (not where .ci/gpu runs: JAX_PLATFORMS=cuda) and only where
# the caller has not set them:
# - LLVM at -O1 instead of XLA's -O2 (XLA's own HLO passes are unchanged): an interpreted PaTH
#   case's backward compiles in ~9 s instead of ~14 s. Seen on jax 0.10.2 (2026-11-27): the
#   interpreted kernel's forward and gradients (float32 and bf16) and the chunked PaTH and FoX
#   gradients bitwise equal to -O2's, a train step's losses bitwise and its parameters within
#   an ulp or two. Not -O0: it moved rounding everywhere and gave NaN gradients in the chunked
#   FoX and GRAPE-AP (path_integral.right_to_left_attention). That is XLA:CPU's -O0 code for
#   one fused step, not the math: the step's parts differentiate finitely alone at -O0 on the
#   same moderate values (|logits| < 10), and the whole step does too at -O0 with HLO fusion
#   off or at -O1 (jax 0.10.2, 2026-11-27). XLA_FLAGS=--xla_backend_optimization_level=2 runs
#   the tests at the shipping level.
# - XLA:CPU's older fusion code generation (--xla_cpu_use_fusion_emitters=false) instead of the
#   MLIR fusion emitters: the default set's CPU time 3,105 -> 2,300 s (-26%; an interpreted
#   PaTH case's kernel gradients compile in ~11 s instead of ~17 s). Checked on jax 0.10.2
#   (2026-11-27) by recording every array the default set compares (rel_rms, assert_allclose;
#   2,432, POSENC_TEST_SEED fixed) with and without it: 2,096 bitwise equal, every interpreted
#   kernel forward and the float32 kernel gradients among them. The cause of the rest: exp
#   and log1p round differently by at most 1 ulp in the elements a vectorised loop leaves to
#   its scalar tail (exp: the default's max error 0.50 ulp from the exact value, this one's
#   0.93; 21,000 draws; every other elementwise function checked, and sums, softmax, cumsum,
#   bitwise). Through a model's layers and their gradients that 1-ulp difference grows to at
#   most 11 ulps of an array's largest element (relative RMS <= 4.2e-7, the scanned-layer
#   cases of test_model); elsewhere <= 4 ulps (relative RMS <= 2.5e-7). Set only where this
#   jaxlib knows the flag (an unknown flag aborts every process: probed once in a subprocess,
#   ~2 s, and inherited by the xdist workers and the CLI subprocesses through XLA_FLAGS);
#   XLA_FLAGS=--xla_cpu_use_fusion_emitters=true runs the tests on the default emitters.
# - A persistent compilation cache for this session only: a fresh temporary directory, shared
#   by the xdist workers and the CLI subprocesses through the environment and removed at the
#   end. A program compiled again unchanged (the train step of a resumed train.run, in its new
#   Trainer) is loaded instead: the same executable.
_CACHE_OWNED = None


def _xla_knows(flag):
  """Whether this jaxlib's XLA accepts `flag`: a CPU backend started with it in a subprocess."""
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                         capture_output=True, check=False)
  return probe.returncode == 0


if os.environ["JAX_PLATFORMS"] == "cpu":
  if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                        "--xla_backend_optimization_level=1"]).strip()
  if ("xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]
      and _xla_knows("--xla_cpu_use_fusion_emitters=false")):
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE_OWNED = tempfile.mkdtemp(prefix="posenc-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_OWNED
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


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


def pytest_unconfigure(config):
  if _CACHE_OWNED and not hasattr(config, "workerinput"):   # the xdist controller, or no xdist
    shutil.rmtree(_CACHE_OWNED, ignore_errors=True)


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
