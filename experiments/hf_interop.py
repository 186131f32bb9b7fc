"""transformers Llama-family checkpoints (Llama, Mistral, Qwen2) as posenc-jax models.

    model, cfg = hf_interop.load("path/to/checkpoint")   # config.json + *.safetensors
    logits = model(tokens)                                # [B, T, vocab], float32

The checkpoint is a directory as `save_pretrained` writes it: config.json and either one
model.safetensors or shards listed in model.safetensors.index.json. Tensors are read with
numpy (no torch); BF16 / F16 weights become float32 parameters, as every model here keeps
them. What maps where:

  config.json                       ModelConfig
  num_hidden_layers, hidden_size    num_layers, d_model
  num_attention_heads               num_heads
  num_key_value_heads               num_kv_heads (grouped-query attention)
  head_dim (or hidden / heads)      head_dim
  intermediate_size                 mlp_dim (SwiGLU: down(silu(gate x) * up x))
  rms_norm_eps                      norm_eps
  tie_word_embeddings               tie_embeddings, with scale_tied_logits=False
  Qwen2's q/k/v biases              qkv_bias=True
  rope_theta, rope_scaling          encoding via encodings.from_hf_rope (layout "half":
                                    the q/k weights stay as transformers stores them)

Weights: a torch Linear's weight [out, in] is our kernel [in, out]. Anything that would
change the numbers and that the model does not compute (a sliding window in use, another
activation, MLP or output biases, quantisation, a RoPE variant from_hf_rope rejects) raises
one ValueError naming the field.

`write_workdir` turns a checkpoint into a run's workdir at step 0 (experiments.import_hf is
its command line). A checkpoint's tokenizer.json is copied into the workdir, with its
eos_token_id (generation_config.json, else config.json) as WD/generation_config.json, so that
experiments.generate reads and writes text through it; under data.task="text" it also becomes
data.tokenizer (unless the config names one), with data.vocab_size the checkpoint's.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Any, Mapping

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from posenc_jax import encodings
from posenc_jax import model as model_lib
from posenc_jax.encodings import rotary

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# model_type -> (architecture, q/k/v carry biases)
FAMILIES = {"llama": ("LlamaForCausalLM", False), "mistral": ("MistralForCausalLM", False),
            "qwen2": ("Qwen2ForCausalLM", True)}
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F64": np.float64}


def read_config(checkpoint_dir: str) -> dict:
  path = os.path.join(checkpoint_dir, CONFIG)
  if not os.path.isfile(path):
    raise ValueError(f"{path} does not exist: give a directory written by save_pretrained")
  try:
    with open(path) as f:
      config = json.load(f)
  except ValueError as e:
    raise ValueError(f"{path} is not valid JSON ({e})") from None
  if not isinstance(config, dict):
    raise ValueError(f"{path} holds a JSON {type(config).__name__}, not a model config")
  return config


def model_config(config: Mapping[str, Any], *, dtype: str = "float32") -> model_lib.ModelConfig:
  """The ModelConfig computing what transformers computes for `config` (a config.json dict);
  ValueError naming the first field it cannot honour."""
  family = config.get("model_type")
  if family not in FAMILIES:
    raise ValueError(f"model_type={family!r} is not supported; supported: {sorted(FAMILIES)}")
  arch = config.get("architectures") or [FAMILIES[family][0]]
  if list(arch) != [FAMILIES[family][0]]:
    raise ValueError(f"architectures={arch!r}: only {FAMILIES[family][0]} is supported for "
                     f"model_type={family!r}")
  if config.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act={config['hidden_act']!r} is not supported (only 'silu')")
  if config.get("mlp_bias"):
    raise ValueError("mlp_bias=true is not supported (the MLP has no biases)")
  if config.get("attention_bias"):  # Llama's: q/k/v/o biases; Qwen2's q/k/v ones are implied
    raise ValueError("attention_bias=true is not supported (no output-projection bias)")
  if config.get("quantization_config"):
    raise ValueError("quantization_config is set: quantised checkpoints are not supported")
  if family == "qwen2" and config.get("use_sliding_window"):
    raise ValueError("use_sliding_window=true is not supported (full causal attention only)")
  if family == "mistral" and config.get("sliding_window") is not None:
    raise ValueError(f"sliding_window={config['sliding_window']!r} is not supported (full "
                     "causal attention only); null means no window")
  layer_types = config.get("layer_types") or []
  if any(t != "full_attention" for t in layer_types):
    raise ValueError(f"layer_types={layer_types!r}: only full_attention layers are supported")
  for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size"):
    value = config.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"{field}={value!r} must be a positive integer")
  heads = config["num_attention_heads"]
  kv_heads = config.get("num_key_value_heads") or heads
  if heads % kv_heads:
    raise ValueError(f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
  head_dim = config.get("head_dim") or config["hidden_size"] // heads
  eps = config.get("rms_norm_eps", 1e-6)
  if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
    raise ValueError(f"rms_norm_eps={eps!r} must be a positive number")
  name, kwargs = encodings.from_hf_rope(config, layout="half")
  return model_lib.ModelConfig(
      vocab_size=config["vocab_size"], encoding=name,
      encoding_kwargs=tuple(sorted(kwargs.items())), num_layers=config["num_hidden_layers"],
      d_model=config["hidden_size"], num_heads=heads, num_kv_heads=kv_heads,
      head_dim=head_dim, mlp_dim=config["intermediate_size"], block="llama",
      tie_embeddings=bool(config.get("tie_word_embeddings", False)), dtype=dtype,
      qkv_bias=FAMILIES[family][1], norm_eps=float(eps), scale_tied_logits=False)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of one .safetensors file as a numpy array (BF16 as ml_dtypes.bfloat16,
  which safetensors.numpy cannot give)."""
  with open(path, "rb") as f:
    try:
      (n,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(n))
    except (struct.error, ValueError) as e:
      raise ValueError(f"{path} is not a safetensors file ({e})") from None
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}; supported: "
                       f"{sorted(_DTYPES)}")
    start, end = info["data_offsets"]
    out[name] = np.asarray(data[start:end]).view(_DTYPES[info["dtype"]]).reshape(info["shape"])
  return out


def read_weights(checkpoint_dir: str) -> dict[str, np.ndarray]:
  """All tensors of the checkpoint: model.safetensors, or the shards its index names."""
  index = os.path.join(checkpoint_dir, INDEX)
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.isfile(os.path.join(checkpoint_dir, WEIGHTS)):
    files = [WEIGHTS]
  else:
    raise ValueError(f"{checkpoint_dir} holds neither {WEIGHTS} nor {INDEX} (only safetensors "
                     "checkpoints are read)")
  weights = {}
  for name in files:
    weights.update(read_safetensors(os.path.join(checkpoint_dir, name)))
  return weights


def params_from_hf(cfg: model_lib.ModelConfig, weights: Mapping[str, np.ndarray]) -> dict:
  """Our parameter tree (nnx.to_pure_dict layout, float32) from transformers' tensor names."""
  used = set()

  def take(name, transpose=False):
    if name not in weights:
      raise ValueError(f"the checkpoint has no tensor {name}")
    used.add(name)
    w = np.asarray(weights[name], np.float32)
    return w.T if transpose else w

  blocks = {}
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    attn = {}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      attn[proj] = {"kernel": take(f"{p}self_attn.{proj}.weight", transpose=True)}
      if cfg.qkv_bias and proj != "o_proj":
        attn[proj]["bias"] = take(f"{p}self_attn.{proj}.bias")
    blocks[i] = {
        "attn": attn,
        "attn_norm": {"scale": take(f"{p}input_layernorm.weight")},
        "mlp": {ours: {"kernel": take(f"{p}mlp.{theirs}_proj.weight", transpose=True)}
                for ours, theirs in (("gate", "gate"), ("up", "up"), ("down", "down"))},
        "mlp_norm": {"scale": take(f"{p}post_attention_layernorm.weight")},
    }
  params = {"blocks": blocks, "embed": {"embedding": take("model.embed_tokens.weight")},
            "final_norm": {"scale": take("model.norm.weight")}}
  if cfg.tie_embeddings:
    used.add("lm_head.weight")  # some writers store the tied copy too
  else:
    params["head"] = {"kernel": take("lm_head.weight", transpose=True)}
  unused = sorted(set(weights) - used - {n for n in weights if n.endswith("rotary_emb.inv_freq")})
  if unused:
    raise ValueError(f"the checkpoint's tensor {unused[0]} has no place in the model "
                     f"({len(unused)} unused)")
  return params


def build(cfg: model_lib.ModelConfig, params: dict) -> model_lib.Transformer:
  """The Transformer of `cfg` holding `params` (checked against its shapes)."""
  abstract = nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(params=0)))
  graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
  want = nnx.to_pure_dict(state)
  flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  flat_got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  for path, leaf in flat_want.items():
    got = flat_got.get(path)
    if got is None or tuple(got.shape) != tuple(leaf.shape):
      name = jax.tree_util.keystr(path)
      raise ValueError(f"parameter {name} has shape {None if got is None else got.shape}, "
                       f"the config needs {leaf.shape}")
  nnx.replace_by_pure_dict(state, jax.tree.map(jax.numpy.asarray, params))
  return nnx.merge(graphdef, state, rest)


def load(checkpoint_dir: str, *, dtype: str = "float32"
         ) -> tuple[model_lib.Transformer, model_lib.ModelConfig]:
  """(model, its ModelConfig) from a transformers checkpoint directory; ValueError naming the
  field or tensor for what cannot be imported."""
  cfg = model_config(read_config(checkpoint_dir), dtype=dtype)
  return build(cfg, params_from_hf(cfg, read_weights(checkpoint_dir))), cfg


def _set_model_fields(config, mcfg) -> None:
  """Sets config.model to the imported model's fields (the data and training ones stay)."""
  from experiments import config_checks
  stored = config_checks.stored_form(mcfg)
  with config.unlocked():
    for field, value in stored.items():
      if field == "vocab_size":
        continue
      if field == "encoding_kwargs":
        value = {k: v for k, v in value}
      config.model[field] = value


def write_workdir(checkpoint_dir: str, workdir: str, config=None) -> dict:
  """Writes workdir from the transformers checkpoint; returns the stored model config.
  ValueError (one line) for what cannot be imported."""
  import jax

  from experiments import checkpoint
  from experiments import config_checks
  from experiments import data as data_module
  from experiments import run_config
  from experiments import train
  from experiments.configs import base

  if config is None:
    config = base.get_config()
  if checkpoint.latest_step(workdir) is not None:
    raise ValueError(f"--workdir={workdir} already holds a checkpoint; use a new --workdir")
  imported = model_config(read_config(checkpoint_dir), dtype=config.model.dtype)
  from experiments import tokenizer_json
  tokenizer = os.path.join(checkpoint_dir, tokenizer_json.FILE)
  has_tokenizer = os.path.isfile(tokenizer)
  if has_tokenizer and config.data.task == "text" and config.data.get("tokenizer") is None:
    _use_tokenizer(config, tokenizer, imported.vocab_size)
  vocab = data_module.vocab_size(config.data)
  if vocab != imported.vocab_size:
    hint = " (data.task='text' reads the checkpoint's tokenizer.json)" if has_tokenizer else ""
    raise ValueError(f"the checkpoint's vocab_size={imported.vocab_size} differs from "
                     f"data.task={config.data.task!r}'s vocabulary ({vocab}); pick a --config "
                     f"whose data has the checkpoint's vocabulary{hint}")
  _set_model_fields(config, imported)
  mcfg = config_checks.check(config, workdir=workdir, data_module=data_module,
                             num_devices=jax.device_count())
  if config_checks.stored_form(mcfg) != config_checks.stored_form(imported):
    raise RuntimeError(f"the run config gives {mcfg}, the checkpoint {imported}")  # a bug
  params = params_from_hf(mcfg, read_weights(checkpoint_dir))
  os.makedirs(workdir, exist_ok=True)
  if has_tokenizer:
    _copy_tokenizer(tokenizer, workdir, config)
  mesh, trainer, train_iter = train.setup(config, mcfg, data_module)
  with jax.set_mesh(mesh):
    state = trainer.init_state(config.train.seed)
    # AdamW's initial state does not depend on the parameters' values: init_state's fits.
    state["params"] = jax.device_put(params, trainer.param_shardings)
    ckpt = checkpoint.Checkpointer(workdir, every=config.train.checkpoint_every)
    try:
      ckpt.save(0, state, train_iter, config_checks.stored_form(mcfg))
    finally:
      ckpt.close()
  run_config.record(workdir, config, step=0)
  return config_checks.stored_form(mcfg)


def _use_tokenizer(config, path: str, vocab_size: int) -> None:
  """The text task tokenized by the checkpoint's tokenizer, at the checkpoint's vocabulary."""
  from experiments import tokenizer_json
  n = tokenizer_json.vocab_size(tokenizer_json.load(path, field="the checkpoint's tokenizer"))
  if n > vocab_size:
    raise ValueError(f"{path} has a vocabulary of {n} tokens, more than the checkpoint's "
                     f"vocab_size={vocab_size}; give the tokenizer the model was trained with")
  with config.unlocked():
    config.data.tokenizer = path
    if config.data.get("vocab_size") is None:
      config.data.vocab_size = vocab_size


def _copy_tokenizer(path: str, workdir: str, config) -> None:
  """WD/tokenizer.json and its eos as WD/generation_config.json; data.tokenizer follows the
  copy (the checkpoint directory may go away)."""
  from experiments import tokenizer_json
  copy = os.path.abspath(os.path.join(workdir, tokenizer_json.FILE))
  shutil.copyfile(path, copy)
  eos = tokenizer_json.eos_beside(path)
  if eos is not None:
    with open(os.path.join(workdir, tokenizer_json.EOS_FILES[0]), "w") as f:
      json.dump({"eos_token_id": eos}, f)
  if config.data.get("tokenizer") == path:
    with config.unlocked():
      config.data.tokenizer = copy


# --- export --------------------------------------------------------------------------


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray]) -> None:
  """A .safetensors file of float32 tensors (the format transformers reads), written whole."""
  header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name], np.float32)
    header[name] = {"dtype": "F32", "shape": list(a.shape),
                    "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
    blobs.append(a.tobytes())
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text)
    for blob in blobs:
      f.write(blob)
  os.replace(tmp, path)


_EXPORTED = ("rope", "rope_llama3", "rope_pi", "rope_ntk", "rope_yarn")


def _rope_kwargs(cfg: model_lib.ModelConfig) -> dict:
  """The encoding's hyperparameters, defaults included."""
  return {**rotary.HPARAMS.get(cfg.encoding, {}), **dict(cfg.encoding_kwargs)}


def _rope_config(cfg: model_lib.ModelConfig) -> tuple[dict, int]:
  """(rope_parameters, max_position_embeddings) of our RoPE-family encoding."""
  kw = _rope_kwargs(cfg)
  if cfg.encoding not in _EXPORTED:
    raise ValueError(f"model.encoding={cfg.encoding!r} has no transformers RoPE type "
                     f"(exported: {', '.join(_EXPORTED)})")
  params = {"rope_theta": float(kw["base"])}
  if cfg.encoding == "rope":
    return dict(params, rope_type="default"), DEFAULT_MAX_POSITIONS
  if cfg.encoding == "rope_llama3":
    return dict(params, rope_type="llama3", factor=kw["factor"],
                low_freq_factor=kw["low_freq_factor"], high_freq_factor=kw["high_freq_factor"],
                original_max_position_embeddings=kw["train_len"]), _scaled_len(kw["train_len"],
                                                                               kw["factor"])
  factor = kw["eval_len"] / kw["train_len"]
  if cfg.encoding == "rope_pi":
    return dict(params, rope_type="linear", factor=factor), kw["train_len"]
  if cfg.encoding == "rope_ntk" and kw.get("variant") == "dynamic":
    return dict(params, rope_type="dynamic", factor=factor), kw["train_len"]
  if cfg.encoding == "rope_yarn" and kw.get("ramp") == "hf":
    out = dict(params, rope_type="yarn", factor=factor, original_max_position_embeddings=kw[
        "train_len"], beta_fast=kw.get("beta_fast", 32.0), beta_slow=kw.get("beta_slow", 1.0),
               truncate=kw.get("truncate", True))
    if kw.get("attention_factor") is not None:
      out["attention_factor"] = kw["attention_factor"]
    return out, _scaled_len(kw["train_len"], factor)
  raise ValueError(f"model.encoding={cfg.encoding!r} with {kw} has no transformers RoPE type "
                   "(exported: rope, rope_llama3, rope_pi, rope_ntk variant='dynamic', "
                   "rope_yarn ramp='hf')")


# transformers needs a max_position_embeddings; plain RoPE does not read it.
DEFAULT_MAX_POSITIONS = 4096


def _scaled_len(length: int, factor: float) -> int:
  return int(round(length * factor))


def hf_config(cfg: model_lib.ModelConfig) -> dict:
  """config.json for `cfg` (Qwen2ForCausalLM with q/k/v biases, else LlamaForCausalLM);
  ValueError naming the field transformers' model cannot compute."""
  for field, ok in (("block", cfg.block == "llama"), ("kv_shift", not cfg.kv_shift),
                    ("qk_norm", not cfg.qk_norm)):
    if not ok:
      raise ValueError(f"model.{field}={getattr(cfg, field)!r} has no counterpart in "
                       "LlamaForCausalLM / Qwen2ForCausalLM")
  rope, max_len = _rope_config(cfg)
  family = "qwen2" if cfg.qkv_bias else "llama"
  out = dict(model_type=family, architectures=[FAMILIES[family][0]],
             vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
             intermediate_size=cfg.mlp_width, num_hidden_layers=cfg.num_layers,
             num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
             head_dim=cfg.head_dim, hidden_act="silu", rms_norm_eps=cfg.norm_eps,
             max_position_embeddings=max_len, rope_parameters=rope,
             # A tied head scaled by 1/sqrt(d_model) is exported untied (lm_head holds E/sqrt C).
             tie_word_embeddings=cfg.tie_embeddings and not cfg.scale_tied_logits,
             dtype="float32")
  if family == "llama":
    out.update(attention_bias=False, mlp_bias=False)
  else:
    out.update(use_sliding_window=False)
  return out


def params_to_hf(cfg: model_lib.ModelConfig, params: Mapping) -> dict[str, np.ndarray]:
  """transformers' tensors (half-split q/k layout) from our parameter tree."""
  np_params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  interleaved = _rope_kwargs(cfg)["layout"] == "interleaved"

  def qk(w, axis):  # our adjacent-pair channels -> transformers' half-split ones
    return encodings.interleaved_to_half(w, head_dim=cfg.head_dim, axis=axis) if interleaved else w

  out = {}
  for i in range(cfg.num_layers):
    p, blk = f"model.layers.{i}.", np_params["blocks"][i]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      w = blk["attn"][proj]["kernel"].T
      out[f"{p}self_attn.{proj}.weight"] = qk(w, 0) if proj in ("q_proj", "k_proj") else w
      if cfg.qkv_bias and proj != "o_proj":
        b = blk["attn"][proj]["bias"]
        out[f"{p}self_attn.{proj}.bias"] = qk(b, 0) if proj in ("q_proj", "k_proj") else b
    for name in ("gate", "up", "down"):
      out[f"{p}mlp.{name}_proj.weight"] = blk["mlp"][name]["kernel"].T
    out[f"{p}input_layernorm.weight"] = blk["attn_norm"]["scale"]
    out[f"{p}post_attention_layernorm.weight"] = blk["mlp_norm"]["scale"]
  embed = np_params["embed"]["embedding"]
  out["model.embed_tokens.weight"] = embed
  out["model.norm.weight"] = np_params["final_norm"]["scale"]
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = np_params["head"]["kernel"].T
  elif cfg.scale_tied_logits:
    out["lm_head.weight"] = embed / np.sqrt(np.float32(cfg.d_model))
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def export(cfg: model_lib.ModelConfig, params: Mapping, out_dir: str) -> dict:
  """Writes out_dir/config.json and out_dir/model.safetensors; returns the config dict.
  The config is read back through `model_config` and must give the same model."""
  config = hf_config(cfg)
  back = model_config(config, dtype=cfg.dtype)
  ours = {k: v for k, v in _rope_kwargs(cfg).items() if k != "layout"}
  theirs = {k: v for k, v in _rope_kwargs(back).items() if k != "layout"}
  if back.encoding != cfg.encoding or any(
      not np.isclose(float(v), float(theirs.get(k, np.nan))) if isinstance(v, (int, float))
      and not isinstance(v, bool) else theirs.get(k) != v for k, v in ours.items()):
    raise ValueError(f"model.encoding={cfg.encoding!r} {ours} does not survive the round trip "
                     f"through transformers' config ({back.encoding!r} {theirs})")
  os.makedirs(out_dir, exist_ok=True)
  write_safetensors(os.path.join(out_dir, WEIGHTS), params_to_hf(cfg, params))
  with open(os.path.join(out_dir, CONFIG), "w") as f:
    json.dump(config, f, indent=1)
  return config
