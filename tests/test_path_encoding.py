"""Registry entries `path` and `path_fox`: parameterisation, segment-safe conv, end to end."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import encodings
from posenc_jax import householder
from posenc_jax.encodings import transport
from tests.util import assert_rel_rms

DIMS = encodings.Dims(d_model=16, num_heads=4, num_kv_heads=2, head_dim=8)
SEG = jnp.array([[0] * 6 + [1] * 9 + [2] * 4, [5] * 19])   # row 0 packs three documents


def _layer(key, B=2, T=19):
  kx, kq, kk, kv = jax.random.split(key, 4)
  H, K, D = DIMS.num_heads, DIMS.num_kv_heads, DIMS.head_dim
  return dict(x=jax.random.normal(kx, (B, T, DIMS.d_model)), q=jax.random.normal(kq, (B, T, H, D)),
              k=jax.random.normal(kk, (B, T, K, D)), v=jax.random.normal(kv, (B, T, K, D)),
              positions=jnp.broadcast_to(jnp.arange(T), (B, T)), tokens=None, rng=None, train=True)


@pytest.mark.parametrize("name", ["path", "path_fox"])
def test_prepare_and_attend(key, name):
  k_init, k_layer, k_cot = jax.random.split(key, 3)
  enc = encodings.get(name)
  params = enc.init(k_init, DIMS)
  layer = _layer(k_layer)
  prep = enc.prepare(params, segment_ids=SEG, **layer)
  assert prep.family == "path"
  assert prep.q is layer["q"] and prep.k is layer["k"]     # no rotary: PaTH replaces RoPE
  w, beta, lf = prep.inputs["w"], prep.inputs["beta"], prep.inputs["log_forget"]
  np.testing.assert_allclose(np.linalg.norm(w, axis=-1), 1.0, atol=1e-5)
  assert beta.shape == (2, 19, 2) and 0.0 < beta.min() and beta.max() < 2.0
  if name == "path":
    assert lf is None
  else:  # gates start near 1 (FoX's bias initialisation), per query head
    assert lf.shape == (2, 19, 4) and np.exp(lf).min() > 0.9 and lf.max() < 0.0
  # The attention calls and the gradient run jitted: one compile each instead of eager
  # op-by-op dispatch (every eager lax.scan recompiles).
  out = jax.jit(lambda q, k, v, inputs: encodings.attend(
      prep._replace(q=q, k=k, v=v, inputs=inputs), segment_ids=SEG, implementation="chunked"))(
          prep.q, prep.k, prep.v, prep.inputs)
  ref = jax.jit(lambda *a: householder.path_attention_reference(
      *a, log_forget=lf, segment_ids=SEG, scale=DIMS.head_dim**-0.5))(
          prep.q, prep.k, prep.v, w, beta)
  assert_rel_rms(out, ref, 1e-5)

  # Every parameter receives a finite, non-zero training signal through the chunked path.
  cot = jax.random.normal(k_cot, out.shape)

  def loss(p):
    o = enc.apply(p, segment_ids=SEG, implementation="chunked", **layer)
    return jnp.sum(o * cot)

  for leaf_name, g in jax.jit(jax.grad(loss))(params).items():
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, leaf_name


def test_w_beta_causal_and_segment_local(key):
  """d w_t / d x_s = 0 unless s is in t's document and t - s < conv_width; beta reads x_t only."""
  params = encodings.get("path").init(key, DIMS)
  x = jax.random.normal(jax.random.fold_in(key, 1), (2, 19, DIMS.d_model))

  def w_beta(x):
    return transport.transport_inputs(params, x, num_kv_heads=2, head_dim=8, segment_ids=SEG)

  jw, jb = jax.jacrev(w_beta)(x)                 # [B,T,K,D, B,T,C], [B,T,K, B,T,C]
  seg = np.asarray(SEG)
  for b in range(2):
    dw = np.abs(np.asarray(jw[b, :, :, :, b])).max(axis=(1, 2, 4))   # [t, s]
    db = np.abs(np.asarray(jb[b, :, :, b])).max(axis=(1, 3))
    t, s = np.meshgrid(np.arange(19), np.arange(19), indexing="ij")
    reach = (s <= t) & (t - s < 3) & (seg[b][t] == seg[b][s])
    assert dw[~reach].max() == 0.0, b
    assert dw[reach].min() > 0.0, b
    assert db[t != s].max() == 0.0 and db[t == s].min() > 0.0


def test_conv_restarts_when_ids_repeat(key):
  """Segment ids 0, 1, 0: the third document must not read the first one."""
  z = jax.random.normal(key, (1, 7, 3))
  kernel = jnp.ones((3, 3))
  seg = jnp.array([[0, 0, 0, 1, 0, 0, 0]])
  out = transport.short_conv(z, kernel, seg)
  zn = np.asarray(z, np.float64)
  expected = zn.copy()
  for t in (1, 2, 5, 6):
    expected[0, t] += zn[0, t - 1] + (zn[0, t - 2] if t - 2 in (0, 4) else 0.0)
  # float32 rounds each sum relative to its summands (O(1)), not to the sum, which can cancel to
  # ~1e-2 (seed 392493220: 2.9e-6 relative, 6e-8 absolute): bound the error by the summands.
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6 * np.abs(zn).max())


def test_hyperparameters(key):
  params = encodings.get("path", rank=4, conv_width=2).init(key, DIMS)
  assert params["w_down"].shape == (16, 4) and params["w_conv"].shape == (2, 4)
  with pytest.raises(ValueError, match="unknown hyperparameters"):
    encodings.get("path", ranks=4).init(key, DIMS)
  with pytest.raises(ValueError, match="forget_time_min"):
    encodings.get("path_fox", forget_time_min=0.5).init(key, DIMS)
  with pytest.raises(ValueError, match="num_kv_heads"):
    encodings.get("path").init(key, encodings.Dims(16, 3, 2, 8))
