"""Registry entries of the additive encodings: GRAPE-A augmentation, initial states, KV-shift."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import encodings
from posenc_jax import grape_a
from posenc_jax import path_integral
from posenc_jax import unipotent
from posenc_jax.encodings import additive
from tests.util import assert_rel_rms
from tests.util import assert_trees_rel_rms
from tests.util import in_float64
from tests.util import value_and_grads

B, T, C, H, K, D = 2, 29, 16, 4, 2, 8
DIMS = encodings.Dims(d_model=C, num_heads=H, num_kv_heads=K, head_dim=D)
SEG = jnp.stack([(jnp.arange(T) >= 12).astype(jnp.int32), jnp.zeros(T, jnp.int32)])


def _layer(key):
  kx, kq, kk, kv = jax.random.split(key, 4)
  return dict(x=jax.random.normal(kx, (B, T, C)), q=jax.random.normal(kq, (B, T, H, D)),
              k=jax.random.normal(kk, (B, T, K, D)), v=jax.random.normal(kv, (B, T, K, D)),
              positions=None, tokens=None, rng=None, train=False)


def _jit_apply(enc, params, layer, implementation):
  """enc.apply(params, **layer) jitted over layer's x, q, k, v: one compile instead of eager
  op-by-op dispatch (the chunked forms' scans recompile at every eager call; CI time)."""
  f = lambda *xqkv: enc.apply(params, **{**layer, **dict(zip("xqkv", xqkv))},
                              implementation=implementation)
  return jax.jit(f)(*(layer[n] for n in "xqkv"))


def _randomise(params, key):
  """Moves every parameter away from its (often symmetric) initial value."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(kk, x.shape)
                                   for x, kk in zip(leaves, keys)])


@pytest.mark.parametrize("name", ["grape_a_q", "grape_a_k", "grape_a_qk"])
def test_grape_a_fast_path_matches_closed_form(key, name):
  """prepare + attend == the dense closed form in float64: the forward for the closed-form
  "reference" and the lift onto softmax ("chunked", "xla"), every parameter's gradient for
  the closed form.

  The lift's gradients are checked on the attention's own inputs (the next test): through
  the encoding, its log-omega gradient sums every token's rate gradient times its rate, whose
  cancellation turns the lift's float32 rounding (the softmax rows' dS sums times positions,
  attention.grape_a_attention) into up to 1.2e-5 relative over 13 seeds at these shapes."""
  k1, k2, k3 = jax.random.split(key, 3)
  enc = encodings.get(name)
  params = _randomise(enc.init(k1, DIMS), k2)
  layer = _layer(k3)

  def fast(params, q, k, v, impl):
    prep = enc.prepare(params, **{**layer, "q": q, "k": k, "v": v, "segment_ids": SEG})
    return encodings.attend(prep, segment_ids=SEG, implementation=impl)

  def oracle(params, q, k, v):
    lam_q, lam_k = grape_a.grape_a_gates(q, k, params.get("v"), params.get("u"))
    return grape_a.grape_a_attention_reference(q, k, v, omega=jnp.exp(params["log_omega"]),
                                               lam_q=lam_q, lam_k=lam_k, segment_ids=SEG,
                                               scale=D**-0.5)

  args = (params, layer["q"], layer["k"], layer["v"])
  ct = jax.random.normal(k1, (B, T, H, D))
  with_grads = lambda f: value_and_grads(f, lambda o: jnp.sum(o * ct.astype(o.dtype)),
                                         (0, 1, 2, 3))
  # The oracle runs in float64: the log_omega gradient sums every logit, and a float32 oracle's
  # own rounding is of the size of the tolerance.
  want, want_g = in_float64(with_grads(oracle), *args)
  ref_out, ref_g = with_grads(lambda *a: fast(*a, "reference"))(*args)
  assert_rel_rms(ref_out, want, 1e-5, f"{name} reference forward")
  assert_trees_rel_rms(ref_g, want_g, 1e-5, f"{name} reference grads")
  for impl in ("chunked", "xla"):
    f = jax.jit(lambda *a: fast(*a, impl))  # noqa: B023 (one compile instead of eager dispatch)
    assert_rel_rms(f(*args), want, 1e-5, f"{name} {impl} forward")


@pytest.mark.parametrize("gates", ["q", "k", "qk"])
def test_grape_a_attention_lift_matches_closed_form(key, gates):
  """attention.grape_a_attention's lift ("chunked", "xla") and closed form ("reference")
  against the closed form in float64: the output and the gradients of q, k, v and the rates,
  with documents and GQA."""
  from posenc_jax import attention
  ks = jax.random.split(key, 6)
  q = jax.random.normal(ks[0], (B, T, H, D))
  k, v = (jax.random.normal(x, (B, T, K, D)) for x in ks[1:3])
  rq, rk = (jax.random.uniform(x, (B, T, H), maxval=0.5) for x in ks[3:5])
  ct = jax.random.normal(ks[5], (B, T, H, D))

  def run(impl):
    return lambda q, k, v, rq, rk: attention.grape_a_attention(
        q, k, v, rq if "q" in gates else None, rk if "k" in gates else None, segment_ids=SEG,
        implementation=impl)

  with_grads = lambda f: value_and_grads(f, lambda o: jnp.sum(o * ct), (0, 1, 2, 3, 4))  # noqa
  want, want_g = in_float64(with_grads(run("reference")), q, k, v, rq, rk)
  for impl in ("reference", "chunked", "xla"):
    got, got_g = with_grads(run(impl))(q, k, v, rq, rk)
    assert_rel_rms(got, want, 1e-5, f"{impl} o")
    for what, g, w, used in zip(("dq", "dk", "dv", "drate_q", "drate_k"), got_g, want_g,
                                (1, 1, 1, "q" in gates, "k" in gates)):
      if used:
        assert_rel_rms(g, w, 1e-5, f"{impl} {what}")
      else:
        assert not jnp.any(g), f"{impl} {what}"


@pytest.mark.parametrize("variant", ["q", "k", "qk"])
def test_augmentation_is_exact_with_bfloat16_inputs_at_long_range(key, variant):
  """bf16 q/k (products exact, float32 accumulation, as on tensor cores/MXU) at T = 3000.

  The bias near the diagonal of late rows is small while |omega a_i i| is ~10^3: one bf16
  channel carrying omega a_i i would be off by several logits there.
  """
  Tl, Dl = 3000, 8
  k1, k2 = jax.random.split(key)
  q = jax.random.normal(k1, (1, Tl, 1, Dl)).astype(jnp.bfloat16)
  k = jax.random.normal(k2, (1, Tl, 1, Dl)).astype(jnp.bfloat16)
  lam_q = jnp.full((1, Tl, 1), 0.9) if "q" in variant else None
  lam_k = 0.5 + jax.nn.sigmoid(k[..., 0].astype(jnp.float32)) if "k" in variant else None
  omega = jnp.array([0.6])
  q_aug, k_aug, _ = grape_a.grape_a_augment(q, k, k, omega=omega, lam_q=lam_q, lam_k=lam_k,
                                            scale=Dl**-0.5)
  assert q_aug.dtype == jnp.bfloat16 and q_aug.shape[-1] % grape_a.LANE == 0
  s = q_aug.shape[-1] ** -0.5
  rows = jnp.arange(Tl - 40, Tl)                      # late rows, keys within 40 of the diagonal
  qa = q_aug[0, rows, 0, Dl:].astype(jnp.float32)
  ka = k_aug[0, Tl - 80:, 0, Dl:].astype(jnp.float32)
  got = s * jnp.einsum("ic,jc->ij", qa, ka, precision=jax.lax.Precision.HIGHEST)
  pos = jnp.arange(Tl)[None]
  # The gates as the channels carry them: omega * lambda / s rounded to bfloat16.
  used = lambda lam: None if lam is None else (
      (omega * lam / s).astype(jnp.bfloat16).astype(jnp.float32) * s / omega)
  sub = lambda b: np.asarray(b[0, 0][rows][:, Tl - 80:])
  want_used = sub(grape_a.grape_a_bias(omega, used(lam_q), used(lam_k), pos))
  want = sub(grape_a.grape_a_bias(omega, lam_q, lam_k, pos))
  got = np.asarray(got)
  i, j = np.nonzero(np.arange(Tl - 80, Tl)[None, :] <= np.asarray(rows)[:, None])

  def off_by_row_constant(target):  # softmax ignores the dropped omega a_i i term
    diff = got[i, j] - target[i, j]
    return np.abs(diff - np.array([diff[i == r].mean() for r in range(len(rows))])[i])

  assert off_by_row_constant(want_used).max() <= 2e-3, "channel products are not exact"
  assert off_by_row_constant(want).max() <= 2**-7 * np.abs(want[i, j]).max(), "gate rounding"


@pytest.mark.parametrize("name", ["fox", "grape_a_q", "grape_a_k", "grape_a_qk", "grape_ap"])
def test_initial_state_is_alibi(key, name):
  """The documented init: every encoding starts as ALiBi (FoX/GRAPE-AP up to data terms)."""
  k1, k2 = jax.random.split(key)
  layer = {**_layer(k2), "segment_ids": SEG}
  enc = encodings.get(name)
  params = enc.init(k1, DIMS)
  if name == "fox":
    params = {**params, "w_f": jnp.zeros_like(params["w_f"])}   # the data-dependent part
  alibi = _jit_apply(encodings.get("alibi"), {}, layer, "reference")
  if name == "grape_ap":  # mean potential ~ -slope only; exact ALiBi with zero probes
    prep = enc.prepare(params, **layer)
    assert np.all(np.asarray(prep.inputs["alpha"]) >= 0)
    np.testing.assert_allclose(np.asarray(jnp.mean(prep.inputs["p"] ** 2, -1)), 1.0, rtol=1e-4)
    o = unipotent.path_integral_attention_reference(
        layer["q"], layer["k"], layer["v"], jnp.zeros_like(prep.inputs["p"]), prep.inputs["alpha"],
        segment_ids=SEG, scale=D**-0.5)
  else:
    o = _jit_apply(enc, params, layer, "reference")
  assert_rel_rms(o, alibi, 1e-5, f"{name} at init vs alibi")


def test_alibi_and_fox_prepare_the_forgetting_family(key):
  layer = {**_layer(key), "segment_ids": None}
  prep = encodings.get("alibi").prepare({}, **layer)
  assert prep.family == "forgetting"
  np.testing.assert_allclose(np.asarray(prep.inputs["log_forget"][0, 0]),
                             -(2.0 ** (-8.0 * np.arange(1, H + 1) / H)), rtol=1e-6)
  enc = encodings.get("fox")
  params = _randomise(enc.init(key, DIMS), key)
  prep = enc.prepare(params, **layer)
  want = jax.nn.log_sigmoid(layer["x"] @ params["w_f"] + params["b_f"])
  assert prep.family == "forgetting"
  assert_rel_rms(prep.inputs["log_forget"], want, 1e-6)
  assert np.asarray(prep.inputs["log_forget"]).max() <= 0.0


def test_grape_ap_hyperparameter_errors(key):
  with pytest.raises(ValueError, match="d_p=5 must be even"):
    encodings.get("grape_ap", d_p=5).init(key, DIMS)
  with pytest.raises(ValueError, match="unknown hyperparameters"):
    encodings.get("fox", d_p=4).init(key, DIMS)
  with pytest.raises(ValueError, match="modifier"):
    encodings.get("kv_shift").prepare({}, **_layer(key), segment_ids=None)


def _kv_shift_loop(params, x, k, seg):
  """k'_t = a_t k_{t-1} + (1 - a_t) k_t with an explicit loop (k_{-1} = 0 per document)."""
  a = np.asarray(jax.nn.sigmoid(x @ params["w_s"] + params["b_s"]))
  k, seg = np.asarray(k), np.asarray(seg)
  out = np.empty_like(k)
  for b in range(k.shape[0]):
    for t in range(k.shape[1]):
      prev = k[b, t - 1] if t > 0 and seg[b, t] == seg[b, t - 1] else 0.0
      out[b, t] = a[b, t, :, None] * prev + (1 - a[b, t, :, None]) * k[b, t]
  return out


def test_kv_shift_matches_loop_and_does_not_leak(key):
  k1, k2 = jax.random.split(key)
  layer = _layer(k1)
  params = _randomise(additive.kv_shift_init(k2, DIMS), k2)
  k2_, v2_ = additive.kv_shift_apply(params, x=layer["x"], k=layer["k"], v=layer["v"],
                                     segment_ids=SEG)
  np.testing.assert_allclose(np.asarray(k2_), _kv_shift_loop(params, layer["x"], layer["k"], SEG),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(v2_), _kv_shift_loop(params, layer["x"], layer["v"], SEG),
                             rtol=1e-5, atol=1e-6)

  def later_doc(x, k, v):  # row 0: the document starting at t = 12
    ks, vs = additive.kv_shift_apply(params, x=x, k=k, v=v, segment_ids=SEG)
    return jnp.sum(ks[0, 12:] ** 2) + jnp.sum(vs[0, 12:] ** 2)

  grads = jax.grad(later_doc, argnums=(0, 1, 2))(layer["x"], layer["k"], layer["v"])
  for g in grads:
    g = np.abs(np.asarray(g[0]))
    assert g[12:].max() > 0 and g[:12].max() == 0.0, "kv_shift leaks across the document boundary"


def test_kv_shift_composes_with_an_encoding(key):
  """kv_shift then grape_ap, as the model runs them; segment isolation holds end to end."""
  k1, k2, k3 = jax.random.split(key, 3)
  layer = {**_layer(k1), "segment_ids": SEG}
  shift = _randomise(additive.kv_shift_init(k2, DIMS), k2)
  enc = encodings.get("grape_ap", d_p=4)
  params = enc.init(k3, DIMS)

  def out(x, k, v):
    k, v = additive.kv_shift_apply(shift, x=x, k=k, v=v, segment_ids=SEG)
    return enc.apply(params, **{**layer, "x": x, "k": k, "v": v}, implementation="chunked")

  # Jitted: one compile instead of eager op-by-op dispatch (the chunked scans; CI time).
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(out(*a)[0, 12:] ** 2), argnums=(0, 1, 2)))(
      layer["x"], layer["k"], layer["v"])
  for g in grads:
    g = np.abs(np.asarray(g[0]))
    assert g[12:].max() > 0 and g[:12].max() == 0.0


def test_grape_a_positions_restart_per_segment(key):
  """A packed document gets the same GRAPE-A outputs as when it is alone in its row."""
  k1, k2 = jax.random.split(key)
  enc = encodings.get("grape_a_qk")
  params = _randomise(enc.init(k1, DIMS), k1)
  layer = _layer(k2)
  packed = _jit_apply(enc, params, {**layer, "segment_ids": SEG}, "chunked")[0, 12:]
  alone = {**layer, **{n: layer[n][:, 12:] for n in ("x", "q", "k", "v")}}
  single = _jit_apply(enc, params, {**alone, "segment_ids": None}, "reference")[0]
  assert_rel_rms(packed, single, 1e-5, "packed vs alone")
  assert path_integral.segment_positions(SEG, B, T)[0, 12] == 0
