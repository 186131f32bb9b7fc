r"""Sample from a trained run: its latest checkpoint, its model config, a prompt.

  python -m experiments.generate --workdir=DIR --prompt="..." [--max_new_tokens=32 \
      --temperature=0 --top_k=0 --top_p=1 --seed=0 --max_len=0]

DIR is a run's workdir (for a sweep, one run's: WORKDIR/<encoding>). The model is rebuilt from
the config saved with the checkpoint, and only its parameters are read. The prompt and the
continuation are text for byte-level text models and for runs with a tokenizer.json (an
imported checkpoint's, or the text task's data.tokenizer), flip-flop symbols for flip-flop
runs and token ids otherwise (experiments/codecs.py). temperature=0 is greedy and deterministic;
otherwise top-k / top-p sampling with --seed. The continuation goes to stdout; progress and
the speed (prefill time, decode tokens/s, compile time) to stderr. Past PROGRESS_BLOCK new
tokens, the decode loop runs in compiled blocks of that many (the same tokens as one call)
and a progress bar with an estimate of the time left follows them on stderr.

A bad input (no checkpoint in DIR, an empty prompt, a prompt longer than --max_len, a
sampling parameter out of range) prints one `error: ...` line and exits with status 2.
"""
from __future__ import annotations

import sys

from absl import app
from absl import flags

from experiments import cli_config

from experiments.run_model import load_model  # noqa: F401  (experiments.generate.load_model)

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's workdir (holds checkpoints/).")
_PROMPT = flags.DEFINE_string("prompt", None, "Text to continue (see the module docstring).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0 = all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Sample within this much probability (1 = all).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_MAX_LEN = flags.DEFINE_integer("max_len", 0, "Cache slots (0 = prompt + max_new_tokens).")
flags.mark_flags_as_required(["workdir", "prompt"])
# Tokens per compiled decode call when a bar is shown: between calls the bar moves. On the
# 2-core CPU, decoding 2048 tokens of a 2-layer d_model-64 model in blocks of 64, 256 or 1024
# took as long as one call, within the measurement's spread.
PROGRESS_BLOCK = 128


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def generate(workdir: str, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int,
             top_p: float, seed: int, max_len: int, log=_log,
             block_tokens: int = PROGRESS_BLOCK) -> dict:
  """Continues `prompt` with the run in workdir; raises ValueError for bad input.

  More than block_tokens new tokens are decoded in blocks of that many, with a progress bar
  on stderr. Returns {"text", "tokens", "prompt_tokens", "output": generation.Output}.
  """
  import tqdm

  from experiments import codecs
  from posenc_jax import generation
  from posenc_jax import sampling

  sampling.check(temperature=temperature, top_k=top_k, top_p=top_p)
  if max_new_tokens < 1:
    raise ValueError(f"--max_new_tokens={max_new_tokens} must be >= 1")
  if max_len < 0:
    raise ValueError(f"--max_len={max_len} must be >= 0 (0 = prompt + max_new_tokens)")
  if not prompt:
    raise ValueError("--prompt is empty: give at least one token to continue")
  model, cfg, step = load_model(workdir)
  codec = codecs.for_workdir(workdir, cfg.vocab_size)
  ids = codec.encode(prompt)
  if not ids:
    raise ValueError(f"--prompt={prompt!r} holds no token")
  slots = max_len or len(ids) + max_new_tokens
  generation.check_lengths(prompt_len=len(ids), max_new_tokens=max_new_tokens, max_len=slots)
  log(f"step {step} of {workdir}: {cfg.encoding}{' + kv_shift' if cfg.kv_shift else ''}, "
      f"{cfg.num_layers} layer(s), d_model {cfg.d_model}, task {codec.task}; "
      f"{len(ids)} prompt tokens, cache of {slots} slots; compiling ...")
  gen = generation.Generator(model, max_len=slots)
  tokens, lengths = generation.pad_prompts([ids])
  bar, progress, block = None, None, 0
  if max_new_tokens > block_tokens:
    bar = tqdm.tqdm(total=max_new_tokens, desc="decode", unit="tok", file=sys.stderr,
                    dynamic_ncols=True, mininterval=0.5)
    progress, block = (lambda n: bar.update(n - bar.n)), block_tokens
  try:
    out = gen.generate(tokens, lengths, max_new_tokens=max_new_tokens, temperature=temperature,
                       top_k=top_k, top_p=top_p, seed=seed, eos_id=codec.eos_id,
                       block_tokens=block, progress=progress)
  finally:
    if bar is not None:
      bar.close()
  new = out.tokens[0, :out.lengths[0]].tolist()
  # The loop sampled decode_steps tokens, the first from the prefill's logits: it ran the
  # model decode_steps - 1 times (it stops early once every row has ended).
  steps = out.decode_steps - 1
  speed = (f"{steps} decode steps, {steps / max(out.decode_s, 1e-9):,.0f} tokens/s" if steps
           else "no decode step")
  log(f"prefill {len(ids)} tokens in {1e3 * out.prefill_s:.1f} ms; sampled {out.decode_steps} "
      f"tokens in {out.decode_s:.3f} s ({speed}); compile {out.compile_s:.1f} s")
  return {"text": codec.decode(new), "tokens": new, "prompt_tokens": ids, "output": out}


def main(argv) -> None:
  cli_config.start(argv)
  try:
    result = generate(_WORKDIR.value, _PROMPT.value, max_new_tokens=_MAX_NEW.value,
                      temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
                      seed=_SEED.value, max_len=_MAX_LEN.value)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(result["text"])


if __name__ == "__main__":
  app.run(main)
