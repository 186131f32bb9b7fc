"""Stick-breaking attention: the dense oracle against a per-query loop of the stick-breaking
product, the blockwise form against the oracle (forward and gradients), properties of the
weights, bfloat16 inputs, gradient memory, and decoding with a cache."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import attention
from posenc_jax import encodings
from posenc_jax import kv_cache
from posenc_jax import stick_breaking as sb
from tests.util import assert_rel_rms
from tests.util import assert_trees_rel_rms
from tests.util import in_float64
from tests.util import value_and_grads

jax.config.update("jax_default_matmul_precision", "highest")

OPTIONS = [(False, "current"), (False, "none"), (True, "current"), (True, "none")]


def _inputs(key, B=2, T=37, H=4, K=2, D=8, Dv=6, q_scale=2.0):
  kq, kk, kv = jax.random.split(key, 3)
  return (q_scale * jax.random.normal(kq, (B, T, H, D)), jax.random.normal(kk, (B, T, K, D)),
          jax.random.normal(kv, (B, T, K, Dv)))


def _packed(key, B, T):
  """2-4 documents per row at random cuts."""
  return jnp.cumsum(jax.random.uniform(key, (B, T)) < 3.0 / T, axis=1).astype(jnp.int32)


def _loop_oracle(q, k, v, *, segment_ids, attend_current, remainder):
  """Per (b, h, i): walk the visible keys from the nearest, each taking sigmoid(z) of the stick
  left, in float64 numpy; the leftover is 1 - (sum of the weights)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  B, T, H, D = q.shape
  G = H // k.shape[2]
  seg = np.asarray(segment_ids)
  out = np.zeros((B, T, H, v.shape[-1]))
  for b in range(B):
    for h in range(H):
      for i in range(T):
        stick, taken = 1.0, 0.0
        for j in range(i if attend_current else i - 1, -1, -1):
          if seg[b, j] != seg[b, i]:
            continue
          beta = 1.0 / (1.0 + math.exp(-(q[b, i, h] @ k[b, j, h // G]) / math.sqrt(D)))
          out[b, i, h] += stick * beta * v[b, j, h // G]
          taken += stick * beta
          stick *= 1.0 - beta
        if remainder == "current":
          out[b, i, h] += (1.0 - taken) * v[b, i, h // G]
  return out


@pytest.mark.parametrize("attend_current,remainder", OPTIONS)
def test_reference_matches_per_query_loop(key, attend_current, remainder):
  """The log-space dense form (suffix sums of log_sigmoid, r = exp(sum)) is the product form
  (running stick, r = 1 - sum A), both in float64; GQA, two documents in one row."""
  q, k, v = _inputs(key, B=2, T=9, H=4, K=2, D=6, Dv=5)
  seg = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1], [3, 3, 3, 3, 3, 3, 3, 3, 3]])
  kw = dict(segment_ids=seg, attend_current=attend_current, remainder=remainder)
  got = in_float64(lambda q, k, v: sb.stick_breaking_attention_reference(q, k, v, **kw), q, k, v)
  assert_rel_rms(got, _loop_oracle(q, k, v, **kw), 1e-12)


@pytest.mark.parametrize("attend_current,remainder,parallel",
                         [(False, "current", False), (True, "none", True)])
def test_chunked_matches_reference(key, attend_current, remainder, parallel):
  """Forward and the gradients of q, k, v against the oracle run in float64; GQA (H=4, K=2),
  packed documents, T=37 with tiles of 16 (a ragged last block); query blocks one by one
  (parallel=False) or all at once."""
  k1, k2, k3 = jax.random.split(key, 3)
  q, k, v = _inputs(k1)
  seg = _packed(k2, 2, 37)
  cot = jax.random.normal(k3, (2, 37, 4, 6))
  kw = dict(segment_ids=seg, attend_current=attend_current, remainder=remainder)
  with_grads = lambda f: value_and_grads(f, lambda o: jnp.sum(o * cot), (0, 1, 2))  # noqa: E731
  want, want_g = in_float64(with_grads(functools.partial(sb.stick_breaking_attention_reference,
                                                         **kw)), q, k, v)
  out, g = with_grads(functools.partial(sb.stick_breaking_attention_chunked, block_size=16,
                                        parallel=parallel, **kw))(q, k, v)
  assert_rel_rms(out, want, 1e-5, "forward")
  assert_trees_rel_rms(g, want_g, 1e-5, "grads (q, k, v)")


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_saturated_logits_give_the_nearest_visible_value(key, impl):
  """With every z large the nearest visible key takes the whole stick: o_i = v_{i-1} inside a
  document; a document's first token has no key, so its stick is left whole (v_i with
  remainder="current", 0 with "none"); attend_current=True makes the token itself the nearest."""
  T, cut = 11, 4
  v = jax.random.normal(key, (1, T, 1, 3))
  q = jnp.full((1, T, 2, 4), 6.0)                       # z = 6 * 6 * 4 / 2 = 72 everywhere
  k = jnp.full((1, T, 1, 4), 6.0)
  seg = (jnp.arange(T) >= cut).astype(jnp.int32)[None]
  fn = jax.jit(functools.partial(attention.stick_breaking_attention, segment_ids=seg,
                                 implementation=impl), static_argnames=("attend_current",
                                                                        "remainder"))
  v1 = np.asarray(v[0, :, 0])
  prev = np.concatenate([v1[:1], v1[:-1]])                # v_{i-1}
  first = np.isin(np.arange(T), [0, cut])[:, None]
  want = {("current", False): np.where(first, v1, prev),
          ("none", False): np.where(first, 0.0, prev),
          ("none", True): v1}
  for (remainder, current), w in want.items():
    o = np.asarray(fn(q, k, v, attend_current=current, remainder=remainder))[0]
    for h in range(2):
      np.testing.assert_allclose(o[:, h], w, rtol=1e-6, atol=1e-6,
                                 err_msg=f"remainder={remainder}, attend_current={current}")


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_the_stick_is_conserved(key, impl):
  """With every value 1, sum_j A_ij + r_i = 1 for every query: the weights and the leftover
  share exactly one stick (r_i is computed as exp(sum log_sigmoid(-z)), not as 1 - sum A)."""
  q, k, _ = _inputs(key, B=1, T=40, H=2, K=1, D=8, q_scale=3.0)
  ones = jnp.ones((1, 40, 1, 2))
  seg = _packed(key, 1, 40)
  o = jax.jit(functools.partial(attention.stick_breaking_attention, segment_ids=seg,
                                implementation=impl))(q, k, ones)
  np.testing.assert_allclose(np.asarray(o), 1.0, rtol=0, atol=2e-6)


def test_bfloat16_inputs_with_large_logits(key):
  """bf16 q, k, v with logits of standard deviation ~8 (|z| up to ~40, where sigmoid saturates
  in float32): the chunked output and gradients are finite and match the float64 oracle on
  the same rounded inputs to bf16 precision (measured: 1.4e-3 forward, <= 2.6e-3 gradients)."""
  q, k, v = _inputs(key, B=1, T=150, H=2, K=1, D=16, Dv=8, q_scale=8.0)
  q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
  seg = _packed(key, 1, 150)
  loss = lambda o: jnp.sum(o.astype(jnp.float32) ** 2)  # noqa: E731
  f = functools.partial(sb.stick_breaking_attention_chunked, segment_ids=seg, block_size=64)
  out, g = value_and_grads(f, loss, (0, 1, 2))(q, k, v)
  assert out.dtype == jnp.bfloat16 and all(x.dtype == jnp.bfloat16 for x in g)
  # The oracle on the same rounded values, upcast here: in_float64 leaves bfloat16 arrays as
  # they are (numpy does not count bfloat16 as a floating type).
  want, want_g = in_float64(value_and_grads(functools.partial(
      sb.stick_breaking_attention_reference, segment_ids=seg), loss, (0, 1, 2)),
      *(a.astype(jnp.float32) for a in (q, k, v)))
  assert_rel_rms(out, want, 1e-2, "forward")
  assert_trees_rel_rms(g, want_g, 2e-2, "grads")


def test_chunked_gradient_memory_is_subquadratic():
  """4x the length costs well under 16x the temporary memory: the steps are rematerialised."""
  def temp_bytes(T):
    x = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
    seg = jnp.ones((1, T), jnp.int32)
    fn = lambda q, k, v: jnp.sum(attention.stick_breaking_attention(  # noqa: E731
        q, k, v, segment_ids=seg, implementation="chunked"))
    grad = jax.jit(jax.grad(fn, argnums=(0, 1, 2)))
    return grad.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes
  small, large = temp_bytes(256), temp_bytes(1024)
  assert large / small < 6, f"temp {small} -> {large} bytes ({large / small:.1f}x)"


@pytest.mark.parametrize("padding", ["left", "right"])
def test_prefill_then_decode_matches_the_full_forward(key, padding):
  """The cache decoder with attend_current=True, remainder="none" (tests/test_generation.py
  runs the defaults through the model): ragged prompts, GQA, one token per step."""
  enc = encodings.get("sba", attend_current=True, remainder="none")
  B, T, P, S, H, K, D, C = 3, 9, 5, 12, 4, 2, 8, 8
  dims = encodings.Dims(d_model=C, num_heads=H, num_kv_heads=K, head_dim=D)
  kx, kq = jax.random.split(key)
  x = jax.random.normal(kx, (B, T, C))
  q, k, v = _inputs(kq, B=B, T=T, H=H, K=K, D=D, Dv=D)
  # Jitted: one compile each instead of eager op-by-op dispatch (CI time).
  full = jax.jit(lambda x, q, k, v: enc.apply(
      {}, x=x, q=q, k=k, v=v, positions=jnp.broadcast_to(jnp.arange(T), (B, T)), tokens=None,
      rng=None, train=False, implementation="reference"))(x, q, k, v)
  lengths = np.array([1, 5, 3])
  slots = kv_cache.prompt_slots(lengths, P, padding=padding)
  start = np.asarray(slots.start)
  # Prompt arrays: row b's tokens 0..n-1 in slots [start, start + n); padding is segment 0.
  src = np.clip(np.arange(P)[None] - start[:, None], 0, None)
  take = lambda a: jnp.take_along_axis(a, jnp.asarray(src).reshape(B, P, *[1] * (a.ndim - 2)),
                                       axis=1)  # noqa: E731
  seg = jnp.asarray(kv_cache.prompt_mask(slots, P), jnp.int32)
  cache = enc.init_cache(dims, batch_size=B, max_len=S, dtype=jnp.float32)
  o_p, cache = jax.jit(lambda cache, slots, seg, x, q, k, v: enc.prefill(
      {}, cache, slots=slots, segment_ids=seg, x=x, q=q, k=k, v=v, positions=jnp.asarray(src),
      tokens=None, rng=None, train=False, implementation="reference"))(
          cache, slots, seg, take(x), take(q), take(k), take(v))
  for b, n in enumerate(lengths):
    assert_rel_rms(o_p[b, start[b]:start[b] + n], full[b, :n], 1e-5, f"prefill, row {b}")
  rows = np.arange(B)
  decode = jax.jit(lambda cache, slots, x, q, k, v: enc.decode({}, cache, slots=slots, x=x, q=q,
                                                               k=k, v=v, tokens=None))
  for i in range(T - lengths.max()):
    t = lengths + i
    one = lambda a: a[rows, t][:, None]  # noqa: E731
    o, cache = decode(cache, slots, one(x), one(q), one(k), one(v))
    assert_rel_rms(o[:, 0], full[rows, t], 1e-5, f"decode step {i}")
    slots = kv_cache.Slots(slots.start, slots.end + 1)


def test_bad_options_name_the_field():
  with pytest.raises(ValueError, match=r"^remainder='value' must be one of \('current', 'none'\)"):
    encodings.get("sba", remainder="value").prepare({}, x=None, q=None, k=None, v=None)
  with pytest.raises(ValueError, match=r"unknown hyperparameters \['attend_self'\] for encoding"):
    encodings.get("sba", attend_self=True).init(None, None)
  q = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match=r"^attend_current=1 must be True or False"):
    attention.stick_breaking_attention(q, q, q, attend_current=1)
