"""Sharding: the logical-axis rules, mesh sizes, and the sharded step == the one-device step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
from jax.sharding import PartitionSpec as P

from experiments import sharding
from tests import util

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH_2x4 = types.SimpleNamespace(shape={"data": 2, "fsdp": 4})


def test_logical_to_spec_maps_and_falls_back():
  rules = sharding.DEFAULT_RULES
  assert sharding.logical_to_spec(("batch", "length"), rules=rules, mesh=MESH_2x4,
                                  shape=(8, 5)) == P(("data", "fsdp"), None)
  assert sharding.logical_to_spec(("embed", "mlp"), rules=rules, mesh=MESH_2x4,
                                  shape=(16, 48)) == P("fsdp", None)
  # 6 rows do not split 4 ways: replicate rather than fail to compile.
  assert sharding.logical_to_spec(("embed", "mlp"), rules=rules, mesh=MESH_2x4,
                                  shape=(6, 48)) == P(None, None)
  # A mesh axis is used at most once per array.
  assert sharding.logical_to_spec(("embed", "embed"), rules=rules, mesh=MESH_2x4,
                                  shape=(8, 8)) == P("fsdp", None)
  assert sharding.logical_to_spec(None, rules=rules) == P()


@pytest.mark.parametrize("data,fsdp,n,expected", [(-1, 1, 8, (8, 1, 1)), (2, -1, 8, (2, 4, 1)),
                                                  (1, 1, 1, (1, 1, 1))])
def test_mesh_shape_fills(data, fsdp, n, expected):
  assert sharding.mesh_shape(data=data, fsdp=fsdp, num_devices=n) == expected


@pytest.mark.parametrize("data,fsdp,n,match", [(3, -1, 8, "do not divide"),
                                               (2, 2, 8, "must equal"), (0, 1, 1, "mesh.data"),
                                               (-1, -1, 8, "only one")])
def test_mesh_shape_errors(data, fsdp, n, match):
  with pytest.raises(ValueError, match=match):
    sharding.mesh_shape(data=data, fsdp=fsdp, num_devices=n)


# Runs in a fresh interpreter: the CPU device count is fixed when JAX initialises.
_SCRIPT = r"""
import json
import jax
import numpy as np
from experiments import sharding, train
from experiments.configs import base
from posenc_jax import model as model_lib

assert jax.device_count() == 8, jax.devices()
mcfg = model_lib.ModelConfig(vocab_size=11, encoding="fox", num_layers=1, d_model=32,
                             num_heads=4, num_kv_heads=2, head_dim=8, block="acc_rot",
                             dropout=0.1)
t = base.get_config().train
t.update(steps=10, warmup_steps=1, learning_rate=1e-2)
rng = np.random.default_rng(0)
batches = []
for _ in range(3):
  tok = rng.integers(0, 11, (8, 21)).astype(np.int32)
  batches.append({"tokens": tok[:, :-1], "targets": tok[:, 1:],
                  "loss_mask": (rng.random((8, 20)) < 0.7).astype(np.float32),
                  "segment_ids": np.ones((8, 20), np.int32),
                  "positions": np.tile(np.arange(20, dtype=np.int32), (8, 1))})
out = {}
for name, mesh in (("sharded", sharding.make_mesh(data=2, fsdp=4)),
                   ("single", sharding.make_mesh(devices=jax.devices()[:1]))):
  trainer = train.Trainer(mcfg, t, mesh)
  with jax.set_mesh(mesh):
    state = trainer.init_state(0)
    out[name + "_spec"] = list(state["params"]["blocks"][0]["mlp"]["up"]["kernel"].sharding.spec)
    out[name + "_opt_devices"] = len(jax.tree.leaves(state["opt"])[1].sharding.device_set)
    out[name + "_threefry_kernel"] = trainer.threefry_kernel
    losses = []
    for b in batches:
      state, m = trainer.train_step(state, trainer.put(b))
      losses.append(float(m["loss"]))
    out[name] = losses
    out[name + "_eval"] = float(trainer.eval_step(state["params"], trainer.put(batches[0]))["ce"])
print("RESULT" + json.dumps(out))
"""


def test_sharded_step_matches_single_device():
  # The session's XLA flags (tests/conftest.py: the CPU's compile settings) plus the device
  # count: the subprocess compiles as the rest of the suite does (CI time: ~29 -> ~13 s).
  env = util.fake_devices_env(8, pythonpath=ROOT)
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.split("RESULT")[-1])
  assert out["sharded_spec"] == ["fsdp", None], out  # FSDP over "embed"
  assert out["sharded_opt_devices"] == 8
  # The init's threefry kernel (one custom call, unsplittable) only where nothing is sharded.
  assert out["single_threefry_kernel"] and not out["sharded_threefry_kernel"]
  # Same math on a different device layout: only the reduction order may differ.
  for a, b in zip(out["sharded"], out["single"]):
    assert abs(a - b) <= 1e-5 * abs(b), (out["sharded"], out["single"])
  assert out["sharded"][0] != out["sharded"][2]  # the steps really trained
  assert abs(out["sharded_eval"] - out["single_eval"]) <= 1e-5 * abs(out["single_eval"])
