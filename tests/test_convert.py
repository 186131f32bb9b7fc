"""experiments.convert_student and the conversion's one-line errors (no training here;
tests/test_convert_run.py converts a trained teacher).

The students' starts are checked against their teachers on random tiny models, where the
math says they compute the same logits (to float32 rounding).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import convert
from experiments import convert_student
from experiments import data
from experiments import run_config
from experiments.configs import base
from experiments.configs import convert as convert_config
from posenc_jax import model as model_lib
from tests.util import assert_rel_rms


def _cfg(encoding, **kw):
  # The reference (dense) attention of every family: what is compared is the math.
  return model_lib.ModelConfig(vocab_size=50, encoding=encoding, num_layers=2, d_model=32,
                               num_heads=2, head_dim=16, implementation="reference",
                               encoding_kwargs=tuple(sorted(kw.items())))


def _params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@nnx.jit
def _logits(model, tokens):
  return model(tokens)


@pytest.mark.parametrize("teacher_enc, student_enc, teacher_kw, student_kw", [
    ("nope", "path", {}, {}),               # beta ~ 0: every Householder factor ~ identity
    ("nope", "path_fox", {}, {}),           # ... and forget gates ~ 1
    ("nope", "grape_a_qk", {}, {}),         # slopes ~ 0
    ("alibi", "fox", {}, {}),               # the gate bias at the ALiBi slopes
    ("alibi", "grape_a_q", {}, {}),
    ("rope", "grape_m", {}, {"base": 10000.0}),                         # identity basis
    ("rope", "grape_m", {"base": 500.0, "layout": "half"}, {"base": 500.0}),   # reordered q/k
])
def test_student_starts_as_its_teacher_where_the_math_says(teacher_enc, student_enc, teacher_kw,
                                                           student_kw):
  t_cfg, s_cfg = _cfg(teacher_enc, **teacher_kw), _cfg(student_enc, **student_kw)
  t_model = model_lib.Transformer(t_cfg, rngs=nnx.Rngs(params=0))
  s_model = model_lib.Transformer(s_cfg, rngs=nnx.Rngs(params=1))
  convert_student.check_pair(t_cfg, s_cfg, teacher="t")
  params = convert_student.student_params(t_cfg, _params(t_model), s_cfg, _params(s_model),
                                          init_beta=1e-7, init_forget_time=1e9)
  state = nnx.state(s_model, nnx.Param)
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
  nnx.update(s_model, state)
  tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, 50)
  assert_rel_rms(_logits(s_model, tokens), _logits(t_model, tokens), 1e-5,
                 f"{teacher_enc} -> {student_enc}")


def test_rope_to_path_copies_the_shared_weights_and_starts_beta_small():
  """From RoPE, PaTH starts at NoPE plus beta = init_beta: the shared weights are the
  teacher's, the rest the student's own draw."""
  t_cfg, s_cfg = _cfg("rope"), _cfg("path")
  teacher = _params(model_lib.Transformer(t_cfg, rngs=nnx.Rngs(params=0)))
  fresh = _params(model_lib.Transformer(s_cfg, rngs=nnx.Rngs(params=1)))
  params = convert_student.student_params(t_cfg, teacher, s_cfg, fresh, init_beta=0.01,
                                          init_forget_time=1e4)
  mine, theirs = params["blocks"][1]["attn"], teacher["blocks"][1]["attn"]
  np.testing.assert_array_equal(mine["q_proj"]["kernel"], theirs["q_proj"]["kernel"])
  np.testing.assert_array_equal(params["embed"]["embedding"], teacher["embed"]["embedding"])
  np.testing.assert_array_equal(mine["enc_params"]["w_up"],
                                fresh["blocks"][1]["attn"]["enc_params"]["w_up"])
  np.testing.assert_allclose(2 * jax.nn.sigmoid(mine["enc_params"]["beta_b"]), 0.01, rtol=1e-5)
  assert not np.any(mine["enc_params"]["beta_u"])
  mask = convert_student.attention_mask(params)
  assert mask["blocks"][0]["attn"]["enc_params"]["beta_b"] == 1.0
  assert mask["blocks"][0]["attn_norm"]["scale"] == 0.0 and mask["embed"]["embedding"] == 0.0


def test_layer_by_layer_forward_is_the_models():
  model = model_lib.Transformer(_cfg("rope"), rngs=nnx.Rngs(params=0))
  tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, 50)
  batch = {"tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(16), (2, 16)),
           "segment_ids": jnp.ones((2, 16), jnp.int32)}
  ins, outs, logits = convert_student.teacher_layers(model, batch)
  np.testing.assert_array_equal(logits, model(tokens))
  # The student's layers fed the teacher's inputs: zero error for the teacher itself.
  np.testing.assert_array_equal(convert_student.layer_mse(model, ins, outs, batch, rngs=None,
                                                          train=False), 0.0)


def _fake_teacher(root, encoding: str, c=None) -> str:
  """A workdir whose config.json and checkpoint metadata say `encoding` (no weights: what the
  checks read before anything is restored); `c`: its run config (default: a tiny text one)."""
  wd = root / f"teacher_{encoding}"
  if c is None:
    c = base.get_config()
    c.data.update(task="text", seq_len=16)
    c.data.max_files = 4
    c.model.update(d_model=32, head_dim=16)
  c.model.encoding = encoding
  os.makedirs(wd / "checkpoints" / "5" / "state")
  os.makedirs(wd / "checkpoints" / "5" / "data")
  os.makedirs(wd / "checkpoints" / "5" / "config")
  from experiments import config_checks
  mcfg = config_checks.model_config(c, data.vocab_size(c.data))
  (wd / "checkpoints" / "5" / "config" / "metadata").write_text(
      json.dumps(config_checks.stored_form(mcfg)))
  run_config.record(str(wd), c, step=0)
  return str(wd)


def _check(c, tmp_path):
  return convert.check(c, workdir=str(tmp_path / "student"), data_module=data, num_devices=1)


def test_errors_are_one_line_naming_the_field(tmp_path):
  rope = _fake_teacher(tmp_path, "rope")
  _, tcfg = _check(convert_config.get_config(f"teacher={rope},runlocal"), tmp_path)
  assert tcfg.encoding == "rope"
  cases = [
      (lambda: convert_config.get_config("teacher=/nonexistent"),
       "convert.teacher='/nonexistent' does not exist; give the workdir of a trained run"),
      (lambda: convert_config.get_config("runlocal"), "needs the teacher's workdir"),
      (lambda: _check(convert_config.get_config(f"teacher={rope},encoding=tapa"), tmp_path),
       "model.encoding='tapa' cannot be converted to; students: path, "),
      (lambda: _check(convert_config.get_config(
          f"teacher={_fake_teacher(tmp_path, 'path')}"), tmp_path),
       "convert.teacher=.* is a 'path' model; a teacher must use softmax attention: one of "),
      (lambda: _check(convert_config.get_config(f"teacher={rope},teacher_step=7"), tmp_path),
       r"convert.teacher_step=7 is not among the steps convert.teacher=.* holds \(5\)"),
      (lambda: _check(convert_config.get_config(
          f"teacher={_fake_teacher(tmp_path, 'nope')},encoding=grape_m"), tmp_path),
       "model.encoding='grape_m' starts as RoPE: it converts only a 'rope' teacher"),
  ]
  for make, message in cases:
    with pytest.raises(ValueError, match=message) as e:
      make()
    assert "\n" not in str(e.value)
  c = convert_config.get_config(f"teacher={rope}")
  c.model.d_model = 64
  with pytest.raises(ValueError, match="model.d_model=64 differs from the teacher's 32"):
    _check(c, tmp_path)
  c = convert_config.get_config(f"teacher={rope}")
  c.convert.mse_warmup_steps = c.convert.mse_steps
  with pytest.raises(ValueError, match="config.convert.mse_warmup_steps=100 must be below"):
    _check(c, tmp_path)
  c.convert.mse_learning_rate = -1.0
  with pytest.raises(ValueError, match=r"config.convert.mse_learning_rate=-1.0 must be a finite "
                                       r"number > 0"):
    _check(c, tmp_path)


def test_gpu_experiment_configs_pass_the_checks(tmp_path):
  """configs/convert.py:gpu: the teacher's run, the scratch runs at equal total tokens, the
  conversions (of the newest and of an earlier checkpoint) and the flip-flop probe are valid
  configs."""
  from experiments import config_checks
  from experiments import config_fields
  teacher = convert_config.get_config("gpu,run=teacher")
  scratch = convert_config.get_config("gpu,run=scratch,encoding=path")
  for c in (teacher, scratch):
    config_fields.check_fields(c)
    config_checks.check_model(c, data.vocab_size(c.data))
  assert (teacher.model.num_layers, teacher.model.d_model, teacher.data.seq_len) == (12, 768, 2048)
  assert teacher.train.steps == 1200 and scratch.train.steps == 1550   # 1200 + 50 + 300
  assert tuple(scratch.eval.lengths) == (2048, 8192, 16384)
  wd = _fake_teacher(tmp_path, "rope", teacher)
  for arg in ("", ",teacher_step=5", ",encoding=path_fox"):
    c = convert_config.get_config(f"gpu,teacher={wd}{arg}")
    mcfg, tcfg = _check(c, tmp_path)
    assert (mcfg.num_layers, mcfg.d_model, tcfg.encoding) == (12, 768, "rope")
    assert c.convert.mse_steps * c.convert.mse_batch_size * c.convert.mse_seq_len == 100 * 8 * 2048
  # The flip-flop probe of a trained run: its model, its parameters, flip-flop in bytes.
  probe = convert_config.get_config(f"gpu,run=probe,init={wd}")
  mcfg = config_checks.check(probe, workdir=str(tmp_path / "probe"), data_module=data,
                             num_devices=1)
  assert (mcfg.num_layers, mcfg.d_model, mcfg.encoding, mcfg.vocab_size) == (12, 768, "rope", 257)
  assert (probe.data.task, probe.data.byte_tokens, probe.train.init_from) == ("flipflop", True, wd)
  assert tuple(probe.eval.lengths) == (512, 2048) and "convert" not in probe
  with pytest.raises(ValueError, match="run=probe needs init=WD"):
    convert_config.get_config("gpu,run=probe")
