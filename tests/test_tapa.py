"""TAPA: the dense reference against a loop-level oracle, the chunked form against the reference."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import posenc_jax
from posenc_jax import tapa
from tests.util import assert_rel_rms
from tests.util import assert_trees_rel_rms

jax.config.update("jax_default_matmul_precision", "highest")


def _inputs(key, B=2, T=37, H=4, K=2, D=8, scale=1.0):
  kq, kk, kv = jax.random.split(key, 3)
  return (scale * jax.random.normal(kq, (B, T, H, D)), scale * jax.random.normal(kk, (B, T, K, D)),
          jax.random.normal(kv, (B, T, K, D)))


def _loop_oracle(q, k, v, *, alpha, theta, linear_phase, segment_ids, phase_scale=1.0):
  """The formula of docs/encodings/tapa.md#tapa written out per (b, h, i, j) in float64 numpy."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  B, T, H, D = q.shape
  G = H // k.shape[2]
  A = round(theta * D)
  seg = np.zeros((B, T), int) if segment_ids is None else np.asarray(segment_ids)
  out = np.zeros((B, T, H, v.shape[-1]))
  for b in range(B):
    for h in range(H):
      kh, vh = k[b, :, h // G], v[b, :, h // G]
      for i in range(T):
        js = [j for j in range(i + 1) if seg[b, j] == seg[b, i]]
        logits = []
        for j in js:
          amp = q[b, i, h, :A] @ kh[j, :A] / math.sqrt(A)
          if linear_phase:
            ph = (q[b, i, h, A:].sum() + kh[j, A:].sum()) / math.sqrt(D - A)
          else:
            ph = q[b, i, h, A:] @ kh[j, A:] / math.sqrt(D - A)
          ph *= phase_scale
          dpow = float(abs(i - j)) ** alpha if i != j else float(alpha == 0)
          logits.append(amp * math.cos(2 * math.pi * dpow * ph))
        w = np.exp(np.array(logits) - max(logits))
        out[b, i, h] = (w / w.sum()) @ vh[js]
  return out


@pytest.mark.parametrize("linear_phase", [False, True])
def test_reference_matches_loop_oracle(key, linear_phase):
  q, k, v = _inputs(key, B=1, T=9, H=2, K=1, D=6)
  seg = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
  kw = dict(alpha=0.1, theta=0.5, linear_phase=linear_phase, segment_ids=seg)
  assert_rel_rms(tapa.tapa_attention_reference(q, k, v, **kw), _loop_oracle(q, k, v, **kw), 1e-5)


@pytest.mark.parametrize("name", ["tapa", "tapa_linear"])
def test_phase_scale_multiplies_the_phase(key, name):
  """The encoding's phase_scale=s: its prepared q, k on the reference give the loop oracle with
  phi multiplied by s (q_P scaled for the quadratic phase, q_P and k_P for the linear)."""
  from posenc_jax import encodings
  q, k, v = _inputs(key, B=1, T=9, H=2, K=1, D=6)
  seg = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
  prep = encodings.get(name).prepare({}, q=q, k=k, v=v, phase_scale=0.3)
  assert set(prep.inputs) == {"alpha", "theta", "linear_phase"}
  got = tapa.tapa_attention_reference(prep.q, prep.k, prep.v, segment_ids=seg, **prep.inputs)
  want = _loop_oracle(q, k, v, alpha=0.1, theta=0.5, linear_phase=name == "tapa_linear",
                      segment_ids=seg, phase_scale=0.3)
  assert_rel_rms(got, want, 1e-5)


@pytest.mark.parametrize("name", ["tapa", "tapa_linear"])
def test_phase_norm_bounds_the_phase(key, name):
  """phase_norm: the attention equals the loop oracle on q, k whose phase channels are divided
  by their RMS (then phase_scale applies), and so does not change when the phase channels of q
  and k grow by any per-token factor; the amplitude channels pass through."""
  from posenc_jax import encodings
  q, k, v = _inputs(key, B=1, T=9, H=2, K=1, D=6)
  seg = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
  linear = name == "tapa_linear"

  def attend(q, k):
    prep = encodings.get(name).prepare({}, q=q, k=k, v=v, phase_norm=True, phase_scale=0.3)
    return tapa.tapa_attention_reference(prep.q, prep.k, prep.v, segment_ids=seg, **prep.inputs)

  def unit_rms_phase(x):
    ph = x[..., 3:]
    return jnp.concatenate([x[..., :3], ph / jnp.sqrt(jnp.mean(ph**2, -1, keepdims=True))], -1)

  want = _loop_oracle(unit_rms_phase(q), unit_rms_phase(k), v, alpha=0.1, theta=0.5,
                      linear_phase=linear, segment_ids=seg, phase_scale=0.3)
  assert_rel_rms(attend(q, k), want, 1e-5)
  phase = jnp.arange(6) >= 3                                     # the P channels
  factor_q = 1.0 + 20.0 * jax.random.uniform(jax.random.fold_in(key, 1), q.shape[:3] + (1,))
  factor_k = 1.0 + 20.0 * jax.random.uniform(jax.random.fold_in(key, 2), k.shape[:3] + (1,))
  big_q, big_k = q * jnp.where(phase, factor_q, 1.0), k * jnp.where(phase, factor_k, 1.0)
  rms = lambda x: float(jnp.sqrt(jnp.mean(x[..., 3:] ** 2)))   # noqa: E731
  assert rms(big_q) > 3 * rms(q) and rms(big_k) > 3 * rms(k)
  assert_rel_rms(attend(big_q, big_k), want, 1e-5)


def test_uneven_split_and_large_alpha(key):
  q, k, v = _inputs(key, B=1, T=7, H=2, K=2, D=10)
  kw = dict(alpha=0.7, theta=0.3, linear_phase=False, segment_ids=None)   # A = 3, P = 7
  assert_rel_rms(tapa.tapa_attention_reference(q, k, v, **kw), _loop_oracle(q, k, v, **kw), 1e-5)


@pytest.mark.parametrize("linear_phase", [False, True])
@pytest.mark.parametrize("segments", [False, True])
def test_chunked_matches_reference(key, linear_phase, segments):
  """Forward and gradients; GQA (H=4, K=2), T=37 with block 16 (a ragged last block); query
  blocks one by one (the CPU schedule) and all at once (the accelerators'), both against one
  oracle run (its compiles shared: CI time)."""
  k1, k2 = jax.random.split(key)
  q, k, v = _inputs(k1)
  seg = None
  if segments:
    seg = jnp.cumsum(jax.random.bernoulli(k2, 0.1, (2, 37)), axis=1).astype(jnp.int32)
  kw = dict(alpha=0.1, theta=0.5, linear_phase=linear_phase, segment_ids=seg)
  cot = jax.random.normal(k2, (2, 37, 4, 8))

  def out_and_grads(fn):
    """fn(q, k, v) and the gradients of <fn(q, k, v), cot> from one jitted program (the
    forward is not compiled again apart from the gradients': CI time)."""
    def run(q, k, v):
      out, pull = jax.vjp(fn, q, k, v)
      return out, pull(cot)
    return jax.jit(run)(q, k, v)

  out_ref, g_ref = out_and_grads(functools.partial(tapa.tapa_attention_reference, **kw))
  for parallel in (False, True):
    out, g_chk = out_and_grads(functools.partial(tapa.tapa_attention_chunked, block_size=16,
                                                 parallel=parallel, **kw))
    assert_rel_rms(out, out_ref, 1e-5, f"forward (parallel={parallel})")
    assert_trees_rel_rms(g_chk, g_ref, 1e-5, f"grads (q, k, v) (parallel={parallel})")


def test_public_entry_point_dispatch(key):
  q, k, v = _inputs(key, T=20)
  # Jitted: one compile each instead of eager op-by-op dispatch (CI time).
  ref = jax.jit(functools.partial(posenc_jax.tapa_attention, implementation="reference"))(q, k, v)
  chk = jax.jit(functools.partial(posenc_jax.tapa_attention, implementation="chunked"))(q, k, v)
  assert_rel_rms(chk, ref, 1e-5)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_causal_by_gradients(key, impl):
  q, k, v = _inputs(key, B=1, T=21)
  fn = tapa.tapa_attention_reference if impl == "reference" else functools.partial(
      tapa.tapa_attention_chunked, block_size=8)
  t = 12
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, alpha=0.1, theta=0.5, linear_phase=False,
                                    segment_ids=None)[:, t])
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for name, g in zip("qkv", grads):
    assert float(jnp.abs(g[:, t + 1:]).max()) == 0.0, f"d o_{t} / d {name}_(>{t}) != 0"
    assert float(jnp.abs(g[:, : t + 1]).max()) > 0.0, f"d o_{t} / d {name} vanished"


def test_segments_are_isolated(key):
  """A packed document gives the same outputs as the document alone: |i - j| is relative."""
  q, k, v = _inputs(key, B=1, T=30)
  seg = jnp.array([[0] * 11 + [1] * 19])
  kw = dict(alpha=0.1, theta=0.5, linear_phase=False)
  packed = tapa.tapa_attention_chunked(q, k, v, segment_ids=seg, block_size=8, **kw)
  alone = tapa.tapa_attention_chunked(q[:, 11:], k[:, 11:], v[:, 11:], segment_ids=None,
                                      block_size=8, **kw)
  assert_rel_rms(packed[:, 11:], alone, 1e-5)


def test_distance_power_diagonal_and_gradient():
  d = jnp.arange(5)
  np.testing.assert_allclose(tapa.distance_power(d, 0.5), [0, 1, 2**0.5, 3**0.5, 2], rtol=1e-6)
  np.testing.assert_allclose(tapa.distance_power(d, 0.0), np.ones(5))
  g = jax.grad(lambda a: tapa.distance_power(d, a).sum())(0.1)
  want = sum(math.log(n) * n**0.1 for n in range(1, 5))
  assert np.isfinite(g) and g == pytest.approx(want, rel=1e-5)


def test_theta_split_errors(key):
  q, k, v = _inputs(key, T=4, D=4)
  with pytest.raises(ValueError, match="theta"):
    posenc_jax.tapa_attention(q, k, v, theta=0.1)   # round(0.4) = 0 amplitude channels
