"""The plan: every choice of a PaTH / FoX call, resolved once, at the entry, before any kernel is
traced. `resolve` turns the call's shapes, dtype, backend, device and options (BlockSizes)
into a frozen Plan; the launches only read it. `str(plan)` says it in a few lines
(`explain(...)` in api.py).

Each default below was the faster one where it was measured (DESIGN.md has the table per device
and head_dim); each limit is a shape that does not build (the GPU's 227 KiB of shared memory
per block) or a kernel that needs what the device lacks (Mosaic GPU needs Hopper).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.path_attention.options import BlockSizes

# Span length: the shortest even span with at most this many boundaries (more at head_dim > 64,
# where a near chunk pair costs far more than a far one), but no shorter than SPAN_MIN chunks
# unless the sequence is short (at most 3 boundaries). More boundaries shorten the sequential
# walks inside a span for one more set of packed boundary states each (transient memory).
SPAN_BOUNDARIES = 7
SPAN_BOUNDARIES_WIDE = 15
SPAN_MIN = 8
# From this many chunks the span backward's far dk/dv walk gets a launch of its own at head_dim
# 64 too, where that launch is Mosaic GPU's.
FAR_DKV_MIN_CHUNKS = 64
# PaTH's backward kernels in float32 build on the GPU up to this head_dim: at 128 every backward
# form asks for more than the 227 KiB of shared memory a block has (256-427 KiB on the H200).
# There the plan has no backward ("none"); the forward runs.
GPU_FLOAT32_BACKWARD_MAX_HEAD_DIM = 64
# The SM count where no GPU answers (the interpreter; lowering for a GPU on a CPU host): the
# H100's and H200's.
DEFAULT_SMS = 132


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a call is: shapes, dtype, features, backend."""
  batch: int
  seq_len: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: str
  transport: bool
  gate: bool
  segments: bool
  backend: str

  @property
  def group(self) -> int:
    return self.heads // self.kv_heads

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Device:
  """The GPU the plan is for: compute capability (major, minor) and SM count. No GPU (the
  interpreter, or lowering for one on a CPU host) plans for an H100."""
  name: str = "H100 / H200 (assumed)"
  capability: tuple = (9, 0)
  sms: int = DEFAULT_SMS

  @property
  def hopper(self) -> bool:
    return self.capability >= (9, 0)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Every choice of one call. Forms:

  prepass: "uz" | "split" (Pallas kernels, prepass/) | "jnp" | "none" (FoX: no transport).
  forward: "walk" (one program per query chunk walks every key chunk) | "span" (walks inside
    its span; earlier spans are plain attention against boundary states) | "tpu".
  forward_far: with "span", where the far keys run: "triton" (inside the forward kernel) or
    "mosaic" (a launch of their own).
  backward: "walk" (dq/dP swept per (batch, kv head, lane), then dk/dv per key chunk) | "span"
    (span-parallel: boundary, far dq, key side, span sweep) | "tpu" | "none" (float32 PaTH at
    head_dim > 64 on the GPU: no kernel fits; GPU_FLOAT32_BACKWARD_MAX_HEAD_DIM).
  far_dkv: with "span", the key side's far walk: "dkv" (inside the dk/dv kernel) or its own
    launch, "triton" or "mosaic".
  far_dq, sweep: with "span", "triton" or "mosaic".
  chain: the precision of the span forms' D x D operator products with 16-bit inputs: "kernel"
    (the kernels' own: one TF32 pass) or "bf16x3" (three bf16 passes).
  launches: ((kernel, warps, stages), ...) of the Triton launches.
  """
  spec: Spec
  scale: float
  device: Device
  block: int
  chunks: int
  prepass: str
  keep_inverse: bool | str
  prepass_warps: tuple
  forward: str
  forward_far: str
  backward: str
  span: int
  lanes: int
  far_dq: str
  far_dq_pairs: bool
  far_dkv: str
  far_dkv_pairs: bool
  sweep: str
  sweep_pairs: bool
  chain: str
  launches: tuple

  def warps(self, kernel: str) -> int:
    return self._launch(kernel)[0]

  def stages(self, kernel: str) -> int:
    return self._launch(kernel)[1]

  def _launch(self, kernel):
    for name, warps, stages in self.launches:
      if name == kernel:
        return warps, stages
    raise KeyError(f"the plan has no launch {kernel!r}")

  @property
  def precision(self):
    """The attention kernels' dot precision: float32 inputs keep float32 accuracy (three-pass
    TF32 on the GPU, HIGHEST elsewhere); 16-bit inputs take the default (one pass)."""
    if self.spec.itemsize == 4:
      return _float32_precision(self.spec.backend)
    return None

  @property
  def chain_precision(self):
    """The precision of the span forms' D x D operator products (float32 operands)."""
    if self.chain == "bf16x3":
      return _bf16x3_precision(self.spec.backend)
    return self.precision

  @property
  def boundaries(self) -> int:
    return (self.chunks - 1) // self.span if self.span else 0

  def __str__(self):
    return explain_text(self)


def _float32_precision(backend):
  return (jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if backend == "gpu"
          else jax.lax.Precision.HIGHEST)


def _bf16x3_precision(backend):
  return (jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3 if backend in ("gpu", "interpret")
          else jax.lax.Precision.HIGHEST)


def gpu_device(backend: str) -> Device:
  """The GPU that runs the kernels (the first one); the assumed H100 where none answers."""
  if backend != "gpu":
    return Device()
  try:
    d = jax.devices("gpu")[0]
  except RuntimeError:   # lowering for a GPU on a host without one
    return Device()
  cap = getattr(d, "compute_capability", None)
  capability = tuple(int(x) for x in str(cap).split(".")) if cap else Device.capability
  return Device(name=getattr(d, "device_kind", "GPU"), capability=capability,
                sms=int(getattr(d, "core_count", 0) or DEFAULT_SMS))


def auto_span(n: int, *, head_dim: int) -> int:
  """Span length in chunks for n chunks (SPAN_BOUNDARIES, SPAN_BOUNDARIES_WIDE, SPAN_MIN)."""
  boundaries = SPAN_BOUNDARIES_WIDE if head_dim > 64 else SPAN_BOUNDARIES
  even = lambda span: span + span % 2
  most = lambda boundaries: even((n - 1) // (boundaries + 1) + 1)
  return max(most(boundaries), min(most(3), SPAN_MIN))


def auto_lanes(programs: int, units: int, sms: int, max_lanes: int = 4) -> int:
  """Lanes per kv head of the sequential dq/dP sweep: each of the `programs` = B K programs
  walks all `units` (query-chunk pairs) of its head, one program an SM, so the launch runs in
  ceil(programs / sms) waves; L lanes split each program's units L ways (time ~ ceil(L programs
  / sms) / L, each lane adding a [T, D, D / C] float32 buffer). Ties go to fewer lanes."""
  lanes = range(1, max(1, min(max_lanes, units)) + 1)
  return min(lanes, key=lambda L: (-(-programs * L // sms) / L, L))


def mosaic_takes(spec: Spec, block: int) -> str | None:
  """None where the far walks' Mosaic GPU launches take the operands, else why not."""
  if spec.itemsize != 2:
    return f"{spec.dtype} inputs (they take bfloat16 or float16)"
  if block != 64 or spec.head_dim % 64:
    return f"block {block}, head_dim {spec.head_dim} (they take 64 and a multiple of 64)"
  return None


def sweep_takes(spec: Spec, block: int, chunks: int) -> str | None:
  """None where the near sweep's Mosaic GPU launch takes the operands, else why not."""
  why = mosaic_takes(spec, block)
  if why is None and spec.head_dim != 64:
    why = f"head_dim {spec.head_dim} (it takes 64)"
  return why or (f"{chunks} chunks (it takes an even number)" if chunks % 2 else None)


def prepass_form(spec: Spec, requested: str | None) -> str:
  """The pre-pass: requested, else "uz"; on the GPU "split" where "uz" was slower and "jnp"
  where no kernel fits.

  On the GPU the kernels hold float32 tiles (and the bf16 halves of their operands) in 227 KiB
  of shared memory per block: every query head of a kv head in one program. So float32 inputs
  build at G = 1 and head_dim <= 64 only, 16-bit ones at head_dim <= 64 for any G and at 128
  with G = 1 in the "split" form (the "uz" form spills at 128)."""
  if not spec.transport:
    return "none"
  form = requested or "uz"
  if form == "jnp" or spec.backend != "gpu":
    return form
  if form == "uz" and (spec.itemsize == 4 or spec.head_dim > 64):
    form = "split"   # the "uz" VJP spills at head_dim 128 and has not run in float32 on a GPU
  G, D = spec.group, spec.head_dim
  if spec.itemsize == 4:
    return form if G == 1 and D < 128 else "jnp"
  return form if D < 128 or (D == 128 and G == 1) else "jnp"


def prepass_warps(head_dim: int) -> tuple:
  """Each pre-pass kernel's warps: the operands kernel and the split VJP's query part spill at
  head_dim 128 with 4 warps and take 8; the others keep 4 at every head_dim."""
  wide = 8 if head_dim >= 128 else 4
  return (("_inv_kernel", 4), ("_refine_kernel", 4), ("_inv_bwd_kernel", 4),
          ("_ops_kernel", wide), ("_ops_bwd_kv_kernel", 4), ("_ops_bwd_q_kernel", wide),
          ("_ops_bwd_uz_kernel", 4), ("_t_pullback_kernel", 4))


def _launches(spec: Spec, *, block: int, dq_pairs: bool, far_dq_pairs: bool,
              far_dkv_pairs: bool, sweep_pairs: bool) -> tuple:
  """Warps and pipeline stages of every Triton launch. Two stages where two fit in shared
  memory (head_dim x block <= 64 x 64, and the flash-like boundary and far launches with
  16-bit inputs at every head_dim); 2C-row tiles take 8 warps (they spill with 4)."""
  D, f32 = spec.head_dim, spec.itemsize == 4
  stages = 2 if D * block <= 64 * 64 else 1
  flash_stages = 2 if not f32 else stages
  warps = 4 if D <= 64 else 8   # the backward launches'
  wide = lambda pairs: 8 if pairs else warps
  return (("forward", 4, stages),
          ("dq", wide(dq_pairs), stages),
          # without grouped heads two stages fit at head_dim 128 too; grouped float32 heads
          # take one at every head_dim
          ("dkv", warps, 2 if spec.group == 1 else (1 if f32 else stages)),
          ("boundary", warps, flash_stages),
          ("far_dq", wide(far_dq_pairs), flash_stages),
          ("far_dkv", wide(far_dkv_pairs), flash_stages),
          ("far_y", 4, 2),
          ("span", wide(sweep_pairs), stages))


def resolve(spec: Spec, options: BlockSizes, *, scale: float, device: Device | None = None
            ) -> Plan:
  """The plan of a call: `options` (BlockSizes) where set, else the defaults above."""
  if spec.head_dim < 16 or spec.head_dim & (spec.head_dim - 1):
    raise ValueError(f"head_dim={spec.head_dim} must be a power of two >= 16")
  device = device or gpu_device(spec.backend)
  C = options.block
  n = -(-spec.seq_len // C)
  D, backend = spec.head_dim, spec.backend
  tpu = backend in ("tpu", "tpu_interpret")
  mosaic = _mosaic_allowed(options.mosaic, backend, device)

  span = 0
  if spec.transport and not tpu:
    span = auto_span(n, head_dim=D) if options.span is None else options.span
    span = span if n > span else 0
  why_far = mosaic_takes(spec, C) if backend == "gpu" else None
  far_mosaic = bool(span) and mosaic and why_far is None

  forward, forward_far = ("tpu", "none") if tpu else ("walk", "none")
  if span and D > 64:   # the span forward: at head_dim 64 the walk was as fast
    forward, forward_far = "span", "mosaic" if far_mosaic else "triton"

  backward, far_dkv, far_dq, sweep = ("tpu" if tpu else "walk"), "none", "none", "none"
  sweep_pairs = far_dq_pairs = far_dkv_pairs = False
  if span:
    backward = "span"
    far_dq = "mosaic" if far_mosaic else "triton"
    # 2C-row tiles (chunk pairs) in float32 exceed the GPU's shared memory at head_dim 128.
    wide_fits = spec.itemsize <= 2 or backend != "gpu"
    far_dq_pairs = D > 64 and wide_fits
    own = D > 64 or (n >= FAR_DKV_MIN_CHUNKS and far_mosaic)
    far_dkv = ("mosaic" if far_mosaic else "triton") if own else "dkv"
    far_dkv_pairs = own and wide_fits
    sweep_pairs = wide_fits
    why_sweep = sweep_takes(spec, C, n) if backend == "gpu" else (
        f"{n} chunks (it takes an even number)" if n % 2 else None)
    sweep = "mosaic" if mosaic and sweep_pairs and why_sweep is None else "triton"

  if not gpu_float32_backward(spec):
    backward, far_dkv, far_dq, sweep = "none", "none", "none", "none"
    sweep_pairs = far_dq_pairs = far_dkv_pairs = False

  lanes = 1
  dq_pairs = spec.transport
  if backward == "walk":
    units = n // 2 if dq_pairs else n
    # Without transport a lane keeps no D x D buffer: one program per query chunk, as in a
    # flash-attention dq launch. (B K programs of the sweep leave SMs idle at B 4, K 12.)
    lanes = (auto_lanes(spec.batch * spec.kv_heads, units, device.sms) if spec.transport
             else units)

  prepass = prepass_form(spec, options.prepass)
  products_halves = spec.itemsize == 2 and backend in ("gpu", "interpret")
  keep = options.keep_inverse
  if keep == "bf16" and not products_halves or prepass in ("jnp", "none"):
    keep = False   # finer products recompute Y: the refining step would make it coarser
  chain = "bf16x3" if D > 64 and spec.itemsize == 2 else "kernel"
  return Plan(spec=spec, scale=float(scale), device=device, block=C, chunks=n, prepass=prepass,
              keep_inverse=keep, prepass_warps=prepass_warps(D), forward=forward,
              forward_far=forward_far, backward=backward, span=span, lanes=lanes,
              far_dq=far_dq, far_dq_pairs=far_dq_pairs, far_dkv=far_dkv,
              far_dkv_pairs=far_dkv_pairs, sweep=sweep, sweep_pairs=sweep_pairs, chain=chain,
              launches=_launches(spec, block=C, dq_pairs=dq_pairs, far_dq_pairs=far_dq_pairs,
                                 far_dkv_pairs=far_dkv_pairs, sweep_pairs=sweep_pairs))


def gpu_float32_backward(spec: Spec) -> bool:
  """Whether the kernels have a backward for this call (all but float32 PaTH at head_dim > 64
  on the GPU)."""
  return not (spec.backend == "gpu" and spec.transport and spec.itemsize == 4
              and spec.head_dim > GPU_FLOAT32_BACKWARD_MAX_HEAD_DIM)


def no_backward_message(spec: Spec) -> str:
  return (f"PaTH's GPU kernels have no backward for float32 inputs at head_dim {spec.head_dim} "
          f"> {GPU_FLOAT32_BACKWARD_MAX_HEAD_DIM}: their float32 tiles need more than the "
          "227 KiB of shared memory a block has. Cast q, k, v to bfloat16, or take the "
          "blockwise jnp implementation (posenc_jax: implementation='chunked'); the forward "
          "alone runs")


def _mosaic_allowed(option, backend: str, device: Device) -> bool:
  """Whether the Mosaic GPU launches may run (each still needs operands it takes)."""
  if option is False or backend in ("tpu", "tpu_interpret"):
    if option:
      raise ValueError(f"mosaic=True needs a GPU (or the interpreter), not backend {backend!r}")
    return False
  if backend == "interpret":
    return bool(option)   # their jnp oracles, where asked
  if not device.hopper:
    if option:
      raise ValueError(f"mosaic=True needs a Hopper GPU (sm_90+); this is {device.name}, "
                       f"sm_{device.capability[0]}{device.capability[1]}")
    return False
  return True


def explain_text(plan: Plan) -> str:
  """The plan in a few lines."""
  s = plan.spec
  what = "PaTH" if s.transport else "FoX" if s.gate else "softmax attention"
  feats = ", ".join(x for x, on in (("gate", s.gate and s.transport), ("segments", s.segments))
                    if on) or "no gate, no segments" if s.transport else (
      "segments" if s.segments else "no segments")
  where = s.backend + (f" ({plan.device.name}, sm_{plan.device.capability[0]}"
                       f"{plan.device.capability[1]}, {plan.device.sms} SMs)"
                       if s.backend == "gpu" else "")
  lines = [f"{what} on {where}: B={s.batch} T={s.seq_len} H={s.heads} K={s.kv_heads} "
           f"D={s.head_dim} {s.dtype}; {feats}",
           f"chunks:    {plan.chunks} of {plan.block} tokens" +
           (f"; spans of {plan.span} chunks ({plan.boundaries} boundaries)" if plan.span
            else "")]
  if plan.prepass != "none":
    keep = {False: "Y recomputed in its backward", True: "Y kept in float32",
            "bf16": "Y kept in bf16, refined by a Newton step"}[plan.keep_inverse]
    lines.append(f"pre-pass:  {plan.prepass}" + ("" if plan.prepass == "jnp" else f"; {keep}"))
  fwd = {"walk": "walk (Triton)", "tpu": "TPU walk (key chunks a grid axis)",
         "span": f"span walk (Triton), far keys on {plan.forward_far}"}[plan.forward]
  lines.append(f"forward:   {fwd}")
  if plan.backward == "span":
    keys = ("dk/dv kernel (its far walk inside)" if plan.far_dkv == "dkv"
            else f"far dk/dv on {plan.far_dkv}{' (key pairs)' * plan.far_dkv_pairs}")
    lines.append(f"backward:  span-parallel: far dq on {plan.far_dq}"
                 f"{' (query pairs)' * plan.far_dq_pairs}; {keys}; near sweep on {plan.sweep}"
                 f"{' (query pairs)' * plan.sweep_pairs}; chains {plan.chain}")
  elif plan.backward == "walk":
    lines.append(f"backward:  walk: dq/dP on {plan.lanes} lane{'s' * (plan.lanes > 1)} a kv "
                 "head, then dk/dv")
  elif plan.backward == "none":
    lines.append(f"backward:  none (float32 at head_dim {s.head_dim} on the GPU: its tiles "
                 "exceed shared memory)")
  else:
    lines.append("backward:  TPU walks (query and key chunks grid axes)")
  if s.backend == "gpu":
    used = _used_launches(plan)
    lines.append("launches:  " + ", ".join(f"{k} {w}w/{st}s" for k, w, st in plan.launches
                                           if k in used))
  return "\n".join(lines)


def _used_launches(plan: Plan) -> set:
  used = {"forward"} | ({"boundary"} if plan.forward == "span" else set())
  if plan.backward == "walk":
    used |= {"dq", "dkv"}
  elif plan.backward == "span":
    used |= {"boundary", "far_y", "span", "dkv"}
    used |= {"far_dq"}   # (its boundary states' launch too, with the Mosaic walk)
    if plan.far_dkv == "triton":
      used.add("far_dkv")
  return used
