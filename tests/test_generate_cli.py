"""experiments.generate: sampling from a trained run's checkpoint, and its errors."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from experiments import codecs
from experiments import generate
from experiments.tasks import flipflop

PROMPT = "w1 i0 i1 r"   # flip-flop: the read after these must answer 1


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A quickstart-sized flip-flop model (the quickstart's layer sizes), trained 3 steps; RoPE
  (the quickstart's other encoding) compiles fastest, and every encoding decodes through the
  same model code (tests/test_generation.py holds each to the full forward)."""
  from experiments import train
  from experiments.configs import quickstart
  c = quickstart.get_config("runlocal,encoding=rope,steps=3")
  c.model.update(d_model=64, head_dim=32)
  c.eval.num_batches = 0
  workdir = str(tmp_path_factory.mktemp("quickstart") / "rope")
  train.run(c, workdir)
  return workdir


def _generate(workdir, prompt=PROMPT, **kw):
  kw = {"max_new_tokens": 6, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0,
        "max_len": 0, "log": lambda _: None, **kw}
  return generate.generate(workdir, prompt, **kw)


@pytest.fixture(scope="module")
def greedy(run_dir):
  return _generate(run_dir)


def test_greedy_generation_from_a_checkpoint_is_deterministic(run_dir, greedy):
  first, second = greedy, _generate(run_dir)
  assert first["tokens"] == second["tokens"] and len(first["tokens"]) == 6
  assert first["text"] == " ".join(flipflop.VOCAB[t] for t in first["tokens"])
  # The oracle: re-running the restored model on the whole sequence, one argmax at a time.
  model, _, _ = generate.load_model(run_dir)
  seq = list(first["prompt_tokens"])
  width = len(seq) + 6
  forward = jax.jit(model)
  for _ in range(6):  # causal: right padding to a fixed width leaves the logits at len-1 alone
    logits = forward(jnp.asarray([seq + [0] * (width - len(seq))]))
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  assert seq[len(first["prompt_tokens"]):] == first["tokens"]


@pytest.mark.parametrize("kw,message", [
    (dict(prompt=""), r"--prompt is empty"),
    (dict(prompt="   "), r"--prompt=' {3}' holds no token"),
    (dict(prompt="w1 x0"), r"--prompt contains 'x'"),
    (dict(max_len=3), r"the prompt has 7 tokens, longer than max_len=3"),
    (dict(max_len=9), r"max_new_tokens=6 does not fit"),
    (dict(max_new_tokens=0), r"--max_new_tokens=0 must be >= 1"),
    (dict(temperature=-1.0), r"temperature=-1.0 must be a finite number >= 0"),
    (dict(top_k=-3), r"top_k=-3 must be an integer >= 0"),
    (dict(top_p=1.5), r"top_p=1.5 must lie in \(0, 1\]"),
])
def test_bad_input_is_one_clear_error(run_dir, kw, message):
  with pytest.raises(ValueError, match=message):
    _generate(run_dir, **kw)


def test_workdir_without_a_checkpoint(run_dir, tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    _generate(str(tmp_path / "missing"))
  (tmp_path / "notes.txt").write_text("a file")
  with pytest.raises(ValueError, match=r"notes.txt is a file; give the run's directory"):
    _generate(str(tmp_path / "notes.txt"))
  with pytest.raises(ValueError, match="holds no checkpoint; train one"):
    _generate(str(tmp_path))
  # A sweep's root names the runs inside it.
  with pytest.raises(ValueError, match=f"holds the runs {run_dir}"):
    _generate(os.path.dirname(run_dir))


def test_long_generation_shows_a_progress_bar(run_dir, greedy, capsys):
  """Past block_tokens new tokens the loop runs in blocks and a bar follows them on stderr;
  the tokens are those of one call (the greedy fixture's 6)."""
  capsys.readouterr()
  blocked = _generate(run_dir, block_tokens=2)
  assert blocked["tokens"] == greedy["tokens"]
  err = capsys.readouterr().err
  assert "decode: 100%" in err and "6/6" in err, err


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "experiments.generate", *args],
                        capture_output=True, text=True, timeout=300,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cli_prints_the_continuation_and_its_speed(run_dir, greedy, tmp_path):
  p = _cli(f"--workdir={run_dir}", f"--prompt={PROMPT}", "--max_new_tokens=6")
  assert p.returncode == 0, p.stderr
  assert p.stdout.strip() == greedy["text"]
  assert "tokens/s" in p.stderr and "prefill 7 tokens" in p.stderr
  p = _cli(f"--workdir={tmp_path}", "--prompt=w1r")
  assert p.returncode == 2
  assert p.stderr.strip().splitlines()[-1].startswith(f"error: --workdir={tmp_path} holds no")
  assert "Traceback" not in p.stderr


def test_codecs_round_trip():
  text = codecs.for_task("text", 257)
  source = "def f(x):\n  return 'é'"
  ids = text.encode(source)
  assert ids[0] == text.eos_id == 256 and text.decode(ids[1:] + [256, 65]) == source
  flip = codecs.for_task("flipflop", 5)
  assert flip.encode("w1 r 1") == [0, 4, 1, 4] and flip.decode([2, 3]) == "i 0"
  ids = codecs.for_task("mqrar", 70)
  assert ids.encode("3, 5 69") == [3, 5, 69] and ids.decode([1, 2]) == "1 2"
  with pytest.raises(ValueError, match=r"outside \[0, 70\)"):
    ids.encode("70")
  assert codecs.run_task("/nonexistent", 257) == "text" and codecs.run_task("/nonexistent", 9) == ""


def test_a_run_records_its_task(run_dir):
  """config.json (written by experiments.train) names the task whatever the vocabulary."""
  assert codecs.run_task(run_dir, 0) == "flipflop"
