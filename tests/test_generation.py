"""Decoding with a cache: prefill + token-by-token decoding == the full forward, for every encoding.

The oracle is the model's own full-sequence forward (the teacher-forced logits every other test
holds to the dense references). Parameters are perturbed away from their initialisation, where
several encodings start as RoPE or ALiBi (zero bases, zero gate weights), so each encoding's
own state is exercised.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posenc_jax import encodings
from posenc_jax import generation
from posenc_jax import kv_cache
from posenc_jax import model as model_lib
from posenc_jax import sampling
from tests.util import assert_rel_rms
from tests.util import fresh_process_json

STANDALONE = [n for n in encodings.NAMES if n not in encodings.MODIFIERS]
V, B, P, T = 13, 3, 6, 11
# Each encoding runs one (padding, kv_shift) combination; consecutive names cycle through all four.
COMBOS = [("right", False), ("left", True), ("right", True), ("left", False)]
# CI runs one encoding per decoder and per kind of state (position-driven rotations through
# rope_llama3, value transport, each accumulated phase, gates, GRAPE-A, GRAPE-AP, PaTH, TAPA);
# the others share a decoder with one of them (e.g. every position-driven rotation decodes as
# rope_llama3 does) and run under -m slow, where every name of NAMES is held to the forward.
SLOW = {"nope", "rope", "rope_pi", "rope_ntk", "rope_yarn", "grape_m", "grape_m_rank2",
        "grape_m_noncommuting", "rope_v", "acc_rot_random", "acc_rot_learned_v", "alibi",
        "grape_a_q", "grape_a_k", "tapa_linear"}
_FAST = [n for n in STANDALONE if n not in SLOW]
CASES = ([pytest.param(n, *COMBOS[i % 4]) for i, n in enumerate(_FAST)] +
         [pytest.param(n, *COMBOS[i % 4], marks=pytest.mark.slow)
          for i, n in enumerate(sorted(SLOW, key=STANDALONE.index))])


def perturbed_model(key, encoding, **kw):
  """A 2-layer float32 model whose every parameter is moved off its initial value."""
  kw = {"num_layers": 2, "d_model": 32, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, **kw}
  cfg = model_lib.ModelConfig(vocab_size=V, encoding=encoding, **kw)
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(params=key))
  state = nnx.state(model, nnx.Param)
  # numpy noise: no per-shape random kernels to compile (CI time is compile time here)
  rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
  noisy = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32),
                       nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, noisy)
  nnx.update(model, state)
  return model


def _prompt_batch(tokens_BT, lengths, padding):
  rows = [np.asarray(tokens_BT[b, :n]).tolist() for b, n in enumerate(lengths)]
  return generation.pad_prompts(rows, padding=padding)


@pytest.mark.parametrize("name,padding,kv_shift", CASES)
def test_prefill_then_decode_matches_full_forward(name, padding, kv_shift, key):
  """Ragged prompts (one of length 1), then teacher-forced decoding of the true next tokens."""
  _check_decode(key, name, padding, kv_shift)


@pytest.mark.parametrize("name", ["tapa", "tapa_linear"])
def test_tapa_phase_scale_decodes_as_the_forward(name, key):
  """phase_scale scales the phase channels where the encoding prepares q and k (the linear
  phase's k too), so the cached keys carry it: decoding still equals the forward."""
  _check_decode(key, name, "left", False, encoding_kwargs={"phase_scale": 0.3})


def _check_decode(key, name, padding, kv_shift, **model_kw):
  k_model, k_tok, k_len = jax.random.split(key, 3)
  model = perturbed_model(k_model, name, kv_shift=kv_shift, num_layers=1, **model_kw)
  tokens = jax.random.randint(k_tok, (B, T), 0, V)
  lengths = np.asarray(jax.random.randint(k_len, (B,), 1, P + 1)).copy()
  lengths[0] = 1
  prompt, lengths = _prompt_batch(tokens, lengths, padding)
  Pmax = prompt.shape[1]
  steps = T - int(lengths.max())

  # The forwards run jitted (eagerly every lax.scan inside recompiles), the decode steps
  # eagerly: their kernels are shared by every case of the suite (CI time is compile time).
  full = jax.jit(model)(tokens)
  logits, cache = jax.jit(lambda p, n: model.prefill(
      p, lengths_B=n, padding=padding, cache=model.init_cache(B, Pmax + steps + 2)))(
          prompt, lengths)
  last = jnp.take_along_axis(logits, (cache["end"] - 1)[:, None, None], axis=1)[:, 0]
  decoded = []
  for i in range(steps):
    step_logits, cache = model.decode(jnp.asarray(tokens)[np.arange(B), lengths + i], cache=cache)
    decoded.append(step_logits)
  decoded = jnp.stack(decoded, axis=1)
  rows = np.arange(B)
  assert_rel_rms(last, full[rows, lengths - 1], 1e-5, "prefill, last prompt token")
  for b, n in enumerate(lengths):
    at = slice(0, n) if padding == "right" else slice(Pmax - n, Pmax)
    assert_rel_rms(logits[b, at], full[b, :n], 1e-5, f"prefill, row {b}")
  want = np.stack([np.asarray(full[b, n:n + steps]) for b, n in enumerate(lengths)])
  assert_rel_rms(decoded, want, 1e-5, "decoded")


def test_greedy_generation_is_the_argmax_of_the_full_forward(key):
  """The compiled loop (ragged, left-padded) picks what re-running the whole sequence picks;
  sampling parameters do not recompile; an eos row stops and is padded with eos."""
  model = perturbed_model(key, "path_fox")
  prompts = [[1, 2, 3, 4], [7], [5, 0, 9]]
  N = 5
  gen = generation.Generator(model, max_len=8)
  tokens, lengths = generation.pad_prompts(prompts, padding="left")
  out = gen.generate(tokens, lengths, max_new_tokens=N, padding="left")
  forward = jax.jit(model)  # causal: right padding to one width leaves logits at len-1 alone
  width = max(map(len, prompts)) + N
  want = []
  for p in prompts:
    seq = list(p)
    for _ in range(N):
      logits = forward(jnp.asarray([seq + [0] * (width - len(seq))]))
      seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    want.append(seq[len(p):])
  np.testing.assert_array_equal(out.tokens, want)
  assert out.compile_s > 0 and out.decode_steps == N
  again = gen.generate(tokens, lengths, max_new_tokens=N, padding="left")
  np.testing.assert_array_equal(again.tokens, out.tokens)          # greedy is deterministic
  a = gen.generate(tokens, lengths, max_new_tokens=N, padding="left", temperature=2.0, seed=1)
  b = gen.generate(tokens, lengths, max_new_tokens=N, padding="left", temperature=2.0, top_k=4,
                   top_p=0.9, seed=1)
  assert a.compile_s == 0 and b.compile_s == 0                     # traced sampling parameters
  np.testing.assert_array_equal(
      gen.generate(tokens, lengths, max_new_tokens=N, padding="left", temperature=2.0,
                   seed=1).tokens, a.tokens)
  eos = int(out.tokens[1, 1])
  stopped = gen.generate(tokens, lengths, max_new_tokens=N, padding="left", eos_id=eos)
  first = [row.index(eos) if eos in row else N - 1 for row in want]
  for r, f in enumerate(first):
    np.testing.assert_array_equal(stopped.tokens[r, :f + 1], want[r][:f + 1])
    assert (stopped.tokens[r, f + 1:] == eos).all() and stopped.lengths[r] == min(f + 1, N)


def test_generation_rejects_what_does_not_fit(key):
  model = perturbed_model(key, "rope", num_layers=1)
  gen = generation.Generator(model, max_len=6)
  tokens, lengths = generation.pad_prompts([[1, 2, 3, 4]])
  with pytest.raises(ValueError, match="max_new_tokens=4 does not fit"):
    gen.generate(tokens, lengths, max_new_tokens=4)
  with pytest.raises(ValueError, match="longer than max_len=6"):
    gen.generate(*generation.pad_prompts([list(range(7))]), max_new_tokens=1)
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    generation.pad_prompts([[1], []])
  with pytest.raises(ValueError, match="top_p"):
    gen.generate(tokens, lengths, max_new_tokens=1, temperature=1.0, top_p=1.5)


def _filtered_probs(logits, temperature, top_k, top_p):
  """Plain numpy oracle of sampling.filter_logits' distribution (one row)."""
  z = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-z, kind="stable")
  keep = np.zeros(z.shape, bool)
  allowed = order[:top_k] if top_k else order
  p = np.exp(z[allowed] - z[allowed].max())
  p /= p.sum()
  mass = 0.0
  for tok, pt in zip(allowed, p):
    if mass >= top_p:
      break
    keep[tok] = True
    mass += pt
  q = np.where(keep, np.exp(z - z.max()), 0.0)
  return q / q.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6),
                                                      (1.0, 4, 0.8)])
def test_sampling_matches_the_filtered_distribution(temperature, top_k, top_p, key):
  k1, k2 = jax.random.split(key)
  logits = 2.0 * jax.random.normal(k1, (9,))
  want = _filtered_probs(logits, temperature, top_k, top_p)
  f = sampling.filter_logits(logits[None], temperature=temperature, top_k=top_k, top_p=top_p)
  np.testing.assert_allclose(np.asarray(jax.nn.softmax(f[0])), want, atol=1e-6)
  n = 20000
  draws = sampling.sample(jnp.broadcast_to(logits, (n, 9)), k2, temperature=temperature,
                          top_k=top_k, top_p=top_p)
  freq = np.bincount(np.asarray(draws), minlength=9) / n
  assert (freq[want == 0] == 0).all(), "a filtered-out token was drawn"
  np.testing.assert_allclose(freq, want, atol=5 * np.sqrt(0.25 / n))   # 5 sigma


def test_greedy_ignores_the_key_and_filters():
  logits = jnp.asarray([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
  for seed in range(3):
    tok = sampling.sample(logits, jax.random.key(seed), temperature=0.0, top_k=2, top_p=0.1)
    np.testing.assert_array_equal(tok, [1, 0])


@pytest.mark.parametrize("kw,field", [(dict(temperature=-0.5), "temperature"),
                                      (dict(temperature=float("nan")), "temperature"),
                                      (dict(top_k=-1), "top_k"), (dict(top_k=1.5), "top_k"),
                                      (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p")])
def test_sampling_parameters_out_of_range_name_the_field(kw, field):
  args = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **kw}
  with pytest.raises(ValueError, match=f"^{field}="):
    sampling.check(**args)


def test_sum_after_and_per_row_writes_against_loops(key):
  x = jax.random.normal(key, (2, 3, 7))                                # [B, N, S]
  slots = kv_cache.Slots(jnp.asarray([1, 0]), jnp.asarray([4, 6]))
  mask = kv_cache.visible(slots, 7)
  got = np.asarray(kv_cache.sum_after(x, mask, axis=2))
  xs, m = np.asarray(x), np.asarray(mask)
  for b in range(2):
    for j in range(7):
      np.testing.assert_allclose(got[b, :, j], (xs[b, :, j + 1:] * m[b, j + 1:]).sum(-1),
                                 atol=1e-6)
  np.testing.assert_allclose(np.asarray(kv_cache.sum_after(jnp.swapaxes(x, 1, 2), mask, axis=1)),
                             np.swapaxes(got, 1, 2), atol=1e-6)
  token = jax.random.normal(key, (2, 1, 3))                            # [B, 1, N]
  cache = kv_cache.write_token(jnp.zeros((2, 3, 7)), token, slots)
  want = np.zeros((2, 3, 7))
  want[0, :, 4], want[1, :, 6] = np.asarray(token[0, 0]), np.asarray(token[1, 0])
  np.testing.assert_array_equal(np.asarray(cache), want)


_IN_PLACE_PROBE = """
import json, sys
import jax, numpy as np
from flax import nnx
from posenc_jax import generation, model as model_lib
cfg = model_lib.ModelConfig(vocab_size=13, encoding=sys.argv[1], num_layers=1, d_model=32,
                            num_heads=4, head_dim=8)
model = model_lib.Transformer(cfg, rngs=nnx.Rngs(params=0))
tokens, lengths = generation.pad_prompts([[1, 2, 3], [4, 5, 6]])
out = {"temps": [], "tokens": []}
for options in (None, {}):
  gen = generation.Generator(model, max_len=4096, compiler_options=options)
  out["tokens"].append(gen.generate(tokens, lengths, max_new_tokens=3).tokens.tolist())
  out["temps"].append(gen.memory_analysis("decode").temp_size_in_bytes)
out["cache"] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
    jax.eval_shape(lambda: model.init_cache(2, 4096))))
print(json.dumps(out))
"""


@pytest.mark.parametrize("encoding", ["rope", "path"])
def test_the_decode_loop_updates_its_cache_in_place(encoding):
  """With the backend's REGION_ANALYSIS the compiled loop needs no copy of the cache (XLA's
  temporaries are a small part of it); XLA's defaults copy it (this test's witness that the
  option is what does it). Same tokens either way. In a subprocess with XLA's default flags:
  the CPU code generation conftest picks for speed (--xla_cpu_use_fusion_emitters=false)
  copies the cache whatever copy insertion does."""
  out = fresh_process_json(_IN_PLACE_PROBE, encoding, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  temps, cache_bytes = out["temps"], out["cache"]
  assert out["tokens"][0] == out["tokens"][1]
  assert temps[0] < cache_bytes / 4 < temps[1], (temps, cache_bytes)
