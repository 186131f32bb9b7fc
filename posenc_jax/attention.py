"""Causal attention entry points, one per family, with `implementation=` dispatch.

Each public function validates its arguments once (shapes, ranges, implementation name) and
hands plain arrays to an implementation in the family's module:

  reference  dense O(T^2) jnp oracle: trivially correct, holds a T x T array
  xla        jax.nn.dot_product_attention as jax picks it (plain softmax family only; XLA's
             T x T form today)
  cudnn      jax.nn.dot_product_attention(implementation="cudnn"): cuDNN flash attention
             (softmax family, CUDA GPUs, bfloat16/float16; segment_ids go in as a dense mask)
  scan       PaTH only: cumulative Householder products by lax.associative_scan
  chunked    blockwise jnp with an online softmax: never holds a T x T array
  pallas     kernels_pallas (GPU/TPU; interpret mode elsewhere); the softmax family runs the
             FoX kernel with no gate

Under a mesh with a "context" axis of size > 1 (jax.set_mesh), path_attention,
forgetting_attention and softmax_attention run their context-parallel form
(posenc_jax.context_parallel, docs/context_parallel.md): T stays sharded and the keys travel
round a ring. `implementation` then picks the per-device local attention: the Pallas kernel
for "pallas" (and None on a GPU or TPU), blockwise jnp otherwise.

`implementation=None` asks `dispatch.auto_implementation` (posenc_jax/dispatch.py), one table
for every family of what runs where, and why.

Shape letters: B batch, T time, H query heads, K kv heads (H % K == 0), D head dim,
Dv value head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from posenc_jax import _checks
from posenc_jax import blockwise
from posenc_jax import context_parallel
from posenc_jax import dispatch
from posenc_jax import grape_a
from posenc_jax import householder
from posenc_jax import masking
from posenc_jax import path_integral
from posenc_jax import stick_breaking
from posenc_jax import tapa
from posenc_jax import unipotent


def _check_triton_kernel(what: str) -> None:
  """implementation='pallas' of a family whose kernel is Triton only: none on a TPU."""
  if jax.default_backend() == "tpu":
    raise ValueError(f"implementation='pallas' for {what} has no TPU form (Triton on a GPU, "
                     "the interpreter on a CPU): use None (auto), 'chunked' or 'reference'")


def _pick(implementation, family: str, allowed, q, v, segment_ids, *, kernel_options=False):
  """-> the implementation to run; with kernel_options "pallas:..." stays whole (the PaTH / FoX
  kernels read their block sizes from it: _checks.kernel_block_sizes)."""
  if implementation is None:
    return dispatch.auto_implementation(family, T=q.shape[1], dtype=q.dtype, head_dim=q.shape[-1],
                               v_head_dim=v.shape[-1],
                               has_segments=segment_ids is not None).implementation
  _checks.check_implementation(implementation, allowed, kernel_options=kernel_options)
  return implementation


def _scale(scale, D: int) -> float:
  return 1.0 / D**0.5 if scale is None else scale


def _pad_head_dims(q, k, v, width: int):
  """q, k, v zero-padded to one head dim: zero channels change neither logits nor outputs."""
  pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
  return pad(q), pad(k), pad(v)


def _check_explicit(implementation: str, problem: str | None, *, gpu_only: bool) -> None:
  """An explicit implementation that cannot run here raises now, not at lowering time."""
  backend = jax.default_backend()
  if gpu_only and backend != "gpu":
    raise ValueError(f"implementation={implementation!r} needs a CUDA GPU (cuDNN); the default "
                     f"backend is {backend!r}: use None (auto), 'xla', 'chunked' or 'reference'")
  if problem is not None:
    raise ValueError(f"implementation={implementation!r} cannot run this call: {problem}")


def _cudnn_attention(q, k, v, segment_ids, scale):
  T, D, Dv = q.shape[1], q.shape[-1], v.shape[-1]
  _check_explicit("cudnn", dispatch.cudnn_unsupported(
      q.dtype, D, Dv, T=T, has_segments=segment_ids is not None), gpu_only=True)
  # is_causal lets cuDNN skip the blocks above the diagonal; the mask matters for segments.
  mask = None if segment_ids is None else masking.causal_dense_mask(T, segment_ids)
  q, k, v = _pad_head_dims(q, k, v, dispatch.cudnn_head_dim(D, Dv))
  o = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, mask=mask,
                                   implementation="cudnn")
  return o[..., :Dv]


def _pallas_softmax(q, k, v, segment_ids, scale, kernel_options):
  D, Dv = q.shape[-1], v.shape[-1]
  _check_explicit("pallas", dispatch.pallas_unsupported(q.dtype, D, Dv), gpu_only=False)
  import kernels_pallas  # imported lazily: the kernels are optional on CPU
  # The FoX kernel with no gate is plain causal softmax attention (segments and GQA included).
  q, k, v = _pad_head_dims(q, k, v, dispatch.pallas_head_dim(D, Dv))
  o = kernels_pallas.forgetting_attention(q, k, v, None,
                                          scale=scale, segment_ids=segment_ids,
                                          block_sizes=_checks.kernel_block_sizes(
                                              "pallas", kernel_options),
                                          interpret=jax.default_backend() == "cpu")
  return o[..., :Dv]


def softmax_attention(q, k, v, *, segment_ids=None, scale=None, implementation=None,
                      block_size: int | None = None, kernel_options=None):
  """Plain causal softmax attention (NoPE, and every rotation encoding after transport).

  q [B, T, H, D], k [B, T, K, D], v [B, T, K, Dv], segment_ids [B, T] -> o [B, T, H, Dv].
  block_size: the "chunked" form's tile edge; None: 128, grown so that T needs at most 16
  blocks (blockwise.block_size_for). kernel_options: the Pallas kernel's (path_attention).
  """
  B, T, H, K, D = _checks.check_qkv(q, k, v)
  _checks.check_segment_ids(segment_ids, B, T)
  impl = _pick(implementation, "softmax", ("reference", "xla", "cudnn", "chunked", "pallas"),
               q, v, segment_ids)
  scale = _scale(scale, D)
  if context_parallel.context_size() > 1:
    # The Pallas kernel gives the lse the ring merges by (cuDNN's public API does not); it
    # runs at the head dims it takes unpadded, jnp elsewhere.
    Dv = v.shape[-1]
    kernel = (impl in ("pallas", "cudnn") and dispatch.pallas_unsupported(q.dtype, D, Dv) is None
              and D == Dv == dispatch.pallas_head_dim(D, Dv))
    return context_parallel.softmax_attention(
        q, k, v, segment_ids=segment_ids, scale=scale, kernel=kernel,
        kernel_options=_checks.kernel_block_sizes("pallas", kernel_options) if kernel else None)
  if impl == "reference":
    return masking.dense_attention(masking.dot_logits(q, k, scale), v,
                                   masking.causal_dense_mask(T, segment_ids))
  if impl == "cudnn":
    return _cudnn_attention(q, k, v, segment_ids, scale)
  if impl == "pallas":
    return _pallas_softmax(q, k, v, segment_ids, scale, kernel_options)
  if impl == "xla":
    mask = None if segment_ids is None else masking.causal_dense_mask(T, segment_ids)
    Dv = v.shape[-1]  # jax wants one head dim for q, k and v
    o = jax.nn.dot_product_attention(*_pad_head_dims(q, k, v, max(D, Dv)), scale=scale,
                                     is_causal=True, mask=mask)
    return o[..., :Dv]
  block_size = blockwise.block_size_for(T, block_size, default=128, max_blocks=16)
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
                   implementation=None, kernel_options=None):
  """PaTH: causal attention with accumulated Householder transport (docs/encodings/path.md#path).

  l_ij = scale * q_i^T (H_i ... H_{j+1}) k_j [+ sum_{s=j+1}^{i} log_forget_s],
  H_t = I - beta_t w_t w_t^T.

  q [B, T, H, D]; k, v [B, T, K, D]; w [B, T, K, D] unit rows; beta [B, T, K] in [0, 2];
  log_forget [B, T, H] <= 0 (PaTH-FoX, unscaled); segment_ids [B, T] -> o [B, T, H, D].
  kernel_options: the Pallas kernel's kernels_pallas.BlockSizes fields (a dict or ConfigDict),
  used where it runs; "pallas:key=value,..." sets them too (kernels_pallas.explain prints the
  plan they give).
  """
  _, T, _, _, D = _check_path_inputs(q, k, v, w, beta, log_forget, segment_ids)
  impl = _pick(implementation, "path", ("reference", "scan", "chunked", "pallas"), q, v,
               segment_ids, kernel_options=True)
  kwargs = dict(log_forget=log_forget, segment_ids=segment_ids, scale=_scale(scale, D))
  if context_parallel.context_size() > 1:
    return context_parallel.path_attention(q, k, v, w, beta, **kwargs,
                                           kernel=impl.startswith("pallas"),
                                           kernel_options=_checks.kernel_block_sizes(
                                               impl, kernel_options))
  if impl.startswith("pallas"):
    import kernels_pallas  # imported lazily: the kernels are optional on CPU
    return kernels_pallas.path_attention(q, k, v, w, beta, log_forget,
                                         scale=kwargs["scale"], segment_ids=segment_ids,
                                         block_sizes=_checks.kernel_block_sizes(
                                             impl, kernel_options),
                                         interpret=jax.default_backend() == "cpu")
  fn = {"reference": householder.path_attention_reference,
        "scan": householder.path_attention_scan,
        "chunked": householder.path_attention_chunked}[impl]
  return fn(q, k, v, w, beta, **kwargs)


def forgetting_attention(q, k, v, log_forget, *, segment_ids=None, scale=None,
                         implementation=None, kernel_options=None):
  """FoX: l_ij = scale * q_i . k_j + sum_{s=j+1}^{i} log_forget_s (gate unscaled).

  ALiBi is the constant gate log_forget[:, :, h] = -slope_h.
  q [B, T, H, D]; k, v [B, T, K, D]; log_forget [B, T, H] <= 0 -> o [B, T, H, D].
  """
  B, T, H, K, D = _checks.check_qkv(q, k, v)
  _checks.check_shape("log_forget", log_forget, (B, T, H), "BTH")
  _checks.check_range("log_forget", log_forget, -float("inf"), 0.0)
  _checks.check_segment_ids(segment_ids, B, T)
  impl = _pick(implementation, "forgetting", ("reference", "chunked", "pallas"), q, v,
               segment_ids, kernel_options=True)
  scale = _scale(scale, D)
  if context_parallel.context_size() > 1:
    return context_parallel.forgetting_attention(
        q, k, v, log_forget, segment_ids=segment_ids, scale=scale,
        kernel=impl.startswith("pallas"),
        kernel_options=_checks.kernel_block_sizes(impl, kernel_options))
  if impl.startswith("pallas"):
    import kernels_pallas
    return kernels_pallas.forgetting_attention(q, k, v, log_forget, scale=scale,
                                               segment_ids=segment_ids,
                                               block_sizes=_checks.kernel_block_sizes(
                                                   impl, kernel_options),
                                               interpret=jax.default_backend() == "cpu")
  fn = {"reference": unipotent.forgetting_attention_reference,
        "chunked": unipotent.forgetting_attention_chunked}[impl]
  return fn(q, k, v, log_forget, segment_ids=segment_ids, scale=scale)


def path_integral_attention(q, k, v, p, alpha, *, segment_ids=None, scale=None,
                            implementation=None, p_query=None):
  """GRAPE-AP: l_ij = scale * q_i . k_j + sum_{l=j+1}^{i} alpha_h log_sigmoid(<p_i, R_l p_l>/d_p).

  q [B, T, H, D]; k, v [B, T, K, D]; p [B, T, H, d_p] (d_p even); alpha [H] >= 0.
  p_query: [B, T, H, d_p] probes for the query side p_i (the official GRAPE code's variant:
  raw query probes, RMS-normalised key probes), or None to use p on both sides (the paper).
  implementation "pallas": kernels_pallas.grape_ap_attention (Triton on a GPU, the Pallas
  interpreter on a CPU; no TPU form); None picks "reference" or "chunked"
  (dispatch.auto_implementation).
  """
  B, T, H, K, D = _checks.check_qkv(q, k, v)
  _checks.check_rank("p", p, 4, "BTHP")
  if p.shape[:3] != (B, T, H):
    raise ValueError(f"p must have shape [B={B}, T={T}, H={H}, d_p], got {tuple(p.shape)}")
  if p_query is not None and p_query.shape != p.shape:
    raise ValueError(f"p_query must have the shape of p {tuple(p.shape)}, "
                     f"got {tuple(p_query.shape)}")
  _checks.check_even("p.shape[-1] (d_p)", p.shape[-1])
  _checks.check_shape("alpha", alpha, (H,), "H")
  _checks.check_range("alpha", alpha, 0.0, float("inf"))
  _checks.check_segment_ids(segment_ids, B, T)
  impl = _pick(implementation, "path_integral", ("reference", "chunked", "pallas"), q, v,
               segment_ids)
  if impl == "pallas":
    _check_triton_kernel("GRAPE-AP")
    import kernels_pallas  # imported lazily: the kernels are optional on CPU
    # The rotation of the key probes stays here, in jnp, where the oracle's is.
    r = path_integral.rotate_probes(p, path_integral.segment_positions(segment_ids, B, T))
    return kernels_pallas.grape_ap_attention(q, k, v, p if p_query is None else p_query, r,
                                             alpha, scale=_scale(scale, D),
                                             segment_ids=segment_ids,
                                             interpret=jax.default_backend() == "cpu")
  fn = {"reference": unipotent.path_integral_attention_reference,
        "chunked": unipotent.path_integral_attention_chunked}[impl]
  return fn(q, k, v, p, alpha, segment_ids=segment_ids, scale=_scale(scale, D), p_query=p_query)


def grape_a_attention(q, k, v, rate_q, rate_k, *, segment_ids=None, scale=None,
                      implementation=None, kernel_options=None):
  """GRAPE-A: l_ij = scale q_i . k_j - (i - j) (rate_q_i + rate_k_j) within a document.

  q [B, T, H, D]; k, v [B, T, K, D]; rate_q, rate_k [B, T, H] (omega_h times a gate) or None
  (that term absent), not both None. implementation "reference": the dense closed form
  (grape_a.grape_a_attention_reference). "pallas": kernels_pallas.grape_a_attention, the bias
  computed in each tile (Triton on a GPU, the Pallas interpreter on a CPU; on a TPU the lift
  below on the softmax Pallas kernel; under context parallelism the lift). Every other value
  lifts the bias into extra q / k channels (grape_a.grape_a_augment) and runs softmax_attention
  with it. None: dispatch.auto_implementation("grape_a"): the kernel on a GPU; elsewhere the closed
  form at short T ("reference") and the lift on softmax's automatic choice beyond.

  The lift drops each row's constant -(i rate_q_i), which softmax ignores, so its gradients
  take the row sums of dS as exactly 0; in float32 they are not, and the rates' gradients
  carry that rounding times the positions (~1e-5 relative in the log-omega gradient at T 29),
  where the closed form and the kernel, which subtract positions first, do not.
  """
  B, T, H, K, D = _checks.check_qkv(q, k, v)
  _checks.check_segment_ids(segment_ids, B, T)
  if rate_q is None and rate_k is None:
    raise ValueError("grape_a_attention needs rate_q or rate_k (or both); got neither")
  for name, r in (("rate_q", rate_q), ("rate_k", rate_k)):
    if r is not None:
      _checks.check_shape(name, r, (B, T, H), "BTH")
  if implementation is not None:
    _checks.check_implementation(implementation, ("reference", "xla", "cudnn", "chunked",
                                                  "pallas"), kernel_options=False)
  scale = _scale(scale, D)
  backend = jax.default_backend()
  one_device = context_parallel.context_size() == 1
  impl = implementation or dispatch.auto_implementation(
      "grape_a", T=T, dtype=q.dtype, head_dim=D, v_head_dim=v.shape[-1],
      has_segments=segment_ids is not None, backend=backend).implementation
  omega = jnp.ones((H,), jnp.float32)   # the rates already hold omega_h
  if impl == "reference" and one_device:
    return grape_a.grape_a_attention_reference(q, k, v, omega=omega, lam_q=rate_q, lam_k=rate_k,
                                               segment_ids=segment_ids, scale=scale)
  if impl == "pallas" and backend != "tpu" and one_device:
    import kernels_pallas  # imported lazily: the kernels are optional on CPU
    return kernels_pallas.grape_a_attention(q, k, v, rate_q, rate_k, scale=scale,
                                            segment_ids=segment_ids,
                                            interpret=backend == "cpu")
  q_aug, k_aug, v_aug = grape_a.grape_a_augment(q, k, v, omega=omega, lam_q=rate_q,
                                                lam_k=rate_k, segment_ids=segment_ids,
                                                scale=scale)
  return softmax_attention(q_aug, k_aug, v_aug, segment_ids=segment_ids,
                           implementation=implementation, kernel_options=kernel_options)


def tapa_attention(q, k, v, *, alpha=0.1, theta=0.5, linear_phase=False, segment_ids=None,
                   implementation=None):
  """TAPA: l_ij = (q_A.k_A / sqrt(theta D)) cos(2 pi |i-j|^alpha q_P.k_P / sqrt((1-theta) D)).

  q [B, T, H, D]; k, v [B, T, K, D]; the first round(theta * D) channels are the amplitude
  part, the rest the phase part. `linear_phase` is the paper's ablation (`tapa_linear`).
  implementation "pallas": kernels_pallas.tapa_attention (Triton on a GPU, the Pallas
  interpreter on a CPU; no TPU form); None picks "reference" or "chunked"
  (dispatch.auto_implementation).
  """
  B, T, H, K, D = _checks.check_qkv(q, k, v)
  _checks.check_segment_ids(segment_ids, B, T)
  if not 0.0 < theta < 1.0:
    raise ValueError(f"theta={theta} must lie strictly between 0 and 1")
  if not 1 <= round(theta * D) <= D - 1:
    raise ValueError(f"theta={theta} with head_dim D={D} leaves an empty amplitude or phase part")
  if alpha < 0:
    raise ValueError(f"alpha={alpha} must be >= 0")
  impl = _pick(implementation, "tapa", ("reference", "chunked", "pallas"), q, v, segment_ids)
  if impl == "pallas":
    _check_triton_kernel("TAPA")
    import kernels_pallas  # imported lazily: the kernels are optional on CPU
    return kernels_pallas.tapa_attention(q, k, v, alpha=alpha, theta=theta,
                                         linear_phase=linear_phase, segment_ids=segment_ids,
                                         interpret=jax.default_backend() == "cpu")
  fn = {"reference": tapa.tapa_attention_reference, "chunked": tapa.tapa_attention_chunked}[impl]
  return fn(q, k, v, alpha=alpha, theta=theta, linear_phase=linear_phase, segment_ids=segment_ids)


def stick_breaking_attention(q, k, v, *, segment_ids=None, scale=None, attend_current=False,
                             remainder="current", implementation=None):
  """SBA (docs/encodings/stick_breaking.md#stick-breaking-attention): not normalised,
  o_i = sum_j A_ij v_j [+ r_i v_i], log A_ij = log_sigmoid(z_ij) + sum_{j<l} log_sigmoid(-z_il)
  over the visible keys l nearer than j, z_ij = scale q_i . k_j.

  q [B, T, H, D]; k [B, T, K, D]; v [B, T, K, Dv] -> o [B, T, H, Dv]. attend_current: key j = i
  is visible too; remainder "current" adds the leftover stick r_i times v_i, "none" drops it.
  implementation "pallas": kernels_pallas.stick_breaking_attention (Triton on a GPU, the
  Pallas interpreter on a CPU; no TPU form); None: dispatch.auto_implementation (on a GPU
  `dispatch.sba_gpu_path`: the kernel from T 256, the dense form below). Under a mesh with a
  "context" axis it has no context-parallel form: it runs as without one
  (docs/context_parallel.md).
  """
  B, T, H, K, D = _checks.check_qkv(q, k, v)
  _checks.check_segment_ids(segment_ids, B, T)
  stick_breaking.check_options(attend_current=attend_current, remainder=remainder)
  impl = _pick(implementation, "stick_breaking", ("reference", "chunked", "pallas"), q, v,
               segment_ids)
  if impl == "pallas":
    _check_triton_kernel("SBA")
    import kernels_pallas  # imported lazily: the kernels are optional on CPU
    return kernels_pallas.stick_breaking_attention(
        q, k, v, segment_ids=segment_ids, scale=_scale(scale, D), attend_current=attend_current,
        remainder=remainder, interpret=jax.default_backend() == "cpu")
  fn = {"reference": stick_breaking.stick_breaking_attention_reference,
        "chunked": stick_breaking.stick_breaking_attention_chunked}[impl]
  return fn(q, k, v, segment_ids=segment_ids, scale=_scale(scale, D),
            attend_current=attend_current, remainder=remainder)
