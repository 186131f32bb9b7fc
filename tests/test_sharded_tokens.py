"""Per-token layers with tokens split over devices (batch over "data", T over "context") keep
their work on each device: the same values and gradients as one device, and no gather of the
tokens into every device in the compiled program.

Two layers once did gather. On 2 x H200 (PaTH, T = 65,536, context 2) they took the step from
~0.17 s to 2.2 s:
- PaTH's short convolution numbered documents with a cumulative sum over T; XLA:GPU ran the
  sharded sum as a sequential loop of T / 2 steps;
- the embedding's one-hot gradient scanned over chunks of the flattened tokens, so every device
  gathered all tokens and cotangents and built the whole table gradient.

The cases run in one fresh interpreter with 4 fake CPU devices (data 2 x context 2).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax

from tests import util

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import json, re, sys
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from posenc_jax import encodings, model
from posenc_jax.encodings import transport

seed = int(sys.argv[1])
model.ONE_HOT_GRAD_CHUNK = 4   # several chunks per device: B T / 4 devices = 12 tokens each
B, T, C, V = 2, 24, 16, 50
dims = encodings.Dims(d_model=C, num_heads=2, num_kv_heads=2, head_dim=8)
# Documents that start inside a shard, at a shard's first token (12) and with a repeated id.
seg = jnp.array([[0] * 5 + [1] * 7 + [2] * 6 + [0] * 6, [3] * T], jnp.int32)
ks = jax.random.split(jax.random.key(seed), 5)
x = jax.random.normal(ks[0], (B, T, C))
tokens = jax.random.randint(ks[1], (B, T), 0, V)
table = jax.random.normal(ks[2], (V, C))
ct = jax.random.normal(ks[3], (B, T, C))
params = encodings.get("path").init(ks[4], dims)
params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(ks[4], p.shape, p.dtype), params)


def conv_loss(params, x):
  w, beta = transport.transport_inputs(params, x, num_kv_heads=2, head_dim=8, segment_ids=seg)
  return jnp.sum(w * ct[..., :1, None]) + jnp.sum(beta * ct[..., :2])


def embed_loss(table):
  return jnp.sum(model.embed_tokens(table, tokens, dtype=jnp.float32, one_hot=True) * ct)


def rel(a, b):
  a, b = (jnp.concatenate([t.reshape(-1) for t in jax.tree.leaves(u)]) for u in (a, b))
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


cases = {"conv": (jax.value_and_grad(conv_loss, argnums=(0, 1)), (params, x)),
         "embed": (jax.value_and_grad(embed_loss), (table,))}
mesh = jax.make_mesh((2, 2), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
out = {}
for name, (fn, args) in cases.items():
  want = jax.jit(fn)(*args)
  with jax.set_mesh(mesh):
    put = lambda a: (jax.device_put(a, NamedSharding(mesh, P("data", "context")))
                     if a.shape[:2] == (B, T) else a)
    args = jax.tree.map(put, args)
    compiled = jax.jit(fn).lower(*args).compile()
    got = compiled(*args)
  hlo = compiled.as_text()
  out[name] = {"error": rel(got, want),
               "gathers": re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo),
               "loops": re.findall(r'known_trip_count":\{"n":"(\d+)"', hlo)}
print("RESULT" + json.dumps(out))
"""


def test_per_token_layers_stay_on_their_devices(key):
  seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
  proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(seed)], cwd=ROOT,
                        env=util.fake_devices_env(4, pythonpath=ROOT), capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.split("RESULT")[-1])
  for name, r in result.items():
    assert r["error"] <= 1e-6, (name, r["error"], seed)
    assert r["gathers"] == [], (name, r["gathers"])
  # The embedding's scan walks each device's own 3 chunks of 4 tokens (not all 12 chunks);
  # the convolution has no loop at all (not one over T).
  assert result["embed"]["loops"] == ["3"], result["embed"]
  assert result["conv"]["loops"] == [], result["conv"]
