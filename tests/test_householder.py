"""PaTH math: the scan and chunked forms against the dense oracle, and the paper's properties."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import posenc_jax
from posenc_jax import householder
from tests.util import assert_rel_rms

FAST = {"scan": householder.path_attention_scan, "chunked": householder.path_attention_chunked}


def _unit(x):
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _inputs(key, *, B=2, T=37, H=4, K=2, D=8, forget=True, segments=True):
  """Random PaTH inputs; beta covers exactly 0, 1 and 2 besides uniform values."""
  kq, kk, kv, kw, kb, kf = jax.random.split(key, 6)
  beta = jax.random.uniform(kb, (B, T, K), maxval=2.0)
  beta = beta.at[:, 3::5].set(1.0).at[:, 4::7].set(2.0).at[:, 5::11].set(0.0)
  args = dict(q=jax.random.normal(kq, (B, T, H, D)), k=jax.random.normal(kk, (B, T, K, D)),
              v=jax.random.normal(kv, (B, T, K, D)),
              w=_unit(jax.random.normal(kw, (B, T, K, D))), beta=beta)
  args["log_forget"] = (jax.nn.log_sigmoid(2.0 + jax.random.normal(kf, (B, T, H)))
                        if forget else None)
  seg = None
  if segments:  # row 0 packs three segments, row 1 is one sequence
    seg = jnp.stack([jnp.repeat(jnp.arange(3), jnp.array([11, 17, T - 28]), total_repeat_length=T),
                     jnp.zeros(T, jnp.int32)])[:B]
  return args, seg


def _call(fn, args, seg, **kw):
  """fn on args, jit-compiled (one compile instead of many eager op dispatches)."""
  return _jitted(fn, args["q"].shape[-1] ** -0.5, tuple(sorted(kw.items())))(args, seg)


@functools.lru_cache(maxsize=None)
def _jitted(fn, scale, kw):
  """One jitted program per (fn, scale, keywords), shared by every call of _call: a repeat
  (same shapes) is not traced, lowered or compiled again (CI time)."""
  return jax.jit(lambda a, s: fn(a["q"], a["k"], a["v"], a["w"], a["beta"],
                                 log_forget=a["log_forget"], segment_ids=s, scale=scale,
                                 **dict(kw)))


def _loss_grads(fn, args, seg, cot, **kw):
  """d/d(inputs) of sum(fn(inputs) * cot), jit-compiled."""
  names = [n for n in ("q", "k", "v", "w", "beta", "log_forget") if args[n] is not None]
  scale = args["q"].shape[-1] ** -0.5

  def loss(diff, rest, s):
    a = {**rest, **diff}
    out = fn(a["q"], a["k"], a["v"], a["w"], a["beta"], log_forget=a["log_forget"],
             segment_ids=s, scale=scale, **kw)
    return jnp.sum(out * cot)

  rest = {n: a for n, a in args.items() if n not in names}
  return jax.jit(jax.grad(loss))({n: args[n] for n in names}, rest, seg)


def _out_and_grads(fn, args, seg, cot, **kw):
  """(fn(inputs), d/d(inputs) of sum(fn(inputs) * cot)) from one jit-compiled program (the
  forward is compiled once, not again apart from the gradients': CI time)."""
  names = [n for n in ("q", "k", "v", "w", "beta", "log_forget") if args[n] is not None]
  scale = args["q"].shape[-1] ** -0.5

  def run(diff, rest, s):
    def f(diff):
      a = {**rest, **diff}
      return fn(a["q"], a["k"], a["v"], a["w"], a["beta"], log_forget=a["log_forget"],
                segment_ids=s, scale=scale, **kw)
    out, pull = jax.vjp(f, diff)
    return out, pull(cot)[0]

  rest = {n: a for n, a in args.items() if n not in names}
  return jax.jit(run)({n: args[n] for n in names}, rest, seg)


@pytest.mark.parametrize("forget,segments", [
    (False, False), (True, True), pytest.param(True, False, marks=pytest.mark.slow)])
def test_fast_paths_match_reference(key, forget, segments):
  """Both fast forms against one oracle run (its compiles shared: CI time)."""
  k1, k2 = jax.random.split(key)
  args, seg = _inputs(k1, forget=forget, segments=segments)
  cot = jax.random.normal(k2, args["q"].shape)   # the output's shape (head_dim of v = of q)
  ref, g_ref = _out_and_grads(householder.path_attention_reference, args, seg, cot)
  assert ref.shape == cot.shape
  for impl in ("scan", "chunked"):
    out, g = _out_and_grads(FAST[impl], args, seg, cot, chunk_size=16)
    assert_rel_rms(out, ref, 1e-5, f"{impl} forward")
    for name in g_ref:
      assert_rel_rms(g[name], g_ref[name], 1e-5, f"{impl} d/d{name}")


def test_chunked_single_chunk_and_bf16(key):
  args, seg = _inputs(key, T=21)
  ref = _call(householder.path_attention_reference, args, seg)
  # One chunk longer than T: only the in-chunk UT logits are used.
  assert_rel_rms(_call(householder.path_attention_chunked, args, seg, chunk_size=32), ref, 1e-5)
  low = {n: (None if a is None else a.astype(jnp.bfloat16)) for n, a in args.items()}
  low["w"] = _unit(args["w"]).astype(jnp.bfloat16)
  out = _call(householder.path_attention_chunked, low, seg, chunk_size=8)
  assert out.dtype == jnp.bfloat16
  ref_low = _call(householder.path_attention_reference,
                  {n: (None if a is None else a.astype(jnp.float32)) for n, a in low.items()}, seg)
  assert_rel_rms(out, ref_low, 1e-2, "bf16 chunked")


def test_public_entry_point(key):
  args, seg = _inputs(key, T=19)
  ref = _call(householder.path_attention_reference, args, seg)
  for implementation in ("reference", "scan", "chunked"):
    fn = functools.partial(posenc_jax.path_attention, implementation=implementation)
    out = jax.jit(lambda a, s: fn(a["q"], a["k"], a["v"], a["w"], a["beta"],  # noqa: B023
                                  log_forget=a["log_forget"], segment_ids=s))(args, seg)
    assert_rel_rms(out, ref, 1e-5, implementation)


def test_householder_product_matches_loop(key):
  args, _ = _inputs(key, T=9, D=5)
  w, beta = np.asarray(args["w"], np.float64), np.asarray(args["beta"], np.float64)
  # Jitted: one compile instead of eager op-by-op dispatch (CI time).
  P = jax.jit(posenc_jax.householder_product)(args["w"], args["beta"])
  expected = np.zeros(P.shape)
  for b in range(w.shape[0]):
    for h in range(w.shape[2]):
      acc = np.eye(w.shape[-1])
      for t in range(w.shape[1]):
        acc = (np.eye(w.shape[-1]) - beta[b, t, h] * np.outer(w[b, t, h], w[b, t, h])) @ acc
        expected[b, t, h] = acc
  assert_rel_rms(P, expected, 1e-5)


@pytest.mark.parametrize("impl", ["reference", "scan", "chunked"])
def test_beta_zero_is_plain_attention(key, impl):
  args, seg = _inputs(key, T=29, forget=False)
  args["beta"] = jnp.zeros_like(args["beta"])
  fn = householder.path_attention_reference if impl == "reference" else FAST[impl]
  out = _call(fn, args, seg, **({} if impl == "reference" else {"chunk_size": 8}))
  plain = posenc_jax.softmax_attention(args["q"], args["k"], args["v"], segment_ids=seg,
                                       implementation="reference")
  assert_rel_rms(out, plain, 1e-5)


def _swap_w(pairs, D):
  """w_t = (e_x - e_y) / sqrt(2) for each (x, y) in pairs: [T, D]."""
  w = np.zeros((len(pairs), D), np.float32)
  for t, (x, y) in enumerate(pairs):
    w[t, x], w[t, y] = 2**-0.5, -(2**-0.5)
  return w


def test_beta_two_swaps_coordinates(key):
  D, T = 6, 12
  rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
  pairs = [tuple(rng.choice(D, 2, replace=False)) for _ in range(T)]
  # Jitted here and below: one compile instead of eager op-by-op dispatch; numpy copies for
  # the loops, where each eager index of a jax array compiles an op (CI time).
  P = np.asarray(jax.jit(posenc_jax.householder_product)(
      jnp.asarray(_swap_w(pairs, D))[None, :, None], jnp.full((1, T, 1), 2.0))[0, :, 0])
  perm = np.eye(D)
  for t, (x, y) in enumerate(pairs):
    swap = np.eye(D)
    swap[[x, y]] = swap[[y, x]]
    perm = swap @ perm
    np.testing.assert_allclose(P[t], perm, atol=1e-6)
  # In attention: the logit of (i, j) is q_i against k_j with swaps j+1..i applied.
  q = jax.random.normal(key, (1, T, 1, D))
  k = jax.random.normal(jax.random.fold_in(key, 1), (1, T, 1, D))
  qn, kn = np.asarray(q[0, :, 0]), np.asarray(k[0, :, 0])
  logits = np.full((T, T), -np.inf)
  for j in range(T):
    kj = np.asarray(kn[j], np.float64)
    for i in range(j, T):
      if i > j:
        x, y = pairs[i]
        kj[[x, y]] = kj[[y, x]]
      logits[i, j] = float(qn[i] @ kj) * D**-0.5
  a = np.exp(logits - logits.max(1, keepdims=True))
  expected = (a / a.sum(1, keepdims=True)) @ kn
  attend = jax.jit(functools.partial(posenc_jax.path_attention, implementation="chunked"))
  out = attend(q, k, k, jnp.asarray(_swap_w(pairs, D))[None, :, None], jnp.full((1, T, 1), 2.0))
  assert_rel_rms(out[0, :, 0], expected, 1e-5)


@pytest.mark.parametrize("implementation", ["reference", "scan", "chunked"])
def test_s5_permutation_tracking(key, implementation):
  """Theorem 2.1's one-head construction: o_t[0] > 1/(t+1) iff swaps 1..t compose to identity."""
  n = 24
  rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
  pairs = []
  while len(pairs) < n:  # random swaps, sometimes undone, so several prefixes are the identity
    p = tuple(rng.choice(5, 2, replace=False))
    pairs += [p, p] if rng.random() < 0.4 else [p]
  pairs = [(0, 1)] + pairs[:n]   # position 0 is '#': its H never enters a logit
  T = n + 1
  ranks = np.array([1, 2, 3, 4, 5, 0], np.float32)
  k = np.zeros((1, T, 1, 6), np.float32)
  k[0, 0, 0] = ranks - np.eye(6)[5]                    # e1 + 2e2 + .. + 5e5 - e6
  q = np.broadcast_to(n * (ranks + 54.5 * np.eye(6)[5]), (1, T, 1, 6)).astype(np.float32)
  v = np.zeros((1, T, 1, 6), np.float32)
  v[0, 0, 0, 0] = 1.0
  attend = jax.jit(functools.partial(posenc_jax.path_attention, scale=1.0,
                                     implementation=implementation))
  o = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
             jnp.asarray(_swap_w(pairs, 6))[None, :, None], jnp.full((1, T, 1), 2.0))
  lst = list(range(5))
  for t in range(1, T):
    x, y = pairs[t]
    lst[x], lst[y] = lst[y], lst[x]
    is_identity = lst == list(range(5))
    assert bool(o[0, t, 0, 0] > 1.0 / (t + 1)) == is_identity, (t, lst, float(o[0, t, 0, 0]))


@pytest.mark.parametrize("impl", ["reference", "scan", "chunked"])
def test_causal_by_gradients(key, impl):
  args, seg = _inputs(key, T=23, forget=True, segments=False)
  t0 = 13
  fn = householder.path_attention_reference if impl == "reference" else FAST[impl]
  kw = {} if impl == "reference" else {"chunk_size": 8}
  cot = jnp.zeros((2, 23, 4, 8)).at[:, t0].set(1.0)
  grads = _loss_grads(fn, args, seg, cot, **kw)
  for name, g in grads.items():
    g = np.asarray(g)
    assert np.abs(g[:, t0 + 1:]).max() <= 1e-7 * np.abs(g).max(), name
    if name in ("q", "k", "v"):
      assert np.abs(g[:, t0]).max() > 0, name


@pytest.mark.parametrize("impl", ["scan", "chunked"])
def test_segment_isolation(key, impl):
  k1, k2 = jax.random.split(key)
  args, seg = _inputs(k1, T=37)
  other, _ = _inputs(k2, T=37)
  outside = (seg != 1)[..., None, None]
  mixed = {n: jnp.where(outside if a.ndim == 4 else outside[..., 0], other[n], a)
           for n, a in args.items()}
  a = _call(FAST[impl], args, seg, chunk_size=8)
  b = _call(FAST[impl], mixed, seg, chunk_size=8)
  inside = np.asarray(seg == 1)
  np.testing.assert_allclose(np.asarray(a)[inside], np.asarray(b)[inside], rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(a)[~inside] - np.asarray(b)[~inside]).max() > 1e-3


def test_value_errors(key):
  args, _ = _inputs(key, T=7, forget=False, segments=False)
  q, k, v, w, beta = (args[n] for n in ("q", "k", "v", "w", "beta"))
  call = functools.partial(posenc_jax.path_attention, q, k, v)
  with pytest.raises(ValueError, match="w must have shape"):
    call(w[:, :, :1], beta)
  with pytest.raises(ValueError, match="beta must have shape"):
    call(w, beta[..., None])
  with pytest.raises(ValueError, match="beta must lie in"):
    call(w, beta.at[0, 0, 0].set(2.5))
  with pytest.raises(ValueError, match="beta must lie in"):
    call(w, beta.at[0, 0, 0].set(-0.1))
  with pytest.raises(ValueError, match="unit L2 norm"):
    call(w * 1.1, beta)
  with pytest.raises(ValueError, match="implementation"):
    call(w, beta, implementation="xla")
  with pytest.raises(ValueError, match="implementation"):
    call(w, beta, implementation="bogus")
  with pytest.raises(ValueError, match="beta must have shape"):
    posenc_jax.householder_product(w, beta[:, :-1])


def test_decoding_matches_full_attention(key):
  """Token-by-token decoding with in-place key transport equals full attention; the prefill
  cache equals the decoded one."""
  args, _ = _inputs(key, B=1, T=27, forget=False, segments=False)
  q, k, v, w, beta = (args[n] for n in ("q", "k", "v", "w", "beta"))
  T = q.shape[1]
  # Jitted here and below: one compile instead of eager op-by-op dispatch (CI time).
  full = jax.jit(functools.partial(householder.path_attention_reference, scale=8**-0.5))(
      q, k, v, w, beta)

  def step(cache, t):
    cache = householder.transport_keys(cache, w[:, t], beta[:, t]).at[:, t].set(k[:, t])
    # Plain attention of the new query over the cache filled so far.
    logits = jnp.einsum("bhd,bshd->bhs", q[:, t], jnp.repeat(cache, 2, axis=2)) * 8**-0.5
    a = jax.nn.softmax(jnp.where(jnp.arange(T) <= t, logits, -jnp.inf), -1)
    return cache, jnp.einsum("bhs,bshd->bhd", a, jnp.repeat(v, 2, axis=2))

  cache, o = jax.jit(lambda: jax.lax.scan(step, jnp.zeros_like(k), jnp.arange(T)))()
  assert_rel_rms(jnp.moveaxis(o, 0, 1), full, 1e-5, "decoding")
  prefill = jax.jit(functools.partial(householder.prefill_keys, chunk_size=8))
  assert_rel_rms(prefill(k, w, beta), cache, 1e-5, "prefill")


@pytest.mark.parametrize("C", [1, 5, 64])
def test_unit_lower_inverse_without_lapack_on_cpu(key, C):
  """The UT transform's (I + L)^{-1} on the CPU: forward substitution equals the float64
  inverse at float32 accuracy (L as the transform builds it, beta in [0, 2] times a Gram
  matrix of unit vectors), and the compiled CPU program calls no LAPACK solve (jaxlib 0.10's
  batched trsm can deadlock XLA:CPU's thread pool when solves run on several devices at once)."""
  kw, kb = jax.random.split(key)
  w = jax.random.normal(kw, (3, C, 2, 8))
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  beta = jax.random.uniform(kb, (3, 2, C), maxval=2.0)
  gram = jnp.einsum("nckd,nlkd->nkcl", w, w)
  lower = jnp.eye(C) + jnp.tril(beta[..., :, None] * gram, -1)
  want = np.linalg.inv(np.asarray(lower, np.float64))
  inverse = jax.jit(householder._unit_lower_inverse)
  assert_rel_rms(inverse(lower), want, 1e-6, f"C={C}")
  hlo = inverse.lower(lower).compile().as_text()
  assert "trsm" not in hlo.lower() and "triangular" not in hlo.lower(), "a LAPACK solve on CPU"
