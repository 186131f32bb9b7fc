"""A decoder-only causal transformer (Flax NNX) that takes its position encoding from the registry.

Two block styles, chosen by `ModelConfig.block`:
  llama    pre-norm RMSNorm, SwiGLU MLP, optional QK-norm (the modern default)
  acc_rot  pre-norm LayerNorm, GELU MLP, dropout (the accumulated-rotations paper's setup)

Each attention layer owns its encoding's parameters (`encodings.get(name).init` gives the
pytree; it is stored as nnx.Param leaves) and calls `enc.apply`; the model never branches on
the encoding name. For generation, `Transformer.prefill` / `decode` thread an explicit cache
pytree (`init_cache`: the encodings' caches, kv_shift's previous k, v, and each row's slots)
through the same layers; posenc_jax.generation compiles them into a sampling loop.
Parameters carry logical axis names as sharding metadata; activations are constrained
through `shard`, which the training code resolves against a mesh.

Precision policy (`ModelConfig.dtype`, "bfloat16" for training on accelerators):
  - Parameters (encodings' included) are float32, and so is the AdamW state (optax keeps the
    parameters' dtype).
  - Activations and matmuls run in `dtype`: embeddings, projections, the residual stream,
    q, k, v, the attention output and the LM head. Norm statistics are float32 (Flax
    promotes them); the logits are cast to float32 for the loss.
  - Numerically sensitive transport inputs are float32 whatever `dtype` is: PaTH's w (and its
    normalisation) and beta, forget gates and their prefix sums (FoX, ALiBi, PaTH-FoX),
    GRAPE-AP probes and potentials, rotation angles and accumulated phases (the rotation runs
    in float32 and the rotated q, k, v are cast back to `dtype`), GRAPE-A's gates (computed
    in float32; their lifted channels are exact bf16 pieces, except that a bf16 model rounds
    each gate to bf16 once), and every softmax statistic (logits, running max and sum: the
    jnp paths, cuDNN and the Pallas kernel all keep them in float32).
  - The Pallas PaTH kernel takes q, k, v in `dtype` and w, beta in float32. Its per-chunk
    pre-pass does the transport algebra in float32 (the UT inverse with float32-accurate
    products) and stores q^, k^, E and the in-chunk logits in `dtype`; the attention kernel
    carries the moving query tile and the softmax state in float32 and multiplies `dtype`
    operands with float32 accumulation.
  tests/test_encodings.py (test_bfloat16_precision_policy) checks the encodings' side of this.

Shape letters: B batch, T time, C d_model, H query heads, K kv heads, D head dim,
F mlp width, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from posenc_jax import dispatch
from posenc_jax.context_parallel import mesh as cp_mesh
from posenc_jax import encodings
from posenc_jax import kv_cache

# The kv_shift modifier lives with the additive encodings (its decoding step beside them).
from posenc_jax.encodings.additive import kv_shift_apply
from posenc_jax.encodings.additive import kv_shift_init
from posenc_jax.encodings.additive_decode import kv_shift_prefill_state
from posenc_jax.encodings.additive_decode import kv_shift_step

BLOCKS = ("llama", "acc_rot")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Vocabularies up to this size take the embedding's gradient as one-hot matmuls over chunks of
# ONE_HOT_GRAD_CHUNK tokens instead of the gather's scatter-add; see embed_tokens.
ONE_HOT_EMBED_MAX_VOCAB = 32768
ONE_HOT_GRAD_CHUNK = 4096

# Default activation constraint: a no-op outside a mesh (see experiments/sharding.py).
ShardFn = Callable[[jax.Array, Sequence[str | None]], jax.Array]


def _no_shard(x, names):
  del names
  return x


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes and choices of the transformer. `num_kv_heads=0` means num_heads; mlp_dim=0 auto."""
  vocab_size: int
  encoding: str = "rope"
  encoding_kwargs: tuple[tuple[str, Any], ...] = ()
  kv_shift: bool = False
  num_layers: int = 2
  d_model: int = 64
  num_heads: int = 2
  num_kv_heads: int = 0
  head_dim: int = 32
  mlp_dim: int = 0
  block: str = "llama"
  qk_norm: bool = False
  dropout: float = 0.0
  tie_embeddings: bool = False
  dtype: str = "float32"
  implementation: str | None = None
  kernel_options: tuple[tuple[str, Any], ...] = ()   # kernels_pallas.BlockSizes fields
  scan_layers: bool = False
  embed_one_hot: bool | None = None   # the embedding's gradient; None: embed_tokens' rule
  # Checkpoints of other code bases (experiments/hf_interop.py) need these; the defaults are
  # what this model always did.
  qkv_bias: bool = False          # biases on the q, k, v projections (Qwen2)
  norm_eps: float = 1e-6          # the norms' epsilon (RMSNorm's and LayerNorm's)
  scale_tied_logits: bool = True  # tied head: logits = x E^T / sqrt(d_model) (False: x E^T)

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def mlp_width(self) -> int:
    if self.mlp_dim:
      return self.mlp_dim
    if self.block == "llama":  # SwiGLU: 8/3 C keeps the parameter count of a 4C GELU MLP
      return -(-8 * self.d_model // 3 // 8) * 8
    return 4 * self.d_model

  @property
  def dims(self) -> encodings.Dims:
    return encodings.Dims(self.d_model, self.num_heads, self.kv_heads, self.head_dim,
                          self.vocab_size)

  def encoding_fn(self) -> encodings.Encoding:
    return encodings.get(self.encoding, **dict(self.encoding_kwargs))


def attention_choice(cfg: ModelConfig, *, batch: int, seq_len: int, segments: bool = True,
                     backend: str | None = None) -> dispatch.Choice:
  """What each attention layer of this model runs at [batch, seq_len] (implementation=None:
  posenc_jax.dispatch.auto_implementation's choice and reason; with a Pallas PaTH / FoX
  kernel, the kernel's plan), from shapes alone. segments: the call passes segment ids (the
  training step does)."""
  enc = cfg.encoding_fn()
  dt = DTYPES[cfg.dtype]
  sd = jax.ShapeDtypeStruct
  B, T, H, K, D = batch, seq_len, cfg.num_heads, cfg.kv_heads, cfg.head_dim
  found = {}

  def prepare(params, x, q, k, v):
    prep = enc.prepare(params, x=x, q=q, k=k, v=v,
                       positions=jnp.zeros((B, T), jnp.int32),
                       segment_ids=jnp.zeros((B, T), jnp.int32) if segments else None,
                       tokens=jnp.zeros((B, T), jnp.int32), rng=None, train=False)
    found["family"] = prep.family
    found["gate"] = prep.inputs.get("log_forget") is not None
    return prep.q, prep.v

  params = jax.eval_shape(lambda: enc.init(jax.random.key(0), cfg.dims))
  q, v = jax.eval_shape(prepare, params, sd((B, T, cfg.d_model), dt), sd((B, T, H, D), dt),
                        sd((B, T, K, D), dt), sd((B, T, K, D), dt))
  if cfg.implementation is not None:
    return dispatch.Choice(cfg.implementation, "set by model.implementation")
  return dispatch.auto_implementation(
      found["family"], T=T, dtype=q.dtype, head_dim=q.shape[-1], v_head_dim=v.shape[-1],
      has_segments=segments, backend=backend, batch=B, heads=q.shape[2], kv_heads=K,
      gate=found["gate"], kernel_options=dict(cfg.kernel_options) or None)


def _part(init, *names):
  # eager_sharding=False: the logical names are metadata only; experiments/sharding.py maps
  # them to a mesh, so a model can be built with no mesh at all.
  return nnx.with_partitioning(init, names, eager_sharding=False)


def _linear(din, dout, names, cfg, rngs, *, init=None, bias=False):
  init = init or nnx.initializers.lecun_normal()
  return nnx.Linear(din, dout, use_bias=bias, dtype=DTYPES[cfg.dtype],
                    param_dtype=jnp.float32, kernel_init=_part(init, *names),
                    bias_init=_part(nnx.initializers.zeros_init(), names[-1]), rngs=rngs)


def _norm(cfg, dim, names, rngs):
  if cfg.block == "llama":
    return nnx.RMSNorm(dim, epsilon=cfg.norm_eps, dtype=DTYPES[cfg.dtype],
                       param_dtype=jnp.float32,
                       scale_init=_part(nnx.initializers.ones_init(), *names), rngs=rngs)
  return nnx.LayerNorm(dim, epsilon=cfg.norm_eps, dtype=DTYPES[cfg.dtype],
                       param_dtype=jnp.float32,
                       scale_init=_part(nnx.initializers.ones_init(), *names),
                       bias_init=_part(nnx.initializers.zeros_init(), *names), rngs=rngs)


def _as_params(tree):
  return nnx.data(jax.tree.map(nnx.Param, tree))


def _values(tree):
  return jax.tree.map(lambda p: p[...], tree, is_leaf=lambda p: isinstance(p, nnx.Variable))


class Attention(nnx.Module):
  """Causal GQA self-attention whose position encoding comes from the registry."""

  def __init__(self, cfg: ModelConfig, *, shard: ShardFn, rngs: nnx.Rngs):
    C, H, K, D = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    self.cfg, self.shard = cfg, shard
    self.q_proj = _linear(C, H * D, ("embed", "heads"), cfg, rngs, bias=cfg.qkv_bias)
    self.k_proj = _linear(C, K * D, ("embed", "kv_heads"), cfg, rngs, bias=cfg.qkv_bias)
    self.v_proj = _linear(C, K * D, ("embed", "kv_heads"), cfg, rngs, bias=cfg.qkv_bias)
    self.o_proj = _linear(H * D, C, ("heads", "embed"), cfg, rngs)
    if cfg.qk_norm:
      self.q_norm = _norm(cfg, D, ("head_dim",), rngs)
      self.k_norm = _norm(cfg, D, ("head_dim",), rngs)
    self.enc = cfg.encoding_fn()
    dispatch.preload_kernels(self.enc.family, cfg.implementation, DTYPES[cfg.dtype])
    self.enc_params = _as_params(self.enc.init(rngs.params(), cfg.dims))
    if cfg.kv_shift:
      self.kv_shift_params = _as_params(kv_shift_init(rngs.params(), cfg.dims))

  def _project(self, x_BTC):
    """q [B,T,H,D], k, v [B,T,K,D] (after QK-norm, before kv_shift and the encoding)."""
    cfg, (B, T, _) = self.cfg, x_BTC.shape
    q = self.q_proj(x_BTC).reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = self.k_proj(x_BTC).reshape(B, T, cfg.kv_heads, cfg.head_dim)
    v = self.v_proj(x_BTC).reshape(B, T, cfg.kv_heads, cfg.head_dim)
    q = self.shard(q, ("batch", "length", "heads", "head_dim"))
    k = self.shard(k, ("batch", "length", "kv_heads", "head_dim"))
    v = self.shard(v, ("batch", "length", "kv_heads", "head_dim"))
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return q, k, v

  def _out(self, o_BTHD, x_BTC):
    B, T, _ = x_BTC.shape
    o = self.shard(o_BTHD.astype(x_BTC.dtype), ("batch", "length", "heads", "head_dim"))
    return self.o_proj(o.reshape(B, T, self.cfg.num_heads * self.cfg.head_dim))

  def init_cache(self, batch_size: int, max_len: int) -> dict:
    """This layer's empty decoding cache (the encoding's, plus kv_shift's previous k, v)."""
    cfg = self.cfg
    cache = {"enc": self.enc.init_cache(cfg.dims, batch_size=batch_size, max_len=max_len,
                                        dtype=DTYPES[cfg.dtype])}
    if cfg.kv_shift:
      prev = jnp.zeros((batch_size, cfg.kv_heads, cfg.head_dim), DTYPES[cfg.dtype])
      cache["kv_shift"] = {"k": prev, "v": prev}
    return cache

  def prefill(self, x_BPC, *, tokens_BT, positions_BT, segment_ids_BT, slots, cache,
              layer_index=0):
    """The prompt's forward (as __call__ at evaluation) and the cache it leaves."""
    q, k, v = self._project(x_BPC)
    cache = dict(cache)
    if self.cfg.kv_shift:
      cache["kv_shift"] = kv_shift_prefill_state(k, v, slots)
      k, v = kv_shift_apply(_values(self.kv_shift_params), x=x_BPC, k=k, v=v,
                            segment_ids=segment_ids_BT)
    o, cache["enc"] = self.enc.prefill(
        _values(self.enc_params), cache["enc"], slots=slots, x=x_BPC, q=q, k=k, v=v,
        positions=positions_BT, segment_ids=segment_ids_BT, tokens=tokens_BT, rng=None,
        train=False, layer_index=layer_index, implementation=self.cfg.implementation,
        kernel_options=dict(self.cfg.kernel_options) or None)
    return self._out(o, x_BPC), cache

  def decode(self, x_B1C, *, tokens_BT, slots, cache, layer_index=0):
    """One new token per row, written at slot slots.end: (output [B, 1, C], cache)."""
    q, k, v = self._project(x_B1C)
    cache = dict(cache)
    if self.cfg.kv_shift:
      k, v, cache["kv_shift"] = kv_shift_step(_values(self.kv_shift_params), cache["kv_shift"],
                                              x=x_B1C, k=k, v=v)
    o, cache["enc"] = self.enc.decode(_values(self.enc_params), cache["enc"], slots=slots,
                                      x=x_B1C, q=q, k=k, v=v, tokens=tokens_BT,
                                      layer_index=layer_index)
    return self._out(o, x_B1C), cache

  def __call__(self, x_BTC, *, tokens_BT, positions_BT, segment_ids_BT, rngs, train,
               layer_index=0):
    """layer_index: this layer's place in the stack (an int, or a traced one under
    scan_layers); encodings that draw fixed angles at evaluation (acc_rot_random) draw them
    per layer from it, as the papers sample each layer independently."""
    cfg = self.cfg
    q, k, v = self._project(x_BTC)
    if cfg.kv_shift:
      k, v = kv_shift_apply(_values(self.kv_shift_params), x=x_BTC, k=k, v=v,
                            segment_ids=segment_ids_BT)
    # Encodings that sample (acc_rot_random) draw a fresh key per layer and step in training;
    # at evaluation rng is None and they draw from their eval_seed folded with layer_index.
    rng = rngs.encoding() if (train and rngs is not None) else None
    o = self.enc.apply(_values(self.enc_params), x=x_BTC, q=q, k=k, v=v,
                       positions=positions_BT, segment_ids=segment_ids_BT, tokens=tokens_BT,
                       rng=rng, train=train, layer_index=layer_index,
                       implementation=cfg.implementation,
                       kernel_options=dict(cfg.kernel_options) or None)
    return self._out(o, x_BTC)


class Mlp(nnx.Module):
  """SwiGLU (llama) or GELU (acc_rot) feed-forward."""

  def __init__(self, cfg: ModelConfig, *, shard: ShardFn, rngs: nnx.Rngs):
    C, F = cfg.d_model, cfg.mlp_width
    self.gated, self.shard = cfg.block == "llama", shard
    self.up = _linear(C, F, ("embed", "mlp"), cfg, rngs)
    if self.gated:
      self.gate = _linear(C, F, ("embed", "mlp"), cfg, rngs)
    self.down = _linear(F, C, ("mlp", "embed"), cfg, rngs)

  def __call__(self, x_BTC):
    h = nnx.silu(self.gate(x_BTC)) * self.up(x_BTC) if self.gated else nnx.gelu(self.up(x_BTC))
    return self.down(self.shard(h, ("batch", "length", "mlp")))


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, *, shard: ShardFn, rngs: nnx.Rngs):
    self.attn_norm = _norm(cfg, cfg.d_model, ("embed",), rngs)
    self.attn = Attention(cfg, shard=shard, rngs=rngs)
    self.mlp_norm = _norm(cfg, cfg.d_model, ("embed",), rngs)
    self.mlp = Mlp(cfg, shard=shard, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout) if cfg.dropout > 0 else None

  def _drop(self, x, rngs, train):
    if self.dropout is None:
      return x
    return self.dropout(x, deterministic=not train, rngs=rngs)

  def __call__(self, x_BTC, *, rngs, train, **layer):
    x_BTC = x_BTC + self._drop(self.attn(self.attn_norm(x_BTC), rngs=rngs, train=train, **layer),
                               rngs, train)
    return x_BTC + self._drop(self.mlp(self.mlp_norm(x_BTC)), rngs, train)

  def cached(self, x_BTC, *, step: bool, cache, **layer):
    """The block at evaluation on a prompt (step=False: Attention.prefill) or on one new
    token per row (step=True: Attention.decode); returns (x, cache)."""
    attend = self.attn.decode if step else self.attn.prefill
    a, cache = attend(self.attn_norm(x_BTC), cache=cache, **layer)
    x_BTC = x_BTC + a
    return x_BTC + self.mlp(self.mlp_norm(x_BTC)), cache


def embed_tokens(table_VC, tokens, *, dtype, one_hot: bool | None = None):
  """Rows of table_VC [V, C] for integer `tokens` [...] -> [..., C] in `dtype`.

  The forward is always a gather. one_hot (None: V <= ONE_HOT_EMBED_MAX_VOCAB on an
  accelerator, False on the CPU) picks the table's gradient:
  - False: the gather's own, a scatter-add, which on a GPU runs as atomics serialised on the
    rows that repeat. With a small vocabulary every row repeats thousands of times per batch,
    and this scatter took nearly all of flip-flop's step;
  - True: one_hot(tokens)^T @ cotangent, as matmuls over chunks of ONE_HOT_GRAD_CHUNK tokens
    (the one-hot block is transient: a whole [B*T, V] one would cost B*T*V*2 bytes),
    accumulated in float32 and deterministic, where the scatter added in `dtype`.
  On a GPU the chunked matmuls beat the scatter by one to three orders of magnitude and sped
  up the 125M model's step at the same peak memory (docs/benchmarks/embed_grad.md has the
  figures). The matmuls' cost, 2 B T V C multiply-adds, is why larger vocabularies keep the
  scatter. So does the CPU at every size: there the scatter is cheap and the matmul is not.
  """
  V = table_VC.shape[0]
  if one_hot is None:
    one_hot = V <= ONE_HOT_EMBED_MAX_VOCAB and jax.default_backend() != "cpu"
  table = table_VC.astype(dtype)
  return _gather_one_hot_grad(V, table, tokens) if one_hot else jnp.take(table, tokens, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_one_hot_grad(V, table_VC, tokens):
  del V
  return jnp.take(table_VC, tokens, axis=0)


def _gather_fwd(V, table_VC, tokens):
  del V
  return jnp.take(table_VC, tokens, axis=0), tokens


def _gather_bwd(V, tokens, ct):
  axes = cp_mesh.token_axes(*tokens.shape) if tokens.ndim == 2 else ()
  if not axes:
    return _one_hot_table_grad(V, tokens, ct), None
  # Tokens split over devices (batch axes, and T over "context"): each device adds up its
  # own tokens and the partial tables are summed once. Left to the partitioner, the scan over
  # chunks of the flattened tokens gathers every token and cotangent onto every device.
  batch = tuple(a for a in axes if a != cp_mesh.AXIS) or None
  spec = P(batch, cp_mesh.AXIS if cp_mesh.AXIS in axes else None)
  local = jax.shard_map(lambda t, c: jax.lax.psum(_one_hot_table_grad(V, t, c), axes),
                        in_specs=(spec, spec), out_specs=P(), axis_names=frozenset(axes),
                        check_vma=False)
  return local(tokens, ct), None


def _one_hot_table_grad(V, tokens, ct):
  """one_hot(tokens)^T @ ct over chunks of ONE_HOT_GRAD_CHUNK tokens -> [V, C] float32."""
  ids_N, ct_NC = tokens.reshape(-1), ct.reshape(-1, ct.shape[-1])
  n = -(-ids_N.shape[0] // ONE_HOT_GRAD_CHUNK)
  pad = n * ONE_HOT_GRAD_CHUNK - ids_N.shape[0]
  # Padding rows get id -1: one_hot gives them a zero row, so they add nothing.
  ids_nK = jnp.pad(ids_N, (0, pad), constant_values=-1).reshape(n, -1)
  ct_nKC = jnp.pad(ct_NC, ((0, pad), (0, 0))).reshape(n, ONE_HOT_GRAD_CHUNK, -1)

  def add_chunk(acc_VC, chunk):
    ids_K, ct_KC = chunk
    oh_KV = jax.nn.one_hot(ids_K, V, dtype=ct_KC.dtype)
    return acc_VC + jnp.dot(oh_KV.T, ct_KC, preferred_element_type=jnp.float32), None

  acc, _ = jax.lax.scan(add_chunk, jnp.zeros((V, ct.shape[-1]), jnp.float32), (ids_nK, ct_nKC))
  return acc.astype(ct.dtype)   # the cotangent has the table's dtype


_gather_one_hot_grad.defvjp(_gather_fwd, _gather_bwd)


class Transformer(nnx.Module):
  """tokens [B, T] -> logits [B, T, V] (float32)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, shard: ShardFn = _no_shard):
    if cfg.block not in BLOCKS:
      raise ValueError(f"model.block={cfg.block!r} is not one of {BLOCKS}")
    if cfg.dtype not in DTYPES:
      raise ValueError(f"model.dtype={cfg.dtype!r} is not one of {tuple(DTYPES)}")
    self.cfg, self.shard = cfg, shard
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=DTYPES[cfg.dtype],
                           param_dtype=jnp.float32,
                           embedding_init=_part(nnx.initializers.normal(1.0), "vocab", "embed"),
                           rngs=rngs)
    self.blocks = nnx.List([Block(cfg, shard=shard, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = _norm(cfg, cfg.d_model, ("embed",), rngs)
    if not cfg.tie_embeddings:
      self.head = _linear(cfg.d_model, cfg.vocab_size, ("embed", "vocab"), cfg, rngs)

  def __call__(self, tokens_BT, *, positions_BT=None, segment_ids_BT=None,
               rngs: nnx.Rngs | None = None, train: bool = False):
    """positions default to 0..T-1; segment_ids None = one sequence per row.

    rngs: streams "dropout" and "encoding", needed only when train=True.
    """
    B, T = tokens_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x = self.shard(self._embed(tokens_BT), ("batch", "length", "embed"))
    layer = dict(tokens_BT=tokens_BT, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)
    if self.cfg.scan_layers and len(self.blocks) > 1:
      return self._logits(self._scan_blocks(x, rngs=rngs, train=train, **layer))
    for i, block in enumerate(self.blocks):
      x = self.shard(block(x, rngs=rngs, train=train, layer_index=i, **layer),
                     ("batch", "length", "embed"))
    return self._logits(x)

  def _scan_blocks(self, x_BTC, *, rngs, train, **layer):
    """The blocks as one lax.scan over their stacked states: same function as the loop.

    XLA then compiles one layer instead of num_layers copies (the 12-layer GPU train step
    compiles several times faster). The parameters stay one subtree per block, so
    checkpoints are the same either way; the stacking is a copy of the block parameters
    per call. Random streams get one key per layer, split from each stream's next key, so
    dropout and sampled encodings draw differently from the unrolled loop (same law).
    """
    graphdefs, states = zip(*(nnx.split(b) for b in self.blocks))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    keys = {} if rngs is None else {name: jax.random.split(stream(), len(self.blocks))
                                     for name, stream in rngs.items()}

    def body(x, per_layer):
      state, layer_keys, index = per_layer
      block = nnx.merge(graphdefs[0], state)
      layer_rngs = nnx.Rngs(**layer_keys) if rngs is not None else None
      x = block(x, rngs=layer_rngs, train=train, layer_index=index, **layer)
      return self.shard(x, ("batch", "length", "embed")), None

    index = jnp.arange(len(self.blocks), dtype=jnp.int32)
    x_BTC, _ = jax.lax.scan(body, x_BTC, (stacked, keys, index))
    return x_BTC

  def _embed(self, tokens):
    return embed_tokens(self.embed.embedding[...], tokens, dtype=DTYPES[self.cfg.dtype],
                        one_hot=self.cfg.embed_one_hot)

  def _logits(self, x_BTC):
    x = self.final_norm(x_BTC)
    if self.cfg.tie_embeddings:  # 1/sqrt(C): unit-variance embeddings would give huge logits
      logits = self.embed.attend(x)
      if self.cfg.scale_tied_logits:
        logits = logits / jnp.sqrt(jnp.asarray(self.cfg.d_model, x.dtype))
    else:
      logits = self.head(x)
    return self.shard(logits.astype(jnp.float32), ("batch", "length", "vocab"))

  # Decoding with a fixed-size cache. The cache is a plain pytree the caller threads through
  # (nothing is stored on the module), so prefill and decode are pure and jit/scan-friendly:
  #   {"layers": (per-layer caches), "start": [B], "end": [B]}  (kv_cache.Slots per row)
  # posenc_jax.generation compiles them and runs the sampling loop.

  def init_cache(self, batch_size: int, max_len: int) -> dict:
    """An empty cache of max_len slots per row."""
    zeros = jnp.zeros((batch_size,), jnp.int32)
    return {"layers": tuple(b.attn.init_cache(batch_size, max_len) for b in self.blocks),
            "start": zeros, "end": zeros}

  def prefill(self, tokens_BP, *, lengths_B, cache, padding: str = "right"):
    """Runs a padded prompt batch and fills `cache` (from init_cache, max_len >= P).

    tokens_BP holds lengths_B[b] >= 1 real tokens per row, at the start of the row
    (padding="right") or at its end ("left"); the padding is a separate segment, so every
    row is computed as if alone. Returns (logits [B, P, V] float32, cache): row b's next
    token is predicted at time end_b - 1 (lengths - 1 for right padding, P - 1 for left).
    """
    P = tokens_BP.shape[1]
    slots = kv_cache.prompt_slots(lengths_B, P, padding=padding)
    valid = kv_cache.prompt_mask(slots, P)
    layer = dict(tokens_BT=tokens_BP, segment_ids_BT=valid.astype(jnp.int32),
                 positions_BT=jnp.where(valid, jnp.arange(P)[None] - slots.start[:, None], 0),
                 slots=slots)
    x = self._embed(tokens_BP)
    layers = []
    for i, (block, c) in enumerate(zip(self.blocks, cache["layers"])):
      x, c = block.cached(x, step=False, cache=c, layer_index=i, **layer)
      layers.append(c)
    return self._logits(x), {"layers": tuple(layers), "start": slots.start, "end": slots.end}

  def decode(self, tokens_B, *, cache):
    """Appends one token per row at its slot `end`: (logits [B, V] float32 of the next token,
    cache). The caller keeps end below max_len (posenc_jax.generation checks it)."""
    slots = kv_cache.Slots(cache["start"], cache["end"])
    x = self._embed(tokens_B[:, None])
    layers = []
    for i, (block, c) in enumerate(zip(self.blocks, cache["layers"])):
      x, c = block.cached(x, step=True, cache=c, tokens_BT=tokens_B[:, None], slots=slots,
                          layer_index=i)
      layers.append(c)
    return self._logits(x)[:, 0], {"layers": tuple(layers), "start": slots.start,
                                    "end": slots.end + 1}
