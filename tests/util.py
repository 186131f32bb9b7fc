"""Comparison helpers for tests: relative RMS error, the measure every tolerance here is stated in
(float32 near 1e-5, bfloat16 near 1e-2), and the environment of fake-device subprocesses."""
import os

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


def value_and_grads(f, loss, argnums=0):
  """A jitted a -> (f(*a), the gradient of loss(f(*a)) w.r.t. a[argnums]): the output is the
  gradient's own forward, so one program computes both and compiles once (CI time)."""
  def with_out(*a):
    out = f(*a)
    return loss(out), out

  grads = jax.value_and_grad(with_out, argnums=argnums, has_aux=True)

  def both(*a):
    (_, out), g = grads(*a)
    return out, g

  return jax.jit(both)


def model_logits_and_grads(model, tokens_BT1, **call):
  """(logits, every parameter's gradient as a list of leaves) of an NNX language model's
  next-token loss on tokens [B, T + 1], jitted; call: the model's keyword arguments."""
  import jax.numpy as jnp
  from flax import nnx

  @nnx.jit
  def loss_and_grads(model):
    def loss(model):
      logits = model(tokens_BT1[:, :-1], **call)
      lp = jax.nn.log_softmax(logits.astype(jnp.float32))
      return -jnp.mean(jnp.take_along_axis(lp, tokens_BT1[:, 1:, None], -1)), logits
    return nnx.value_and_grad(loss, has_aux=True)(model)

  (_, logits), grads = loss_and_grads(model)
  return logits, jax.tree.leaves(nnx.to_pure_dict(grads))


def in_float64(fn, *args):
  """Runs an oracle in float64 on float32 test inputs (pytrees), returning numpy arrays.

  A float32 oracle carries rounding error of the same size as the fast path's: comparing two
  float32 computations at 1e-5 then judges the oracle as much as the code under test. The
  oracle runs jitted: one compile instead of eager op-by-op dispatch (CI time).
  """
  import jax.numpy as jnp
  with jax.enable_x64(True):
    args64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64)
                          if np.issubdtype(np.asarray(a).dtype, np.floating) else a, args)
    return jax.tree.map(np.asarray, jax.jit(fn)(*args64))


def fake_devices_env(devices: int, *, pythonpath: str | None = None) -> dict:
  """The environment of a subprocess that runs `devices` fake CPU devices (the device count is
  fixed when JAX starts): the session's XLA flags (tests/conftest.py's compile settings) with
  that count, and Eigen's single-threaded matmuls. The last because XLA:CPU's collectives
  block their threads while waiting for the other devices: on a 2-core machine the devices of a
  ring (ppermute, all_gather in a scan) can all wait on threads that Eigen's intra-op pool
  needs, and the program hangs. Seen on jax 0.10.2 with the three default context-parallel
  cases in one process: 2 of 4 runs hung without this flag, 3 of 3 finished with it.
  """
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith(("--xla_force_host_platform_device_count",
                                "--xla_cpu_multi_thread_eigen"))]
  flags += [f"--xla_force_host_platform_device_count={devices}",
            "--xla_cpu_multi_thread_eigen=false"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
  if pythonpath is not None:
    env["PYTHONPATH"] = pythonpath + os.pathsep + os.environ.get("PYTHONPATH", "")
  return env


def fresh_process_json(script: str, *args: str, **env):
  """Runs `script` (python -c) with `args` in a new interpreter, from the repository's root,
  with os.environ updated by `env`; returns the JSON its last stdout line prints. For what a
  pytest process cannot show: a first import, or XLA flags other than the session's."""
  import json
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = subprocess.run([sys.executable, "-c", script, *args], cwd=root, capture_output=True,
                       text=True, check=False, env=dict(os.environ, **env))
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads(run.stdout.strip().splitlines()[-1])

