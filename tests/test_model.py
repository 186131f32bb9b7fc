"""The transformer's wiring: causality, packed-segment isolation, GQA, dtypes, dropout."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posenc_jax import model as model_lib
from tests.util import assert_rel_rms

V = 17


def _model(key, encoding="rope", **kw):
  kw = {"num_layers": 2, "d_model": 16, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, **kw}
  cfg = model_lib.ModelConfig(vocab_size=V, encoding=encoding, **kw)
  return model_lib.Transformer(cfg, rngs=nnx.Rngs(params=key))


def _tokens(key, B=2, T=13):
  return jax.random.randint(key, (B, T), 0, V)


# Model calls and gradients run jitted: one compile each instead of eager op-by-op dispatch,
# whose per-op compiles (and every eager lax.scan's) were most of this file's CI time.
_forward = nnx.jit(lambda model, tokens, **kw: model(tokens, **kw))


# Encodings whose state accumulates along the sequence (forget gates, contextual phases,
# token-dependent angles, Householder transport) plus the kv_shift modifier: the ones where
# a wiring mistake would leak across time or across packed documents.
CAUSAL_CASES = [("rope", False), ("fox", False), ("grape_m_ctx", False),
                ("acc_rot_learned_v", False), ("path", False), ("path_fox", False),
                ("rope", True)]


@pytest.mark.parametrize("encoding,kv_shift", CAUSAL_CASES)
def test_future_tokens_do_not_change_past_logits(encoding, kv_shift, key):
  k1, k2, k3 = jax.random.split(key, 3)
  model = _model(k1, encoding, kv_shift=kv_shift, block="acc_rot")
  tok = _tokens(k2)
  t = 6
  changed = tok.at[:, t + 1:].set((tok[:, t + 1:] + jax.random.randint(k3, (), 1, V)) % V)
  a, b = _forward(model, tok), _forward(model, changed)
  np.testing.assert_allclose(a[:, :t + 1], b[:, :t + 1], rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(a[:, t + 1:] - b[:, t + 1:])).max() > 1e-3  # the future did change


@pytest.mark.parametrize("encoding,kv_shift", CAUSAL_CASES)
def test_packed_documents_are_isolated(encoding, kv_shift, key):
  """Doc 2 packed after doc 1 (positions restarting) == doc 2 alone."""
  k1, k2 = jax.random.split(key)
  model = _model(k1, encoding, kv_shift=kv_shift)
  tok = _tokens(k2, B=1, T=13)
  split = 5
  seg = jnp.where(jnp.arange(13) < split, 1, 2)[None]
  pos = jnp.where(seg == 1, jnp.arange(13), jnp.arange(13) - split)
  packed = _forward(model, tok, positions_BT=pos, segment_ids_BT=seg)
  alone = _forward(model, tok[:, split:])
  assert_rel_rms(packed[:, split:], alone, 1e-5, "packed doc 2")
  assert_rel_rms(packed[:, :split], _forward(model, tok[:, :split]), 1e-5, "packed doc 1")


def test_grouped_query_attention_equals_repeated_kv_heads(key):
  """K=1 kv head == K=H kv heads whose k/v projections are copies of the one."""
  k1, k2 = jax.random.split(key)
  gqa = _model(k1, "rope", num_kv_heads=1)
  mha = _model(k1, "rope", num_kv_heads=4)
  params = nnx.to_pure_dict(nnx.state(gqa, nnx.Param))
  for blk in params["blocks"].values():
    for proj in ("k_proj", "v_proj"):
      blk["attn"][proj]["kernel"] = jnp.tile(blk["attn"][proj]["kernel"], (1, 4))
  state = nnx.state(mha, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(mha, state)
  tok = _tokens(k2)
  assert_rel_rms(_forward(mha, tok), _forward(gqa, tok), 1e-5, "logits")


@pytest.mark.parametrize("block", ["llama", "acc_rot"])
def test_bfloat16_compute_tracks_float32(block, key):
  k1, k2 = jax.random.split(key)
  f32 = _model(k1, "rope", block=block, qk_norm=block == "llama")
  bf16 = _model(k1, "rope", block=block, qk_norm=block == "llama", dtype="bfloat16")
  tok = _tokens(k2)
  out = _forward(bf16, tok)
  assert out.dtype == jnp.float32
  assert_rel_rms(out, _forward(f32, tok), 3e-2, "bf16 logits")


def test_dropout_only_in_training_and_keyed_by_rngs(key):
  k1, k2 = jax.random.split(key)
  model = _model(k1, "rope", block="acc_rot", dropout=0.3)
  tok = _tokens(k2)
  rngs = lambda s: nnx.Rngs(dropout=s, encoding=s + 1)
  eval_a, eval_b = model(tok), model(tok, rngs=rngs(1))
  np.testing.assert_array_equal(eval_a, eval_b)
  train_1, train_1b, train_2 = (model(tok, rngs=rngs(s), train=True) for s in (1, 1, 2))
  np.testing.assert_array_equal(train_1, train_1b)
  assert not np.allclose(train_1, train_2)
  assert not np.allclose(train_1, eval_a)


def test_tied_embeddings_share_the_table(key):
  k1, k2 = jax.random.split(key)
  model = _model(k1, "nope", tie_embeddings=True)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert "head" not in params
  tok = _tokens(k2) % 3  # token 3 never appears in the input...
  grads = nnx.to_pure_dict(nnx.jit(nnx.grad(lambda m: m(tok)[:, -1, 3].sum()))(model))
  # ...so its embedding row gets gradient only as the output row of logit 3.
  assert np.abs(np.asarray(grads["embed"]["embedding"][3])).sum() > 0
  assert np.abs(np.asarray(grads["embed"]["embedding"][4])).sum() == 0


def test_bad_model_config_raises(key):
  with pytest.raises(ValueError, match="model.block"):
    _model(key, "rope", block="gpt2")


@pytest.mark.parametrize("encoding,kv_shift", [("rope", False), ("path", False),
                                               ("acc_rot_learned", False), ("fox", True),
                                               ("acc_rot_random", False)])
def test_scanned_layers_match_the_loop(encoding, kv_shift, key):
  """scan_layers=True is the same function of the same parameters, forward and gradients
  (acc_rot_random: each layer's evaluation angles from its index, traced under the scan).

  Gradients are compared per module (all of one module's parameters as one vector): float32
  bounds a gradient's error relative to the norm of what it sums, not per entry. PaTH's
  beta_b, two entries each a sum over tokens that mostly cancels (RMS 0.01 against beta_u's
  0.15), differed by 1.9e-5 of its own RMS at POSENC_TEST_SEED=330464051; its module's
  error was 7e-7. A wiring mistake stays visible: layer 1 reading layer 0's beta_b is 2.5e-2
  to 6.9e-2 in this measure (seeds 0, 1, 330464051).
  """
  k1, k2 = jax.random.split(key)
  kw = dict(num_layers=3, kv_shift=kv_shift, qk_norm=True)
  loop, scanned = (_model(k1, encoding, scan_layers=s, **kw) for s in (False, True))
  tok = _tokens(k2)

  def loss(m):
    logits = m(tok)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0]), logits

  # The logits and the gradients from one compile of each model.
  (_, logits_loop), g_loop = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(loop)
  (_, logits_scan), g_scan = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(scanned)
  assert_rel_rms(logits_scan, logits_loop, 1e-5, "logits")
  g_loop, g_scan = nnx.to_pure_dict(g_loop), nnx.to_pure_dict(g_scan)
  modules = {}
  for path, g in jax.tree_util.tree_leaves_with_path(g_loop):
    got = g_scan
    for p in path:
      got = got[p.key]
    pair = modules.setdefault(jax.tree_util.keystr(path[:-1]), ([], []))
    pair[0].append(jnp.ravel(got))
    pair[1].append(jnp.ravel(g))
  for name, (got, want) in modules.items():
    assert_rel_rms(jnp.concatenate(got), jnp.concatenate(want), 1e-5, name)


def test_scanned_layers_draw_per_layer_keys_from_rngs(key):
  """Training through the scan is keyed by rngs alone: same seeds, same output."""
  k1, k2 = jax.random.split(key)
  model = _model(k1, "acc_rot_random", num_layers=3, block="acc_rot", dropout=0.3,
                 scan_layers=True)
  tok = _tokens(k2)
  rngs = lambda s: nnx.Rngs(dropout=s, encoding=s + 1)
  a, b, c = (model(tok, rngs=rngs(s), train=True) for s in (1, 1, 2))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)


@pytest.mark.parametrize("chunk", [64, None])   # 64: three chunks of the 150 tokens, padded
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_hot_embedding_matches_the_gather(dtype, chunk, key, monkeypatch):
  """embed_tokens' one-hot gradient (small vocabularies) against the gather's scatter-add it
  replaces: the same rows, and the table gradient of a random cotangent against the float32
  scatter-add's."""
  if chunk:
    monkeypatch.setattr(model_lib, "ONE_HOT_GRAD_CHUNK", chunk)
  k1, k2, k3 = jax.random.split(key, 3)
  V, C = 7, 24
  table = jax.random.normal(k1, (V, C), jnp.float32)
  tokens = jax.random.randint(k2, (3, 50), 0, V)      # every row repeats: the case that matters
  ct = jax.random.normal(k3, (3, 50, C), jnp.float32)

  def loss(t, one_hot, dt):
    out = model_lib.embed_tokens(t, tokens, dtype=dt, one_hot=one_hot)
    return jnp.sum(out.astype(jnp.float32) * ct), out

  (_, fast), g_fast = jax.value_and_grad(loss, has_aux=True)(table, True, dtype)
  (_, gather), _ = jax.value_and_grad(loss, has_aux=True)(table, False, dtype)
  _, g_oracle = jax.value_and_grad(loss, has_aux=True)(table, False, jnp.float32)
  assert fast.dtype == dtype
  np.testing.assert_array_equal(np.asarray(fast, np.float32), np.asarray(gather, np.float32))
  # The one-hot gradient accumulates in float32 and rounds to dtype once.
  tol = 1e-6 if dtype == jnp.float32 else 4e-3
  assert_rel_rms(g_fast, g_oracle, tol)
  assert model_lib.embed_tokens(table, tokens, dtype=dtype).dtype == dtype


def test_attention_choice_gives_the_kernel_plan():
  """model.attention_choice: the implementation a layer runs and why, with the Pallas kernel's
  plan for PaTH / PaTH-FoX (the gate seen from the encoding's own inputs) and kernel_options
  reaching it; from shapes alone."""
  base = dict(vocab_size=256, num_layers=2, d_model=256, num_heads=4, head_dim=64,
              dtype="bfloat16")
  path = model_lib.attention_choice(model_lib.ModelConfig(encoding="path", **base), batch=2,
                                    seq_len=1024, backend="gpu")
  fox = model_lib.attention_choice(
      model_lib.ModelConfig(encoding="path_fox", kernel_options=(("span", 0),), **base),
      batch=2, seq_len=1024, backend="gpu")
  assert path.implementation == fox.implementation == "pallas"
  assert "PaTH on gpu" in path.reason and "no gate, segments" not in path.reason
  assert "segments" in path.reason and "gate" not in path.reason.split("\n")[1]
  assert "gate, segments" in fox.reason
  assert "backward:  span-parallel" in path.reason and "backward:  walk" in fox.reason
  rope = model_lib.attention_choice(model_lib.ModelConfig(encoding="rope", **base), batch=2,
                                    seq_len=1024, backend="cpu")
  assert rope.implementation in ("reference", "chunked") and "PaTH" not in rope.reason
