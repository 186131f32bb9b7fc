"""What a distilled student is made of: which encodings convert, its initial parameters, the
two stages' losses (experiments/convert.py runs them).

A teacher uses softmax attention (TEACHERS); the student is the same model with another
encoding (STUDENTS). The student copies every weight the two share (embeddings, norms,
q/k/v/o, MLP, head, kv_shift) and starts its own encoding parameters where it computes
(nearly) what the teacher computes. "Near" for each, with T the distance between query and
key:

  path       beta_t = init_beta for every token (u = 0, b = logit(init_beta / 2)): each
             Householder factor I - beta w w^T is within init_beta of the identity, so the
             transport over T tokens is within (1 + init_beta)^T - 1 of it: NoPE, to that.
             w's projections keep their random init (beta scales their effect).
  fox        log f_t = log_sigmoid(b), w_f = 0. From an ALiBi teacher b = -log(expm1(slope_h)),
             which is ALiBi exactly; else b = log(init_forget_time - 1), a bias of about
             -T / init_forget_time: NoPE to that.
  path_fox   both of the above.
  grape_a_*  the gates' v, u = 0. From ALiBi the encoding's own init, ALiBi exactly; else
             omega_h = 1 / (n log 2 init_forget_time) with n gates, the bias exactly
             -T / init_forget_time.
  grape_m    from a rope teacher only: basis B = I and RoPE's frequencies at the teacher's
             base are exactly RoPE (a half-layout teacher's q/k channels are reordered into
             adjacent pairs, which leaves its logits unchanged).
A RoPE teacher's rotation has no counterpart in path / fox / grape_a: those students start at
NoPE (plus their near-zero terms) and stage 1 learns the rest.

Stage 1 (`layer_mse`): each student attention layer gets the teacher's input to that layer
(through the student's own norm, a copy of the teacher's) and matches the teacher layer's
output in mean squared error. Stage 2 (`kl`): the student's next-token distribution matches
the teacher's in KL(teacher || student). Both count every real token (segment id > 0).
"""
from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from flax import traverse_util

from posenc_jax import encodings
from posenc_jax import unipotent
from posenc_jax.encodings import rotary

ROPES = ("rope", "rope_pi", "rope_ntk", "rope_yarn", "rope_llama3")
TEACHERS = ("nope", "alibi") + ROPES
STUDENTS = ("path", "path_fox", "fox", "grape_a_q", "grape_a_k", "grape_a_qk", "grape_m")


def check_pair(teacher_cfg, student_cfg, *, teacher: str) -> None:
  """One ValueError naming the field when `student_cfg` is not a conversion of `teacher_cfg`."""
  if teacher_cfg.encoding not in TEACHERS:
    raise ValueError(f"convert.teacher={teacher!r} is a {teacher_cfg.encoding!r} model; a "
                     f"teacher must use softmax attention: one of {', '.join(TEACHERS)}")
  if student_cfg.encoding not in STUDENTS:
    raise ValueError(f"model.encoding={student_cfg.encoding!r} cannot be converted to; "
                     f"students: {', '.join(STUDENTS)}")
  if student_cfg.encoding == "grape_m":
    if teacher_cfg.encoding != "rope":
      raise ValueError(f"model.encoding='grape_m' starts as RoPE: it converts only a 'rope' "
                       f"teacher, not {teacher_cfg.encoding!r}")
    base = _rope_kwargs(teacher_cfg)["base"]
    mine = dict(student_cfg.encoding_kwargs).get("base", rotary.HPARAMS["grape_m"]["base"])
    if float(mine) != float(base):
      raise ValueError(f"model.encoding_kwargs.base={mine} must be the teacher's RoPE base "
                       f"{base} (grape_m then starts as the teacher)")
  for field in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads",
                "head_dim", "mlp_dim", "block", "qk_norm", "tie_embeddings", "kv_shift",
                "qkv_bias", "norm_eps", "scale_tied_logits"):
    a, b = getattr(teacher_cfg, field), getattr(student_cfg, field)
    if a != b:
      raise ValueError(f"model.{field}={b!r} differs from the teacher's {a!r}; a student "
                       f"keeps the teacher's model and changes only model.encoding")


def _rope_kwargs(cfg) -> dict:
  return {**rotary.HPARAMS.get(cfg.encoding, {}), **dict(cfg.encoding_kwargs)}


def _flat(tree) -> dict:
  """{(key, ...): leaf}; the blocks' keys are ints, so the paths stay tuples."""
  return traverse_util.flatten_dict(tree)


def student_params(teacher_cfg, teacher_params, student_cfg, fresh_params, *,
                   init_beta: float, init_forget_time: float) -> dict:
  """The student's initial parameters as numpy arrays (module docstring): `fresh_params`
  (its own random init; only the encoding's leaves are read, the others may be shapes) with
  every weight it shares with the teacher copied and its encoding's set near the teacher."""
  got, theirs = _flat(fresh_params), _flat(teacher_params)
  half = _rope_kwargs(teacher_cfg).get("layout") == "half" and student_cfg.encoding == "grape_m"
  for name, value in got.items():
    if "enc_params" in name:
      continue
    if name not in theirs or theirs[name].shape != value.shape:
      raise ValueError(f"the teacher has no parameter {name} of shape {value.shape}")  # a bug
    w = theirs[name]
    if half and ("q_proj" in name or "k_proj" in name):  # channels into adjacent pairs
      w = encodings.half_to_interleaved(np.asarray(w), head_dim=student_cfg.head_dim)
    got[name] = np.array(w, value.dtype)
  init = _near(student_cfg, alibi=teacher_cfg.encoding == "alibi", init_beta=init_beta,
               init_forget_time=init_forget_time)
  for name in got:
    if "enc_params" in name:
      got[name] = init(name[-1], got[name])
  return traverse_util.unflatten_dict(got)


def _near(cfg, *, alibi: bool, init_beta: float, init_forget_time: float):
  """leaf name, fresh value -> the student's near-teacher value (module docstring)."""
  slopes = unipotent.alibi_slopes(cfg.num_heads)
  gate_bias = (-np.log(np.expm1(slopes)) if alibi
               else np.full(cfg.num_heads, np.log(init_forget_time - 1.0)))
  n_gates = {"grape_a_q": 1, "grape_a_k": 1, "grape_a_qk": 2}.get(cfg.encoding, 1)
  log_omega = np.full(cfg.num_heads, -np.log(n_gates * np.log(2.0) * init_forget_time))
  beta_b = np.log(init_beta / (2.0 - init_beta))   # 2 sigmoid(b) = init_beta
  table = {"beta_u": 0.0, "beta_b": beta_b, "w_f": 0.0, "f_w": 0.0, "b_f": gate_bias,
           "f_b": gate_bias, "v": 0.0, "u": 0.0}
  if not alibi:
    table["log_omega"] = log_omega

  def init(leaf: str, value):
    if leaf not in table:   # PaTH's w projections, grape_m's identity basis and frequencies
      return np.array(value, value.dtype)
    return np.broadcast_to(np.asarray(table[leaf], value.dtype), value.shape).copy()
  return init


def _mask(batch):
  return (batch["segment_ids"] > 0).astype(jnp.float32)


def teacher_layers(model, batch):
  """(inputs, outputs, logits): each block's input and attention output, and the logits,
  of `model` at evaluation (the Transformer's forward, one block at a time)."""
  layer = dict(tokens_BT=batch["tokens"], positions_BT=batch["positions"],
               segment_ids_BT=batch["segment_ids"])
  x = model._embed(batch["tokens"])   # pylint: disable=protected-access
  ins, outs = [], []
  for block in model.blocks:
    a = block.attn(block.attn_norm(x), rngs=None, train=False, **layer)
    ins.append(x)
    outs.append(a)
    x = x + a
    x = x + block.mlp(block.mlp_norm(x))
  return ins, outs, model._logits(x)   # pylint: disable=protected-access


def layer_mse(student, ins, outs, batch, *, rngs, train: bool = True):
  """Per layer, the mean over real tokens and channels of (student - teacher)^2 of the
  attention output, the student's layer fed the teacher's input: an array [num_layers]."""
  layer = dict(tokens_BT=batch["tokens"], positions_BT=batch["positions"],
               segment_ids_BT=batch["segment_ids"])
  mask = _mask(batch)
  count = jnp.maximum(jnp.sum(mask), 1.0)
  errs = []
  for block, x, want in zip(student.blocks, ins, outs):
    got = block.attn(block.attn_norm(x), rngs=rngs, train=train, **layer)
    se = jnp.mean(jnp.square(got.astype(jnp.float32) - want.astype(jnp.float32)), axis=-1)
    errs.append(jnp.sum(se * mask) / count)
  return jnp.stack(errs)


def kl_sums(teacher_logits, student_logits, mask):
  """Masked sum of KL(teacher || student) over tokens and the token count (float32)."""
  t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
  s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
  kl = jnp.sum(jnp.exp(t) * (t - s), axis=-1)
  return jnp.sum(kl * mask), jnp.sum(mask)


def kl(teacher_logits, student_logits, batch):
  """Mean KL(teacher || student) over the real tokens."""
  total, count = kl_sums(teacher_logits, student_logits, _mask(batch))
  return total / jnp.maximum(count, 1.0)


def attention_mask(params) -> dict:
  """1.0 on the attention layers' parameters (q/k/v/o and the encoding's), 0.0 elsewhere:
  what stage 1 trains."""
  return traverse_util.unflatten_dict(
      {k: jnp.float32("attn" in k) for k in _flat(params)})
