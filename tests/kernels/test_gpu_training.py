"""What a researcher runs, on the GPU: a real-size bf16 model trained through the project's train
step with the PaTH kernels (.ci/gpu runs it first: the longest start first)."""
from __future__ import annotations

import math

import jax
import pytest

from tests.util import fresh_process_json

# (encoding, head_dim, model.kernel_options, lines of the plan each layer runs). The 12-layer
# llama-style model: d_model 768, 12 heads x 64 or 6 x 128; batch 8 x 2048 packed tokens.
SMOKES = [
    ("path", 64, None, ["forward:   walk (Triton)", "far dq on mosaic", "near sweep on mosaic"]),
    ("path_fox", 64, None, ["gate, segments", "far dq on mosaic"]),
    # the span forward's far keys on Mosaic: the default at head_dim 128, pinned here so that a
    # GPU without Mosaic GPU raises instead of running Triton
    ("path", 128, {"mosaic": True}, ["span walk (Triton), far keys on mosaic",
                                     "far dk/dv on mosaic (key pairs)"]),
]


def _model_config(encoding, head_dim, kernel_options):
  from experiments import data
  from experiments.configs import base
  from posenc_jax import model as model_lib
  c = base.get_config()
  c.data.task, c.data.seq_len = "text", 2048
  c.train.update(steps=200, batch_size=8, learning_rate=1e-3, warmup_steps=5)
  mcfg = model_lib.ModelConfig(
      vocab_size=data.vocab_size(c.data), encoding=encoding, num_layers=12, d_model=768,
      num_heads=768 // head_dim, head_dim=head_dim, dtype="bfloat16",
      kernel_options=tuple(sorted((kernel_options or {}).items())))
  return c, mcfg


@pytest.mark.parametrize("encoding,head_dim,kernel_options,plan_lines", SMOKES)
def test_smokes_run_the_plans_they_name(encoding, head_dim, kernel_options, plan_lines):
  """Each smoke's layer plan, resolved for "gpu" on this host (the H100 assumed): the smokes run
  only on the device, so a default that moved under them shows here."""
  from posenc_jax import model as model_lib
  _, mcfg = _model_config(encoding, head_dim, kernel_options)
  choice = model_lib.attention_choice(mcfg, batch=8, seq_len=2048, backend="gpu")
  assert choice.implementation == "pallas", choice
  for line in plan_lines:
    assert line in choice.reason, (line, choice.reason)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
class TestGPUTraining:
  """The 12-layer bf16 model (SMOKES) on the packed code corpus at T = 2048 through the
  project's train step, 20 steps: finite, and the loss falls."""

  steps = 20

  @pytest.mark.parametrize("encoding,head_dim,kernel_options,plan_lines", SMOKES)
  def test_bf16_model_trains(self, encoding, head_dim, kernel_options, plan_lines):
    import numpy as np
    from experiments import data, sharding, train
    from posenc_jax import model as model_lib
    c, mcfg = _model_config(encoding, head_dim, kernel_options)
    choice = model_lib.attention_choice(mcfg, batch=8, seq_len=2048)
    for line in plan_lines:
      assert line in choice.reason, (line, choice.reason)
    mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
    trainer = train.Trainer(mcfg, c.train, mesh)
    batches = data.make_train_iter(c.data, batch_size=8, seed=0)
    losses = []
    with jax.set_mesh(mesh):
      state = trainer.init_state(0)
      for _ in range(self.steps):
        state, metrics = trainer.train_step(state, trainer.put(next(batches)))
        losses.append(float(metrics["loss"]))
        assert np.isfinite(float(metrics["grad_norm"])), f"grad norm not finite: {metrics}"
    assert np.all(np.isfinite(losses)), losses
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_init_state_draws_the_same_parameters_through_the_threefry_kernel():
  """Trainer.init_state lowers threefry to JAX's GPU kernel (it compiles faster than XLA's
  inlined hash): the state equals, bit for bit, the one the inlined hash draws."""
  import numpy as np
  from experiments import sharding, train
  c, mcfg = _model_config("path_fox", 64, None)
  mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  trainer = train.Trainer(mcfg, c.train, mesh)
  with jax.set_mesh(mesh):
    kernel = jax.device_get(trainer.init_state(3))
    inlined = jax.device_get(trainer._init_jit(3))  # the flag is part of jit's cache key
    with train._threefry_kernel():
      assert "threefry2x32_ffi" in trainer._init_jit.lower(3).as_text()
    assert "threefry2x32_ffi" not in trainer._init_jit.lower(3).as_text()
  flat_k, flat_i = jax.tree.leaves(kernel), jax.tree.leaves(inlined)
  assert len(flat_k) == len(flat_i) > 100
  for a, b in zip(flat_k, flat_i):
    np.testing.assert_array_equal(a, b)


def _first_steps(encoding, *, steps=3):
  """A 2-layer d_model 768 bf16 model of `encoding` (the base config's optimizer) trained
  `steps` steps on the text task at T 2048, batch 4: (XLA compiles per step, losses)."""
  from experiments import data, sharding, train
  from experiments.configs import base
  from posenc_jax import model as model_lib
  c = base.get_config()
  c.data.task, c.data.seq_len = "text", 2048
  mcfg = model_lib.ModelConfig(vocab_size=data.vocab_size(c.data), encoding=encoding,
                               num_layers=2, d_model=768, num_heads=12, head_dim=64,
                               dtype="bfloat16")
  compiles = []
  def on_duration(event, seconds, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(seconds)
  jax.monitoring.register_event_duration_secs_listener(on_duration)
  mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  trainer = train.Trainer(mcfg, c.train, mesh)
  batches = data.make_train_iter(c.data, batch_size=4, seed=0)
  per_step, losses = [], []
  try:
    with jax.set_mesh(mesh):
      state = trainer.init_state(0)
      for _ in range(steps):
        before = len(compiles)
        state, metrics = trainer.train_step(state, trainer.put(next(batches)))
        losses.append(float(metrics["loss"]))
        per_step.append(sum(s > 1.0 for s in compiles[before:]))  # the step, not small helpers
  finally:
    jax.monitoring.unregister_event_duration_listener(on_duration)
  return per_step, losses


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("encoding", ["path", "rope"])
def test_the_train_step_compiles_once(encoding):
  """Importing kernels_pallas loads pallas_call's GPU lowerings, which add a config state to
  JAX's tracing context (jax 0.11). Imported lazily inside the train step's first trace, the
  step misses its trace cache at its second call and compiles again; the model imports the
  kernels when it is built (dispatch.preload_kernels). In a fresh process, as the CLI runs:
  here pytest has imported the kernels long before."""
  script = ("import json, sys; from tests.kernels.test_gpu_training import _first_steps; "
            "print(json.dumps(_first_steps(sys.argv[1])))")
  per_step, losses = fresh_process_json(script, encoding, JAX_PLATFORMS="cuda")
  assert per_step == [1, 0, 0], per_step
  assert all(map(math.isfinite, losses)), losses
