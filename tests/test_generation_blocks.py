"""Blocked decoding (Generator.decode's block_tokens): the tokens of one compiled call, bit for
bit, from calls of a few tokens each, with the progress reported between them."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from posenc_jax import generation
from posenc_jax import model as model_lib

N = 13


@pytest.fixture(scope="module")
def gen():
  """A 1-layer PaTH model (its decode cache transports every cached key each step), its
  parameters moved off their initial values so that sampled tokens vary."""
  cfg = model_lib.ModelConfig(vocab_size=11, encoding="path", num_layers=1, d_model=16,
                              num_heads=2, head_dim=8)
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(params=0))
  state = nnx.state(model, nnx.Param)
  rng = np.random.default_rng(0)
  nnx.replace_by_pure_dict(state, jax.tree.map(
      lambda x: x + 0.5 * rng.standard_normal(x.shape, np.float32), nnx.to_pure_dict(state)))
  nnx.update(model, state)
  return generation.Generator(model, max_len=4 + N)


def _run(gen, block, **kw):
  prompt = generation.pad_prompts([[1, 2, 3, 4], [5, 6]], padding="left")
  seen = []
  out = gen.generate(*prompt, max_new_tokens=N, padding="left", block_tokens=block,
                     progress=seen.append, **kw)
  return out, seen


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, top_p=0.9, seed=3)],
                         ids=["greedy", "sampled"])
def test_blocks_give_the_tokens_of_one_call(gen, sampling):
  whole, seen = _run(gen, 0, **sampling)
  assert seen == [N] and whole.decode_steps == N
  assert len(set(whole.tokens.ravel().tolist())) > 3      # the comparison has tokens to miss
  for block, calls in ((4, [4, 8, 12, 13]), (1, list(range(1, N + 1)))):
    blocked, seen = _run(gen, block, **sampling)
    np.testing.assert_array_equal(blocked.tokens, whole.tokens)
    assert seen == calls and blocked.decode_steps == N
    assert blocked.compile_s == 0                          # the bound is traced: one program


def test_blocks_stop_where_every_row_has_ended(gen):
  """eos inside a block: the loop stops there, and later blocks never run."""
  free, _ = _run(gen, 0, temperature=1.0, seed=3)
  both = set(free.tokens[0, 2:9].tolist()) & set(free.tokens[1, 2:9].tolist())
  eos = min(both)                                          # ends each row between steps 3 and 9
  whole, _ = _run(gen, 0, temperature=1.0, seed=3, eos_id=eos)
  blocked, seen = _run(gen, 4, temperature=1.0, seed=3, eos_id=eos)
  np.testing.assert_array_equal(blocked.tokens, whole.tokens)
  np.testing.assert_array_equal(blocked.lengths, whole.lengths)
  assert whole.decode_steps < N and blocked.decode_steps == whole.decode_steps
  # Blocks run until one ends short of its bound: 4, 8, ... up to the first past the stop.
  assert seen == [min(b, whole.decode_steps) for b in range(4, whole.decode_steps + 5, 4)]
  with pytest.raises(ValueError, match="block_tokens=-1"):
    _run(gen, -1)
