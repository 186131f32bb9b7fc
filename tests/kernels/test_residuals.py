"""What the kernels' custom VJP keeps from the forward for the backward, by jaxpr (no kernel
runs): per layer, these arrays stay alive from a model's forward to its backward, so each one
costs a [B, T, heads, D]-sized buffer per layer of a trained model."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas as kp
from kernels_pallas.path_attention import api


def _kept_beyond_inputs_and_output(plan, *args):
  """Bytes of the residuals that are neither an input nor the returned output (those the caller
  holds anyway), by the forward rule's jaxpr."""
  jaxpr = jax.make_jaxpr(lambda *a: api._attend_fwd(plan, *a))(*args).jaxpr
  held = set(jaxpr.invars) | {jaxpr.outvars[0]}
  for eqn in jaxpr.eqns:   # a reshape of a held array is that array (XLA: a bitcast, no copy)
    if eqn.primitive.name == "reshape" and eqn.invars[0] in held:
      held.update(eqn.outvars)
  kept = {v for v in jaxpr.outvars[1:] if not hasattr(v, "val") and v not in held}
  return sum(v.aval.size * v.aval.dtype.itemsize for v in kept)


@pytest.mark.parametrize("backend,keep_inverse,prepass,span_forward", [
    ("gpu", False, "uz", False), ("interpret", False, "uz", False), ("gpu", True, "uz", False),
    ("gpu", "bf16", "uz", False), ("gpu", "bf16", "split", False),
    ("interpret", "bf16", "split", False), ("gpu", "bf16", "uz", True)])
def test_path_residuals_are_the_backward_operands(backend, keep_inverse, prepass, span_forward):
  """PaTH: the backward kernels' operands q^, k^, E, the in-chunk logits, the log-sum-exp and
  the pre-pass pullback's blocked beta; no copy of v (the kernels read it time-major: a
  reshape of the input) and none of the output (Delta comes from the time-major output the
  caller holds). keep_inverse adds the pre-pass's float32 Y (True) or its bf16 rounding
  ("bf16", the default, where the GPU's bf16 halves run the inverse); the span forward adds
  its boundary launch (the moved keys kb and the float32 span operators), which the span
  backward reads instead of launching it again; nothing else."""
  B, T, H, K, D, C = 2, 256, 4, 2, 32, 64          # n = 4 whole chunks (padding adds copies)
  n = -(-T // C)
  bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  args = (bf16(B, T, H, D), bf16(B, T, K, D), bf16(B, T, K, D), bf16(B, T, K, D), bf16(B, T, K),
          None, None)
  plan = kp.explain(*args[:5], backend=backend,
                    block_sizes=dict(keep_inverse=keep_inverse, prepass=prepass))
  if span_forward:
    plan = dataclasses.replace(plan, forward="span", forward_far="triton")
  assert (plan.prepass, plan.keep_inverse) == (prepass, keep_inverse)
  assert (plan.backward, plan.span) == ("span", 2)   # n = 4 > the plan's span
  expected = 2 * (B * H * n * C * D           # q^
                  + B * K * n * C * D         # k^ (v is the input itself, in chunks)
                  + B * K * n * D * D         # E
                  + B * H * n * C * C         # in-chunk logits
                  + B * K * n * C)            # blocked beta
  expected += 4 * B * H * n * C               # float32 log-sum-exp
  expected += {False: 0, True: 4, "bf16": 2}[keep_inverse] * B * K * n * C * C   # Y
  if span_forward:   # kb (bf16) and one float32 operator per boundary
    expected += 2 * B * K * n * C * D + 4 * B * K * plan.boundaries * D * D
  assert _kept_beyond_inputs_and_output(plan, *args) == expected
