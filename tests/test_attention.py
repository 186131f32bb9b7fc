"""posenc_jax.attention dispatch: the auto rule's table, the softmax kernels against the dense
oracle, explicit-implementation errors, and O(T) gradient memory of the blockwise forms."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from posenc_jax import attention

from posenc_jax import dispatch
from tests.util import assert_rel_rms

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@pytest.mark.parametrize("dtype,D,Dv,segments,T,expected,why", [
    (BF16, 64, 64, False, 2048, "cudnn", "cuDNN flash attention"),
    (F16, 128, 128, False, 8192, "cudnn", "head dim 128"),
    (BF16, 72, 64, False, 2048, "cudnn", "head dim 72"),          # GRAPE-A's lifted q, k
    (BF16, 60, 64, False, 2048, "cudnn", "head dim 64"),          # padded to a multiple of 8
    (BF16, 64, 64, True, 8192, "cudnn", "segments as a dense [B,1,T,T] mask"),
    (BF16, 64, 64, True, 32768, "pallas", "T=32768 > CUDNN_SEGMENT_MASK_MAX_T=16384"),
    (F32, 64, 64, False, 2048, "pallas", "dtype float32 is not bfloat16 or float16"),
    (F32, 64, 64, True, 8192, "pallas", "dtype float32"),
    (BF16, 192, 192, False, 2048, "xla", "head dim 192 > CUDNN_MAX_HEAD_DIM=128"),
    (jnp.float64, 64, 64, False, 16, "xla", "dtype float64 is not one of"),
])
def test_softmax_gpu_path_table(dtype, D, Dv, segments, T, expected, why):
  choice = dispatch.softmax_gpu_path(dtype, D, Dv, has_segments=segments, T=T)
  assert choice.implementation == expected, choice
  assert why in choice.reason, choice


@pytest.mark.parametrize("dtype,T,expected,why", [
    (BF16, 2048, "cudnn", "segments as a dense [B,1,T,T] mask"),
    (BF16, 2047, "pallas", "odd T=2047"),                 # cuDNN's bias backward: even T only
    (F32, 2048, "pallas", "dtype float32"),
])
def test_softmax_gpu_path_segments_via_cudnn(dtype, T, expected, why):
  """Packed documents go to cuDNN (dense mask) where it can take them, else to Pallas."""
  choice = dispatch.softmax_gpu_path(dtype, 64, 64, has_segments=True, T=T)
  assert (choice.implementation, why in choice.reason) == (expected, True), choice


def test_softmax_gpu_path_segment_mask_limit_is_a_switch(monkeypatch):
  """CUDNN_SEGMENT_MASK_MAX_T=0 sends every packed batch to the Pallas kernel."""
  monkeypatch.setattr(dispatch, "CUDNN_SEGMENT_MASK_MAX_T", 0)
  choice = dispatch.softmax_gpu_path(BF16, 64, 64, has_segments=True, T=2048)
  assert choice.implementation == "pallas", choice
  assert "T=2048 > CUDNN_SEGMENT_MASK_MAX_T=0" in choice.reason, choice
  assert dispatch.softmax_gpu_path(BF16, 64, 64, has_segments=False,
                                    T=2048).implementation == "cudnn"


def test_softmax_gpu_path_long_segments_fall_back_to_cudnn(monkeypatch):
  """Beyond the mask limit, where the Pallas kernel cannot run, packed documents still go to
  cuDNN, not to XLA's T x T form."""
  monkeypatch.setattr(dispatch, "PALLAS_MAX_HEAD_DIM", 64)
  choice = dispatch.softmax_gpu_path(BF16, 96, 96, has_segments=True, T=32768)
  assert choice.implementation == "cudnn", choice
  assert "the Pallas kernel cannot: head dim 128 > PALLAS_MAX_HEAD_DIM=64" in choice.reason, choice


@pytest.mark.parametrize("family,backend,T,expected", [
    # CPU: the faster exact form by measurement (CPU_DENSE_MAX_T, docs/benchmarks/cpu_auto.md).
    ("softmax", "cpu", 128, "reference"), ("softmax", "cpu", 2048, "chunked"),
    ("tapa", "cpu", 512, "reference"), ("path_integral", "cpu", 8192, "chunked"),
    ("path", "cpu", 64, "chunked"), ("path", "cpu", 512, "chunked"),
    ("forgetting", "cpu", 2048, "reference"), ("forgetting", "cpu", 4096, "chunked"),
    ("softmax", "gpu", 2048, "cudnn"), ("softmax", "gpu", 32768, "pallas"),
    ("softmax", "tpu", 512, "chunked"),
    ("path", "gpu", 512, "pallas"), ("forgetting", "tpu", 8192, "pallas"),
    # Triton kernels on the GPU; the TPU has none: blockwise, never the dense reference.
    ("tapa", "gpu", 512, "pallas"), ("tapa", "tpu", 8192, "chunked"),
    ("path_integral", "gpu", 16, "pallas"), ("path_integral", "tpu", 2048, "chunked"),
    ("stick_breaking", "cpu", 256, "reference"), ("stick_breaking", "cpu", 512, "chunked"),
    # SBA on the GPU: dense below SBA_GPU_KERNEL_MIN_T, the Triton kernel from it; no TPU form.
    ("stick_breaking", "gpu", 64, "reference"), ("stick_breaking", "gpu", 256, "pallas"),
    ("stick_breaking", "tpu", 64, "chunked"), ("stick_breaking", "tpu", 2048, "chunked"),
])
def test_auto_implementation_table(family, backend, T, expected):
  choice = dispatch.auto_implementation(family, T=T, dtype=BF16, head_dim=64, has_segments=True,
                                         backend=backend)
  assert choice.implementation == expected, choice
  assert choice.reason.startswith(backend) or family == "softmax", choice


# The measured CPU thresholds (docs/benchmarks/cpu_auto.md): dense up to T, chunked
# beyond; 0 = chunked at every T. Re-measure before changing one.
CPU_THRESHOLDS = {"softmax": 256, "grape_a": 256, "path": 0, "forgetting": 2048,
                  "path_integral": 2048, "tapa": 2048, "stick_breaking": 256}


@pytest.mark.parametrize("family", dispatch.FAMILIES)
def test_cpu_dense_threshold_per_family(family):
  limit = CPU_THRESHOLDS[family]
  assert dispatch.CPU_DENSE_MAX_T[family] == limit
  pick = lambda T: dispatch.auto_implementation(family, T=T, dtype=F32, head_dim=32,  # noqa: E731
                                                 has_segments=True, backend="cpu")
  if limit:
    assert pick(limit).implementation == "reference", pick(limit)
    assert pick(1).implementation == "reference"
  choice = pick(limit + 1)
  assert choice.implementation == "chunked", choice
  assert choice.reason.startswith("cpu: "), choice
  assert f"CPU_DENSE_MAX_T[{family!r}]={limit}" in choice.reason, choice
  assert pick(2 * dispatch.AUTO_DENSE_MAX_T).implementation == "chunked"


def test_auto_implementation_unknown_family_raises():
  with pytest.raises(ValueError, match="family='rope'"):
    dispatch.auto_implementation("rope", T=16, dtype=F32, head_dim=8)


def test_none_on_a_tpu_runs_the_blockwise_tapa(monkeypatch, key):
  """implementation=None dispatches by auto_implementation: chunked TAPA on a TPU (no kernel)."""
  from posenc_jax import tapa
  ran = []
  chunked = tapa.tapa_attention_chunked
  monkeypatch.setattr(tapa, "tapa_attention_chunked",
                      lambda *a, **kw: ran.append(1) or chunked(*a, **kw))
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  q, k, v = (jax.random.normal(k_, (1, 16, 2, 8)) for k_ in jax.random.split(key, 3))
  o = attention.tapa_attention(q, k, v)
  assert ran == [1]
  assert_rel_rms(o, attention.tapa_attention(q, k, v, implementation="reference"), 1e-5)


@pytest.mark.parametrize("family", ["tapa", "path_integral"])
def test_none_on_a_gpu_runs_the_triton_kernel(monkeypatch, key, family):
  """implementation=None on a GPU calls the family's Triton kernel (seen called; run here by
  the interpreter, as the GPU would run it)."""
  import kernels_pallas
  name = {"tapa": "tapa_attention", "path_integral": "grape_ap_attention"}[family]
  real = getattr(kernels_pallas, name)
  ran = []
  monkeypatch.setattr(kernels_pallas, name,
                      lambda *a, **kw: ran.append(1) or real(*a, **{**kw, "interpret": True}))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  ks = jax.random.split(key, 4)
  q, k, v = (jax.random.normal(k_, (1, 16, 2, 8)) for k_ in ks[:3])
  if family == "tapa":
    fn = lambda impl: attention.tapa_attention(q, k, v, implementation=impl)  # noqa: E731
  else:
    p = jax.random.normal(ks[3], (1, 16, 2, 4))
    alpha = jnp.array([0.5, 1.0])
    fn = lambda impl: attention.path_integral_attention(q, k, v, p, alpha,  # noqa: E731
                                                        implementation=impl)
  o = fn(None)
  assert ran == [1]
  assert_rel_rms(o, fn("reference"), 1e-4)


@pytest.mark.parametrize("dtype,D,Dv,T,expected,why", [
    # measured on the H200 in bf16 (docs/benchmarks/path_kernel.md): dense ties or wins at T 64
    (BF16, 64, 64, 64, "reference", "below SBA_GPU_KERNEL_MIN_T=256"),
    (BF16, 64, 64, 255, "reference", "below SBA_GPU_KERNEL_MIN_T=256"),
    (F32, 256, 256, 128, "reference", "dense jnp"),      # short T: dense whatever the kernel
    (BF16, 128, 128, 256, "pallas", "the Triton SBA kernel (T=256"),
    (BF16, 32, 32, 512, "pallas", "the Triton SBA kernel"),
    (F16, 64, 24, 2048, "pallas", "the Triton SBA kernel"),
    # where the kernel has not run on a GPU: blockwise, never a T x T array
    (F32, 64, 64, 512, "chunked", "dtype float32 is not bfloat16 or float16"),
    (BF16, 256, 256, 2048, "chunked", "head dim 256 > PALLAS_MAX_HEAD_DIM=128"),
    (BF16, 64, 136, 512, "chunked", "head dim 256 > PALLAS_MAX_HEAD_DIM=128"),   # Dv padded
])
def test_sba_gpu_path_table(dtype, D, Dv, T, expected, why):
  choice = dispatch.auto_implementation("stick_breaking", T=T, dtype=dtype, head_dim=D,
                                         v_head_dim=Dv, has_segments=True, backend="gpu")
  assert choice == dispatch.sba_gpu_path(dtype, D, Dv, T=T)
  assert choice.implementation == expected, choice
  assert why in choice.reason and choice.reason.startswith("gpu: "), choice


def test_sba_gpu_kernel_threshold_is_a_switch(monkeypatch):
  """SBA_GPU_KERNEL_MIN_T is the one place the GPU switch lives: moved, the rule follows."""
  monkeypatch.setattr(dispatch, "SBA_GPU_KERNEL_MIN_T", 1024)
  pick = lambda T: dispatch.sba_gpu_path(BF16, 64, 64, T=T).implementation  # noqa: E731
  assert (pick(1023), pick(1024)) == ("reference", "pallas")


def test_none_on_a_gpu_runs_the_sba_kernel(monkeypatch, key):
  """implementation=None on a GPU calls the SBA Triton kernel from SBA_GPU_KERNEL_MIN_T on
  (lowered to 16 so the interpreter runs it here, as the GPU would), with documents and grouped
  heads in bf16, and the dense form below it."""
  import kernels_pallas
  from posenc_jax import stick_breaking
  ran = []

  def record(module, name, name_ran, **force):
    real = getattr(module, name)
    monkeypatch.setattr(module, name,
                        lambda *a, **kw: ran.append(name_ran) or real(*a, **{**kw, **force}))

  record(kernels_pallas, "stick_breaking_attention", "pallas", interpret=True)
  record(stick_breaking, "stick_breaking_attention_reference", "reference")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(dispatch, "SBA_GPU_KERNEL_MIN_T", 16)
  ks = jax.random.split(key, 3)
  q = jax.random.normal(ks[0], (1, 16, 4, 16), BF16)
  k, v = (jax.random.normal(k_, (1, 16, 2, 16), BF16) for k_ in ks[1:])
  seg = jnp.array([[0] * 5 + [1] * 11])
  o = attention.stick_breaking_attention(q, k, v, segment_ids=seg)
  assert ran == ["pallas"]
  want = attention.stick_breaking_attention(q, k, v, segment_ids=seg, implementation="reference")
  assert_rel_rms(o, want, 1e-2)
  attention.stick_breaking_attention(q[:, :15], k[:, :15], v[:, :15], segment_ids=seg[:, :15])
  assert ran == ["pallas", "reference", "reference"]


def _inputs(key, *, B=2, T=37, H=4, K=2, D=12, Dv=8, dtype=F32):
  ks = jax.random.split(key, 5)
  q = jax.random.normal(ks[0], (B, T, H, D), dtype)
  k = jax.random.normal(ks[1], (B, T, K, D), dtype)
  v = jax.random.normal(ks[2], (B, T, K, Dv), dtype)
  # Random packing, 2-4 segments per row; T is not a multiple of the kernel's 64-token tile.
  seg = jnp.cumsum(jax.random.uniform(ks[3], (B, T)) < 3.0 / T, axis=1).astype(jnp.int32)
  do = jax.random.normal(ks[4], (B, T, H, Dv), dtype)
  return q, k, v, seg, do


@pytest.mark.parametrize("implementation,tol", [("pallas", 1e-4), ("xla", 1e-5)])
def test_softmax_implementation_matches_reference(key, implementation, tol):
  """Forward and every gradient against the dense oracle: segments, GQA, Dv != D (padded)."""
  q, k, v, seg, do = _inputs(key)

  def loss(impl):
    return lambda q, k, v: jnp.sum(attention.softmax_attention(
        q, k, v, segment_ids=seg, implementation=impl) * do)

  def attend(impl):   # jitted: one compile instead of eager op-by-op dispatch (CI time)
    return jax.jit(lambda q, k, v: attention.softmax_attention(q, k, v, segment_ids=seg,
                                                              implementation=impl))

  with jax.default_matmul_precision("highest"):
    o_ref = attend("reference")(q, k, v)
    g_ref = jax.jit(jax.grad(loss("reference"), argnums=(0, 1, 2)))(q, k, v)
    o = attend(implementation)(q, k, v)
    g = jax.jit(jax.grad(loss(implementation), argnums=(0, 1, 2)))(q, k, v)
  assert o.shape == o_ref.shape == (2, 37, 4, 8)
  assert_rel_rms(o, o_ref, tol, "o")
  for name, a, b in zip(("dq", "dk", "dv"), g, g_ref):
    assert_rel_rms(a, b, tol, name)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs a CUDA GPU")
@pytest.mark.parametrize("segments", [False, True])
def test_cudnn_matches_reference_on_gpu(key, segments):
  """bf16 cuDNN (packed documents through the dense mask), GQA and Dv != D, forward and grads."""
  q, k, v, seg, do = _inputs(key, T=256, D=72, Dv=64, dtype=BF16)
  seg = seg if segments else None

  def loss(impl):
    return lambda q, k, v: jnp.sum(attention.softmax_attention(
        q, k, v, segment_ids=seg, implementation=impl).astype(F32) * do)

  for a, b, name in zip((attention.softmax_attention(q, k, v, segment_ids=seg,
                                                     implementation="cudnn"),)
                        + jax.grad(loss("cudnn"), argnums=(0, 1, 2))(q, k, v),
                        (attention.softmax_attention(q, k, v, segment_ids=seg,
                                                     implementation="reference"),)
                        + jax.grad(loss("reference"), argnums=(0, 1, 2))(q, k, v),
                        ("o", "dq", "dk", "dv")):
    assert_rel_rms(a, b, 1e-2, name)


def _zeros(B=1, T=8, H=2, K=1, D=8, Dv=8, dtype=F32):
  """Inputs for the error tests: their values never matter."""
  return (jnp.zeros((B, T, H, D), dtype), jnp.zeros((B, T, K, D), dtype),
          jnp.zeros((B, T, K, Dv), dtype))


def test_cudnn_off_gpu_raises():
  q, k, v = _zeros(dtype=BF16)
  seg = jnp.ones((1, 8), jnp.int32)
  with pytest.raises(ValueError, match=r"implementation='cudnn' needs a CUDA GPU"):
    attention.softmax_attention(q, k, v, segment_ids=seg, implementation="cudnn")


def test_cudnn_unsupported_dtype_raises_before_lowering(monkeypatch):
  """On a GPU an explicit cudnn with float32 inputs names the reason, not a lowering error."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q, k, v = _zeros()
  with pytest.raises(ValueError, match=r"implementation='cudnn' cannot run.*dtype float32"):
    attention.softmax_attention(q, k, v, implementation="cudnn")


def test_cudnn_is_not_an_implementation_of_other_families():
  q, k, v = _zeros()
  with pytest.raises(ValueError, match="implementation='cudnn'"):
    attention.tapa_attention(q, k, v, implementation="cudnn")


def _grad_temp_bytes(family: str, T: int) -> int:
  """Temporary memory of the compiled gradient of the chunked form at length T."""
  B, H, D = 1, 2, 16
  q = k = v = jax.ShapeDtypeStruct((B, T, H, D), F32)
  seg = jnp.ones((B, T), jnp.int32)
  if family == "tapa":
    fn = lambda q, k, v: attention.tapa_attention(q, k, v, segment_ids=seg,
                                                  implementation="chunked")
  elif family == "path_integral":
    p, alpha = jnp.ones((B, T, H, 8)), jnp.ones((H,))
    fn = lambda q, k, v: attention.path_integral_attention(q, k, v, p, alpha, segment_ids=seg,
                                                           implementation="chunked")
  elif family == "forgetting":
    lf = jnp.full((B, T, H), -0.1)
    fn = lambda q, k, v: attention.forgetting_attention(q, k, v, lf, segment_ids=seg,
                                                        implementation="chunked")
  else:
    fn = lambda q, k, v: attention.softmax_attention(q, k, v, segment_ids=seg,
                                                     implementation="chunked")
  grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2)))
  return grad.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("family", ["tapa", "path_integral", "forgetting", "softmax"])
def test_chunked_gradient_memory_is_subquadratic(family):
  """4x the length must cost well under 16x the temporary memory: the per-tile steps are
  rematerialised in the backward, not stored (T x T would be 16x; O(T) is 4x)."""
  small, large = _grad_temp_bytes(family, 512), _grad_temp_bytes(family, 2048)
  assert large / small < 6, f"{family}: temp {small} -> {large} bytes ({large / small:.1f}x)"


def test_block_size_grows_so_the_scan_steps_stay_bounded():
  """The chunked forms' default tile keeps at most max_blocks blocks (n^2 scan steps);
  T = 2048 keeps its old tiling, an explicit block_size is kept."""
  from posenc_jax import blockwise
  size = lambda T, b=None, d=128, m=16: blockwise.block_size_for(T, b, default=d, max_blocks=m)
  assert [size(T) for T in (100, 2048, 2049, 8192, 16384)] == [128, 128, 256, 512, 1024]
  assert [size(T, d=64, m=32) for T in (2048, 8192)] == [64, 256]
  assert size(8192, 64) == 64


def test_tapa_chunked_with_a_grown_block_matches_reference(key):
  """Past 16 blocks of 128 the default tile grows (256 at T = 2100, padded to 2304)."""
  from posenc_jax import tapa
  B, T, H, D = 1, 2100, 1, 8
  q, k, v = (jax.random.normal(k_, (B, T, H, D)) for k_ in jax.random.split(key, 3))
  kw = dict(alpha=0.1, theta=0.5, linear_phase=False, segment_ids=None)
  assert_rel_rms(jax.jit(lambda *a: tapa.tapa_attention_chunked(*a, **kw))(q, k, v),
                 jax.jit(lambda *a: tapa.tapa_attention_reference(*a, **kw))(q, k, v), 1e-5,
                 "o")


def test_pallas_kernel_options_reach_the_path_kernel(key, monkeypatch):
  """implementation="pallas:KEY=VALUE,..." and kernel_options (a dict or ConfigDict of
  kernels_pallas.BlockSizes fields, as config.model.kernel_options gives them) pass their
  fields to the PaTH / FoX kernels together; the result matches the dense oracle."""
  import kernels_pallas
  import ml_collections
  from posenc_jax import householder
  seen = []
  for name in ("path_attention", "forgetting_attention"):
    real = getattr(kernels_pallas, name)
    monkeypatch.setattr(kernels_pallas, name, lambda *a, real=real, **kw: seen.append(
        kw["block_sizes"]) or real(*a, **kw))
  ks = jax.random.split(key, 5)
  B, T, H, D = 1, 40, 2, 16
  q, k, v = (jax.random.normal(ks[i], (B, T, H, D)) for i in range(3))
  w = jax.random.normal(ks[3], (B, T, H, D))
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  beta = 2 * jax.random.uniform(ks[4], (B, T, H))
  options = ml_collections.ConfigDict(dict(block=None, span=0, prepass="jnp"))
  # Jitted: one compile instead of eager op-by-op dispatch (CI time).
  out = jax.jit(lambda *a: attention.path_attention(
      *a, implementation="pallas:block=16", kernel_options=options))(q, k, v, w, beta)
  assert seen == [kernels_pallas.BlockSizes(block=16, span=0, prepass="jnp")]
  with jax.default_matmul_precision("highest"):
    ref = jax.jit(lambda *a: householder.path_attention_reference(*a, scale=D ** -0.5))(
        q, k, v, w, beta)
  assert_rel_rms(out, ref, 1e-4, "forward")
  jax.eval_shape(lambda *a: attention.forgetting_attention(
      *a, implementation="pallas", kernel_options={"span": 0}), q, k, v, -jnp.ones((B, T, H)))
  assert seen[-1] == kernels_pallas.BlockSizes(span=0)


@pytest.mark.parametrize("call,impl,options,match", [
    ("path", "pallas:no_such_field=1", None,
     r"^implementation='pallas:no_such_field=1': unknown kernel option no_such_field; the "
     r"options are block, span, prepass, mosaic, keep_inverse$"),
    ("path", "pallas:span", None, r"^implementation='pallas:span': kernel option 'span' is not "
                                  r"KEY=VALUE$"),
    ("path", "pallas", {"bogus": 1}, r"^kernel_options=\{'bogus': 1\}: unknown kernel option "
                                     r"bogus; the options are block, span"),
    ("forgetting", "pallas", {"span": 3}, r"^kernel_options=\{'span': 3\}: span=3 must be"),
    ("path", "pallas:span=2", {"span": 4}, r"^kernel_options=\{'span': 4\}: span set both here "
                                           r"and in implementation='pallas:span=2'$"),
    ("path", "chunked:span=0", None, "options after ':'"),
    ("softmax", "pallas:span=0", None, "options after ':'")])
def test_pallas_kernel_options_errors_name_the_argument(call, impl, options, match):
  q, k, v = _zeros()
  B, T, H, D = q.shape
  K = k.shape[2]
  with pytest.raises(ValueError, match=match) as raised:
    if call == "softmax":
      attention.softmax_attention(q, k, v, implementation=impl)
    elif call == "forgetting":
      attention.forgetting_attention(q, k, v, -jnp.ones((B, T, H)), implementation=impl,
                                     kernel_options=options)
    else:
      w = jnp.ones((B, T, K, D)) / D ** 0.5
      attention.path_attention(q, k, v, w, jnp.ones((B, T, K)), implementation=impl,
                               kernel_options=options)
  assert "\n" not in str(raised.value)


def test_auto_implementation_gives_the_kernel_plan():
  """With batch and heads, the reason for a Pallas PaTH / FoX kernel ends with the plan it runs
  (kernels_pallas.explain), kernel_options included; without them it names the kernel only."""
  kw = dict(T=2048, dtype=BF16, head_dim=64, has_segments=True, backend="gpu")
  plain = dispatch.auto_implementation("path", **kw)
  assert plain.implementation == "pallas" and "plan" not in plain.reason, plain
  choice = dispatch.auto_implementation("path", **kw, batch=16, heads=12, gate=True)
  lines = choice.reason.splitlines()
  assert lines[0] == "gpu: the Pallas path kernel; its plan:", choice.reason
  assert lines[1].startswith("  PaTH on gpu") and "B=16 T=2048 H=12 K=12 D=64" in lines[1]
  assert "gate, segments" in lines[1]
  assert any(line.startswith("  backward:  span-parallel: far dq on mosaic") for line in lines)
  walk = dispatch.auto_implementation("path", **kw, batch=16, heads=12, gate=True,
                                       kernel_options={"span": 0})
  assert "  backward:  walk: dq/dP on 2 lanes a kv head, then dk/dv" in walk.reason.splitlines()
  fox = dispatch.auto_implementation("forgetting", **kw, batch=2, heads=4, kv_heads=2,
                                      gate=True)
  assert "  FoX on gpu" in fox.reason and "K=2" in fox.reason, fox.reason


def test_model_kernel_options_reach_the_plan():
  """ModelConfig.kernel_options (config.model.kernel_options) is what the model's attention
  layers pass on: posenc_jax.model.attention_choice shows the plan they give."""
  from posenc_jax import model as model_lib
  cfg = model_lib.ModelConfig(vocab_size=64, encoding="path", num_heads=12, head_dim=64,
                              d_model=768, dtype="bfloat16")
  reason = lambda c: model_lib.attention_choice(c, batch=16, seq_len=2048, backend="gpu").reason
  assert "spans of 8 chunks" in reason(cfg)
  pinned = model_lib.ModelConfig(**{**cfg.__dict__, "kernel_options": (("span", 0),)})
  assert "backward:  walk" in reason(pinned) and "spans of" not in reason(pinned)


def test_grape_a_auto_is_its_kernel_on_gpu_and_the_lift_elsewhere():
  """implementation=None runs GRAPE-A's Triton kernel on a GPU up to head dim 128; beyond it,
  and on a TPU, it lifts the bias into extra channels and takes softmax's choice at the lifted
  head dim (72 for a bf16 head of 64)."""
  choice = dispatch.auto_implementation("grape_a", T=2048, dtype=jnp.bfloat16, head_dim=64,
                                         has_segments=True, backend="gpu")
  assert choice.implementation == "pallas", choice
  wide = dispatch.auto_implementation("grape_a", T=2048, dtype=jnp.bfloat16, head_dim=256,
                                       has_segments=True, backend="gpu")
  assert wide.reason.startswith("GRAPE-A lifted"), wide   # beyond the kernel's tuned tiles
  choice = dispatch.auto_implementation("grape_a", T=2048, dtype=jnp.bfloat16, head_dim=64,
                                         has_segments=True, backend="tpu")
  softmax = dispatch.auto_implementation("softmax", T=2048, dtype=jnp.bfloat16, head_dim=72,
                                          has_segments=True, backend="tpu")
  assert choice.implementation == softmax.implementation, (choice, softmax)
  assert choice.reason.startswith("GRAPE-A lifted to head dim 72; "), choice
