"""The command line's compile report and persistent compilation cache
(experiments/compilation.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

from experiments import compilation
from experiments import startup

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"^compiled the train step in [\d.]+ s \(trace [\d.]+, lower [\d.]+, "
                  r"(XLA [\d.]+|read from the compilation cache [\d.]+)\)$", re.M)


def test_timed_sums_one_compile_and_unregisters(key):
  x = jax.random.normal(key, (8, 8))
  fn = jax.jit(lambda a: jnp.tanh(a @ a.T) + a.sum())   # a new function: a fresh compile
  with compilation.timed() as spent:
    fn(x).block_until_ready()
  assert spent["trace"] > 0 and spent["lower"] > 0 and spent["xla"] > 0, spent
  assert spent["cache_hits"] == 0
  before = dict(spent)
  jax.jit(lambda a: a * 3)(x).block_until_ready()        # after the block: not counted
  assert spent == before
  assert LINE.search(compilation.describe(spent))


def _train(workdir, cache_dir) -> str:
  args = ["--config=experiments/configs/quickstart.py:runlocal,encoding=rope",
          "--config.train.steps=2", "--config.train.log_every=1", "--config.eval.num_batches=0",
          f"--config.train.compile_cache_dir={cache_dir}", f"--workdir={workdir}"]
  # Every program cached, however fast this machine compiles it (JAX's own variable, which
  # compilation.enable_cache leaves as set): the default 1 s made the test depend on the load.
  env = dict(os.environ, **{compilation.MIN_COMPILE_SECONDS_ENV: "0"})
  result = subprocess.run([sys.executable, "-m", "experiments.main", *args], cwd=REPO, env=env,
                          text=True, capture_output=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stderr.replace("\r", "\n")


def test_a_rerun_reads_the_train_step_from_the_cache(tmp_path):
  cache = tmp_path / "cache"
  first = LINE.findall(_train(tmp_path / "a", cache))
  assert first and first[0].startswith("XLA"), first
  assert os.listdir(cache), "nothing was written to the cache"
  # A second run of the same shapes (another workdir, another process) compiles nothing.
  stderr = _train(tmp_path / "b", cache)
  again = LINE.findall(stderr)
  assert again and again[0].startswith("read from the compilation cache"), again
  # The command's start-up line gives every stage's own seconds, in order.
  startup_line = re.search(r"^start-up [\d.]+ s: (.*)$", stderr, re.M)
  assert startup_line, stderr[-2000:]
  stages = [part.rsplit(" ", 1)[0] for part in startup_line.group(1).split(", ")]
  assert stages == list(startup.STAGES[:startup.STAGES.index("first_step") + 1])
