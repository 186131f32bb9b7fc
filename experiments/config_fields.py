"""Every field an experiment config may hold, with the type and range each value must have.

`check_fields(config)` walks the config against the table below before anything is built:
an unknown field (a typo on the command line or in a config file) raises one ValueError
naming the valid fields of its group, and a value of the wrong type or out of range one
naming the field and what it must be. What depends on several fields (an encoding's
head_dim, a sequence length the data can fill, the mesh against the devices) is checked
afterwards by experiments/config_checks.py.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from typing import Any, Callable

from experiments import data
from experiments.tasks import word_problem
from posenc_jax import model as model_lib

_SEED_MAX = 2**31 - 1  # numpy's and jax's seeds


@dataclasses.dataclass(frozen=True)
class Rule:
  """ok(value) says whether a value is valid; `expect` says what a valid one is."""
  ok: Callable[[Any], bool]
  expect: str
  optional: bool = False   # the field may be absent (fields only some configs set)
  none: bool = False       # None is a valid value


def _is_int(v) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
  return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def integer(lo: int, hi: int | None = None, *, note: str = "", **kw) -> Rule:
  where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
  return Rule(lambda v: _is_int(v) and v >= lo and (hi is None or v <= hi),
              f"an integer {where}{note}", **kw)


def real(lo: float, hi: float | None = None, *, lo_open=False, hi_open=True, note="",
         **kw) -> Rule:
  if hi is None:
    where = f"> {lo:g}" if lo_open else f">= {lo:g}"
  else:
    where = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

  def ok(v):
    return (_is_real(v) and (v > lo if lo_open else v >= lo)
            and (hi is None or (v < hi if hi_open else v <= hi)))
  return Rule(ok, f"a finite number {where}{note}", **kw)


def flag(**kw) -> Rule:
  return Rule(lambda v: isinstance(v, bool), "True or False", **kw)


def choice(values, **kw) -> Rule:
  values = tuple(values)
  return Rule(lambda v: isinstance(v, str) and v in values, f"one of {values}", **kw)


def text(expect: str = "a non-empty string", **kw) -> Rule:
  return Rule(lambda v: isinstance(v, str) and v != "", expect, **kw)


def integers(lo: int, *, example: str, **kw) -> Rule:
  return Rule(lambda v: isinstance(v, (tuple, list)) and all(_is_int(x) and x >= lo for x in v),
              f"a tuple of integers >= {lo}, e.g. --config.<field>={example}", **kw)


def strings(*, example: str) -> Rule:
  return Rule(lambda v: isinstance(v, (tuple, list)) and all(isinstance(x, str) and x for x in v),
              f"a tuple of names, e.g. --config.<field>={example}")


def _rules_table(v) -> bool:
  """mesh.rules: (logical axis, None | mesh axis | tuple of mesh axes) pairs."""
  def axes(a):
    return a is None or isinstance(a, str) or (
        isinstance(a, (tuple, list)) and all(isinstance(x, str) for x in a))
  return isinstance(v, (tuple, list)) and all(
      isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str) and axes(r[1])
      for r in v)


FIELDS: dict[str, dict[str, Rule]] = {
    "model": {
        "encoding": text("a name of posenc_jax.encodings.NAMES"),  # the registry: config_checks
        "encoding_kwargs": Rule(lambda v: hasattr(v, "keys"), "a dict of the encoding's "
                                "hyperparameters, e.g. --config.model.encoding_kwargs.base=5e5"),
        "kv_shift": flag(),
        "num_layers": integer(1),
        "d_model": integer(1),
        "num_heads": integer(1),
        "num_kv_heads": integer(0, note=" (0 = num_heads)"),
        "head_dim": integer(1),
        "mlp_dim": integer(0, note=" (0 = auto)"),
        "block": choice(model_lib.BLOCKS),
        "qk_norm": flag(),
        "dropout": real(0.0, 1.0),
        "tie_embeddings": flag(),
        "dtype": choice(model_lib.DTYPES),
        "implementation": text("None (auto) or an implementation name", none=True),
        # the values: kernels_pallas.BlockSizes.of, in config_checks
        "kernel_options": Rule(lambda v: hasattr(v, "keys"), "the PaTH / FoX kernels' options "
                               "(kernels_pallas.BlockSizes fields: block, span, prepass, mosaic, "
                               "keep_inverse), e.g. --config.model.kernel_options.span=8"),
        "scan_layers": flag(),
        # Set by experiments.import_hf for transformers checkpoints; absent = the default.
        "qkv_bias": flag(optional=True),
        "norm_eps": real(0.0, lo_open=True, optional=True),
        "scale_tied_logits": flag(optional=True),
    },
    "train": {
        "steps": integer(1),
        "batch_size": integer(1),
        "learning_rate": real(0.0, lo_open=True),
        "warmup_steps": integer(0),   # below steps: config_checks
        "weight_decay": real(0.0),
        "grad_clip": real(0.0, note=" (0 turns clipping off)"),
        "checkpoint_every": integer(0, note=" (0 = only at the end)"),
        "log_every": integer(1),
        "seed": integer(0, _SEED_MAX),
        "divergence_factor": real(1.0),
        "divergence_margin": real(0.0),
        "divergence_patience": integer(0, note=" (0 = stop only at a NaN / inf loss)"),
        "allow_config_change": flag(),
        "init_from": Rule(lambda v: isinstance(v, str), "a workdir ('' = none)"),
        "compile_cache_dir": Rule(lambda v: isinstance(v, str), "a directory ('' turns the "
                                  "cache off; None: ~/.cache/posenc-jax/jax)", none=True),
    },
    "eval": {
        "lengths": integers(1, example="64,128 (() = data.seq_len only)"),
        "every": integer(0, note=" (0 = only at the end)"),
        "num_batches": integer(0, note=" (0 = no evaluation)"),
        "batch_size": integer(0, note=" (0 = train.batch_size)"),
        "seed": integer(0, _SEED_MAX),
    },
    "data": {
        "task": choice(data.TASKS),
        "seq_len": integer(1),
        "ignore_prob": real(0.0, 1.0),
        "sparse_ignore_prob": real(0.0, 1.0),
        "dense_ignore_prob": real(0.0, 1.0),
        "byte_tokens": flag(),
        "group": choice(word_problem.GROUPS),
        "alphabet": choice(word_problem.ALPHABETS, optional=True),
        "n_back": integer(1),
        "num_pairs": integer(1),
        "num_values": integer(1),
        "query_prob": real(0.0, 1.0, lo_open=True),
        "text_dir": text("a directory, a file or a glob of text files, or None (the default "
                         "corpus: the interpreter's standard library)", none=True),
        "max_files": integer(1, none=True),
        "valid_fraction": real(0.0, 1.0, lo_open=True),
        "shuffle_window": integer(0, note=" (0 = no shuffling)"),
        # The text task through a tokenizer.json instead of bytes (tasks/code_corpus.py);
        # absent = None, so that configs and results recorded before them read the same.
        "tokenizer": text("a tokenizer.json file, or None (the byte-level corpus)", none=True,
                          optional=True),
        "doc_token": integer(0, note=" (the id that ends a document; None = the tokenizer's "
                             "eos_token_id)", none=True, optional=True),
        "vocab_size": integer(1, note=" (the model's vocabulary; None = the data's own)",
                              none=True, optional=True),
        "read_threads": integer(1),
        "prefetch_batches": integer(1),
    },
    "mesh": {
        "data": Rule(lambda v: _is_int(v) and (v >= 1 or v == -1), "a positive size or -1 (fill)"),
        "fsdp": Rule(lambda v: _is_int(v) and (v >= 1 or v == -1), "a positive size or -1 (fill)"),
        "context": Rule(lambda v: _is_int(v) and (v >= 1 or v == -1),
                        "a positive size or -1 (fill)"),
        "rules": Rule(_rules_table, "(logical axis, mesh axes) pairs (experiments/sharding.py)"),
    },
    # Their combination: experiments/distributed.py, before JAX starts.
    "distributed": {
        "coordinator": text("HOST:PORT of process 0, or None (one process)", none=True),
        "num_processes": integer(1, none=True),
        "process_id": integer(0, none=True),
    },
    # Only encodings is read by experiments.main; the rest are experiments.sweeps' fields.
    "sweep": {
        "encodings": strings(example="rope,path (() = one run of model.encoding)"),
        "seeds": integers(0, example="0,1,2", optional=True),
        "axis": Rule(lambda v: isinstance(v, str), "a dotted config field, e.g. "
                     "'model.num_layers' ('' = none)", optional=True),
        "axis_values": Rule(lambda v: isinstance(v, (tuple, list)), "a tuple of values",
                            optional=True),
        "experiment": text("a results writer's name (experiments/results_writers.py)",
                           optional=True),
        "eval_lengths": integers(1, example="64,128", optional=True),
        "eval_tokens": integer(0, optional=True),
        "eval_batch_tokens": integer(1, optional=True),
    },
    # experiments.convert's (configs/convert.py sets them all; other configs have no such
    # group, and experiments.main refuses one): the teacher and stage 1 of a distillation;
    # stage 2 is train.*.
    "convert": {
        "teacher": text("the teacher run's workdir", optional=True),
        "teacher_step": integer(1, note=" (a step the teacher's checkpoints hold; None = the "
                                "newest)", none=True, optional=True),
        "mse_steps": integer(0, note=" (0 = no stage 1)", optional=True),
        "mse_batch_size": integer(1, optional=True),
        "mse_seq_len": integer(0, note=" (0 = data.seq_len)", optional=True),
        "mse_learning_rate": real(0.0, lo_open=True, optional=True),
        "mse_warmup_steps": integer(0, optional=True),   # below mse_steps: experiments.convert
        "init_beta": real(0.0, 2.0, lo_open=True, note=" (PaTH's initial beta; near 0 = NoPE)",
                          optional=True),
        "init_forget_time": real(1.0, lo_open=True, note=" (forget gates start at "
                                 "log f ~ -1 / this: the larger, the nearer NoPE)",
                                 optional=True),
    },
}
def unknown_field(where: str, name: str, known) -> ValueError:
  known = sorted(known)
  close = difflib.get_close_matches(name, known, n=1)
  hint = f" (did you mean {close[0]}?)" if close else ""
  return ValueError(f"{where} has no field {name}{hint}; fields: {', '.join(known)}")


def check_fields(config) -> None:
  """Raises one ValueError for the first unknown field or invalid value of `config`."""
  for group in config.keys():
    if group not in FIELDS:
      raise unknown_field("config", group, FIELDS)
  for group, rules in FIELDS.items():
    if group not in config and all(r.optional for r in rules.values()):
      continue   # a group only some configs have (convert)
    if group not in config:
      raise ValueError(f"config has no group {group}; start the config from "
                       f"experiments.configs.base.get_config()")
    node = config[group]
    for name in node.keys():
      if name not in rules:
        raise unknown_field(f"config.{group}", name, rules)
    for name, rule in rules.items():
      if name not in node:
        if rule.optional:
          continue
        raise ValueError(f"config.{group}.{name} is missing; start the config from "
                         f"experiments.configs.base.get_config()")
      value = node[name]
      if value is None and rule.none:
        continue
      if not rule.ok(value):
        expect = rule.expect.replace("<field>", f"{group}.{name}")
        raise ValueError(f"config.{group}.{name}={_show(value)} must be {expect}")


def _show(value) -> str:
  return repr(value.to_dict() if hasattr(value, "to_dict") else value)
