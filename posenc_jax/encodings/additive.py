"""Additive encodings, docs/encodings/additive.md#additive-encodings: ALiBi, FoX, GRAPE-A/AP,
KV-shift.

  alibi        family "forgetting": constant gate log_forget[..., h] = -slope_h, no parameters.
  fox          family "forgetting": log_forget = log_sigmoid(x W_f + b_f) per query head.
  grape_a_*    family "grape_a": per-token rates omega_h softplus(v_h.q_i/sqrt D) and
               omega_h softplus(u_h.k_j/sqrt D), b_ij = -(i-j) (rate_q_i + rate_k_j);
               attention.grape_a_attention lifts them into exact extra q / k channels
               (posenc_jax.grape_a.grape_a_augment) for any softmax kernel, or computes the
               bias in the tiles of its Pallas kernel.
  grape_ap     family "path_integral": p_t = RMSNorm(W_p x_t) per head (d_p channels),
               alpha_h = softplus(raw_h) >= 0. variant="paper" (default) uses these probes on
               both sides of <p_i, R_l p_l>, as GRAPE §5 writes it; variant="official" is the
               official GRAPE code (model/llama-mha-grape-ap-v1.py): RMSNorm on the key-side
               probe p_l only, the raw projection W_p x_i on the query side. What else that
               code does needs no variant: its half-split rotation of p_l by -l is ours after
               a signed permutation of W_p's columns, its fixed alpha_h = slope_h is our
               initial value, its unweighted RMSNorm our initial p_scale = 1 (its eps is
               float32's machine epsilon: pass eps=1.19e-7 to match it to the last bit).
  kv_shift     modifier: k'_t = a_t k_{t-1} + (1 - a_t) k_t (same for v), a_t =
               sigmoid(x_t W_s + b_s) per kv head, k_{-1} = 0 at segment starts. The model
               applies it through kv_shift_init / kv_shift_apply (config.model.kv_shift).

Initialisation. Every learned slope starts at the ALiBi slopes (unipotent.alibi_slopes: 2^(-8h/H)
for H a power of two, the ALiBi reference code's rule for other H), so each additive encoding
begins as ALiBi plus a small data-dependent part:
  fox       b_f,h = -log(expm1(slope_h)), i.e. log f = -slope_h (gates near 1, decay time
            1/slope_h: the FoX paper's decay-time bias init with its T_min..T_max replaced by
            the ALiBi range); W_f ~ N(0, 0.02^2) as FoX's initializer_range.
            bias_init="zero" gives the FoX paper's plain data-dependent gate (f = 0.5).
  grape_a   v, u = 0 so every gate is softplus(0) = log 2, and omega_h = slope_h / (n log 2)
            with n the number of gates (1 or 2): the initial bias is exactly ALiBi.
  grape_ap  alpha_h = slope_h / log 2: psi = alpha log_sigmoid(z), z in [-1, 1] after the
            RMSNorm, so the mean edge potential is about -slope_h. variant="official" starts
            at alpha_h = slope_h, the official code's (fixed) head scalars.
  kv_shift  W_s ~ N(0, 0.02^2), b_s = 0: a_t ~ 0.5, as the shift gates of FoX-Pro.

Shape letters: B batch, T time, C d_model, H query heads, K kv heads, D head dim, P = d_p.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax import _checks
from posenc_jax import grape_a
from posenc_jax import masking
from posenc_jax import unipotent
from posenc_jax.encodings import Prepared
from posenc_jax.encodings import register
from posenc_jax.encodings import resolve_hparams
from posenc_jax.encodings import split_layer_args

_GATE_STD = 0.02  # FoX's initializer_range for gate projections

HPARAMS = {
    "alibi": {},
    "fox": dict(bias_init="alibi"),
    "grape_a_q": {},
    "grape_a_k": {},
    "grape_a_qk": {},
    "grape_ap": dict(d_p=16, eps=1e-6, variant="paper"),
}




def _add(name, family, init_fn, prepare_fn):
  """Registers `name`: hyperparameters are validated and defaulted from HPARAMS."""

  def init(key, dims, **hp):
    return init_fn(key, dims, **resolve_hparams(name, hp, HPARAMS[name]))

  def prepare(params, **kw):
    layer, hp = split_layer_args(kw)
    return prepare_fn(params, layer, **resolve_hparams(name, hp, HPARAMS[name]))

  register(name, family=family, init=init, prepare=prepare)


def _inv_softplus(y):
  return np.log(np.expm1(y))


# ALiBi and FoX ----------------------------------------------------------------------------

def _alibi_init(key, dims):
  del key, dims
  return {}


def _alibi_prepare(params, layer):
  del params
  q = layer["q"]
  B, T, H, _ = q.shape
  return Prepared("forgetting", q, layer["k"], layer["v"],
                  {"log_forget": unipotent.alibi_log_forget(B, T, H)})


def _fox_init(key, dims, *, bias_init):
  if bias_init not in ("alibi", "zero"):
    raise ValueError(f"bias_init={bias_init!r} must be 'alibi' or 'zero'")
  slopes = unipotent.alibi_slopes(dims.num_heads)
  b = -np.log(np.expm1(slopes)) if bias_init == "alibi" else np.zeros_like(slopes)
  return {"w_f": _GATE_STD * jax.random.normal(key, (dims.d_model, dims.num_heads)),
          "b_f": jnp.asarray(b, jnp.float32)}


def _fox_prepare(params, layer, *, bias_init):
  del bias_init
  x = layer["x"].astype(jnp.float32)
  log_forget = jax.nn.log_sigmoid(x @ params["w_f"] + params["b_f"])
  return Prepared("forgetting", layer["q"], layer["k"], layer["v"], {"log_forget": log_forget})


_add("alibi", "forgetting", _alibi_init, _alibi_prepare)
_add("fox", "forgetting", _fox_init, _fox_prepare)


# GRAPE-A ----------------------------------------------------------------------------------

def _grape_a(q_gate: bool, k_gate: bool):
  n_gates = int(q_gate) + int(k_gate)

  def init(key, dims):
    del key
    H, D = dims.num_heads, dims.head_dim
    omega = unipotent.alibi_slopes(H) / (n_gates * math.log(2.0))
    params = {"log_omega": jnp.asarray(np.log(omega), jnp.float32)}
    if q_gate:
      params["v"] = jnp.zeros((H, D), jnp.float32)
    if k_gate:
      params["u"] = jnp.zeros((H, D), jnp.float32)
    return params

  def prepare(params, layer):
    q, k, v = layer["q"], layer["k"], layer["v"]
    lam_q, lam_k = grape_a.grape_a_gates(q, k, params.get("v"), params.get("u"))
    omega = jnp.exp(params["log_omega"])[None, None, :]
    rate = lambda lam: None if lam is None else omega * lam  # noqa: E731
    return Prepared("grape_a", q, k, v, {"rate_q": rate(lam_q), "rate_k": rate(lam_k)})

  return init, prepare


for _name, _gates in (("grape_a_q", (True, False)), ("grape_a_k", (False, True)),
                      ("grape_a_qk", (True, True))):
  _add(_name, "grape_a", *_grape_a(*_gates))


# GRAPE-AP ---------------------------------------------------------------------------------

_AP_VARIANTS = ("paper", "official")


def _check_d_p(d_p, variant="paper"):
  _checks.check_even("d_p", d_p)
  if d_p <= 0:
    raise ValueError(f"d_p={d_p} must be a positive even number")
  if variant not in _AP_VARIANTS:
    raise ValueError(f"variant={variant!r} must be one of {_AP_VARIANTS}")


def _grape_ap_init(key, dims, *, d_p, eps, variant):
  del eps
  _check_d_p(d_p, variant)
  H, C = dims.num_heads, dims.d_model
  alpha = unipotent.alibi_slopes(H) / (math.log(2.0) if variant == "paper" else 1.0)
  return {"w_p": jax.random.normal(key, (C, H, d_p)) / C**0.5,
          "p_scale": jnp.ones((H, d_p), jnp.float32),
          "alpha_raw": jnp.asarray(_inv_softplus(alpha), jnp.float32)}


def raw_probes(params, x_BTC):
  """W_p x_t per head, not normalised: [B, T, H, P] float32 (the official code's query probes)."""
  return jnp.einsum("btc,chp->bthp", x_BTC.astype(jnp.float32), params["w_p"])


def probes(params, x_BTC, *, eps):
  """p_t = RMSNorm(W_p x_t) per head: [B, T, H, P] float32."""
  p = raw_probes(params, x_BTC)
  p = p * jax.lax.rsqrt(jnp.mean(p * p, axis=-1, keepdims=True) + eps)
  return p * params["p_scale"]


def _grape_ap_prepare(params, layer, *, d_p, eps, variant):
  _check_d_p(d_p, variant)
  inputs = {"p": probes(params, layer["x"], eps=eps), "alpha": jax.nn.softplus(params["alpha_raw"])}
  if variant == "official":
    inputs["p_query"] = raw_probes(params, layer["x"])
  return Prepared("path_integral", layer["q"], layer["k"], layer["v"], inputs)


_add("grape_ap", "path_integral", _grape_ap_init, _grape_ap_prepare)


# KV-shift (modifier) ----------------------------------------------------------------------

def kv_shift_init(key, dims):
  """Parameters of the KV-shift gate a_t = sigmoid(x_t W_s + b_s): W_s [C, K], b_s [K]."""
  return {"w_s": _GATE_STD * jax.random.normal(key, (dims.d_model, dims.num_kv_heads)),
          "b_s": jnp.zeros((dims.num_kv_heads,), jnp.float32)}


def kv_shift_apply(params, *, x, k, v, segment_ids=None):
  """k'_t = a_t k_{t-1} + (1 - a_t) k_t and the same for v; k_{-1} = 0 at segment starts.

  x [B, T, C]; k [B, T, K, D]; v [B, T, K, Dv]; segment_ids [B, T] -> (k', v') in their dtypes.
  """
  B, T, K = k.shape[:3]
  _checks.check_shape("params['w_s']", params["w_s"], (x.shape[-1], K), "CK")
  _checks.check_segment_ids(segment_ids, B, T)
  a = jax.nn.sigmoid(x.astype(jnp.float32) @ params["w_s"] + params["b_s"])[..., None]
  if segment_ids is None:
    first = jnp.zeros((B, T), bool).at[:, 0].set(True)
  else:
    first = masking.segment_starts(segment_ids)
  keep = ~first[:, :, None, None]  # no previous token inside this document: shift in zeros

  def shift(y):
    prev = jnp.concatenate([jnp.zeros_like(y[:, :1]), y[:, :-1]], axis=1)
    prev = jnp.where(keep, prev, 0).astype(jnp.float32)
    return (a * prev + (1.0 - a) * y.astype(jnp.float32)).astype(y.dtype)

  return shift(k), shift(v)


def _kv_shift_prepare(params, **unused):
  del params, unused
  raise ValueError("kv_shift is a modifier, not an attention encoding: enable it with "
                   "config.model.kv_shift=True (kv_shift_init / kv_shift_apply) alongside "
                   "an encoding")


register("kv_shift", family="modifier", init=kv_shift_init, prepare=_kv_shift_prepare)
