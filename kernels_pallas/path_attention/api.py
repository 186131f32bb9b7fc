"""Public entry points: PaTH and FoX attention as Pallas kernels with their own backward.

  path_attention(q, k, v, w, beta, log_forget=None, *, scale, segment_ids, block_sizes, interpret)
  forgetting_attention(q, k, v, log_forget, *, scale, segment_ids, block_sizes, interpret)

l_ij = scale q_i^T (H_i ... H_{j+1}) k_j + sum_{s=j+1}^{i} log_forget_s, H_t = I - beta_t w_t w_t^T,
causal softmax; segments never attend across each other. Shapes: q [B, T, H, D]; k, v, w
[B, T, K, D] (query head h reads kv head h // (H // K)); beta [B, T, K]; log_forget [B, T, H];
segment_ids [B, T] int. Any T (padded inside to whole chunks with identity transport).

The VJP is a jax.custom_vjp: the backward kernels (bwd_span.py and bwd_kernels.py on the GPU;
bwd_tpu.py on the TPU) give gradients of the kernel's operands, and the pre-pass's own VJP (the
Pallas kernel of prepass_kernel.py for the transport operands, jax.vjp for padding, layout and
gate prefix sums) carries them to q, k, v, w, beta, log_forget.
Residuals are the inputs, the output (time-major, as returned), the log-sum-exp and, with
BlockSizes(keep_operands=True) (the default), the pre-pass's outputs (q^, k^, v, E,
in-chunk logits, gate sums) and its VJP's residuals, so the backward does not run the pre-pass
again: O(T) memory either way.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels_pallas.path_attention import calls
from kernels_pallas.path_attention import prepass
from kernels_pallas.path_attention import prepass_kernel
from kernels_pallas.path_attention import prepass_variants
from kernels_pallas.path_attention.calls import BlockSizes

BACKENDS = ("gpu", "tpu", "interpret", "tpu_interpret")


@dataclasses.dataclass(frozen=True)
class _Config:
  scale: float
  T: int
  backend: str
  block_sizes: BlockSizes


def _precision(dtype, backend):
  """float32 inputs: float32-accurate products (three-pass TF32 on the GPU); else the default."""
  return calls.float32_precision(backend) if jnp.dtype(dtype) == jnp.float32 else None


def _transport_kwargs(cfg, q, k):
  """The Pallas pre-pass's keyword arguments (prepass_kernel.transport_pallas), or None where
  the batched jnp pre-pass runs instead (prepass_variants.usable_variant)."""
  variant = prepass_variants.usable_variant(cfg.block_sizes.prepass, backend=cfg.backend,
                                            dtype=q.dtype,
                                            heads_per_kv=q.shape[2] // k.shape[2],
                                            head_dim=q.shape[-1])
  if variant == "jnp":
    return None
  return dict(backend=cfg.backend, variant=variant, num_warps=cfg.block_sizes.prepass_num_warps,
              keep_inverse=cfg.block_sizes.prepass_keep_inverse,
              late_wk=cfg.block_sizes.prepass_late_wk)


def _prepare(cfg, q, k, v, w, beta, log_forget, seg):
  """Kernel operands; the transport part (q^, k^, E, diag) comes from the Pallas pre-pass."""
  kw = _transport_kwargs(cfg, q, k)
  transport = prepass.transport_jnp if kw is None else functools.partial(
      prepass_kernel.transport_pallas, **kw)
  return prepass.prepare(q, k, v, w, beta, log_forget, seg, scale=cfg.scale,
                         C=cfg.block_sizes.block_q, dtype=q.dtype, transport=transport)


def _prepare_vjp(cfg, q, k, v, w, beta, log_forget, seg):
  """(ops, pullback) as jax.vjp(_prepare) gives them (pullback a pytree: a residual), except
  that pullback reads the E cotangent as the backward kernels leave it: dL/dP in float32
  (P = I - E). The Pallas pre-pass's VJP kernels negate and round it as they read it
  (transport_pallas_vjp), so it runs outside jax.vjp here; elsewhere (no transport, the jnp
  pre-pass) one XLA pass makes dL/dE."""
  kw = _transport_kwargs(cfg, q, k)
  if w is None or kw is None:
    ops, pull = jax.vjp(lambda *a: _prepare(cfg, *a, seg), q, k, v, w, beta, log_forget)
    e_dtype = None if ops.e is None else ops.e.dtype
    return ops, jax.tree_util.Partial(functools.partial(_pullback_de, e_dtype), pull)
  C = cfg.block_sizes.block_q

  def rest(q, k, v, w, beta, log_forget):   # everything but the transport, and its inputs
    ops = prepass.prepare(q, k, v, w, beta, log_forget, seg, scale=cfg.scale, C=C,
                          dtype=q.dtype, transport=None)
    return ops, prepass.transport_inputs(q, k, w, beta, C=C)

  (ops, inputs), pull_rest = jax.vjp(rest, q, k, v, w, beta, log_forget)
  (qh, kh, e, diag), pull_transport = prepass_kernel.transport_pallas_vjp(
      *inputs, scale=cfg.scale, dtype=q.dtype, **kw)
  ops = ops._replace(q=qh, k=kh, e=e, diag=diag)
  return ops, jax.tree_util.Partial(_pullback_dp, pull_rest, pull_transport)


def _pullback_de(e_dtype, pull, ct):
  e = None if ct.e is None else (-ct.e).astype(e_dtype)   # dL/dE = -dL/dP in E's dtype
  return pull(ct._replace(e=e))


def _pullback_dp(pull_rest, pull_transport, ct):
  d_inputs = pull_transport((ct.q, ct.k, ct.e, ct.diag))
  return pull_rest((ct._replace(q=None, k=None, e=None, diag=None), d_inputs))


def _forward(cfg, q, k, v, w, beta, log_forget, seg):
  return _attend_ops(cfg, _prepare(cfg, q, k, v, w, beta, log_forget, seg), q.dtype)


def _attend_ops(cfg, ops, dtype, boundary=None):
  return calls.forward(ops, scale=cfg.scale, precision=_precision(dtype, cfg.backend),
                       backend=cfg.backend, bs=cfg.block_sizes, boundary=boundary)


def _span_boundary(cfg, ops, dtype):
  """The span forward's and backward's boundary launch (calls.span_boundary), or None."""
  return calls.span_boundary(ops, precision=_precision(dtype, cfg.backend), backend=cfg.backend,
                             bs=cfg.block_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(cfg, q, k, v, w, beta, log_forget, seg):
  o, _ = _forward(cfg, q, k, v, w, beta, log_forget, seg)
  return prepass.unchunked(o)[:, :cfg.T]


def _attend_fwd(cfg, q, k, v, w, beta, log_forget, seg):
  # keep_operands: the pre-pass's outputs and its pullback's residuals become residuals too.
  kept = _prepare_vjp(cfg, q, k, v, w, beta, log_forget, seg) \
      if cfg.block_sizes.keep_operands else None
  ops = kept[0] if kept else _prepare(cfg, q, k, v, w, beta, log_forget, seg)
  # With the span forward (BlockSizes.fwd_spans) the keys moved to their span's end are made
  # once here and, with kept operands, kept for the span backward.
  boundary = _span_boundary(cfg, ops, q.dtype)
  o, lse = _attend_ops(cfg, ops, q.dtype, boundary)
  kept = None if kept is None else (*kept, boundary)
  # The residual is the output itself, which the caller holds anyway (a model's output
  # projection keeps it for its own gradient). The backward needs o only for Delta.
  out = prepass.unchunked(o)[:, :cfg.T]   # the kernels write o time-major: a reshape
  return out, (q, k, v, w, beta, log_forget, seg, out, lse, kept)


def _attend_bwd(cfg, res, do):
  q, k, v, w, beta, log_forget, seg, out, lse, kept = res
  C = cfg.block_sizes.block_q
  Tp = lse.shape[2] * C
  do = do.astype(q.dtype)
  do_b = prepass.chunked(prepass.pad_time(do, Tp), C)   # [B, n, C, H, D], as the kernels read it
  # Delta_i = dO_i . o_i in float32, time-major, then blocked as lse is ([B, H, n, C, 1]; padded
  # rows 0).
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), -1, keepdims=True)
  delta = prepass.blocked(prepass.pad_time(delta, Tp), C)
  # Recompute the pre-pass under jax.vjp (its residuals are only the inputs) unless the forward
  # kept it, run the backward kernels on it, then pull the operand gradients back.
  ops, pullback, boundary = kept if kept is not None else _prepare_vjp(
      cfg, q, k, v, w, beta, log_forget, seg) + (None,)
  g = calls.backward(ops, do_b, lse, delta, scale=cfg.scale,
                     precision=_precision(q.dtype, cfg.backend),
                     backend=cfg.backend, bs=cfg.block_sizes, boundary=boundary)
  # The E cotangent goes to the pullback as dL/dP (float32, as the kernels accumulated it):
  # it makes dL/dE = -dL/dP itself (_prepare_vjp).
  ct = ops._replace(
      q=g["q"], k=g["k"], v=g["v"], e=None if w is None else g["dp"],
      diag=None if w is None else g["diag"].astype(ops.diag.dtype), fq=g.get("fq"),
      fk=g.get("fk"), sq=None if seg is None else jnp.zeros_like(ops.sq),
      sk=None if seg is None else jnp.zeros_like(ops.sk),
      lo=None if seg is None else jnp.zeros_like(ops.lo),
      hi=None if seg is None else jnp.zeros_like(ops.hi))
  grads = pullback(ct)
  grads = tuple(None if x is None else gx.astype(x.dtype)
                for x, gx in zip((q, k, v, w, beta, log_forget), grads))
  return grads + (None,)


_attend.defvjp(_attend_fwd, _attend_bwd)


def _backend(interpret, backend):
  if backend is not None:
    if backend not in BACKENDS:
      raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    return backend
  if interpret:
    return "interpret"
  platform = jax.default_backend()
  if platform not in ("gpu", "tpu"):
    raise ValueError(f"no Pallas backend for platform {platform!r}: pass interpret=True")
  return platform


def _check(q, k, v, w, beta, log_forget, segment_ids, block_sizes):
  if q.ndim != 4:
    raise ValueError(f"q must have shape [B, T, H, D], got {q.shape}")
  B, T, H, D = q.shape
  if k.ndim != 4 or k.shape[:2] != (B, T) or k.shape[3] != D or H % k.shape[2]:
    raise ValueError(f"k must have shape [B={B}, T={T}, K, D={D}] with H={H} % K == 0, "
                     f"got {k.shape}")
  K = k.shape[2]
  for name, x, shape in (("v", v, (B, T, K, D)), ("w", w, (B, T, K, D)), ("beta", beta, (B, T, K)),
                         ("log_forget", log_forget, (B, T, H)), ("segment_ids", segment_ids, (B, T))):
    if x is not None and tuple(x.shape) != shape:
      raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
  block_sizes.validate(D)


def path_attention(q, k, v, w, beta, log_forget=None, *, scale=None, segment_ids=None,
                   block_sizes: BlockSizes | None = None, interpret=False, backend=None):
  """PaTH (and PaTH-FoX with log_forget) attention -> o [B, T, H, D] in v's dtype."""
  block_sizes = block_sizes or BlockSizes()
  if w is None or beta is None:
    raise ValueError("w and beta are required (use forgetting_attention for no transport)")
  _check(q, k, v, w, beta, log_forget, segment_ids, block_sizes)
  cfg = _Config(scale=float(q.shape[-1] ** -0.5 if scale is None else scale), T=q.shape[1],
                backend=_backend(interpret, backend), block_sizes=block_sizes)
  return _attend(cfg, q, k, v, w, beta, log_forget, segment_ids)


def forgetting_attention(q, k, v, log_forget, *, scale=None, segment_ids=None,
                         block_sizes: BlockSizes | None = None, interpret=False, backend=None):
  """FoX attention (no transport); ALiBi is a constant log_forget per head."""
  block_sizes = block_sizes or BlockSizes()
  _check(q, k, v, None, None, log_forget, segment_ids, block_sizes)
  cfg = _Config(scale=float(q.shape[-1] ** -0.5 if scale is None else scale), T=q.shape[1],
                backend=_backend(interpret, backend), block_sizes=block_sizes)
  return _attend(cfg, q, k, v, None, None, log_forget, segment_ids)
