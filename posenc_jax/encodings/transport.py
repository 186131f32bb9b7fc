"""PaTH encodings (docs/encodings/path.md#path): `path` and `path_fox`, family "path".

Per kv head, from the layer input x (PaTH paper §2):

    w_t    = L2norm(SiLU(ShortConv_W(LowRank_r(x_t))))     r = rank, W = conv_width
    beta_t = 2 sigmoid(u^T x_t + b)                         in (0, 2)
    log f_t = log_sigmoid(w_f^T x_t + b_f)                  per query head, path_fox only

The short convolution is causal and depthwise over the r low-rank channels; it restarts at
every packed-segment start, so w_t never reads another document. q and k pass through
untouched: the transport replaces RoPE. FoX's gate bias starts with gates near 1, at decay
times 1 / (1 - f) spaced log-uniformly over [forget_time_min, forget_time_max] across heads.

Shape letters: B batch, T time, C d_model, H query heads, K kv heads, D head dim, R rank,
W conv width.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax import masking
from posenc_jax.encodings import Prepared
from posenc_jax.encodings import register
from posenc_jax.encodings import resolve_hparams
from posenc_jax.encodings import split_layer_args

HPARAMS = {
    "path": dict(rank=32, conv_width=3),
    "path_fox": dict(rank=32, conv_width=3, forget_time_min=16.0, forget_time_max=4096.0),
}


def _resolve(name: str, hp: dict) -> dict:
  hp = resolve_hparams(name, hp, HPARAMS[name])
  if hp["rank"] < 1 or hp["conv_width"] < 1:
    raise ValueError(f"rank={hp['rank']} and conv_width={hp['conv_width']} must be >= 1")
  if "forget_time_min" in hp and not 1.0 < hp["forget_time_min"] <= hp["forget_time_max"]:
    raise ValueError(f"need 1 < forget_time_min={hp['forget_time_min']} <= "
                     f"forget_time_max={hp['forget_time_max']}")
  return hp


def _check(dims) -> None:
  if dims.num_kv_heads < 1 or dims.num_heads % dims.num_kv_heads:
    raise ValueError(f"num_heads={dims.num_heads} must be a multiple of "
                     f"num_kv_heads={dims.num_kv_heads} for PaTH")


def _normal(key, shape, std):
  return std * jax.random.normal(key, shape, jnp.float32)


def _init_path(key, dims, *, rank, conv_width, **unused):
  del unused
  C, K, D = dims.d_model, dims.num_kv_heads, dims.head_dim
  k_down, k_conv, k_up, k_u = jax.random.split(key, 4)
  return {
      "w_down": _normal(k_down, (C, rank), C**-0.5),
      "w_conv": _normal(k_conv, (conv_width, rank), conv_width**-0.5),
      "w_up": _normal(k_up, (rank, K * D), rank**-0.5),
      "beta_u": _normal(k_u, (C, K), 0.02),     # beta starts near 1, data-dependent
      "beta_b": jnp.zeros((K,), jnp.float32),
  }


def _init_path_fox(key, dims, *, forget_time_min, forget_time_max, **hp):
  k_path, k_f = jax.random.split(key)
  params = _init_path(k_path, dims, **hp)
  H = dims.num_heads
  tau = np.geomspace(forget_time_min, forget_time_max, H)
  params["f_w"] = _normal(k_f, (dims.d_model, H), 0.02)
  params["f_b"] = jnp.asarray(np.log(tau - 1.0), jnp.float32)   # sigmoid(b) = 1 - 1/tau
  return params


def short_conv(z_BTR, kernel_WR, segment_ids=None):
  """Causal depthwise convolution y_t = sum_m kernel[m] z_{t-m}, restarting at segment starts.

  A tap reaches back to t - m only if no segment starts in (t - m, t]; looking at starts (not
  comparing ids) stays correct when ids repeat. Only shifts by fewer than the kernel's width:
  no running count over time, which a T sharded over devices (mesh.context) would turn into
  a gather of T plus a sequential loop of T steps on the GPU.
  """
  T = z_BTR.shape[1]
  out = kernel_WR[0] * z_BTR
  starts = None if segment_ids is None else masking.segment_starts(segment_ids)
  blocked = None                                         # a start in (t - m, t]
  for m in range(1, kernel_WR.shape[0]):
    tap = kernel_WR[m] * jnp.pad(z_BTR, ((0, 0), (m, 0), (0, 0)))[:, :T]
    if starts is not None:
      start_m = jnp.pad(starts, ((0, 0), (m - 1, 0)), constant_values=True)[:, :T]
      blocked = start_m if blocked is None else blocked | start_m
      tap = jnp.where(blocked[..., None], 0.0, tap)
    out = out + tap
  return out


def transport_inputs(params, x_BTC, *, num_kv_heads: int, head_dim: int, segment_ids=None):
  """w [B,T,K,D] (unit rows) and beta [B,T,K] in (0, 2) from the layer input."""
  x = x_BTC.astype(jnp.float32)
  z = short_conv(x @ params["w_down"], params["w_conv"], segment_ids)
  w = (jax.nn.silu(z) @ params["w_up"]).reshape(x.shape[:2] + (num_kv_heads, head_dim))
  w = w * jax.lax.rsqrt(jnp.sum(w * w, axis=-1, keepdims=True) + 1e-12)
  beta = 2.0 * jax.nn.sigmoid(x @ params["beta_u"] + params["beta_b"])
  return w, beta


def _prepare(params, *, x, q, k, v, segment_ids=None, fox: bool, **unused):
  K, D = k.shape[2], k.shape[3]
  if params["w_up"].shape[1] != K * D:
    raise ValueError(f"params['w_up'] has {params['w_up'].shape[1]} outputs; expected "
                     f"num_kv_heads * head_dim = {K} * {D}")
  w, beta = transport_inputs(params, x, num_kv_heads=K, head_dim=D, segment_ids=segment_ids)
  lf = None
  if fox:
    lf = jax.nn.log_sigmoid(x.astype(jnp.float32) @ params["f_w"] + params["f_b"])
  return Prepared("path", q, k, v, {"w": w, "beta": beta, "log_forget": lf})


def _register(name: str, init_fn, *, fox: bool) -> None:
  def init(key, dims, **hp):
    _check(dims)
    return init_fn(key, dims, **_resolve(name, hp))

  def prepare(params, **kw):
    layer, hp = split_layer_args(kw)
    _resolve(name, hp)  # validates; the transport's inputs need no hyperparameter
    return _prepare(params, fox=fox, **layer)

  register(name, family="path", init=init, prepare=prepare, check=_check)


_register("path", _init_path, fox=False)
_register("path_fox", _init_path_fox, fox=True)
