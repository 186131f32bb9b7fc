"""Rotation encodings (docs/encodings.md): RoPE and its extensions, GRAPE-M,
accumulated rotations, and value transport.

Every entry is family "softmax": `prepare` maps q_i -> G_i q_i and k_j -> G_j k_j, so plain
attention computes l_ij = scale (G_i q_i)^T (G_j k_j). The *_v entries also pre-rotate v_j by
G_j^T and return `out_angles` so that `attend` post-rotates o_i by G_i:
o_i = sum_j a_ij G_i G_j^T v_j (accumulated_rotations §5, "Implementation convention").

Positions come from the `positions` argument [B, T] (restarting per packed document); the
accumulated encodings ignore it and restart their phase sums at segment starts instead.
GRAPE-M parameters live per kv head: the query heads of a GQA group share their kv head's
map, so keys are transformed once, at K heads. Hyperparameters (defaults in HPARAMS) are
keyword-only; an unknown one raises ValueError.

Reference-code variants (hyperparameters; defaults follow the papers; the table is in
docs/encodings.md#reference-implementations-and-the-switches-that-select-them):
  rope_ntk    variant="static" | "dynamic" (transformers' dynamic NTK; see _rope_family)
  rope_yarn   ramp="paper" | "hf" (transformers / original YaRN code; rotations.yarn_frequencies)
  rope_llama3 Llama 3.1's RoPE scaling (transformers' "llama3"), Llama 3.1's values by default
  grape_m_ctx variant="paper" (softplus gate) | "official" (the official code's sigmoid(z/16))
posenc_jax.encodings.from_hf_rope maps a transformers config to one of these.

acc_rot_random draws its step angles from `rng` when train=True and otherwise from
jax.random.key(eval_seed) folded with the layer's index (eval_key), one draw per in-document
position (so decoding token by token repeats the full forward's angles); the paper samples
each layer independently, and the model hands each layer its own rng and index.

Shape letters: B batch, T time, C d_model, H query heads, K kv heads, D head dim, P = D/2.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from posenc_jax import grape_m
from posenc_jax import path_integral
from posenc_jax import rotations
from posenc_jax.encodings import Prepared
from posenc_jax.encodings import register
from posenc_jax.encodings import resolve_hparams
from posenc_jax.encodings import split_layer_args

# PI / NTK / YaRN default to a 4x extension (train 2048 -> evaluate 8192); s = eval / train.
_EXTENSION = dict(base=10000.0, layout="interleaved", train_len=2048, eval_len=8192)

HPARAMS = {
    "rope": dict(base=10000.0, layout="interleaved"),
    "rope_pi": dict(_EXTENSION),
    "rope_ntk": dict(_EXTENSION, variant="static"),
    "rope_yarn": dict(_EXTENSION, beta_fast=32.0, beta_slow=1.0, ramp="paper", truncate=True,
                      attention_factor=None),
    # Llama 3.1's own values; train_len is its original_max_position_embeddings.
    "rope_llama3": dict(base=500000.0, layout="interleaved", train_len=8192, factor=8.0,
                        low_freq_factor=1.0, high_freq_factor=4.0),
    "grape_m": dict(base=10000.0),
    # num_planes None: D/2 planes; planes: "scan" (XLA), "pallas" (one fused kernel pass) or
    # None (the kernel on a GPU, the scan elsewhere)
    "grape_m_rank2": dict(base=10000.0, num_planes=None, planes=None),
    "grape_m_noncommuting": dict(base=10000.0, rank=None),    # None: rank D
    "grape_m_ctx": dict(base=10000.0, variant="paper"),
    "acc_rot_random": dict(base=10000.0, width=2.0, eval_seed=0),
    "acc_rot_learned": dict(base=10000.0),
    "rope_v": dict(base=10000.0),
    "acc_rot_random_v": dict(base=10000.0, width=2.0, eval_seed=0),
    "acc_rot_learned_v": dict(base=10000.0),
}


def _even_head_dim(name):
  def check(dims):
    if dims.head_dim % 2:
      raise ValueError(f"head_dim={dims.head_dim} must be even for rotation encoding {name!r}")
  return check




def _add(name, init_fn, prepare_fn):
  """Registers `name`: hyperparameters are validated and defaulted from HPARAMS."""
  check = _even_head_dim(name)

  def init(key, dims, **hp):
    check(dims)
    return init_fn(key, dims, **resolve_hparams(name, hp, HPARAMS[name]))

  def prepare(params, **kw):
    layer, hp = split_layer_args(kw)
    return prepare_fn(params, layer, **resolve_hparams(name, hp, HPARAMS[name]))

  register(name, family="softmax", init=init, prepare=prepare, check=check)


def _no_params(key, dims, **hp):
  del key, dims, hp
  return {}


def _heads(angles_BTKP, num_heads: int):
  """Per-kv-head angles [B, T, K, P] -> query heads (size-1 head axes broadcast as they are)."""
  K = angles_BTKP.shape[2]
  return angles_BTKP if K in (1, num_heads) else jnp.repeat(angles_BTKP, num_heads // K, axis=2)


def _rotated(layer, angles, *, values: bool = False, layout: str = "interleaved"):
  """Prepared with q, k rotated by G = R(angles [B, T, K or 1, P]); optionally value transport."""
  q, k, v = layer["q"], layer["k"], layer["v"]
  q2 = rotations.rotate(q, _heads(angles, q.shape[2]), layout=layout)
  k2 = rotations.rotate(k, angles, layout=layout)
  if not values:
    return Prepared("softmax", q2, k2, v, {})
  if v.shape[-1] != q.shape[-1]:
    raise ValueError(f"value transport needs v.shape[-1] == head_dim={q.shape[-1]}, "
                     f"got v of shape {tuple(v.shape)}")
  # o_i = G_i sum_j a_ij G_j^T v_j: pre-rotate by -phi_j here, attend() rotates by +phi_i.
  return Prepared("softmax", q2, k2, rotations.rotate(v, -angles), {},
                  out_angles=_heads(angles, q.shape[2]))


# ----------------------------------------------------------------------------------------
# RoPE and its length extensions.


_NTK_VARIANTS = ("static", "dynamic")


def _rope_family(kind: str, *, values: bool = False):
  """prepare for RoPE and its extensions; s = eval_len / train_len (at least 1).

  rope_ntk variant="static" (default): base * s^(D/(D-2)) for every length.
  rope_ntk variant="dynamic": transformers' "dynamic" NTK, factor s, L = train_len, and the
    current length L' = max(positions) + 1 over the whole batch, as transformers takes it from
    one forward call's position_ids (rotations.dynamic_ntk_base). Stateless: transformers also
    keeps the largest L' since it last dropped below L; here each call uses its own.
  rope_yarn ramp / truncate: rotations.yarn_frequencies; attention_factor=None is
    0.1 ln s + 1 (a number overrides it, as transformers' attention_factor does).
  rope_llama3: rotations.llama3_frequencies.
  """
  def prepare(params, layer, *, base, layout="interleaved", train_len=None, eval_len=None,
              beta_fast=None, beta_slow=None, variant="static", ramp="paper", truncate=True,
              attention_factor=None, factor=None, low_freq_factor=None, high_freq_factor=None):
    del params
    D = layer["q"].shape[-1]
    pos = layer["positions"]
    if kind == "rope":
      freqs = rotations.rope_frequencies(D, base=base)
    elif kind == "llama3":
      freqs = rotations.llama3_frequencies(D, base=base, factor=factor, train_len=train_len,
                                           low_freq_factor=low_freq_factor,
                                           high_freq_factor=high_freq_factor)
    else:
      s = rotations.length_scale(train_len=train_len, eval_len=eval_len)
      if kind == "pi":
        freqs = rotations.rope_frequencies(D, base=base)
        pos = rotations.pi_positions(pos, train_len=train_len, eval_len=eval_len)
      elif kind == "ntk":
        if variant not in _NTK_VARIANTS:
          raise ValueError(f"variant={variant!r} must be one of {_NTK_VARIANTS}")
        if variant == "static":
          ntk = rotations.ntk_base(D, base=base, scale=s)
        else:
          ntk = rotations.dynamic_ntk_base(D, base=base, factor=s, train_len=train_len,
                                           seq_len=jnp.max(pos) + 1)
        freqs = rotations.rope_frequencies(D, base=ntk)
      else:
        freqs = rotations.yarn_frequencies(D, base=base, scale=s, train_len=train_len,
                                           beta_fast=beta_fast, beta_slow=beta_slow, ramp=ramp,
                                           truncate=truncate)
    prep = _rotated(layer, rotations.rope_angles(pos, freqs), values=values, layout=layout)
    if kind == "yarn":  # attention temperature, split evenly between q and k
      if attention_factor is not None and not attention_factor > 0:
        raise ValueError(f"attention_factor={attention_factor} must be positive (or None)")
      m = rotations.yarn_attention_factor(s) if attention_factor is None else attention_factor
      prep = prep._replace(q=(prep.q * m).astype(prep.q.dtype), k=(prep.k * m).astype(prep.k.dtype))
    return prep
  return prepare


# ----------------------------------------------------------------------------------------
# GRAPE-M: learned basis, rank-2 planes, thin non-commuting compression, contextual phase.


def _log_rope(dims, base, n=None):
  """log omega for n planes of a RoPE of width 2n (n = D/2: exactly RoPE), per kv head."""
  n = dims.head_dim // 2 if n is None else n
  w = jnp.log(rotations.rope_frequencies(2 * n, base=base))
  return jnp.broadcast_to(w, (dims.num_kv_heads, n))


def _grape_m_init(key, dims, *, base):
  del key
  D, K = dims.head_dim, dims.num_kv_heads
  return {"basis": jnp.zeros((K, D, D), jnp.float32), "log_theta": _log_rope(dims, base)}


def _grape_m_prepare(params, layer, *, base):
  del base
  q, k = layer["q"], layer["k"]
  H = q.shape[2]
  basis = grape_m.orthogonal_from_param(params["basis"])
  pos = layer["positions"].astype(jnp.float32)[:, :, None, None]
  angles = pos * jnp.exp(params["log_theta"])                       # [B, T, K, P]
  q2 = grape_m.basis_rotate(q, _heads(angles, H), grape_m.per_query_head(basis, H))
  k2 = grape_m.basis_rotate(k, angles, basis)
  return Prepared("softmax", q2, k2, layer["v"], {})


def _rank2_init(key, dims, *, base, num_planes, planes):
  del key
  grape_m.planes_implementation(planes)   # a bad value fails at init, naming the field
  D, K = dims.head_dim, dims.num_kv_heads
  n = D // 2 if num_planes is None else num_planes
  if not 1 <= n <= D // 2:
    raise ValueError(f"num_planes={n} must lie in [1, head_dim/2={D // 2}]")
  a, b = grape_m.canonical_planes(K, D, n)
  log_w = jnp.log(rotations.rope_frequencies(D, base=base))[:n]
  return {"a": a, "b": b, "log_w": jnp.broadcast_to(log_w, (K, n))}


def _rank2_prepare(params, layer, *, base, num_planes, planes):
  del base, num_planes
  q, k = layer["q"], layer["k"]
  H = q.shape[2]
  pos, w = layer["positions"], jnp.exp(params["log_w"])
  a, b = params["a"], params["b"]
  heads = lambda p: grape_m.per_query_head(p, H)  # noqa: E731
  q2 = grape_m.rank2_planes_at_positions(q, heads(a), heads(b), pos, heads(w),
                                         implementation=planes)
  k2 = grape_m.rank2_planes_at_positions(k, a, b, pos, w, implementation=planes)
  return Prepared("softmax", q2, k2, layer["v"], {})


def _thin_init(key, dims, *, base, rank):
  del key
  D, K = dims.head_dim, dims.num_kv_heads
  r = D if rank is None else rank
  if r % 2 or not 2 <= r <= D:
    raise ValueError(f"rank={r} must be even and lie in [2, head_dim={D}]")
  return {"e": jnp.zeros((K, D, D), jnp.float32), "t": jnp.zeros((K, r, r), jnp.float32),
          "log_theta": _log_rope(dims, base, r // 2)}


def _thin_prepare(params, layer, *, base, rank):
  del base, rank
  q, k = layer["q"], layer["k"]
  H = q.shape[2]
  frame = grape_m.thin_frame(params["e"], params["t"])
  angles = layer["positions"].astype(jnp.float32)[:, :, None, None] * jnp.exp(params["log_theta"])
  q2 = grape_m.thin_apply(q, _heads(angles, H), grape_m.per_query_head(frame, H))
  return Prepared("softmax", q2, grape_m.thin_apply(k, angles, frame), layer["v"], {})


# GRAPE-M-ctx phase gates w_s = gate(u.x_s + c) >= 0, by variant:
#   paper     softplus(z) (GRAPE §5, App. B), c = softplus^-1(1): RoPE at initialisation;
#   official  sigmoid(z / 16), the official GRAPE code (model/llama-mha-grape-m-ctx.py, whose
#             comments still say softplus), c = softplus^-1(1e-3) as that code initialises it:
#             w = sigmoid(-0.432) = 0.394 at init, i.e. RoPE with every frequency x 0.394.
# The rest of that code is ours up to reparameterisation: its half-split rotation by -Phi theta
# is ours after a signed permutation of the q/k channels, its theta shared by all heads is our
# per-kv-head theta with equal rows (tests/test_reference_formulas.py checks both variants).
_CTX_GATES = {
    "paper": (jax.nn.softplus, math.log(math.e - 1.0)),
    "official": (lambda z: jax.nn.sigmoid(z / 16.0), math.log(math.expm1(1e-3))),
}


def _ctx_variant(variant):
  if variant not in _CTX_GATES:
    raise ValueError(f"variant={variant!r} must be one of {tuple(_CTX_GATES)}")
  return _CTX_GATES[variant]


def _ctx_init(key, dims, *, base, variant):
  del key
  _, c = _ctx_variant(variant)
  return {"u": jnp.zeros((dims.d_model,), jnp.float32), "c": jnp.asarray(c, jnp.float32),
          "log_theta": _log_rope(dims, base)}


def _ctx_prepare(params, layer, *, base, variant):
  del base
  gate, _ = _ctx_variant(variant)
  x = layer["x"]
  w = gate(x.astype(jnp.float32) @ params["u"] + params["c"])                  # [B, T] >= 0
  phi = rotations.accumulate_phases(w, layer.get("segment_ids"), exclusive=True)   # sum_{s<t} w_s
  return _rotated(layer, phi[:, :, None, None] * jnp.exp(params["log_theta"]))


# ----------------------------------------------------------------------------------------
# Accumulated rotations (accumulated_rotations §5, App. C).


def eval_key(eval_seed: int, layer: dict):
  """acc_rot_random's key at evaluation: eval_seed folded with the layer's place in the stack
  (layer["layer_index"], which models pass), so each layer draws its own angles as the paper
  samples them; eval_seed alone where no index is given."""
  key = jax.random.key(eval_seed)
  index = layer.get("layer_index")
  return key if index is None else jax.random.fold_in(key, index)


def _random_prepare(values: bool):
  def prepare(params, layer, *, base, width, eval_seed):
    del params
    q = layer["q"]
    rng, train = layer.get("rng"), layer.get("train", False)
    freqs = rotations.rope_frequencies(q.shape[-1], base=base)
    if train and rng is not None:  # fresh angles every training step
      steps = rotations.random_step_angles(rng, q.shape[:2], freqs, width=width)   # [B, T, P]
    else:  # a fixed draw per in-document position: evaluations and decoding repeat it exactly
      pos = path_integral.segment_positions(layer.get("segment_ids"), *q.shape[:2])
      steps = rotations.positional_step_angles(eval_key(eval_seed, layer), pos, freqs, width=width)
    phi = rotations.accumulate_phases(steps, layer.get("segment_ids"))
    return _rotated(layer, phi[:, :, None, :], values=values)
  return prepare


def _learned_init(key, dims, *, base):
  # U(0, 2 omega_m) per token and plane: the mean step is RoPE's omega_m (as acc_rot_random).
  freqs = rotations.rope_frequencies(dims.head_dim, base=base)
  return {"angles": rotations.random_step_angles(key, (dims.vocab_size,), freqs)}


def _learned_prepare(values: bool):
  def prepare(params, layer, *, base):
    del base
    tokens = layer.get("tokens")
    if tokens is None:
      raise ValueError("tokens [B, T] are required by the learned accumulated rotation")
    steps = jnp.take(params["angles"], tokens, axis=0)                     # [B, T, P]
    phi = rotations.accumulate_phases(steps, layer.get("segment_ids"))
    return _rotated(layer, phi[:, :, None, :], values=values)
  return prepare


_add("rope", _no_params, _rope_family("rope"))
_add("rope_pi", _no_params, _rope_family("pi"))
_add("rope_ntk", _no_params, _rope_family("ntk"))
_add("rope_yarn", _no_params, _rope_family("yarn"))
_add("rope_llama3", _no_params, _rope_family("llama3"))
_add("grape_m", _grape_m_init, _grape_m_prepare)
_add("grape_m_rank2", _rank2_init, _rank2_prepare)
_add("grape_m_noncommuting", _thin_init, _thin_prepare)
_add("grape_m_ctx", _ctx_init, _ctx_prepare)
_add("acc_rot_random", _no_params, _random_prepare(False))
_add("acc_rot_learned", _learned_init, _learned_prepare(False))
_add("rope_v", _no_params, _rope_family("rope", values=True))
_add("acc_rot_random_v", _no_params, _random_prepare(True))
_add("acc_rot_learned_v", _learned_init, _learned_prepare(True))
