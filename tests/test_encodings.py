"""Registry-wide properties: every encoding in NAMES is registered, causal and segment-isolated.

Each encoding is driven the way the model drives it: random layer input x, q/k/v projected from
x (so gates, Householder vectors and phases all depend on x), then prepare + attend.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import encodings
from tests.util import value_and_grads

STANDALONE = [n for n in encodings.NAMES if n not in encodings.MODIFIERS]
B, T, C, H, K, D, V = 2, 19, 32, 4, 2, 8, 16
DIMS = encodings.Dims(d_model=C, num_heads=H, num_kv_heads=K, head_dim=D, vocab_size=V)


def test_registry_covers_exactly_the_spec_names():
  missing = [n for n in encodings.NAMES if n not in encodings._REGISTRY]
  assert not missing, f"in encodings.NAMES but not registered: {missing}"
  assert set(encodings._REGISTRY) == set(encodings.NAMES)


def test_unknown_encoding_is_a_clear_error():
  with pytest.raises(ValueError, match="unknown encoding 'ropee'"):
    encodings.get("ropee")


def _layer(key, name):
  """Returns (params, f) with f(x, tokens, segment_ids, implementation) -> o [B,T,H,D]."""
  enc = encodings.get(name)
  kp, kq, kk, kv = jax.random.split(key, 4)
  params = enc.init(kp, DIMS)
  wq = jax.random.normal(kq, (C, H * D)) / C**0.5
  wk = jax.random.normal(kk, (C, K * D)) / C**0.5
  wv = jax.random.normal(kv, (C, K * D)) / C**0.5

  def f(x, tokens, segment_ids, implementation=None):
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    if segment_ids is not None:  # positions restart per packed document
      starts = jnp.concatenate([jnp.ones((B, 1), bool),
                                segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
      idx = jnp.where(starts, pos, 0)
      pos = pos - jax.lax.cummax(idx, axis=1)
    q = (x @ wq).reshape(B, T, H, D)
    k = (x @ wk).reshape(B, T, K, D)
    v = (x @ wv).reshape(B, T, K, D)
    return enc.apply(params, x=x, q=q, k=k, v=v, positions=pos, segment_ids=segment_ids,
                     tokens=tokens, rng=None, train=False, implementation=implementation)

  # Jitted (one compile per program instead of eager op-by-op dispatch: CI time); the model
  # runs its encodings under jit too.
  return jax.jit(f, static_argnames="implementation")


def _inputs(key):
  kx, kt = jax.random.split(key)
  return jax.random.normal(kx, (B, T, C)), jax.random.randint(kt, (B, T), 0, V)


def _registered(name):
  if name not in encodings._REGISTRY:
    pytest.fail(f"encoding {name!r} is not registered")


@pytest.mark.parametrize("name", STANDALONE)
def test_causal_by_gradients(name, key):
  _registered(name)
  k1, k2 = jax.random.split(key)
  f = _layer(k1, name)
  x, tokens = _inputs(k2)
  t = T // 2
  g = jax.jit(jax.grad(lambda x: jnp.sum(f(x, tokens, None)[:, : t + 1] ** 2)))(x)
  past, future = np.abs(np.asarray(g[:, : t + 1])), np.abs(np.asarray(g[:, t + 1:]))
  assert past.max() > 0, "output does not depend on its own past: the test would prove nothing"
  assert future.max() <= 1e-6 * past.max(), f"output at t <= {t} depends on inputs after t"


@pytest.mark.parametrize("name", STANDALONE)
def test_causal_under_future_token_changes(name, key):
  """Tokens are integers (acc_rot_learned reads them): check causality by perturbation."""
  _registered(name)
  k1, k2, k3 = jax.random.split(key, 3)
  f = _layer(k1, name)
  x, tokens = _inputs(k2)
  t = T // 2
  x2 = x.at[:, t + 1:].set(jax.random.normal(k3, (B, T - t - 1, C)))
  tokens2 = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 1) % V)
  o1, o2 = f(x, tokens, None), f(x2, tokens2, None)
  np.testing.assert_array_equal(np.asarray(o1[:, : t + 1]), np.asarray(o2[:, : t + 1]))
  assert not np.allclose(np.asarray(o1[:, t + 1:]),
                         np.asarray(o2[:, t + 1:])), "perturbation had no effect"


@pytest.mark.parametrize("name", STANDALONE)
def test_segments_are_isolated(name, key):
  """A later packed document's outputs do not depend on an earlier document's inputs."""
  _registered(name)
  k1, k2, k3 = jax.random.split(key, 3)
  f = _layer(k1, name)
  x, tokens = _inputs(k2)
  cut = 8
  seg = jnp.broadcast_to((jnp.arange(T) >= cut).astype(jnp.int32) + 1, (B, T))
  x2 = x.at[:, :cut].set(jax.random.normal(k3, (B, cut, C)))
  tokens2 = tokens.at[:, :cut].set((tokens[:, :cut] + 3) % V)
  # The outputs and, from the same program, the gradient: nothing flows from the first
  # document into the second.
  both = value_and_grads(lambda x, tokens: f(x, tokens, seg), lambda o: jnp.sum(o[:, cut:] ** 2))
  (o1, g), (o2, _) = both(x, tokens), both(x2, tokens2)
  np.testing.assert_allclose(np.asarray(o1[:, cut:]), np.asarray(o2[:, cut:]), rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(g[:, :cut])).max() <= 1e-6 * np.abs(np.asarray(g[:, cut:])).max()


# Family inputs that carry transport, gates or phases: float32 whatever the model dtype.
_FLOAT32_INPUTS = ("w", "beta", "log_forget", "p", "alpha")


@pytest.mark.parametrize("name", STANDALONE)
def test_bfloat16_precision_policy(name, key):
  """model.py's precision policy: q, k, v and the output stay in the model dtype (bf16), the
  sensitive transport inputs are float32, and so every softmax encoding of a bf16 model reaches
  cuDNN on the GPU (a float32 q would silently take a slower path)."""
  from posenc_jax import dispatch
  _registered(name)
  enc = encodings.get(name)
  kp, kx, kq, kk, kv, kr = jax.random.split(key, 6)
  bf16 = jnp.bfloat16
  x = jax.random.normal(kx, (B, T, C)).astype(bf16)
  q = jax.random.normal(kq, (B, T, H, D)).astype(bf16)
  k = jax.random.normal(kk, (B, T, K, D)).astype(bf16)
  v = jax.random.normal(kv, (B, T, K, D)).astype(bf16)
  layer = dict(x=x, q=q, k=k, v=v, positions=jnp.broadcast_to(jnp.arange(T), (B, T)),
               segment_ids=None, tokens=jnp.zeros((B, T), jnp.int32), rng=kr, train=True)
  prep = enc.prepare(enc.init(kp, DIMS), **layer)
  assert (prep.q.dtype, prep.k.dtype, prep.v.dtype) == (bf16,) * 3, prep.family
  for arg in _FLOAT32_INPUTS:
    if isinstance(prep.inputs.get(arg), jax.Array):   # tapa's alpha is a Python float
      assert prep.inputs[arg].dtype == jnp.float32, arg
  if prep.out_angles is not None:
    assert prep.out_angles.dtype == jnp.float32
  assert encodings.attend(prep, implementation="reference").dtype == bf16
  if prep.family == "softmax":
    choice = dispatch.auto_implementation("softmax", T=T, dtype=prep.q.dtype,
                                           head_dim=prep.q.shape[-1], v_head_dim=prep.v.shape[-1],
                                           backend="gpu")
    assert choice.implementation == "cudnn", choice
