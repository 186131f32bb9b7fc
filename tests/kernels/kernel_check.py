"""The kernels against their dense oracles: one check that every kernel test runs.

`check(...)` draws fresh inputs, resolves the call's plan (kernels_pallas.explain), pins fields
of it (`pins`: dataclasses.replace, how a test runs a form that is not the default at its
shape), asserts the plan runs the forms the test names (`expect`), then compares the kernel's
output and every gradient with the oracle's at the dtype's tolerance, and with `determinism`
checks the gradients bitwise equal over two runs.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

import kernels_pallas as kp
from posenc_jax import householder
from posenc_jax import unipotent
from tests.kernels.transport_inputs import segment_ids, transport_vectors
from tests.util import assert_rel_rms, assert_trees_rel_rms, model_logits_and_grads
from tests.util import value_and_grads

# Relative RMS against the float32 oracle: the dtype's rounding of the kernels' operands.
TOL = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 1e-2}


def cuda_kernels_with_grad(f, arrays, argnums) -> tuple[set[str], set[str]]:
  """cuda_kernels of f, and of the gradient of sum(f(*a)) w.r.t. argnums."""
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=argnums)
  return cuda_kernels(f, arrays), cuda_kernels(grad, arrays)


def kernel_and_oracle(kernel, oracle, args, ct):
  """((o, grads), (o_want, grads_want)): kernel(*args) and oracle(*args), each with the
  gradients of sum(o * ct) w.r.t. every argument; the oracle at the highest matmul precision."""
  loss = lambda o: jnp.sum(o.astype(jnp.float32) * ct)  # noqa: E731
  argnums = tuple(range(len(args)))
  got = value_and_grads(kernel, loss, argnums)(*args)
  with jax.default_matmul_precision("highest"):
    want = value_and_grads(oracle, loss, argnums)(*args)
  return got, want


def assert_matches(got, want, tol, *, names=("o", "dq", "dk", "dv"), dtypes=None) -> None:
  """kernel_and_oracle's kernel result got = (o, grads) against the oracle's want, each array
  within tol (relative RMS) under its name; with dtypes (one per name), each array's dtype is
  asserted first."""
  (o, grads), (o_want, grads_want) = got, want
  arrays, wanted = (o, *grads), (o_want, *grads_want)
  assert len(names) == len(arrays), f"{len(arrays)} arrays, names {names}"
  for i, (name, a, b) in enumerate(zip(names, arrays, wanted)):
    if dtypes is not None:
      assert a.dtype == dtypes[i], name
    assert_rel_rms(a, b, tol, name)


def cuda_kernels(fn, arrays) -> set[str]:
  """The Pallas kernels (by name, "..._kernel") that jit(fn) at `arrays` (ShapeDtypeStructs)
  lowers to through Triton for "cuda" on this host: the lowering tests' check that a kernel is
  real beyond the interpreter, and that no other kernel runs."""
  text = jax.jit(fn).trace(*arrays).lower(lowering_platforms=("cuda",)).as_text()
  return set(re.findall(r'name = \\?"(\w+_kernel)', text))


def qkv(key, *, B, T, H, K, D, Dv, dtype):
  """Standard-normal q [B, T, H, D], k [B, T, K, D] and v [B, T, K, Dv] in dtype."""
  kq, kk, kv = jax.random.split(key, 3)
  return (jax.random.normal(kq, (B, T, H, D), dtype), jax.random.normal(kk, (B, T, K, D), dtype),
          jax.random.normal(kv, (B, T, K, Dv), dtype))


def inputs(key, B, T, H, K, D, dtype, *, gate, segments, w_mode="random"):
  """-> q, k, v, w, beta, log_forget (None without gate), segment ids (None without segments),
  the output cotangent do. segments: True ("few" documents) or a transport_inputs.segment_ids
  mode."""
  ks = jax.random.split(key, 8)
  q = jax.random.normal(ks[0], (B, T, H, D), dtype)
  k = jax.random.normal(ks[1], (B, T, K, D), dtype)
  v = jax.random.normal(ks[2], (B, T, K, D), dtype)
  w, beta = transport_vectors(ks[3], B, T, K, D, mode=w_mode)
  lf = jax.nn.log_sigmoid(jax.random.normal(ks[5], (B, T, H)) + 2.0) if gate else None
  seg = None
  if segments:
    seg = segment_ids(ks[6], B, T, "few" if segments is True else segments)
  do = jax.random.normal(ks[7], (B, T, H, D), dtype)
  return q, k, v, w, beta, lf, seg, do


def resolve(args, seg, *, fox, backend, block_sizes=None, pins=None, expect=None):
  """The plan of the call (args: q, k, v, w, beta, log_forget; w, beta ignored with fox) with
  `pins` replaced, after asserting each `expect` field (on the pinned plan)."""
  q, k, v, w, beta, lf = args
  plan = kp.explain(q, k, v, None if fox else w, None if fox else beta, lf, segment_ids=seg,
                    block_sizes=block_sizes, backend=backend)
  plan = dataclasses.replace(plan, **(pins or {}))
  for field, want in (expect or {}).items():
    got = getattr(plan, field)
    assert got == want, f"plan.{field} is {got!r}, the test names {want!r}:\n{plan}"
  return plan


def check(key, *, backend, dtype, H, K, D, T, B=2, gate=False, segments=False, fox=False,
          w_mode="random", block_sizes=None, pins=None, expect=None, determinism=False,
          chunked_oracle=False, forward_only=False):
  """The kernel against the oracle on fresh inputs (see the module docstring) -> the plan run.

  forward_only: the output alone (a plan without a backward: plan.backward "none").

  chunked_oracle: PaTH's oracle is householder.path_attention_chunked (the UT algorithm, no
  T x T array: long sequences) instead of the dense walk."""
  q, k, v, w, beta, lf, seg, do = inputs(key, B, T, H, K, D, dtype, gate=gate,
                                         segments=segments, w_mode=w_mode)
  plan = resolve((q, k, v, w, beta, lf), seg, fox=fox, backend=backend,
                 block_sizes=block_sizes, pins=pins, expect=expect)
  scale = D ** -0.5
  # The segment ids and the cotangent are arguments, not constants: the oracle's program is
  # then one per shape, which the session's compilation cache compiles once (CI time).
  if fox:
    args = (q, k, v) + ((lf,) if gate else ())
    fast = lambda seg, *a: kp.forgetting_attention(*a[:3], a[3] if gate else None,
                                                   segment_ids=seg, backend=backend, plan=plan)
    ref = lambda seg, *a: unipotent.forgetting_attention_reference(
        *a[:3], a[3] if gate else jnp.zeros(a[0].shape[:3]), segment_ids=seg, scale=scale)
    names = ("q", "k", "v", "log_forget")
  else:
    args = (q, k, v, w, beta) + ((lf,) if gate else ())
    fast = lambda seg, *a: kp.path_attention(*a, segment_ids=seg, backend=backend, plan=plan)
    dense = (householder.path_attention_chunked if chunked_oracle
             else householder.path_attention_reference)
    ref = lambda seg, *a: dense(*a[:5], log_forget=a[5] if gate else None, segment_ids=seg,
                                scale=scale)
    names = ("q", "k", "v", "w", "beta", "log_forget")
  names = ("forward",) + tuple(f"d{name}" for name in names[:len(args)])

  # One program each for the kernel and the oracle, forward and gradients together (jitted:
  # the interpreter's grid loops recompile at every eager call). The kernel's output comes from
  # its own call, as a caller without gradients runs it (the custom VJP's primal).
  @jax.jit
  def kernel(args, seg, do):
    if forward_only:
      return [fast(seg, *args)]
    grads = jax.grad(lambda *a: jnp.sum(fast(seg, *a).astype(jnp.float32) * do),
                     argnums=tuple(range(len(args))))(*args)
    return [fast(seg, *args), *grads]

  @jax.jit
  def oracle(args, seg, do):
    out, pull = jax.vjp(lambda *a: ref(seg, *a), *args)
    return [out] if forward_only else [out, *pull(do.astype(out.dtype))]

  got = kernel(args, seg, do)
  with jax.default_matmul_precision("highest"):
    want = oracle(args, seg, do)
  tol = TOL[jnp.dtype(dtype)]
  for name, a, b in zip(names, got, want):
    assert_rel_rms(a, b, tol, name)
  if determinism:
    for name, a, b in zip(names[1:], got[1:], kernel(args, seg, do)[1:]):
      assert bool(jnp.array_equal(a, b)), f"{name} differs between two runs"
  return plan


def recorded_calls(monkeypatch, kernel: str, record) -> list:
  """Replaces kernels_pallas.<kernel> (as posenc_jax looks it up) with a wrapper that appends
  record(*args, **kwargs) of every call to the returned list, then runs the kernel: how a model
  test sees that its kernel ran, and how."""
  import kernels_pallas
  calls = []
  original = getattr(kernels_pallas, kernel)

  def recorded(*a, **kw):
    calls.append(record(*a, **kw))
    return original(*a, **kw)

  monkeypatch.setattr(kernels_pallas, kernel, recorded)
  return calls


def check_model_on_the_kernel(key, encoding: str, *, encoding_kwargs=()):
  """A one-layer `encoding` transformer (d_model 32, 4 heads on 2 kv heads of 16) with
  model.implementation="pallas" against the same parameters on "reference" (highest matmul
  precision): logits and every parameter's gradient of the loss, on two packed documents, at
  the float32 tolerance. The caller checks that its kernel ran."""
  from flax import nnx
  from posenc_jax import model as model_lib

  V, B, T = 50, 2, 24
  kp_, kt = jax.random.split(key)
  tokens = jax.random.randint(kt, (B, T + 1), 0, V)
  seg = jnp.where(jnp.arange(T) < 9, 1, 2)[None].repeat(B, 0)
  pos = jnp.where(seg == 1, jnp.arange(T), jnp.arange(T) - 9)

  def run(implementation):
    cfg = model_lib.ModelConfig(vocab_size=V, encoding=encoding, num_layers=1, d_model=32,
                                num_heads=4, num_kv_heads=2, head_dim=16,
                                encoding_kwargs=tuple(encoding_kwargs),
                                implementation=implementation)
    model = model_lib.Transformer(cfg, rngs=nnx.Rngs(params=kp_))
    return model_logits_and_grads(model, tokens, positions_BT=pos, segment_ids_BT=seg)

  logits, grads = run("pallas")
  with jax.default_matmul_precision("highest"):
    logits_want, grads_want = run("reference")
  tol = TOL[jnp.dtype(jnp.float32)]
  assert_rel_rms(logits, logits_want, tol, "logits")
  assert_trees_rel_rms(grads, grads_want, tol, "gradient")
