"""Loads a trained run's parameters and exposes each layer's prepared attention inputs.

`restore(config, workdir)` rebuilds the run's model from its config (the same Trainer the
run used) and restores only the parameters of the newest intact checkpoint. `layer_inputs` walks
the model on a batch and yields, per layer, the attention's Prepared (the family's
q/k/v and inputs, exactly what the model attends with) and the raw pre-encoding q/k, so
probes can re-apply an encoding at chosen positions or read its transports.

Shape letters: B batch, T time, C d_model, H heads, K kv heads, D head dim.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments import checkpoint
from experiments import config_checks
from experiments import data
from experiments import run_config
from experiments import sharding
from experiments import train
from experiments.configs import from_workdir
from posenc_jax import model as model_lib


def source_run(config_module: str, config_arg: str, encoding: str, workdir: str):
  """The config a probe rebuilds a trained run from: the run's own config.json when its
  workdir has one (so command-line overrides it trained with, such as an encoding's
  hyperparameters, are kept), else `config_module`'s config for `config_arg` with its encoding
  set to `encoding` (workdirs from before runs recorded their config)."""
  recorded = run_config.stored(workdir)
  if recorded is not None:
    config = from_workdir.on_defaults(recorded)
    if config.model.encoding != encoding:
      raise ValueError(f"{workdir}/{run_config.CONFIG} trained encoding "
                       f"{config.model.encoding!r}, not {encoding!r}")
    return config
  module = __import__(f"experiments.configs.{config_module}", fromlist=["get_config"])
  config = module.get_config(config_arg)
  with config.unlocked():
    config.model.encoding = encoding
  return config


def restore(config, workdir: str):
  """(trainer, params) of the newest intact checkpoint in workdir, trained from `config`
  (damaged newer steps passed over with a warning line each, as training does)."""
  mcfg = config_checks.model_config(config, data.vocab_size(config.data))
  if checkpoint.latest_step(workdir) is None:
    raise ValueError(f"workdir={workdir!r} holds no checkpoint; train it first")
  mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  trainer = train.Trainer(mcfg, config.train, mesh, rules=config.mesh.rules)
  with jax.set_mesh(mesh):
    _, params = checkpoint.restore_params(workdir, trainer.abstract_state()["params"])
  return trainer, params


def layer_inputs(model: model_lib.Transformer, tokens_BT) -> list[dict]:
  """Per layer: {"prep": Prepared, "q": raw q [B,T,H,D], "k": raw k [B,T,K,D], "enc", "params"}.

  One unpacked sequence per row (positions 0..T-1, no segments); inference mode.
  """
  cfg = model.cfg
  if cfg.kv_shift or cfg.qk_norm:
    raise ValueError("layer_inputs covers models without kv_shift / qk_norm")
  B, T = tokens_BT.shape
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  layer = dict(tokens_BT=tokens_BT, positions_BT=pos, segment_ids_BT=None)
  x, out = model.embed(tokens_BT), []
  for i, block in enumerate(model.blocks):
    attn, h = block.attn, block.attn_norm(x)
    q = attn.q_proj(h).reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = attn.k_proj(h).reshape(B, T, cfg.kv_heads, cfg.head_dim)
    v = attn.v_proj(h).reshape(B, T, cfg.kv_heads, cfg.head_dim)
    params = model_lib._values(attn.enc_params)
    prep = attn.enc.prepare(params, x=h, q=q, k=k, v=v, positions=pos, segment_ids=None,
                            tokens=tokens_BT, rng=None, train=False, layer_index=i)
    out.append({"prep": prep, "q": q, "k": k, "v": v, "enc": attn.enc, "params": params})
    x = block(x, rngs=None, train=False, layer_index=i, **layer)
  return out


def trained_layers(c, name: str, seed: int):
  """(tokens [B, T], layer_inputs) of the trained run WORKDIR/<name>/seed<seed> of a probe
  config c (source_workdir, source_config, source_arg) on its first held-out batch of
  c.text_batch rows of c.text_len tokens."""
  run_dir = os.path.join(c.source_workdir, name, f"seed{seed}")
  config = source_run(c.source_config, c.source_arg, name, run_dir)
  trainer, params = restore(config, run_dir)
  tokens = jnp.asarray(eval_tokens(config, seq_len=c.text_len, batch_size=c.text_batch))
  return tokens, layer_inputs(trainer.model(params), tokens)


def eval_tokens(config, *, seq_len: int, batch_size: int) -> np.ndarray:
  """The first held-out batch of the run's eval set at seq_len: tokens [B, T]."""
  sets = data.make_eval_sets(config.data, seq_len=seq_len, batch_size=batch_size,
                             num_batches=1, seed=config.eval.seed)
  return next(iter(sets.values()))[0]["tokens"]
