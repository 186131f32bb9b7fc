"""kernels_pallas.path_decode_step, PaTH's decode step over its key cache in one pass, against
the XLA form it replaces (transport_decode.transport_and_logits), in the Pallas interpreter;
its Triton and Mosaic TPU lowerings; and a PaTH model decoding on it."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import kernels_pallas as kp
from posenc_jax import kv_cache
from posenc_jax.encodings.transport_decode import transport_and_logits
from tests.util import assert_rel_rms

SD = jax.ShapeDtypeStruct


def _inputs(key, B, K, G, D, S):
  kq, kw, kb, kk = jax.random.split(key, 4)
  q = jax.random.normal(kq, (B, 1, K * G, D), jnp.float32)
  w = jax.random.normal(kw, (B, K, D), jnp.float32)
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  beta = 2 * jax.nn.sigmoid(jax.random.normal(kb, (B, K)))   # PaTH's beta in (0, 2)
  return q, w, beta, jax.random.normal(kk, (B, K, S, D), jnp.float32)


@pytest.mark.parametrize("G,S,block_s", [(1, 64, 16), (3, 40, None), (2, 1024, None)])
def test_kernel_matches_the_xla_step(G, S, block_s, key):
  """Logits and transported keys, with one query head per kv head, three (padded to four
  rows) and two; a tile that divides S (40: tiles of 8) and several tiles per row."""
  B, K, D = 2, 2, 16
  q, w, beta, k = _inputs(key, B, K, G, D, S)
  want_keys, want_logits = transport_and_logits(q, k, w, beta, D ** -0.5)
  logits, keys = kp.path_decode_step(q[:, 0].reshape(B, K, G, D), w, beta, k,
                                     scale=D ** -0.5, block_s=block_s, backend="interpret")
  assert logits.shape == (B, K, G, S) and keys.shape == k.shape
  assert_rel_rms(logits.reshape(B, K * G, S), want_logits, 1e-6, "logits")
  assert_rel_rms(keys, want_keys, 1e-6, "keys")


def test_kernel_writes_the_new_key_at_each_rows_slot(key):
  """With k_new and end the pass also writes each row's new key at its own slot (the XLA step
  scatters it after the update): keys equal write_token(transported keys)."""
  B, K, G, D, S = 3, 2, 2, 16, 32
  q, w, beta, k = _inputs(key, B, K, G, D, S)
  k_new = jax.random.normal(jax.random.fold_in(key, 1), (B, 1, K, D), jnp.bfloat16)
  end = jnp.array([0, 17, 31], jnp.int32)           # first slot, inside a later tile, last slot
  moved, want_logits = transport_and_logits(q, k, w, beta, D ** -0.5)
  want_keys = kv_cache.write_token(moved, k_new, kv_cache.Slots(start=jnp.zeros_like(end),
                                                                end=end))
  logits, keys = kp.path_decode_step(q[:, 0].reshape(B, K, G, D), w, beta, k, scale=D ** -0.5,
                                     k_new=k_new[:, 0], end=end, block_s=8,
                                     backend="interpret")
  assert_rel_rms(logits.reshape(B, K * G, S), want_logits, 1e-6, "logits")
  np.testing.assert_array_equal(keys[np.arange(B), :, end], k_new[:, 0].astype(jnp.float32))
  assert_rel_rms(keys, want_keys, 1e-6, "keys")


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_kernel_lowers(backend):
  """The 134M model's layer at batch 8 and an 8192-slot cache with the new key written in the
  pass, one query head per kv head (Triton for cuda), and grouped heads (Mosaic TPU, exported
  on this host)."""
  G = 1 if backend == "gpu" else 2
  args = (SD((8, 12, G, 64), jnp.bfloat16), SD((8, 12, 64), jnp.float32),
          SD((8, 12), jnp.float32), SD((8, 12, 8192, 64), jnp.float32),
          SD((8, 12, 64), jnp.bfloat16), SD((8,), jnp.int32))
  f = jax.jit(lambda q, w, b, k, kn, e: kp.path_decode_step(q, w, b, k, scale=0.125, k_new=kn,
                                                            end=e, backend=backend))
  if backend == "gpu":
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
  else:
    text = export.export(f, platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in text


def test_errors_name_the_argument():
  q, w, beta, k = (jnp.zeros((1, 1, 1, 16)), jnp.zeros((1, 1, 16)), jnp.zeros((1, 1)),
                   jnp.zeros((1, 1, 12, 16)))
  with pytest.raises(ValueError, match="power-of-two tile"):
    kp.path_decode_step(q, w, beta, k, scale=1.0, backend="interpret")
  with pytest.raises(ValueError, match="k must be float32"):
    kp.path_decode_step(q, w, beta, k[:, :, :8].astype(jnp.bfloat16), scale=1.0)
  with pytest.raises(ValueError, match="k_new and end come together"):
    kp.path_decode_step(q, w, beta, k[:, :, :8], scale=1.0, k_new=w)
  with pytest.raises(ValueError, match="block_s=24"):
    kp.path_decode_step(q, w, beta, jnp.zeros((1, 1, 48, 16)), scale=1.0, block_s=24)


@pytest.mark.parametrize("name", ["path", "path_fox"])
def test_a_model_decodes_on_the_kernel_as_on_xla(name, key):
  """Teacher-forced decoding of a perturbed 1-layer model (grouped heads): the model with
  implementation='pallas' (the kernel's step) gives the logits and cache of the XLA step."""
  from tests.test_generation import perturbed_model
  k_model, k_tok = jax.random.split(key)
  model = perturbed_model(k_model, name, num_layers=1)
  B, P, steps = 2, 3, 5
  tokens = np.asarray(jax.random.randint(k_tok, (B, P + steps), 0, 13))
  _, cache = model.prefill(jnp.asarray(tokens[:, :P]), lengths_B=np.full((B,), P),
                           padding="right", cache=model.init_cache(B, 16))
  xla_cache, kernel_cache = cache, cache
  for i in range(steps):
    t = jnp.asarray(tokens[:, P + i])
    want, xla_cache = model.decode(t, cache=xla_cache)
    for block in model.blocks:
      block.attn.cfg = dataclasses.replace(block.attn.cfg, implementation="pallas")
    got, kernel_cache = model.decode(t, cache=kernel_cache)
    for block in model.blocks:
      block.attn.cfg = dataclasses.replace(block.attn.cfg, implementation=None)
    assert_rel_rms(got, want, 1e-6, f"logits, step {i}")
  assert_rel_rms(kernel_cache["layers"][0]["enc"]["k"], xla_cache["layers"][0]["enc"]["k"],
                 1e-6, "cached keys")
