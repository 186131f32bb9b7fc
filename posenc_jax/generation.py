"""Generation from a Transformer: a prompt batch fills a fixed-size cache, then a compiled loop
samples one token per row per step.

    gen = Generator(model, max_len=S)
    tokens_BP, lengths_B = pad_prompts([[1, 2, 3], [4, 5]], padding="right")
    out = gen.generate(tokens_BP, lengths_B, max_new_tokens=N, temperature=0.0, seed=0)
    out.tokens   # [B, N] int32 (after an eos_id, eos_id again)

Two compiled functions per (batch size, prompt length, N, padding, eos_id): `prefill` (the
prompt's forward, Transformer.prefill) and `decode` (a lax.while_loop of Transformer.decode
and sampling.sample; the cache is the loop's carry, so every step updates it in place).
Nothing recompiles per step, and the sampling parameters are traced arguments: changing
them does not recompile either. The cache has max_len slots per row and must hold the prompt
plus the N - 1 tokens fed back (the last one sampled is never fed): P + N - 1 <= max_len.
The loop stops early once every row has sampled eos_id.

`block_tokens` runs the loop in calls of that many steps (the bound is a traced argument:
one program for every block), so a `progress` callback can report between them; the tokens
are the same, bit for bit, as from one call.

Keys: the token of step n is drawn with fold_in(key(seed), n), so a seed fixes the output.

Shape letters: B batch, P prompt length (the longest prompt), N new tokens, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posenc_jax import sampling


# XLA's CPU backend copies a loop-carried buffer that the loop body both reads and updates in
# place (the whole cache, once or twice per decode step) unless copy insertion uses region
# analysis. The GPU backend's switch of the same name changed neither the time nor the
# temporaries of the decode loop on an H200 (docs/benchmarks/decode_speed.md), so it is not
# set. compiler_options=None in Generator means these.
REGION_ANALYSIS = {"cpu": {"xla_cpu_copy_insertion_use_region_analysis": True}}


def _compile(lowered, options: dict):
  if options:
    try:
      return lowered.compile(compiler_options=options)
    except Exception as e:  # a jaxlib without the option: compile as it would by default
      if "No such compile option" not in str(e):
        raise
  return lowered.compile()


def pad_prompts(prompts: Sequence[Sequence[int]], *, padding: str = "right", pad_id: int = 0):
  """Token lists -> (tokens [B, P] int32 padded with pad_id, lengths [B] int32), P the longest."""
  if padding not in ("right", "left"):
    raise ValueError(f"padding={padding!r} must be 'right' or 'left'")
  if not prompts:
    raise ValueError("prompts is empty: give at least one prompt")
  lengths = np.array([len(p) for p in prompts], np.int32)
  if lengths.min() == 0:
    raise ValueError(f"prompt {int(np.argmin(lengths))} is empty: every prompt needs a token")
  tokens = np.full((len(prompts), lengths.max()), pad_id, np.int32)
  for b, p in enumerate(prompts):
    if padding == "right":
      tokens[b, :len(p)] = p
    else:
      tokens[b, tokens.shape[1] - len(p):] = p
  return tokens, lengths


def check_lengths(*, prompt_len: int, max_new_tokens: int, max_len: int) -> None:
  """Raises one ValueError when the prompt and the new tokens do not fit max_len slots."""
  if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral)
      or max_new_tokens < 1):
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
  if prompt_len > max_len:
    raise ValueError(f"the prompt has {prompt_len} tokens, longer than max_len={max_len}")
  if prompt_len + max_new_tokens - 1 > max_len:
    raise ValueError(f"max_new_tokens={max_new_tokens} does not fit: a prompt of {prompt_len} "
                     f"tokens leaves room for {max_len - prompt_len + 1} in max_len={max_len}")


@dataclasses.dataclass
class Output:
  """tokens [B, N] int32; lengths [B]: tokens up to and including eos_id (N without one);
  seconds spent compiling (0 when cached), in the prefill and in the decode loop."""
  tokens: np.ndarray
  lengths: np.ndarray
  compile_s: float
  prefill_s: float
  decode_s: float
  decode_steps: int


class Generator:
  """Compiled prefill and decode loop for one model and cache size (max_len slots per row)."""

  def __init__(self, model, *, max_len: int, compiler_options: dict | None = None):
    """compiler_options: XLA options for both compiled functions; None: the backend's
    REGION_ANALYSIS (the cache updated in place), {}: XLA's defaults."""
    if isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral) or max_len < 1:
      raise ValueError(f"max_len={max_len!r} must be a positive integer")
    self.max_len = max_len
    self.graphdef, self.state = nnx.split(model)
    self._compiled: dict = {}
    self.compile_s = 0.0   # seconds spent compiling since the last generate()
    self.compiler_options = (REGION_ANALYSIS.get(jax.default_backend(), {})
                             if compiler_options is None else dict(compiler_options))

  def _prefill(self, state, tokens_BP, lengths_B, *, padding):
    model = nnx.merge(self.graphdef, state)
    B = tokens_BP.shape[0]
    logits, cache = model.prefill(tokens_BP, lengths_B=lengths_B, padding=padding,
                                  cache=model.init_cache(B, self.max_len))
    last = jnp.take_along_axis(logits, (cache["end"] - 1)[:, None, None], axis=1)[:, 0]
    return last, cache

  def _decode(self, state, carry, logits_BV, key, temperature, top_k, top_p, stop_at, *,
              num_tokens, eos_id):
    """The loop's steps from carry = (n, cache, token, out [B, N], done) up to n = stop_at (or
    until every row is done). At n = 0 it first draws token 0 from the prefill's logits."""
    model = nnx.merge(self.graphdef, state)
    draw = functools.partial(sampling.sample, temperature=temperature, top_k=top_k, top_p=top_p)
    stop = -1 if eos_id is None else eos_id               # -1: no token ever equals it
    n, cache, tok, out, done = carry
    start = n == 0
    first = draw(logits_BV, jax.random.fold_in(key, 0))
    tok = jnp.where(start, first, tok)
    out = jnp.where(start, out.at[:, 0].set(first), out)
    done = jnp.where(start, first == stop, done)
    n = jnp.where(start, 1, n)

    def cond(carry):
      n, _, _, _, done = carry
      return (n < stop_at) & ~jnp.all(done)

    def body(carry):
      n, cache, tok, out, done = carry
      logits, cache = model.decode(tok, cache=cache)
      nxt = jnp.where(done, stop, draw(logits, jax.random.fold_in(key, n)))
      out = jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], n, axis=1)
      return n + 1, cache, nxt, out, done | (nxt == stop)

    return jax.lax.while_loop(cond, body, (n, cache, tok, out, done))

  def _executable(self, name: str, fn, args, **static):
    """fn jitted with `static` bound, lowered and compiled once per shapes (timed)."""
    shapes = tuple((a.shape, a.dtype) for a in jax.tree.leaves(args[1:]))
    key = (name, shapes, tuple(sorted(static.items())))
    if key not in self._compiled:
      started = time.perf_counter()
      # decode donates its carry (argument 1, the cache in it): the loop updates it in
      # place, no second copy.
      jitted = jax.jit(functools.partial(fn, **static),
                       donate_argnums=(1,) if name == "decode" else ())
      self._compiled[key] = _compile(jitted.lower(*args), self.compiler_options)
      self.compile_s += time.perf_counter() - started
    return self._compiled[key]

  def memory_analysis(self, name: str):
    """XLA's memory analysis of the last compiled "prefill" or "decode" (None before one)."""
    found = [c for k, c in self._compiled.items() if k[0] == name]
    return found[-1].memory_analysis() if found else None

  def prefill(self, tokens_BP, lengths_B, *, padding: str = "right"):
    """Runs the prompts: (logits [B, V] of each row's next token, cache, seconds).

    Compiling (first call per shapes) is not in the seconds; see `compile_s`.
    """
    tokens_BP = np.asarray(tokens_BP, np.int32)
    lengths_B = np.asarray(lengths_B, np.int32)
    B, P = tokens_BP.shape
    if lengths_B.shape != (B,) or lengths_B.min() < 1 or lengths_B.max() > P:
      raise ValueError(f"lengths must be {B} integers in [1, {P}], got {lengths_B.tolist()}")
    if P > self.max_len:
      raise ValueError(f"the prompt has {P} tokens, longer than max_len={self.max_len}")
    args = (self.state, tokens_BP, lengths_B)
    prefill = self._executable("prefill", self._prefill, args, padding=padding)
    started = time.perf_counter()
    logits, cache = jax.block_until_ready(prefill(*args))
    return logits, cache, time.perf_counter() - started

  def decode(self, cache, logits_BV, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
             block_tokens: int = 0, progress=None):
    """Samples max_new_tokens per row, the first from logits_BV, feeding each back into the
    cache (which must have room: every row's end + max_new_tokens - 1 <= max_len).

    block_tokens > 0 runs the loop in calls of that many tokens and calls progress(tokens
    sampled so far) after each (0: one call). The cache is donated (its buffers are reused;
    do not read it afterwards). Returns (tokens [B, N] int32, steps run, seconds, the cache
    after them). Compiling is not in the seconds.
    """
    sampling.check(temperature=temperature, top_k=top_k, top_p=top_p)
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, numbers.Integral) or (
        block_tokens < 0):
      raise ValueError(f"block_tokens={block_tokens!r} must be an integer >= 0 (0 = one call)")
    end = int(np.max(cache["end"]))
    check_lengths(prompt_len=end, max_new_tokens=max_new_tokens, max_len=self.max_len)
    B = np.shape(logits_BV)[0]
    carry = (jnp.int32(0), cache, jnp.zeros((B,), jnp.int32),
             jnp.zeros((B, max_new_tokens), jnp.int32), jnp.zeros((B,), bool))
    fixed = (jax.random.key(seed), jnp.float32(temperature), jnp.int32(top_k),
             jnp.float32(top_p))
    args = (self.state, carry, logits_BV, *fixed, jnp.int32(max_new_tokens))
    decode = self._executable("decode", self._decode, args, num_tokens=max_new_tokens,
                              eos_id=eos_id)
    step = block_tokens or max_new_tokens
    started, bound = time.perf_counter(), 0
    while True:
      bound = min(bound + step, max_new_tokens)
      carry = decode(self.state, carry, logits_BV, *fixed, jnp.int32(bound))
      steps = int(carry[0])              # waits for the block
      if progress is not None:
        progress(steps)
      if steps < bound or steps == max_new_tokens:   # every row ended early, or all sampled
        break
    seconds = time.perf_counter() - started
    _, cache, _, out, _ = carry
    # Stopped early (every row hit eos): the steps not taken are eos too.
    out = np.where(np.arange(max_new_tokens)[None] < steps, np.asarray(out),
                   -1 if eos_id is None else eos_id).astype(np.int32)
    return out, steps, seconds, cache

  def generate(self, tokens_BP, lengths_B, *, max_new_tokens: int, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
               padding: str = "right", block_tokens: int = 0, progress=None) -> Output:
    """prefill + decode: max_new_tokens per row after each prompt (layout: pad_prompts);
    block_tokens and progress as in decode."""
    sampling.check(temperature=temperature, top_k=top_k, top_p=top_p)
    check_lengths(prompt_len=np.shape(tokens_BP)[1], max_new_tokens=max_new_tokens,
                  max_len=self.max_len)
    self.compile_s = 0.0
    logits, cache, prefill_s = self.prefill(tokens_BP, lengths_B, padding=padding)
    out, steps, decode_s, _ = self.decode(cache, logits, max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_k=top_k, top_p=top_p,
                                       seed=seed, eos_id=eos_id, block_tokens=block_tokens,
                                       progress=progress)
    lengths = np.full((out.shape[0],), max_new_tokens, np.int32)
    if eos_id is not None:
      hit = out == eos_id
      lengths = np.where(hit.any(1), hit.argmax(1) + 1, max_new_tokens).astype(np.int32)
    return Output(out, lengths, self.compile_s, prefill_s, decode_s, steps)
