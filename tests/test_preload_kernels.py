"""dispatch.preload_kernels: a model imports the Pallas kernels when it is built, not inside
the first trace of a function that calls them (see its docstring for why)."""
from __future__ import annotations

import jax.numpy as jnp
import pytest


from posenc_jax import dispatch
from tests.util import fresh_process_json


@pytest.mark.parametrize("family,implementation,dtype,backend,want", [
    ("path", None, jnp.bfloat16, "gpu", True),          # auto on a GPU: the PaTH kernel
    ("forgetting", None, jnp.bfloat16, "tpu", True),
    ("softmax", None, jnp.bfloat16, "gpu", False),      # cuDNN
    ("softmax", None, jnp.float32, "gpu", True),        # cuDNN has no float32: Pallas flash
    ("path", None, jnp.bfloat16, "cpu", False),         # jnp on a CPU
    ("path", "chunked", jnp.bfloat16, "gpu", False),    # named, and not a kernel
    ("softmax", "pallas:block_q=64", jnp.float32, "cpu", True),   # named: interpreted
])
def test_which_models_load_the_kernels(family, implementation, dtype, backend, want):
  assert dispatch.preload_kernels(family, implementation, dtype, backend=backend) is want


_PROBE = """
import json, sys
import jax, jax.numpy as jnp
from flax import nnx
from jax._src import config as jax_config
from posenc_jax import model as model_lib
cfg = model_lib.ModelConfig(vocab_size=11, encoding="path", num_layers=1, d_model=16,
                            num_heads=1, head_dim=16, implementation=sys.argv[1])
before = "kernels_pallas" in sys.modules
model = model_lib.Transformer(cfg, rngs=nnx.Rngs(params=0))
built = "kernels_pallas" in sys.modules
traces = []
@jax.jit
def logits(tokens):
  traces.append(len(jax_config.trace_context()))
  return model(tokens)
tokens = jnp.zeros((1, 16), jnp.int32)
for _ in range(3):
  logits(tokens).block_until_ready()
print(json.dumps(dict(before=before, built=built, traces=len(traces))))
"""


@pytest.mark.parametrize("implementation,loads", [("pallas", True), ("chunked", False)])
def test_a_model_imports_the_kernels_when_built_and_traces_once(implementation, loads):
  """In a fresh process (pytest has imported the kernels already): building a model that will
  run a kernel imports kernels_pallas, so its jitted forward is traced once, not again at its
  second call (under jax 0.11 the lazy import inside the first trace made it trace twice)."""
  out = fresh_process_json(_PROBE, implementation, JAX_PLATFORMS="cpu")
  assert out == dict(before=False, built=loads, traces=1), out
