"""Context parallelism through the model: every encoding's loss and gradients on a mesh whose
"context" axis splits each sequence equal the one-device ones, and training runs the same
losses across meshes. One subprocess with 8 fake CPU devices (the device count is fixed when
JAX starts) runs every mesh; the config errors run here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments import config_checks
from experiments import sharding
from experiments.configs import base
from tests import util

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (data, context): one device, the sequence over 2 and 4 devices, and both axes at once
MESHES = ((1, 1), (1, 2), (1, 4), (2, 2))
TRAINED = ("path", "path_fox", "fox", "rope")

_SCRIPT = r"""
import json, sys
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from experiments import evaluate, sharding, train
from experiments.configs import base
from posenc_jax import encodings
from posenc_jax import model as model_lib

names, meshes, trained, train_meshes, steps = json.loads(sys.argv[1])
assert jax.device_count() == 8, jax.devices()
T, B = 32, 2
rng = np.random.default_rng(0)
batches = []
for _ in range(steps):
  tok = rng.integers(0, 13, (B, T + 1)).astype(np.int32)
  seg = np.repeat(np.array([[1] * 20 + [2] * 12]), B, 0).astype(np.int32)   # two documents
  pos = np.concatenate([np.arange(20), np.arange(12)])[None].repeat(B, 0).astype(np.int32)
  batches.append({"tokens": tok[:, :-1], "targets": tok[:, 1:],
                  "loss_mask": np.ones((B, T), np.float32), "segment_ids": seg,
                  "positions": pos})
t = base.get_config().train
t.update(steps=steps, warmup_steps=1, learning_rate=1e-2)
out = {}
for name in names:
  mcfg = model_lib.ModelConfig(vocab_size=13, encoding=name, num_layers=1, d_model=32,
                               num_heads=4, num_kv_heads=2, head_dim=8, block="llama")
  for data_n, context_n in meshes:
    mesh = sharding.make_mesh(data=data_n, fsdp=1, context=context_n,
                              devices=jax.devices()[:data_n * context_n])
    trainer = train.Trainer(mcfg, t, mesh)
    key = f"{name}/{data_n}x{context_n}"
    with jax.set_mesh(mesh):
      state = trainer.init_state(0)
      b = trainer.put(batches[0])
      shard_T = b["tokens"].addressable_shards[0].data.shape[1]
      assert shard_T == T // context_n, (b["tokens"].sharding, shard_T)   # T is split
      k1, k2 = jax.random.split(jax.random.key(1))

      @jax.jit
      def loss_and_grads(params, batch):
        def loss(p):
          logits = trainer._logits(p, batch, rngs=nnx.Rngs(dropout=k1, encoding=k2), train=True)
          return evaluate.loss_and_metrics(logits, batch)[0]
        return jax.value_and_grad(loss)(params)

      loss, grads = loss_and_grads(state["params"], b)
      flat = jax.tree.leaves(grads)
      out[key] = {"loss": float(loss),
                  "grads": [np.asarray(g, np.float64).ravel().tolist() for g in flat]}
      if name in trained and [data_n, context_n] in train_meshes:
        losses = []
        for batch in batches:
          state, m = trainer.train_step(state, trainer.put(batch))
          losses.append(float(m["loss"]))
        out[key]["losses"] = losses
print("RESULT" + json.dumps(out))
"""


def _run(names, meshes, trained, steps, train_meshes=None):
  """{name/DxC: loss, grads (and losses where trained)} from the subprocess; `trained` names
  train `steps` steps on each of `train_meshes` (default: every mesh)."""
  env = util.fake_devices_env(8, pythonpath=ROOT)
  train_meshes = meshes if train_meshes is None else train_meshes
  arg = json.dumps([list(names), [list(m) for m in meshes], list(trained),
                    [list(m) for m in train_meshes], steps])
  proc = subprocess.run([sys.executable, "-c", _SCRIPT, arg], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.split("RESULT")[-1])


def _rel(a, b):
  import numpy as np
  a, b = np.asarray(a), np.asarray(b)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _check(out, names, meshes, trained):
  for name in names:
    one = out[f"{name}/1x1"]
    for data_n, context_n in meshes[1:]:
      got = out[f"{name}/{data_n}x{context_n}"]
      where = f"{name} at data={data_n} x context={context_n}"
      assert abs(got["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]), (where, got["loss"],
                                                                          one["loss"])
      for i, (g, g1) in enumerate(zip(got["grads"], one["grads"])):
        assert _rel(g, g1) <= 1e-4, (where, f"gradient leaf {i}", _rel(g, g1))
      if name in trained and "losses" in got:
        assert max(_rel([a], [b]) for a, b in zip(got["losses"], one["losses"])) <= 1e-5, (
            where, got["losses"], one["losses"])
  for name in trained:
    losses = out[f"{name}/1x1"]["losses"]
    assert losses[-1] < losses[0], (name, losses)   # the steps trained


def test_training_under_context_parallelism():
  """PaTH-FoX (the transport ring with the gate) and RoPE (the softmax ring): one step's loss
  and gradients with the sequence over 2 devices beside data 2 and over 4 devices, equal to
  one device's; PaTH-FoX then trains ten steps at data 2 x context 2 with one device's losses.
  (Every encoding, every mesh, training each: -m slow.)"""
  names, meshes, train_meshes = ("path_fox", "rope"), [(1, 1), (2, 2), (1, 4)], [(1, 1), (2, 2)]
  out = _run(names, meshes, ("path_fox",), steps=10, train_meshes=train_meshes)
  _check(out, names, meshes, ("path_fox",))
  assert "losses" in out["path_fox/2x2"] and "losses" not in out["rope/2x2"]


@pytest.mark.slow
def test_path_and_fox_train_under_context_parallelism():
  names, meshes = ("path", "fox"), [(1, 1), (2, 2)]
  _check(_run(names, meshes, names, steps=10), names, meshes, names)


@pytest.mark.slow
def test_every_encoding_under_context_parallelism():
  from posenc_jax import encodings
  names = encodings.NAMES
  _check(_run(names, MESHES, TRAINED, steps=10), names, MESHES, TRAINED)


def test_lengths_must_split_over_the_context_axis():
  config = base.get_config()
  config.mesh.update(data=1, context=4)
  config.data.seq_len = 30
  with pytest.raises(ValueError, match=r"^config.data.seq_len=30 must be a multiple of "
                                       r"config.mesh.context=4"):
    config_checks.check_mesh(config, 4)
  config.data.seq_len = 32
  config.eval.lengths = (32, 50)
  with pytest.raises(ValueError, match=r"^config.eval.lengths \[50\] must be multiples of "
                                       r"config.mesh.context=4"):
    config_checks.check_mesh(config, 4)
  config.eval.lengths = (32, 64)
  assert config_checks.check_mesh(config, 4) == (1, 1, 4)
  with pytest.raises(ValueError, match=r"context=4 must equal the 8 available devices"):
    sharding.mesh_shape(data=1, fsdp=1, context=4, num_devices=8)
