"""experiments.hf_interop / import_hf against transformers itself (CPU torch, float32).

Small random LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM checkpoints written
with save_pretrained are imported and their logits compared with transformers' on random
tokens. Skipped unless torch and transformers >= 5 are installed (`pip install -e ".[parity]"`).
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
  pytest.skip(f"needs transformers >= 5, found {transformers.__version__}", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

from experiments import hf_interop  # noqa: E402
from tests.util import assert_rel_rms  # noqa: E402

VOCAB = 257  # the text task's, so that an imported workdir can train on it
B, T = 2, 24
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5)
CASES = {
    "llama_llama3": ("LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=16))),
    "llama_yarn": ("LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16))),
    "llama_tied": ("LlamaForCausalLM", dict(tie_word_embeddings=True, head_dim=32)),
    "qwen2": ("Qwen2ForCausalLM", dict(rope_parameters=dict(rope_type="default",
                                                            rope_theta=1e6))),
    "mistral": ("MistralForCausalLM", dict(sliding_window=None)),
}


def save_hf(path, which, seed=0):
  """A random transformers model of CASES[which] saved in `path`; returns the torch model."""
  arch, extra = CASES[which]
  torch.manual_seed(seed)
  cls = getattr(transformers, arch)
  config = cls.config_class(**SMALL, **extra)
  model = cls(config).float().eval()
  with torch.no_grad():  # norms start at 1 and biases at 0: randomise them so they count
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or name.endswith(".bias"):
        p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(path)
  return model


def hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(tokens, np.int64))).logits.numpy()


def tokens_for(seed=1):
  return np.random.default_rng(seed).integers(0, VOCAB, (B, T)).astype(np.int32)


@pytest.mark.parametrize("which", sorted(CASES))
def test_imported_logits_match_transformers(tmp_path, which):
  hf = save_hf(tmp_path, which)
  model, cfg = hf_interop.load(str(tmp_path))
  tokens = tokens_for()
  assert_rel_rms(model(jnp.asarray(tokens)), hf_logits(hf, tokens), 1e-5, which)
  assert cfg.kv_heads == 2 and cfg.qkv_bias == (which == "qwen2")
  assert cfg.tie_embeddings == (which == "llama_tied")


def test_sharded_checkpoint(tmp_path):
  hf = save_hf(tmp_path, "qwen2")
  hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
  assert (tmp_path / "sharded" / hf_interop.INDEX).exists()
  model, _ = hf_interop.load(str(tmp_path / "sharded"))
  tokens = tokens_for(2)
  assert_rel_rms(model(jnp.asarray(tokens)), hf_logits(hf, tokens), 1e-5, "sharded")


def test_bfloat16_weights_read_exactly(tmp_path):
  hf = save_hf(tmp_path, "llama_llama3")
  hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
  weights = hf_interop.read_weights(str(tmp_path / "bf16"))
  w = hf.model.layers[0].self_attn.q_proj.weight
  np.testing.assert_array_equal(np.asarray(weights["model.layers.0.self_attn.q_proj.weight"],
                                           np.float32), w.detach().float().numpy())


def _text_config(tmp_path):
  from experiments.configs import quickstart
  c = quickstart.get_config("runlocal,encoding=rope,steps=2")
  corpus = tmp_path / "corpus.txt"  # one file: split by position
  corpus.write_text("".join(f"def f(x):\n  return x + {i}\n" for i in range(200)))
  c.data.update(task="text", text_dir=str(corpus), seq_len=16, valid_fraction=0.3)
  c.eval.num_batches = 0
  return c


@pytest.mark.slow  # compiles generation, a training step and an export: 35 s on 2 cores
def test_import_workdir_generates_and_trains_on(tmp_path):
  from experiments import generate
  from experiments import train
  from experiments.configs import from_workdir
  hf = save_hf(tmp_path / "hf", "qwen2")
  wd = str(tmp_path / "wd")
  stored = hf_interop.write_workdir(str(tmp_path / "hf"), wd, _text_config(tmp_path))
  assert stored["qkv_bias"] and stored["encoding"] == "rope"
  model, cfg, step = generate.load_model(wd)
  assert step == 0
  tokens = tokens_for(3)
  assert_rel_rms(model(jnp.asarray(tokens)), hf_logits(hf, tokens), 1e-5, "restored")
  # Greedy generation continues as transformers' greedy argmax does, token by token.
  out = generate.generate(wd, "def f", max_new_tokens=4, temperature=0.0, top_k=0, top_p=1.0,
                          seed=0, max_len=0, log=lambda _: None)
  ids = list(out["prompt_tokens"])
  for _ in range(4):
    ids.append(int(hf_logits(hf, np.asarray([ids]))[0, -1].argmax()))
  assert out["tokens"] == ids[len(out["prompt_tokens"]):]
  # experiments.main's run continues from the imported step 0 under the recorded config.
  summary = train.run(from_workdir.get_config(wd), wd)
  assert summary["step"] == 2
  # The trained step exports through the command line and reloads in transformers.
  subprocess.run([sys.executable, "-m", "experiments.export_hf", f"--workdir={wd}",
                  f"--out={tmp_path / 'out'}"], check=True, capture_output=True)
  model, _, step = generate.load_model(wd)
  assert step == 2
  assert_rel_rms(hf_logits(_reload(tmp_path / "out"), tokens), model(jnp.asarray(tokens)), 1e-5,
                 "exported after training")
  with pytest.raises(ValueError, match="already holds a checkpoint"):
    hf_interop.write_workdir(str(tmp_path / "hf"), wd, _text_config(tmp_path))


def _reload(path):
  return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_export_of_an_import_reloads_in_transformers(tmp_path):
  from flax import nnx
  hf = save_hf(tmp_path / "hf", "llama_yarn")
  model, cfg = hf_interop.load(str(tmp_path / "hf"))
  hf_interop.export(cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), str(tmp_path / "out"))
  tokens = tokens_for(4)
  assert_rel_rms(hf_logits(_reload(tmp_path / "out"), tokens), hf_logits(hf, tokens), 1e-5,
                 "round trip")


def test_export_of_our_model_matches_its_logits(tmp_path):
  """Our adjacent-pair RoPE layout, a 1/sqrt(C)-scaled tied head and q/k/v biases, as
  transformers' Qwen2 with permuted q/k channels and an untied lm_head."""
  import jax
  from flax import nnx
  from posenc_jax import model as model_lib
  cfg = model_lib.ModelConfig(
      vocab_size=VOCAB, encoding="rope_llama3", encoding_kwargs=tuple(sorted(dict(
          base=5e5, layout="interleaved", train_len=16, factor=8.0, low_freq_factor=1.0,
          high_freq_factor=4.0).items())), num_layers=2, d_model=64, num_heads=4,
      num_kv_heads=2, head_dim=16, mlp_dim=96, tie_embeddings=True, qkv_bias=True)
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(params=0))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  params = jax.tree.map(lambda x, k: x + 0.1 * jax.random.normal(k, x.shape), params,
                        jax.tree.unflatten(jax.tree.structure(params), list(jax.random.split(
                            jax.random.key(1), len(jax.tree.leaves(params))))))
  nnx.update(model, nnx.state(hf_interop.build(cfg, params), nnx.Param))
  config = hf_interop.export(cfg, params, str(tmp_path / "out"))
  assert config["architectures"] == ["Qwen2ForCausalLM"] and not config["tie_word_embeddings"]
  tokens = tokens_for(5)
  assert_rel_rms(hf_logits(_reload(tmp_path / "out"), tokens), model(jnp.asarray(tokens)), 1e-5,
                 "export")


def test_export_refuses_what_transformers_cannot_compute():
  from posenc_jax import model as model_lib
  with pytest.raises(ValueError, match="model.encoding='path'"):
    hf_interop.hf_config(model_lib.ModelConfig(vocab_size=VOCAB, encoding="path"))
  with pytest.raises(ValueError, match="model.qk_norm=True has no counterpart"):
    hf_interop.hf_config(model_lib.ModelConfig(vocab_size=VOCAB, qk_norm=True))


def test_imported_tokenizer_generates_as_transformers_greedy(tmp_path):
  """A Llama saved with a tokenizer.json (a padded vocabulary, eos in generation_config.json):
  the text task reads it, experiments.generate encodes and decodes through it, and greedy
  decoding equals transformers' generate(do_sample=False) for 20 tokens."""
  from experiments import generate
  tokenizers = pytest.importorskip("tokenizers")
  from tests.test_tokenizer import EOS, write_tokenizer
  torch.manual_seed(3)
  config = transformers.LlamaConfig(**dict(SMALL, vocab_size=320), bos_token_id=0,
                                    eos_token_id=EOS)
  hf = transformers.LlamaForCausalLM(config).float().eval()
  hf.save_pretrained(tmp_path / "hf")
  tok_path = write_tokenizer(tmp_path / "hf", eos_in=None)   # save_pretrained wrote the eos
  c = _text_config(tmp_path)
  wd = str(tmp_path / "wd")
  hf_interop.write_workdir(str(tmp_path / "hf"), wd, c)
  recorded = json.loads((tmp_path / "wd" / "config.json").read_text())["data"]
  assert recorded["tokenizer"] == str(tmp_path / "wd" / "tokenizer.json")
  assert recorded["vocab_size"] == 320 and recorded.get("doc_token") is None
  out = generate.generate(wd, "def f1(x):", max_new_tokens=20, temperature=0.0, top_k=0,
                          top_p=1.0, seed=0, max_len=0, log=lambda _: None)
  tok = tokenizers.Tokenizer.from_file(tok_path)
  ids = tok.encode("def f1(x):", add_special_tokens=False).ids
  assert out["prompt_tokens"] == [EOS] + ids   # a document's start, as the text task frames it
  with torch.no_grad():
    want = hf.generate(torch.tensor([out["prompt_tokens"]]), do_sample=False,
                       max_new_tokens=20, eos_token_id=EOS, pad_token_id=EOS)
  want = want[0, len(out["prompt_tokens"]):].tolist()
  assert len(out["tokens"]) == 20 and out["tokens"] == want
  assert out["text"] == tok.decode(want, skip_special_tokens=True)
