"""experiments.hf_interop without torch: what a config.json maps to, and the one-line refusals."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from experiments import hf_interop

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=50,
             hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1e4, hidden_act="silu",
             tie_word_embeddings=True)


def test_config_maps_gqa_eps_tying_and_rope():
  cfg = hf_interop.model_config(LLAMA)
  assert (cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_dim) == (4, 2, 16, 96)
  assert cfg.norm_eps == 1e-5 and cfg.tie_embeddings and not cfg.scale_tied_logits
  assert cfg.encoding == "rope" and dict(cfg.encoding_kwargs) == {"base": 1e4, "layout": "half"}
  assert hf_interop.model_config(dict(LLAMA, model_type="qwen2",
                                      architectures=["Qwen2ForCausalLM"])).qkv_bias


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gpt2"), "model_type='gpt2' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(mlp_bias=True), "mlp_bias=true is not supported"),
    (dict(attention_bias=True), "attention_bias=true is not supported"),
    (dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096),
     "sliding_window=4096 is not supported"),
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True),
     "use_sliding_window=true is not supported"),
    (dict(rope_scaling=dict(rope_type="longrope", factor=2.0)),
     "rope_scaling.rope_type='longrope' is not supported"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3 must divide num_attention_heads=4"),
])
def test_unsupported_fields_are_one_line_naming_the_field(change, message):
  with pytest.raises(ValueError, match=message) as e:
    hf_interop.model_config(dict(LLAMA, **change))
  assert "\n" not in str(e.value)


def test_missing_and_extra_tensors_are_named(tmp_path):
  safetensors_numpy = pytest.importorskip("safetensors.numpy")
  (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, num_hidden_layers=1)))
  weights = {"model.embed_tokens.weight": np.zeros((50, 64), np.float32)}
  safetensors_numpy.save_file(weights, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="no tensor model.layers.0.self_attn.q_proj.weight"):
    hf_interop.load(str(tmp_path))
  (tmp_path / "model.safetensors").unlink()
  with pytest.raises(ValueError, match="holds neither model.safetensors nor"):
    hf_interop.load(str(tmp_path))


@pytest.mark.slow  # a fresh interpreter importing jax and flax: 9 s of CPU
def test_import_cli_prints_one_error_line(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, hidden_act="gelu")))
  out = subprocess.run([sys.executable, "-m", "experiments.import_hf",
                        f"--checkpoint={tmp_path}", f"--workdir={tmp_path / 'wd'}"],
                       capture_output=True, text=True, check=False)
  assert out.returncode == 2
  assert out.stderr.strip() == "error: hidden_act='gelu' is not supported (only 'silu')"
  assert not (tmp_path / "wd").exists()
