"""Agreement with the reference implementations people compare against (issue 14).

Every expected value here comes from the reference's formula, written again in numpy float64
in the reference's own form (its loops, layouts and rotation signs), not from our code:
  ALiBi slopes       the ALiBi paper's code / BLOOM / GRAPE repo recursion (any head count)
  YaRN               the paper's ramp over turns, transformers' ramp over plane indices
  dynamic NTK        transformers' base * (s L'/L - s + 1)^(D/(D-2))
  Llama 3.1          Meta's per-frequency branches (wavelength bands)
  GRAPE-AP official  model/llama-mha-grape-ap-v1.py: raw query probe, RMS-normalised key probe,
                     half-split probe rotation by -l, fixed ALiBi slopes
  GRAPE-M-ctx off.   model/llama-mha-grape-m-ctx.py: sigmoid((w.x + b)/16), half-split, -phi
  rotate_half        transformers' q cos + rotate_half(q) sin, and the weight permutation
tests/test_transformers_parity.py runs the same comparisons against transformers itself.
"""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import encodings
from posenc_jax import rotations
from posenc_jax import unipotent
from posenc_jax.encodings import Dims
from tests.util import assert_rel_rms
from tests.util import rel_rms

jax.config.update("jax_default_matmul_precision", "highest")

B, T, H, D = 2, 13, 4, 32
POS = np.broadcast_to(np.arange(T), (B, T))


# ----------------------------------------------------------------------------------------
# Reference formulas (numpy float64).


def ref_alibi_slopes(n):
  """The ALiBi paper's get_slopes (Press et al., fairseq), as BLOOM and the GRAPE repo copy it."""
  def power_of_2(n):
    start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]
  if math.log2(n).is_integer():
    return power_of_2(n)
  closest = 2 ** math.floor(math.log2(n))
  return power_of_2(closest) + ref_alibi_slopes(2 * closest)[0::2][: n - closest]


def ref_inv_freq(dim, base):
  return 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def ref_yarn_paper(dim, base, L, s, beta_fast, beta_slow):
  """YaRN paper §3.2: gamma(r) over r = L / lambda, the turns over the training context."""
  inv = ref_inv_freq(dim, base)
  r = L / (2 * np.pi / inv)
  gamma = np.where(r < beta_slow, 0.0, np.where(r > beta_fast, 1.0,
                                                (r - beta_slow) / (beta_fast - beta_slow)))
  return (1 - gamma) * inv / s + gamma * inv


def ref_yarn_hf(dim, base, L, s, beta_fast, beta_slow, truncate=True):
  """transformers' _compute_yarn_parameters (= the original YaRN code, vLLM)."""
  def correction_dim(rotations):
    return dim * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(base))
  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  inv = ref_inv_freq(dim, base)
  return inv / s * (1 - extrapolation) + inv * extrapolation


def ref_dynamic_ntk(dim, base, L, s, seq_len):
  seq_len = max(seq_len, L)
  return ref_inv_freq(dim, base * (s * seq_len / L - (s - 1)) ** (dim / (dim - 2)))


def ref_llama3(dim, base, factor, low_freq_factor, high_freq_factor, old_context_len):
  """Meta's apply_scaling (llama-models), one frequency at a time."""
  low_wavelen, high_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
  out = []
  for freq in ref_inv_freq(dim, base):
    wavelen = 2 * math.pi / freq
    if wavelen < high_wavelen:
      out.append(freq)
    elif wavelen > low_wavelen:
      out.append(freq / factor)
    else:
      smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out)


def hf_rotate(x, angles):
  """transformers: x cos + rotate_half(x) sin, cos = cat(cos, cos); x [.., D], angles [.., D/2]."""
  both = np.concatenate([angles, angles], -1)
  cos, sin = np.cos(both), np.sin(both)
  half = x.shape[-1] // 2
  return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def adjacent_rotate(x, angles):
  """R(angles) on adjacent pairs (x[2m], x[2m+1]) (docs/encodings.md#conventions), float64."""
  c, s = np.cos(angles), np.sin(angles)
  out = np.empty_like(x)
  out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
  out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
  return out


def causal_attention(q, k, v, bias=None):
  """softmax(q.k / sqrt(D) + bias) v, causal, float64; q, k, v [B, T, H, D], bias [B, H, T, T]."""
  logits = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1])
  if bias is not None:
    logits = logits + bias
  n = q.shape[1]
  logits = np.where(np.tril(np.ones((n, n), bool)), logits, -np.inf)
  a = np.exp(logits - logits.max(-1, keepdims=True))
  a /= a.sum(-1, keepdims=True)
  return np.einsum("bhij,bjhd->bihd", a, v)


def signed_interleave(x):
  """F P x on the last axis: (P x)[2m] = x[m], (P x)[2m+1] = x[m + D/2], then odd signs flipped.

  R_adjacent(+a) F P = F P R_half(-a): the official GRAPE code's half-split rotation by -angle
  is ours after this fixed signed permutation (which RMSNorm and dot products ignore).
  """
  half = x.shape[-1] // 2
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = x[..., :half], -x[..., half:]
  return out


def _random(key, *shapes):
  keys = jax.random.split(key, len(shapes))
  return [np.asarray(jax.random.normal(k, s), np.float64) for k, s in zip(keys, shapes)]


def _prepare(name, q, k, **kwargs):
  layer = dict(x=None, q=jnp.asarray(q, jnp.float32), k=jnp.asarray(k, jnp.float32),
               v=jnp.asarray(k, jnp.float32), positions=jnp.asarray(POS), segment_ids=None,
               tokens=None, rng=None, train=False)
  return encodings.get(name, **kwargs).prepare({}, **layer)


# ----------------------------------------------------------------------------------------
# ALiBi slopes for any head count.


def test_alibi_slopes_follow_the_reference_rule_for_every_head_count():
  for h in range(1, 41):
    np.testing.assert_allclose(unipotent.alibi_slopes(h), ref_alibi_slopes(h), rtol=1e-7,
                               err_msg=f"num_heads={h}")
  # The example: H = 6.
  np.testing.assert_allclose(unipotent.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
  with pytest.raises(ValueError, match="num_heads=0"):
    unipotent.alibi_slopes(0)


def test_every_alibi_style_slope_uses_the_reference_slopes(key):
  """H = 6: ALiBi's gate (the forgetting kernel's input) and every ALiBi-initialised slope."""
  Hs = 6
  dims = Dims(d_model=8, num_heads=Hs, num_kv_heads=Hs, head_dim=8)
  want = np.array(ref_alibi_slopes(Hs))
  q, k, v = _random(key, (1, 9, Hs, 8), (1, 9, Hs, 8), (1, 9, Hs, 8))
  layer = dict(x=jnp.zeros((1, 9, 8)), q=jnp.asarray(q, jnp.float32), k=jnp.asarray(k, jnp.float32),
               v=jnp.asarray(v, jnp.float32), positions=None, segment_ids=None, tokens=None,
               rng=None, train=False)
  alibi = encodings.get("alibi")
  gate = alibi.prepare({}, **layer).inputs["log_forget"]
  np.testing.assert_allclose(gate[0, 3], -want, rtol=1e-6)
  fox = encodings.get("fox").init(key, dims)
  np.testing.assert_allclose(-jax.nn.log_sigmoid(fox["b_f"]), want, rtol=1e-5)
  omega = np.exp(encodings.get("grape_a_qk").init(key, dims)["log_omega"])
  np.testing.assert_allclose(omega * 2 * np.log(2.0), want, rtol=1e-5)
  for variant, per in (("paper", np.log(2.0)), ("official", 1.0)):
    ap = encodings.get("grape_ap", variant=variant).init(key, dims)
    np.testing.assert_allclose(jax.nn.softplus(ap["alpha_raw"]) * per, want, rtol=1e-5)
  # ALiBi attention end to end against the dense reference bias -slope_h (i - j).
  i, j = np.arange(9)[:, None], np.arange(9)[None, :]
  expected = causal_attention(q, k, v, -want[None, :, None, None] * (i - j))
  for impl in ("reference", "chunked"):
    assert_rel_rms(alibi.apply({}, implementation=impl, **layer), expected, 1e-5, impl)


# ----------------------------------------------------------------------------------------
# RoPE scaling: YaRN (two ramps), dynamic NTK, Llama 3.1.

YARN_CASES = [  # (head_dim, base, train_len, scale, beta_fast, beta_slow)
    (32, 10000.0, 256, 4.0, 32.0, 1.0),
    (64, 10000.0, 4096, 8.0, 32.0, 1.0),
    (128, 1e6, 32768, 4.0, 32.0, 1.0),
    (16, 500.0, 64, 2.5, 8.0, 2.0),
]


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_frequencies_match_both_reference_ramps(case):
  dim, base, L, s, bf, bs = case
  kw = dict(base=base, scale=s, train_len=L, beta_fast=bf, beta_slow=bs)
  paper = np.asarray(rotations.yarn_frequencies(dim, **kw))
  np.testing.assert_allclose(paper, ref_yarn_paper(dim, base, L, s, bf, bs), rtol=2e-6)
  for truncate in (True, False):
    hf = np.asarray(rotations.yarn_frequencies(dim, ramp="hf", truncate=truncate, **kw))
    np.testing.assert_allclose(hf, ref_yarn_hf(dim, base, L, s, bf, bs, truncate), rtol=2e-6)
  # The two ramps are different functions (the issue: 22-49% apart inside the ramp).
  assert np.abs(hf / paper - 1).max() > 0.05


def test_yarn_ramp_errors():
  with pytest.raises(ValueError, match="ramp='linear'"):
    rotations.yarn_frequencies(8, scale=2.0, train_len=64, ramp="linear")
  with pytest.raises(ValueError, match="truncate=False"):
    rotations.yarn_frequencies(8, scale=2.0, train_len=64, truncate=False)


def test_rope_yarn_hf_ramp_rotates_as_the_reference(key):
  q, k = _random(key, (B, T, H, D), (B, T, H, D))
  prep = _prepare("rope_yarn", q, k, train_len=64, eval_len=256, ramp="hf", attention_factor=1.3)
  angles = POS[..., None, None] * ref_yarn_hf(D, 10000.0, 64, 4.0, 32.0, 1.0)
  assert_rel_rms(prep.q, 1.3 * adjacent_rotate(q, angles), 1e-6, "q")
  assert_rel_rms(prep.k, 1.3 * adjacent_rotate(k, angles), 1e-6, "k")
  with pytest.raises(ValueError, match="attention_factor=0.0 must be positive"):
    _prepare("rope_yarn", q, k, attention_factor=0.0)


def test_dynamic_ntk_is_transformers_dynamic(key):
  q, k = _random(key, (B, T, H, D), (B, T, H, D))
  for L in (8, 13, 20):   # L' = max(positions) + 1 = 13: scaled, boundary, plain RoPE
    prep = _prepare("rope_ntk", q, k, variant="dynamic", train_len=L, eval_len=3 * L)
    angles = POS[..., None, None] * ref_dynamic_ntk(D, 10000.0, L, 3.0, T)
    assert_rel_rms(prep.q, adjacent_rotate(q, angles), 1e-6, f"L={L}")
  plain = _prepare("rope", q, k)
  assert_rel_rms(prep.q, plain.q, 1e-6, "L' <= L is RoPE")
  static = _prepare("rope_ntk", q, k, train_len=8, eval_len=24)
  dynamic = _prepare("rope_ntk", q, k, variant="dynamic", train_len=8, eval_len=24)
  assert rel_rms(static.q, dynamic.q) > 1e-3  # different variants at factor 3
  with pytest.raises(ValueError, match="variant='dynamik'"):
    _prepare("rope_ntk", q, k, variant="dynamik")


def test_llama3_frequencies_match_meta_reference():
  # Llama 3.1's own configuration: all three wavelength bands occur over 64 planes.
  want = ref_llama3(128, 500000.0, 8.0, 1.0, 4.0, 8192)
  got = np.asarray(rotations.llama3_frequencies(128))
  np.testing.assert_allclose(got, want, rtol=2e-6)
  inv = ref_inv_freq(128, 500000.0)
  assert (np.isclose(want, inv)).any() and (np.isclose(want, inv / 8)).any()
  assert (~np.isclose(want, inv) & ~np.isclose(want, inv / 8)).sum() >= 3   # the smooth band
  got = np.asarray(rotations.llama3_frequencies(16, base=100.0, factor=3.0, train_len=40,
                                                low_freq_factor=0.5, high_freq_factor=3.0))
  np.testing.assert_allclose(got, ref_llama3(16, 100.0, 3.0, 0.5, 3.0, 40), rtol=2e-6)
  with pytest.raises(ValueError, match="high_freq_factor=1.0"):
    rotations.llama3_frequencies(16, low_freq_factor=1.0, high_freq_factor=1.0)


def test_rope_llama3_encoding_rotates_as_the_reference(key):
  q, k = _random(key, (B, T, H, D), (B, T, H, D))
  kw = dict(base=1000.0, train_len=64, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0)
  want = ref_llama3(D, 1000.0, 4.0, 1.0, 4.0, 64)
  for layout, rot in (("interleaved", adjacent_rotate), ("half", hf_rotate)):
    prep = _prepare("rope_llama3", q, k, layout=layout, **kw)
    assert_rel_rms(prep.q, rot(q, POS[..., None, None] * want), 1e-6, layout)


# ----------------------------------------------------------------------------------------
# GRAPE's official-code variants.


def test_grape_ap_official_variant_matches_the_official_code(key):
  """Official: bias_ij = sum_{l in (j, i]} slope_h log_sigmoid(<a_i, R_half(-l) b_l> / P),
  a = W x raw, b = rms_norm(a) (eps = float32 eps, no weight)."""
  Tn, Hn, C, P = 11, 3, 12, 8
  q, k, v, x, w = _random(key, (1, Tn, Hn, 8), (1, Tn, Hn, 8), (1, Tn, Hn, 8), (1, Tn, C),
                          (C, Hn, P))
  a = np.einsum("btc,chp->bthp", x, w)
  b = a / np.sqrt(np.mean(a * a, -1, keepdims=True) + np.finfo(np.float32).eps)
  l = np.arange(Tn)[None, :, None, None]
  b1, b2 = b[..., : P // 2], b[..., P // 2:]
  b_rot = np.concatenate([b1 * np.cos(l) + b2 * np.sin(l), -b1 * np.sin(l) + b2 * np.cos(l)], -1)
  z = np.einsum("bihp,blhp->bhil", a, b_rot) / P
  slopes = np.array(ref_alibi_slopes(Hn))
  psi = slopes[None, :, None, None] * -np.logaddexp(0.0, -z)           # slope * log_sigmoid(z)
  psi = np.where(np.tril(np.ones((Tn, Tn), bool)), psi, 0.0)
  bias = psi.sum(-1, keepdims=True) - np.cumsum(psi, -1)                # sum over l > j
  expected = causal_attention(q, k, v, bias)

  dims = Dims(d_model=C, num_heads=Hn, num_kv_heads=Hn, head_dim=8)
  layer = dict(x=jnp.asarray(x, jnp.float32), q=jnp.asarray(q, jnp.float32),
               k=jnp.asarray(k, jnp.float32), v=jnp.asarray(v, jnp.float32),
               positions=None, segment_ids=None, tokens=None, rng=None, train=False)
  eps = float(np.finfo(np.float32).eps)
  enc = encodings.get("grape_ap", d_p=P, eps=eps, variant="official")
  params = {**enc.init(key, dims), "w_p": jnp.asarray(signed_interleave(w), jnp.float32)}
  for impl in ("reference", "chunked"):
    assert_rel_rms(enc.apply(params, implementation=impl, **layer), expected, 1e-5, impl)
  o_paper = encodings.get("grape_ap", d_p=P, eps=eps).apply(params, implementation="reference",
                                                            **layer)
  assert rel_rms(o_paper, expected) > 1e-3, "the paper's form should differ from the official code"
  with pytest.raises(ValueError, match="variant='offical'"):
    encodings.get("grape_ap", variant="offical").init(key, dims)


def test_grape_m_ctx_official_variant_matches_the_official_code(key):
  """Official: w_t = sigmoid((u.x_t + c)/16), Phi_t = cumsum(w) - w, q, k rotated half-split by
  -Phi_t theta; our adjacent-pair +Phi_t theta equals it after a signed channel permutation."""
  Tn, Hn, C, Dn = 10, 2, 12, 8
  q, k, v, x, u, lt = _random(key, (1, Tn, Hn, Dn), (1, Tn, Hn, Dn), (1, Tn, Hn, Dn), (1, Tn, C),
                              (C,), (Dn // 2,))
  u, c, log_theta = 2.0 * u, 3.0, np.log(rotations.rope_frequencies(Dn, base=100.0)) + 0.2 * lt
  w = 1.0 / (1.0 + np.exp(-(x @ u + c) / 16.0))
  phi = np.cumsum(w, 1) - w
  ang = phi[..., None, None] * np.exp(log_theta)

  def official_rotate(y):
    y1, y2 = y[..., : Dn // 2], y[..., Dn // 2:]
    return np.concatenate([y1 * np.cos(ang) + y2 * np.sin(ang),
                           -y1 * np.sin(ang) + y2 * np.cos(ang)], -1)

  expected = causal_attention(official_rotate(q), official_rotate(k), v)
  dims = Dims(d_model=C, num_heads=Hn, num_kv_heads=Hn, head_dim=Dn)
  enc = encodings.get("grape_m_ctx", variant="official")
  params = enc.init(key, dims)
  np.testing.assert_allclose(jax.nn.sigmoid(params["c"] / 16), 0.3937, atol=1e-4)  # official init
  params = {**params, "u": jnp.asarray(u, jnp.float32), "c": jnp.asarray(c, jnp.float32),
            "log_theta": jnp.broadcast_to(jnp.asarray(log_theta, jnp.float32), (Hn, Dn // 2))}
  layer = dict(x=jnp.asarray(x, jnp.float32), q=jnp.asarray(signed_interleave(q), jnp.float32),
               k=jnp.asarray(signed_interleave(k), jnp.float32), v=jnp.asarray(v, jnp.float32),
               positions=jnp.asarray(np.broadcast_to(np.arange(Tn), (1, Tn))), segment_ids=None,
               tokens=None, rng=None, train=False)
  assert_rel_rms(enc.apply(params, implementation="reference", **layer), expected, 1e-5)
  paper = encodings.get("grape_m_ctx").apply(params, implementation="reference", **layer)
  assert rel_rms(paper, expected) > 1e-3, "the paper's softplus gate should differ"
  with pytest.raises(ValueError, match="variant='sigmoid'"):
    encodings.get("grape_m_ctx", variant="sigmoid").init(key, dims)


# ----------------------------------------------------------------------------------------
# transformers' rotate_half layout and configs.


def test_weight_permutation_turns_half_split_rope_into_adjacent_pairs(key):
  C, K = 24, 2
  x, wq, wk, bq = _random(key, (B, T, C), (C, H * D), (C, K * D), (H * D,))
  inv = ref_inv_freq(D, 10000.0)
  ang = POS[..., None, None] * inv
  q_hf = hf_rotate((x @ wq + bq).reshape(B, T, H, D), ang)
  k_hf = hf_rotate((x @ wk).reshape(B, T, K, D), ang)
  logits_hf = np.einsum("bihd,bjhd->bhij", q_hf, np.repeat(k_hf, H // K, 2))

  wq2 = encodings.half_to_interleaved(wq, head_dim=D)
  bq2 = encodings.half_to_interleaved(bq, head_dim=D)
  wk2 = encodings.half_to_interleaved(wk, head_dim=D)
  q = jnp.asarray((x @ wq2 + bq2).reshape(B, T, H, D), jnp.float32)
  k = jnp.asarray((x @ wk2).reshape(B, T, K, D), jnp.float32)
  q_ours = rotations.rope(q, jnp.asarray(POS))
  k_ours = rotations.rope(k, jnp.asarray(POS))
  perm = np.stack([np.arange(D // 2), np.arange(D // 2) + D // 2], -1).reshape(-1)
  assert_rel_rms(q_ours, q_hf[..., perm], 1e-6, "rotated q, permuted")
  logits = jnp.einsum("bihd,bjhd->bhij", q_ours, jnp.repeat(k_ours, H // K, 2))
  assert_rel_rms(logits, logits_hf, 1e-6, "logits")
  # Unpermuted weights with layout="half" compute transformers' rotation directly.
  q_half = rotations.rope(jnp.asarray((x @ wq + bq).reshape(B, T, H, D), jnp.float32),
                          jnp.asarray(POS), layout="half")
  assert_rel_rms(q_half, q_hf, 1e-6, "layout='half'")
  # torch's [out, in] weights (axis 0), the inverse, and jax arrays.
  np.testing.assert_array_equal(encodings.half_to_interleaved(wq.T, head_dim=D, axis=0), wq2.T)
  np.testing.assert_array_equal(encodings.interleaved_to_half(wq2, head_dim=D), wq)
  on_device = encodings.half_to_interleaved(jnp.asarray(wq), head_dim=D)
  np.testing.assert_array_equal(np.asarray(on_device), wq2.astype(np.float32))
  with pytest.raises(ValueError, match=r"w.shape\[-1\]=100 must be a multiple of head_dim=32"):
    encodings.half_to_interleaved(np.zeros((3, 100)), head_dim=D)


def _hf_reference_q(config, q):
  """q rotated as transformers would for `config` (a dict): numpy float64, half layout."""
  rs = config.get("rope_scaling") or config.get("rope_parameters") or {}
  kind = rs.get("rope_type", rs.get("type", "default"))
  base = rs.get("rope_theta", config.get("rope_theta", 10000.0))
  dim, att = q.shape[-1], 1.0
  L = config.get("max_position_embeddings")
  L0 = rs.get("original_max_position_embeddings", L)
  if kind == "default":
    inv = ref_inv_freq(dim, base)
  elif kind == "linear":
    inv = ref_inv_freq(dim, base) / rs["factor"]
  elif kind == "dynamic":
    inv = ref_dynamic_ntk(dim, base, L, rs["factor"], T)
  elif kind == "llama3":
    inv = ref_llama3(dim, base, rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], L0)
  else:
    s = rs.get("factor") or L / L0
    mscale = lambda m: 0.1 * m * math.log(s) + 1.0
    if rs.get("attention_factor"):
      att = rs["attention_factor"]
    elif rs.get("mscale") and rs.get("mscale_all_dim"):
      att = mscale(rs["mscale"]) / mscale(rs["mscale_all_dim"])
    else:
      att = mscale(1.0)
    inv = ref_yarn_hf(dim, base, L0, s, rs.get("beta_fast") or 32, rs.get("beta_slow") or 1,
                      rs.get("truncate", True))
  return att * hf_rotate(q, POS[..., None, None] * inv)


HF_CONFIGS = {
    "no scaling": dict(rope_theta=5e5, max_position_embeddings=64, head_dim=D),
    "linear": dict(rope_scaling={"type": "linear", "factor": 2.0}, max_position_embeddings=64),
    "dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 3.0}, rope_theta=500.0,
                    max_position_embeddings=8, hidden_size=4 * D, num_attention_heads=4),
    "llama3.1": dict(rope_theta=500.0, max_position_embeddings=256, head_dim=D,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    "qwen2.5 yarn": dict(max_position_embeddings=1024, rope_theta=1e4,
                         rope_scaling={"type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 256}),
    "deepseek yarn": dict(max_position_embeddings=640, rope_theta=1e4, rope_scaling={
        "type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
        "mscale_all_dim": 0.5, "original_max_position_embeddings": 16}),
    "gpt-oss yarn": dict(max_position_embeddings=512, rope_parameters={
        "rope_type": "yarn", "rope_theta": 15e4, "factor": 8.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
    "yarn, factor from lengths": dict(max_position_embeddings=1024, rope_parameters={
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 128,
        "attention_factor": 1.25}),
}


@pytest.mark.parametrize("which", sorted(HF_CONFIGS))
def test_from_hf_rope_rotates_as_transformers_formulas(key, which):
  config = HF_CONFIGS[which]
  name, kwargs = encodings.from_hf_rope(config)
  q, k = _random(key, (B, T, H, D), (B, T, H, D))
  assert_rel_rms(_prepare(name, q, k, **kwargs).q, _hf_reference_q(config, q), 1e-6, which)
  # The same model with its q/k weights permuted runs in our adjacent-pair layout.
  name2, kwargs2 = encodings.from_hf_rope(config, layout="interleaved")
  perm = np.stack([np.arange(D // 2), np.arange(D // 2) + D // 2], -1).reshape(-1)
  got = _prepare(name2, q[..., perm], k[..., perm], **kwargs2).q
  assert_rel_rms(got, _hf_reference_q(config, q)[..., perm], 1e-6, f"{which} interleaved")


def test_from_hf_rope_names_and_kwargs():
  name, kw = encodings.from_hf_rope(HF_CONFIGS["no scaling"])
  assert (name, kw) == ("rope", {"base": 5e5, "layout": "half"})
  name, kw = encodings.from_hf_rope(HF_CONFIGS["qwen2.5 yarn"])
  assert name == "rope_yarn" and kw["ramp"] == "hf" and kw["truncate"] is True
  assert (kw["train_len"], kw["eval_len"], kw["attention_factor"]) == (256, 1024, None)
  name, kw = encodings.from_hf_rope(HF_CONFIGS["dynamic"])
  assert (name, kw["variant"], kw["train_len"], kw["eval_len"]) == ("rope_ntk", "dynamic", 8, 24)
  name, kw = encodings.from_hf_rope(HF_CONFIGS["llama3.1"])
  assert name == "rope_llama3" and kw == dict(base=500.0, layout="half", train_len=64, factor=8.0,
                                              low_freq_factor=1.0, high_freq_factor=4.0)
  # A top-level original_max_position_embeddings wins, as in transformers (Phi-3 style).
  cfg = {**HF_CONFIGS["llama3.1"], "original_max_position_embeddings": 32}
  assert encodings.from_hf_rope(cfg)[1]["train_len"] == 32


@pytest.mark.parametrize("config,field", [
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}),
     "rope_scaling.rope_type='longrope'"),
    (dict(rope_parameters={"rope_type": "default", "mrope_section": [2, 2]}),
     "rope_parameters.mrope_section"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
     "rope_scaling.low_freq_factor is required"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling.factor is required"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0.5}, max_position_embeddings=8),
     "rope_scaling.factor=0.5"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "max_position_embeddings is required"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}}),
     "rope_parameters.full_attention: per-layer"),
    (dict(rope_theta="big"), "rope_theta='big'"),
    (dict(head_dim=7), "head_dim=7"),
    (dict(rope_scaling=[1, 2]), "rope_scaling must be a dict"),
    (dict(rotary_pct=0.25, rotary_emb_base=10000), "rotary_pct=0.25 is not supported"),
])
def test_from_hf_rope_errors_name_the_field(config, field):
  with pytest.raises(ValueError, match=re.escape(field)):
    encodings.from_hf_rope(config)
