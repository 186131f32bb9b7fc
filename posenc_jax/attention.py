"""Causal attention entry points, one per family, with `implementation=` dispatch.

Each public function validates its arguments once (shapes, ranges, implementation name) and
hands plain arrays to an implementation in the family's module:

  reference  dense O(T^2) jnp oracle: trivially correct, holds a T x T array
  xla        jax.nn.dot_product_attention (plain softmax family only; cuDNN on GPU)
  scan       PaTH only: cumulative Householder products by lax.associative_scan
  chunked    blockwise jnp with an online softmax: never holds a T x T array
  pallas     kernels_pallas (GPU/TPU; interpret mode elsewhere)

`implementation=None` picks the Pallas kernel on GPU/TPU where one exists, otherwise the
dense reference up to AUTO_DENSE_MAX_T tokens (fastest on CPU) and the chunked form beyond.

Shape letters: B batch, T time, H query heads, K kv heads (H % K == 0), D head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from posenc_jax import _checks
from posenc_jax import blockwise
from posenc_jax import householder
from posenc_jax import masking
from posenc_jax import tapa
from posenc_jax import unipotent

AUTO_DENSE_MAX_T = 2048


def _pick(implementation, T: int, allowed, *, has_kernel: bool):
  if implementation is None:
    if has_kernel and jax.default_backend() in ("gpu", "tpu"):
      return "pallas"
    return "reference" if T <= AUTO_DENSE_MAX_T else "chunked"
  _checks.check_implementation(implementation, allowed)
  return implementation


def _scale(scale, D: int) -> float:
  return 1.0 / D**0.5 if scale is None else scale


def softmax_attention(q, k, v, *, segment_ids=None, scale=None, implementation=None,
                      block_size: int = 128):
  """Plain causal softmax attention (NoPE, and every rotation encoding after transport).

  q [B, T, H, D], k [B, T, K, D], v [B, T, K, Dv], segment_ids [B, T] -> o [B, T, H, Dv].
  """
  B, T, H, K, D = _checks.check_qkv(q, k, v)
  _checks.check_segment_ids(segment_ids, B, T)
  impl = _pick(implementation, T, ("reference", "xla", "chunked"), has_kernel=False)
  if implementation is None and jax.default_backend() == "gpu":
    impl = "xla"
  scale = _scale(scale, D)
  if impl == "reference":
    return masking.dense_attention(masking.dot_logits(q, k, scale), v,
                                   masking.causal_dense_mask(T, segment_ids))
  if impl == "xla":
    mask = None if segment_ids is None else masking.causal_dense_mask(T, segment_ids)
    Dv = v.shape[-1]
    if Dv != D:  # it wants one head dim: zero channels change neither logits nor outputs
      width = lambda x, n: jnp.pad(x, [(0, 0)] * 3 + [(0, n - x.shape[-1])])
      q, k, v = width(q, max(D, Dv)), width(k, max(D, Dv)), width(v, max(D, Dv))
    o = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, mask=mask)
    return o[..., :Dv]
  Tp = blockwise.padded_length(T, block_size)
  qp, kp = blockwise.pad_time(q, Tp), blockwise.pad_time(k, Tp)

  def tile(q0, k0):
    return masking.dot_logits(jax.lax.dynamic_slice_in_dim(qp, q0, block_size, 1),
                              jax.lax.dynamic_slice_in_dim(kp, k0, block_size, 1), scale)

  return blockwise.blockwise_attention(tile, v, num_heads=H, segment_ids=segment_ids,
                                       block_size=block_size)


def _check_path_inputs(q, k, v, w, beta, log_forget, segment_ids):
  B, T, H, K, D = _checks.check_qkv(q, k, v)
  _checks.check_shape("w", w, (B, T, K, D), "BTKD")
  _checks.check_shape("beta", beta, (B, T, K), "BTK")
  if log_forget is not None:
    _checks.check_shape("log_forget", log_forget, (B, T, H), "BTH")
    _checks.check_range("log_forget", log_forget, -float("inf"), 0.0)
  _checks.check_segment_ids(segment_ids, B, T)
  _checks.check_range("beta", beta, 0.0, 2.0)
  _checks.check_unit_norm("w", w)
  return B, T, H, K, D


def path_attention(q, k, v, w, beta, *, log_forget=None, segment_ids=None, scale=None,
                   implementation=None):
  """PaTH: causal attention with accumulated Householder transport (SPEC.md "PaTH").

  l_ij = scale * q_i^T (H_i ... H_{j+1}) k_j [+ sum_{s=j+1}^{i} log_forget_s],
  H_t = I - beta_t w_t w_t^T.

  q [B, T, H, D]; k, v [B, T, K, D]; w [B, T, K, D] unit rows; beta [B, T, K] in [0, 2];
  log_forget [B, T, H] <= 0 (PaTH-FoX, unscaled); segment_ids [B, T] -> o [B, T, H, D].
  """
  _, T, _, _, D = _check_path_inputs(q, k, v, w, beta, log_forget, segment_ids)
  impl = _pick(implementation, T, ("reference", "scan", "chunked", "pallas"), has_kernel=True)
  kwargs = dict(log_forget=log_forget, segment_ids=segment_ids, scale=_scale(scale, D))
  if impl == "pallas":
    import kernels_pallas  # imported lazily: the kernels are optional on CPU
    return kernels_pallas.path_attention(q, k, v, w, beta, log_forget,
                                         scale=kwargs["scale"], segment_ids=segment_ids,
                                         interpret=jax.default_backend() == "cpu")
  fn = {"reference": householder.path_attention_reference,
        "scan": householder.path_attention_scan,
        "chunked": householder.path_attention_chunked}[impl]
  return fn(q, k, v, w, beta, **kwargs)


def forgetting_attention(q, k, v, log_forget, *, segment_ids=None, scale=None,
                         implementation=None):
  """FoX: l_ij = scale * q_i . k_j + sum_{s=j+1}^{i} log_forget_s (gate unscaled).

  ALiBi is the constant gate log_forget[:, :, h] = -slope_h.
  q [B, T, H, D]; k, v [B, T, K, D]; log_forget [B, T, H] <= 0 -> o [B, T, H, D].
  """
  B, T, H, K, D = _checks.check_qkv(q, k, v)
  _checks.check_shape("log_forget", log_forget, (B, T, H), "BTH")
  _checks.check_range("log_forget", log_forget, -float("inf"), 0.0)
  _checks.check_segment_ids(segment_ids, B, T)
  impl = _pick(implementation, T, ("reference", "chunked", "pallas"), has_kernel=True)
  scale = _scale(scale, D)
  if impl == "pallas":
    import kernels_pallas
    return kernels_pallas.forgetting_attention(q, k, v, log_forget, scale=scale,
                                               segment_ids=segment_ids,
                                               interpret=jax.default_backend() == "cpu")
  fn = {"reference": unipotent.forgetting_attention_reference,
        "chunked": unipotent.forgetting_attention_chunked}[impl]
  return fn(q, k, v, log_forget, segment_ids=segment_ids, scale=scale)


def path_integral_attention(q, k, v, p, alpha, *, segment_ids=None, scale=None,
                            implementation=None):
  """GRAPE-AP: l_ij = scale * q_i . k_j + sum_{l=j+1}^{i} alpha_h log_sigmoid(<p_i, R_l p_l>/d_p).

  q [B, T, H, D]; k, v [B, T, K, D]; p [B, T, H, d_p] (d_p even); alpha [H] >= 0.
  """
  B, T, H, K, D = _checks.check_qkv(q, k, v)
  _checks.check_rank("p", p, 4, "BTHP")
  if p.shape[:3] != (B, T, H):
    raise ValueError(f"p must have shape [B={B}, T={T}, H={H}, d_p], got {tuple(p.shape)}")
  _checks.check_even("p.shape[-1] (d_p)", p.shape[-1])
  _checks.check_shape("alpha", alpha, (H,), "H")
  _checks.check_range("alpha", alpha, 0.0, float("inf"))
  _checks.check_segment_ids(segment_ids, B, T)
  impl = _pick(implementation, T, ("reference", "chunked"), has_kernel=False)
  fn = {"reference": unipotent.path_integral_attention_reference,
        "chunked": unipotent.path_integral_attention_chunked}[impl]
  return fn(q, k, v, p, alpha, segment_ids=segment_ids, scale=_scale(scale, D))


def tapa_attention(q, k, v, *, alpha=0.1, theta=0.5, linear_phase=False, segment_ids=None,
                   implementation=None):
  """TAPA: l_ij = (q_A.k_A / sqrt(theta D)) cos(2 pi |i-j|^alpha q_P.k_P / sqrt((1-theta) D)).

  q [B, T, H, D]; k, v [B, T, K, D]; the first round(theta * D) channels are the amplitude
  part, the rest the phase part. `linear_phase` is the paper's ablation (`tapa_linear`).
  """
  B, T, H, K, D = _checks.check_qkv(q, k, v)
  _checks.check_segment_ids(segment_ids, B, T)
  if not 0.0 < theta < 1.0:
    raise ValueError(f"theta={theta} must lie strictly between 0 and 1")
  if not 1 <= round(theta * D) <= D - 1:
    raise ValueError(f"theta={theta} with head_dim D={D} leaves an empty amplitude or phase part")
  if alpha < 0:
    raise ValueError(f"alpha={alpha} must be >= 0")
  impl = _pick(implementation, T, ("reference", "chunked"), has_kernel=False)
  fn = {"reference": tapa.tapa_attention_reference, "chunked": tapa.tapa_attention_chunked}[impl]
  return fn(q, k, v, alpha=alpha, theta=theta, linear_phase=linear_phase, segment_ids=segment_ids)
