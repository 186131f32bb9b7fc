"""Public entry points: PaTH and FoX attention as Pallas kernels with their own backward, and the
plan they run.

  path_attention(q, k, v, w, beta, log_forget=None, *, scale, segment_ids, block_sizes, ...)
  forgetting_attention(q, k, v, log_forget, *, scale, segment_ids, block_sizes, ...)
  explain(q, k, v, w=None, beta=None, log_forget=None, ...) -> Plan   (print it)
  phases(q, k, v, w, beta, log_forget=None, ...) -> the four phases, for timing them apart

l_ij = scale q_i^T (H_i ... H_{j+1}) k_j + sum_{s=j+1}^{i} log_forget_s, H_t = I - beta_t w_t w_t^T,
causal softmax; segments never attend across each other. Shapes: q [B, T, H, D]; k, v, w
[B, T, K, D] (query head h reads kv head h // (H // K)); beta [B, T, K]; log_forget [B, T, H];
segment_ids [B, T] int. Any T (padded inside to whole chunks with identity transport).

Each call resolves its plan (plan.py) from the shapes, dtype, backend, device and options once,
here, and every launch reads it. The VJP is a jax.custom_vjp: the backward kernels give the
gradients of the kernels' operands, and the pre-pass's VJP carries them to q, k, v, w, beta,
log_forget. Residuals are the inputs, the output, the log-sum-exp, the pre-pass's outputs and
its VJP's residuals, and with the span forward its boundary launch: O(T) memory.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels_pallas.path_attention import backward
from kernels_pallas.path_attention import forward
from kernels_pallas.common import launch
from kernels_pallas.path_attention import operands
from kernels_pallas.path_attention import span_backward
from kernels_pallas.path_attention import spans
from kernels_pallas.path_attention import tpu
from kernels_pallas.path_attention.options import BlockSizes
from kernels_pallas.path_attention.plan import Plan, Spec, no_backward_message, resolve
from kernels_pallas.path_attention.prepass import kernels as prepass_kernels
from kernels_pallas.path_attention.prepass import reference as prepass_reference


def _transport(plan: Plan):
  """The pre-pass form's transport function (operands.prepare's `transport`), or None where
  the Pallas pre-pass runs outside jax.vjp (_prepare_vjp)."""
  if plan.prepass in ("jnp", "none"):
    return prepass_reference.transport_jnp
  return functools.partial(prepass_kernels.transport_pallas, **_pallas_prepass(plan))


def _pallas_prepass(plan: Plan) -> dict:
  return dict(backend=plan.spec.backend, form=plan.prepass, warps=plan.prepass_warps,
              keep_inverse=plan.keep_inverse)


def _prepare(plan, q, k, v, w, beta, log_forget, seg):
  """The kernels' operands (operands.Operands)."""
  return operands.prepare(q, k, v, w, beta, log_forget, seg, scale=plan.scale, C=plan.block,
                          dtype=q.dtype, transport=_transport(plan))


def _prepare_vjp(plan, q, k, v, w, beta, log_forget, seg):
  """(ops, pullback) as jax.vjp(_prepare) gives them (pullback a pytree: a residual), except
  that pullback reads the E cotangent as the backward kernels leave it: dL/dP in float32
  (P = I - E). The Pallas pre-pass's VJP kernels negate and round it as they read it
  (transport_pallas_vjp), so it runs outside jax.vjp here; elsewhere (no transport, the jnp
  pre-pass) one XLA pass makes dL/dE."""
  if plan.prepass in ("jnp", "none"):
    ops, pull = jax.vjp(lambda *a: _prepare(plan, *a, seg), q, k, v, w, beta, log_forget)
    e_dtype = None if ops.e is None else ops.e.dtype
    return ops, jax.tree_util.Partial(functools.partial(_pullback_de, e_dtype), pull)
  C = plan.block

  def rest(q, k, v, w, beta, log_forget):   # everything but the transport, and its inputs
    ops = operands.prepare(q, k, v, w, beta, log_forget, seg, scale=plan.scale, C=C,
                           dtype=q.dtype, transport=None)
    return ops, operands.transport_inputs(q, k, w, beta, C=C)

  (ops, inputs), pull_rest = jax.vjp(rest, q, k, v, w, beta, log_forget)
  (qh, kh, e, diag), pull_transport = prepass_kernels.transport_pallas_vjp(
      *inputs, scale=plan.scale, dtype=q.dtype, **_pallas_prepass(plan))
  ops = ops._replace(q=qh, k=kh, e=e, diag=diag)
  return ops, jax.tree_util.Partial(_pullback_dp, pull_rest, pull_transport)


def _pullback_de(e_dtype, pull, ct):
  e = None if ct.e is None else (-ct.e).astype(e_dtype)   # dL/dE = -dL/dP in E's dtype
  return pull(ct._replace(e=e))


def _pullback_dp(pull_rest, pull_transport, ct):
  d_inputs = pull_transport((ct.q, ct.k, ct.e, ct.diag))
  return pull_rest((ct._replace(q=None, k=None, e=None, diag=None), d_inputs))


def _boundary(plan, ops):
  """The span forward's boundary launch (kb, pi), which the span backward then reads too."""
  return spans.boundary(ops, plan) if plan.forward == "span" else None


def _forward(plan, ops, boundary):
  if plan.forward == "tpu":
    return tpu.forward(ops, plan)
  return forward.forward(ops, plan, boundary=boundary)


def _backward(plan, ops, do, lse, delta, boundary):
  if plan.backward == "none":
    raise ValueError(no_backward_message(plan.spec))
  if plan.backward == "tpu":
    return tpu.backward(ops, do, lse, delta, plan)
  if plan.backward == "span":
    return span_backward.backward(ops, do, lse, delta, plan, boundary=boundary)
  return backward.backward(ops, do, lse, delta, plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan, q, k, v, w, beta, log_forget, seg):
  ops = _prepare(plan, q, k, v, w, beta, log_forget, seg)
  o, _ = _forward(plan, ops, _boundary(plan, ops))
  return operands.unchunked(o)[:, :plan.spec.seq_len]


def _attend_fwd(plan, q, k, v, w, beta, log_forget, seg):
  # the pre-pass's outputs and its pullback's residuals are residuals: the backward does not
  # run the pre-pass again
  ops, pullback = _prepare_vjp(plan, q, k, v, w, beta, log_forget, seg)
  boundary = _boundary(plan, ops)
  o, lse = _forward(plan, ops, boundary)
  # The residual is the output itself, which the caller holds anyway (a model's output
  # projection keeps it for its own gradient). The backward needs o only for Delta.
  out = operands.unchunked(o)[:, :plan.spec.seq_len]   # the kernels write o time-major
  return out, (q, k, v, w, beta, log_forget, seg, out, lse, (ops, pullback, boundary))


def _backward_inputs(plan, out, do):
  """do chunked [B, n, C, H, D] as the kernels read it, and Delta_i = dO_i . o_i in float32,
  time-major, then blocked as lse is ([B, H, n, C, 1]; padded rows 0)."""
  C = plan.block
  Tp = plan.chunks * C
  do_b = operands.chunked(operands.pad_time(do, Tp), C)
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), -1, keepdims=True)
  return do_b, operands.blocked(operands.pad_time(delta, Tp), C)


def _cotangents(ops, g, *, transport: bool, segments: bool):
  """The kernels' gradients g as the cotangent of the operands, for the pre-pass's pullback.
  The E cotangent goes as dL/dP (float32, as the kernels accumulated it): the pullback makes
  dL/dE = -dL/dP itself (_prepare_vjp)."""
  zero = lambda x: jnp.zeros_like(x) if segments else None
  return ops._replace(
      q=g["q"], k=g["k"], v=g["v"], e=g["dp"] if transport else None,
      diag=g["diag"].astype(ops.diag.dtype) if transport else None, fq=g.get("fq"),
      fk=g.get("fk"), sq=zero(ops.sq), sk=zero(ops.sk), lo=zero(ops.lo), hi=zero(ops.hi))


def _attend_bwd(plan, res, do, dlse=None):
  q, k, v, w, beta, log_forget, seg, out, lse, (ops, pullback, boundary) = res
  do_b, delta = _backward_inputs(plan, out, do.astype(q.dtype))
  if dlse is not None:
    # d lse_i / d s_ij = P_ij: an lse cotangent adds P_ij dlse_i to dS_ij = P_ij (dP_ij -
    # Delta_i), which is Delta_i - dlse_i in place of Delta_i
    delta = delta - operands.blocked(operands.pad_time(
        dlse.astype(jnp.float32)[..., None], plan.chunks * plan.block), plan.block)
  g = _backward(plan, ops, do_b, lse, delta, boundary)
  grads = pullback(_cotangents(ops, g, transport=w is not None, segments=seg is not None))
  grads = tuple(None if x is None else gx.astype(x.dtype)
                for x, gx in zip((q, k, v, w, beta, log_forget), grads))
  return grads + (None,)


_attend.defvjp(_attend_fwd, _attend_bwd)


def _lse_rows(plan, lse):
  """The forward's lse, blocked [B, H, n, C, 1] -> [B, T, H] float32."""
  B, H = lse.shape[:2]
  return jnp.moveaxis(lse.reshape(B, H, -1)[:, :, :plan.spec.seq_len], 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend_lse(plan, q, k, v, w, beta, log_forget, seg):
  """_attend with the log-sum-exp of every query row's logits: (o, lse [B, T, H])."""
  ops = _prepare(plan, q, k, v, w, beta, log_forget, seg)
  o, lse = _forward(plan, ops, _boundary(plan, ops))
  return operands.unchunked(o)[:, :plan.spec.seq_len], _lse_rows(plan, lse)


def _attend_lse_fwd(plan, *args):
  out, res = _attend_fwd(plan, *args)
  return (out, _lse_rows(plan, res[8])), res


def _attend_lse_bwd(plan, res, cts):
  do, dlse = cts
  return _attend_bwd(plan, res, do, dlse)


_attend_lse.defvjp(_attend_lse_fwd, _attend_lse_bwd)

# The entry points call the kernels through jit, keyed by the plan: a model calls the same plan
# in each layer, and jit traces it (forward, linearization, transpose) and lowers its kernels
# to Triton / Mosaic IR once, each layer calling that one function, instead of once per layer.
# XLA inlines the calls, so the compiled program is the same.
_attend_once = jax.jit(_attend, static_argnums=0)
_attend_lse_once = jax.jit(_attend_lse, static_argnums=0)


def _spec(q, k, v, w, beta, log_forget, segment_ids, backend) -> Spec:
  """The call's Spec, after checking every shape against q's."""
  if q.ndim != 4:
    raise ValueError(f"q must have shape [B, T, H, D], got {q.shape}")
  B, T, H, D = q.shape
  if k.ndim != 4 or k.shape[:2] != (B, T) or k.shape[3] != D or H % k.shape[2]:
    raise ValueError(f"k must have shape [B={B}, T={T}, K, D={D}] with H={H} % K == 0, "
                     f"got {k.shape}")
  K = k.shape[2]
  for name, x, shape in (("v", v, (B, T, K, D)), ("w", w, (B, T, K, D)), ("beta", beta, (B, T, K)),
                         ("log_forget", log_forget, (B, T, H)),
                         ("segment_ids", segment_ids, (B, T))):
    if x is not None and tuple(x.shape) != shape:
      raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
  return Spec(batch=B, seq_len=T, heads=H, kv_heads=K, head_dim=D,
              dtype=jnp.dtype(q.dtype).name, transport=w is not None,
              gate=log_forget is not None, segments=segment_ids is not None, backend=backend)


def _plan(spec: Spec, scale, block_sizes, plan: Plan | None) -> Plan:
  scale = float(spec.head_dim ** -0.5 if scale is None else scale)
  if plan is None:
    return resolve(spec, BlockSizes.of(block_sizes), scale=scale)
  if block_sizes is not None:
    raise ValueError("pass block_sizes or plan, not both (a plan is resolved already)")
  if plan.spec != spec:
    diff = [f"{f.name}={getattr(plan.spec, f.name)!r} (the call's {getattr(spec, f.name)!r})"
            for f in dataclasses.fields(Spec)
            if getattr(plan.spec, f.name) != getattr(spec, f.name)]
    raise ValueError(f"plan is for another call: {', '.join(diff)}")
  return dataclasses.replace(plan, scale=scale)


def explain(q, k, v, w=None, beta=None, log_forget=None, *, scale=None, segment_ids=None,
            block_sizes=None, interpret=False, backend=None) -> Plan:
  """The plan path_attention (w given) or forgetting_attention (w None) runs for these
  arguments (arrays or jax.ShapeDtypeStruct). print() it for a few readable lines."""
  backend = launch.resolve_backend(interpret, backend)
  spec = _spec(q, k, v, w, beta, log_forget, segment_ids, backend)
  return _plan(spec, scale, block_sizes, None)


def path_attention(q, k, v, w, beta, log_forget=None, *, scale=None, segment_ids=None,
                   block_sizes=None, interpret=False, backend=None, plan: Plan | None = None,
                   return_lse: bool = False):
  """PaTH (and PaTH-FoX with log_forget) attention -> o [B, T, H, D] in v's dtype; with
  return_lse, (o, lse): lse [B, T, H] float32, the natural log-sum-exp of each query's scaled
  logits (gate included), differentiable (it merges partial attentions, e.g. across devices).

  block_sizes: a BlockSizes, or a dict / "key=value,..." of its fields. backend: "gpu", "tpu",
  "interpret" or "tpu_interpret" (None: the default platform's, or "interpret" with
  interpret=True). plan: a Plan from explain(...) for this call, possibly with fields replaced
  (dataclasses.replace), to run instead of resolving one: it pins a form."""
  if w is None or beta is None:
    raise ValueError("w and beta are required (use forgetting_attention for no transport)")
  backend = launch.resolve_backend(interpret, backend)
  spec = _spec(q, k, v, w, beta, log_forget, segment_ids, backend)
  attend = _attend_lse_once if return_lse else _attend_once
  return attend(_plan(spec, scale, block_sizes, plan), q, k, v, w, beta, log_forget,
                segment_ids)


def forgetting_attention(q, k, v, log_forget, *, scale=None, segment_ids=None, block_sizes=None,
                         interpret=False, backend=None, plan: Plan | None = None,
                         return_lse: bool = False):
  """FoX attention (no transport); ALiBi is a constant log_forget per head; None is plain causal
  softmax attention. Arguments as path_attention's."""
  backend = launch.resolve_backend(interpret, backend)
  spec = _spec(q, k, v, None, None, log_forget, segment_ids, backend)
  attend = _attend_lse_once if return_lse else _attend_once
  return attend(_plan(spec, scale, block_sizes, plan), q, k, v, None, None, log_forget,
                segment_ids)


def phases(q, k, v, w, beta, log_forget=None, *, do=None, scale=None, segment_ids=None,
           block_sizes=None, interpret=False, backend=None) -> dict:
  """What path_attention's forward and backward run (w None: forgetting_attention's), as four
  phases to time apart: {"prepass": (f, args), "forward": ..., "backward": ...,
  "prepass_vjp": ...}, each f(*args) one phase given the outputs of the phases before it (run
  here once, eagerly; wrap f in jax.jit to time it). do: the output cotangent (default: ones).
  The kernels inside a phase are split apart by a profiler trace of the whole call."""
  backend = launch.resolve_backend(interpret, backend)
  spec = _spec(q, k, v, w, beta, log_forget, segment_ids, backend)
  plan = _plan(spec, scale, block_sizes, None)
  args = (q, k, v, w, beta, log_forget)
  seg = segment_ids

  def prepass(*a):
    ops, pullback = _prepare_vjp(plan, *a, seg)
    return ops, pullback, _boundary(plan, ops)

  ops, pullback, boundary = prepass(*args)
  forward_fn = lambda ops, boundary: _forward(plan, ops, boundary)
  o, lse = forward_fn(ops, boundary)
  out = operands.unchunked(o)[:, :spec.seq_len]
  do_b, delta = _backward_inputs(plan, out, jnp.ones_like(out) if do is None else
                                 do.astype(q.dtype))
  backward_fn = lambda ops, do_b, lse, delta, boundary: _backward(plan, ops, do_b, lse, delta,
                                                                   boundary)
  g = backward_fn(ops, do_b, lse, delta, boundary)
  ct = _cotangents(ops, g, transport=w is not None, segments=seg is not None)
  return {"prepass": (prepass, args), "forward": (forward_fn, (ops, boundary)),
          "backward": (backward_fn, (ops, do_b, lse, delta, boundary)),
          "prepass_vjp": (lambda pullback, ct: pullback(ct), (pullback, ct))}
