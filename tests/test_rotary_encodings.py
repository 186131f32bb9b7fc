"""Registry entries of posenc_jax.encodings.rotary and .phase: every name end to end, RoPE at
initialisation, value transport against a dense oracle, accumulated-angle sampling rules."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import posenc_jax
from posenc_jax import encodings
from posenc_jax import rotations
from posenc_jax.encodings import Dims
from posenc_jax.encodings import rotary
from tests.util import assert_rel_rms

jax.config.update("jax_default_matmul_precision", "highest")

ROTARY = tuple(rotary.HPARAMS)
B, T, H, K, D, C = 2, 13, 4, 2, 8, 12
DIMS = Dims(d_model=C, num_heads=H, num_kv_heads=K, head_dim=D, vocab_size=17)
SEG = jnp.array([[0] * 6 + [1] * 7, [3] * 13])
POS = jnp.array([list(range(6)) + list(range(7)), list(range(13))])


def _layer(key, **over):
  ks = jax.random.split(key, 5)
  layer = dict(x=jax.random.normal(ks[0], (B, T, C)), q=jax.random.normal(ks[1], (B, T, H, D)),
               k=jax.random.normal(ks[2], (B, T, K, D)), v=jax.random.normal(ks[3], (B, T, K, D)),
               positions=POS, segment_ids=SEG, tokens=jax.random.randint(ks[4], (B, T), 0, 17),
               rng=jax.random.key(1), train=True)
  layer.update(over)
  return layer


@pytest.mark.parametrize("name", ROTARY)
def test_rotary_entry_end_to_end(key, name):
  """init -> prepare -> attend; q, k keep their norms (orthogonal G); dense == chunked attend."""
  k1, k2 = jax.random.split(key)
  enc = encodings.get(name)
  assert enc.family == "softmax"
  params = enc.init(k1, DIMS)
  layer = _layer(k2)
  prep = enc.prepare(params, **layer)
  m = rotations.yarn_attention_factor(4.0) if name == "rope_yarn" else 1.0
  for a, b in ((prep.q, layer["q"]), (prep.k, layer["k"])):
    np.testing.assert_allclose(jnp.linalg.norm(a, axis=-1), m * jnp.linalg.norm(b, axis=-1),
                               rtol=2e-5)
  assert (prep.out_angles is not None) == name.endswith("_v")
  ref = encodings.attend(prep, segment_ids=SEG, implementation="reference")
  chk = encodings.attend(prep, segment_ids=SEG, implementation="chunked")
  assert ref.shape == (B, T, H, D)
  assert_rel_rms(chk, ref, 1e-5)


@pytest.mark.parametrize("name", ROTARY)
def test_odd_head_dim_raises(name):
  enc = encodings.get(name)
  dims = Dims(d_model=C, num_heads=H, num_kv_heads=K, head_dim=7)
  msg = f"head_dim=7 must be even for rotation encoding '{name}'"
  with pytest.raises(ValueError, match=msg):
    enc.check(dims)
  with pytest.raises(ValueError, match=msg):
    enc.init(jax.random.key(0), dims)


def test_bad_hyperparameters_raise():
  with pytest.raises(ValueError, match="unknown hyperparameters"):
    encodings.get("rope", bse=5.0).prepare({}, **_layer(jax.random.key(0)))
  with pytest.raises(ValueError, match="rank=3"):
    encodings.get("grape_m_noncommuting", rank=3).init(jax.random.key(0), DIMS)
  with pytest.raises(ValueError, match="num_planes=9"):
    encodings.get("grape_m_rank2", num_planes=9).init(jax.random.key(0), DIMS)
  with pytest.raises(ValueError, match="tokens"):
    enc = encodings.get("acc_rot_learned")
    enc.prepare(enc.init(jax.random.key(0), DIMS), **_layer(jax.random.key(0), tokens=None))


@pytest.mark.parametrize("name",
                         ["grape_m", "grape_m_rank2", "grape_m_noncommuting", "grape_m_ctx"])
def test_grape_m_starts_as_rope(key, name):
  k1, k2 = jax.random.split(key)
  layer = _layer(k2)
  enc = encodings.get(name)
  prep = enc.prepare(enc.init(k1, DIMS), **layer)
  want = encodings.get("rope").prepare({}, **layer)
  assert_rel_rms(prep.q, want.q, 1e-5, "q")
  assert_rel_rms(prep.k, want.k, 1e-5, "k")


def test_thin_compression_leaves_the_complement_alone(key):
  enc = encodings.get("grape_m_noncommuting", rank=4)
  layer = _layer(key)
  prep = enc.prepare(enc.init(key, DIMS), **layer)
  np.testing.assert_array_equal(prep.q[..., 4:], layer["q"][..., 4:])
  assert float(jnp.abs(prep.q[:, 1:, :, :4] - layer["q"][:, 1:, :, :4]).max()) > 1e-3


@pytest.mark.parametrize("name", ["grape_m", "grape_m_rank2", "grape_m_noncommuting", "grape_m_ctx",
                                  "acc_rot_learned", "acc_rot_learned_v"])
def test_learned_parameters_get_gradients(key, name):
  k1, k2, k3 = jax.random.split(key, 3)
  enc = encodings.get(name)
  params = enc.init(k1, DIMS)
  layer = _layer(k2)
  cot = jax.random.normal(k3, (B, T, H, D))
  loss = lambda p: jnp.sum(enc.apply(p, implementation="reference", **layer) * cot)
  grads = jax.jit(jax.grad(loss))(params)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert bool(jnp.all(jnp.isfinite(g))), path
    assert float(jnp.abs(g).max()) > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_length_extensions_are_rope_variants(key):
  layer = _layer(key)
  pi = encodings.get("rope_pi", train_len=4, eval_len=16).prepare({}, **layer)
  want = rotations.rotate(layer["q"],
                          rotations.rope_angles(POS / 4.0, rotations.rope_frequencies(D)))
  assert_rel_rms(pi.q, want, 1e-6, "PI")
  ntk = encodings.get("rope_ntk", train_len=4, eval_len=16).prepare({}, **layer)
  want = rotations.rope(layer["q"], POS, base=rotations.ntk_base(D, scale=4.0))
  assert_rel_rms(ntk.q, want, 1e-6, "NTK")
  yarn = encodings.get("rope_yarn", train_len=4, eval_len=16).prepare({}, **layer)
  f = rotations.yarn_frequencies(D, scale=4.0, train_len=4)
  want = (rotations.yarn_attention_factor(4.0)
          * rotations.rotate(layer["q"], rotations.rope_angles(POS, f)))
  assert_rel_rms(yarn.q, want, 1e-6, "YaRN")
  half = encodings.get("rope", layout="half").prepare({}, **layer)
  assert_rel_rms(half.q, rotations.rope(layer["q"], POS, layout="half"), 1e-6, "half layout")


def _value_transport_oracle(q, k, v, phi, seg):
  """o_i = sum_j a_ij G_i G_j^T v_j, G_t = R(phi_t), with dense 2x2 blocks per plane."""
  c, s = jnp.cos(phi), jnp.sin(phi)                                          # [B, T, P]
  G = jnp.stack([jnp.stack([c, -s], -1), jnp.stack([s, c], -1)], -2)         # [B, T, P, 2, 2]
  rot = lambda x: jnp.einsum("btpij,bthpj->bthpi", G, x.reshape(x.shape[:3] + (-1, 2)))
  Gq, Gk = rot(q).reshape(q.shape), rot(jnp.repeat(k, H // K, 2)).reshape(q.shape)
  logits = jnp.einsum("bihd,bjhd->bhij", Gq, Gk) / np.sqrt(D)
  mask = (jnp.tril(jnp.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]
  a = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
  rel = jnp.einsum("bipkl,bjpml->bijpkm", G, G)                              # G_i G_j^T
  vv = jnp.repeat(v, H // K, 2).reshape(B, T, H, D // 2, 2)
  return jnp.einsum("bhij,bijpkm,bjhpm->bihpk", a, rel, vv).reshape(B, T, H, D)


def test_rope_v_matches_dense_value_transport_oracle(key):
  layer = _layer(key)
  prep = encodings.get("rope_v").prepare({}, **layer)
  o = encodings.attend(prep, segment_ids=SEG, implementation="reference")
  phi = POS[..., None] * rotations.rope_frequencies(D)
  assert_rel_rms(o, _value_transport_oracle(layer["q"], layer["k"], layer["v"], phi, SEG), 1e-5)


def test_acc_rot_learned_v_matches_oracle(key):
  k1, k2 = jax.random.split(key)
  enc = encodings.get("acc_rot_learned_v")
  params = enc.init(k1, DIMS)
  layer = _layer(k2)
  o = enc.apply(params, implementation="reference", **layer)
  table, tok, seg = (np.asarray(params["angles"], np.float64), np.asarray(layer["tokens"]),
                     np.asarray(SEG))
  phi = np.zeros((B, T, D // 2))
  for b in range(B):
    for t in range(T):
      prev = phi[b, t - 1] if t and seg[b, t] == seg[b, t - 1] else 0.0
      phi[b, t] = prev + table[tok[b, t]]
  want = _value_transport_oracle(layer["q"], layer["k"], layer["v"],
                                 jnp.asarray(phi, jnp.float32), SEG)
  assert_rel_rms(o, want, 1e-5)


def test_acc_rot_learned_init_mean_is_rope():
  params = encodings.get("acc_rot_learned").init(jax.random.key(0),
                                                 Dims(8, 1, 1, 8, vocab_size=20000))
  mean = np.asarray(params["angles"]).mean(0)
  np.testing.assert_allclose(mean / rotations.rope_frequencies(8), 1.0, atol=0.03)  # 6 sigma


@pytest.mark.parametrize("name", ["acc_rot_random", "acc_rot_random_v"])
def test_acc_rot_random_sampling_rules(key, name):
  enc = encodings.get(name)
  layer = _layer(key)
  run = lambda **kw: enc.prepare({}, **{**layer, **kw})
  a, b = run(rng=jax.random.key(1)), run(rng=jax.random.key(2))
  assert float(jnp.abs(a.q - b.q).max()) > 1e-3, "training steps must draw fresh angles"
  e1, e2 = run(train=False, rng=jax.random.key(1)), run(train=False, rng=jax.random.key(2))
  np.testing.assert_array_equal(e1.q, e2.q)                        # eval: fixed seed, rng unused
  np.testing.assert_array_equal(run(rng=None).q, e1.q)
  e3 = encodings.get(name, eval_seed=5).prepare({}, **{**layer, "train": False})
  assert float(jnp.abs(e3.q - e1.q).max()) > 1e-3
  # Each layer its own evaluation draw (the paper samples layers independently); without an
  # index, eval_seed's own key.
  l0, l1 = run(train=False, layer_index=0), run(train=False, layer_index=1)
  assert float(jnp.abs(l0.q - l1.q).max()) > 1e-3
  np.testing.assert_array_equal(run(train=False, layer_index=1).q, l1.q)
  freqs = rotations.rope_frequencies(D, base=10000.0)
  steps = rotations.positional_step_angles(jax.random.key(0), POS, freqs, width=2.0)
  want = rotations.rotate(layer["q"], rotations.accumulate_phases(steps, SEG)[:, :, None, :])
  assert_rel_rms(e1.q, want, 1e-6, "q at evaluation, no layer index")
  # Shared across heads: every query head of a token turns by the same angles.
  ang = (jnp.arctan2(a.q[..., 1::2], a.q[..., 0::2])
         - jnp.arctan2(layer["q"][..., 1::2], layer["q"][..., 0::2]))
  d = jnp.angle(jnp.exp(1j * (ang - ang[:, :, :1])))
  assert float(jnp.abs(d).max()) < 1e-4


@pytest.mark.parametrize("name,linear", [("tapa", False), ("tapa_linear", True)])
def test_tapa_entries(key, name, linear):
  enc = encodings.get(name)
  assert enc.family == "tapa" and enc.init(key, DIMS) == {}
  layer = _layer(key)
  prep = enc.prepare({}, **layer)
  assert prep.inputs == {"alpha": 0.1, "theta": 0.5, "linear_phase": linear}
  assert prep.q is layer["q"] and prep.out_angles is None        # no other positional encoding
  o = encodings.attend(prep, segment_ids=SEG, implementation="chunked")
  want = posenc_jax.tapa_attention(layer["q"], layer["k"], layer["v"], linear_phase=linear,
                                   segment_ids=SEG, implementation="reference")
  assert_rel_rms(o, want, 1e-5)
  with pytest.raises(ValueError, match="empty amplitude"):
    encodings.get(name, theta=0.05).init(key, DIMS)
