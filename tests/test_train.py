"""Training: a 2-step smoke test per encoding, exact resume, NaN stop, and the workdir's files."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest

from experiments import checkpoint
from experiments import evaluate
from experiments import report
from experiments import sharding
from experiments import train
from experiments.configs import base
from posenc_jax import encodings
from posenc_jax import model as model_lib

V, B, T = 13, 2, 12  # T not a multiple of any block size


def _train_cfg(**kw):
  c = base.get_config().train
  c.update(steps=10, warmup_steps=0, learning_rate=3e-3, weight_decay=0.0, grad_clip=1.0)
  c.update(**kw)
  return c


def _batch(key):
  """A random packed batch: two documents per row, positions restarting in each."""
  tok = np.asarray(jax.random.randint(key, (B, T + 1), 0, V), np.int32)
  seg = np.where(np.arange(T) < 7, 1, 2).astype(np.int32)[None].repeat(B, 0)
  pos = np.where(seg == 1, np.arange(T), np.arange(T) - 7).astype(np.int32)
  return {"tokens": tok[:, :-1], "targets": tok[:, 1:], "loss_mask": np.ones((B, T), np.float32),
          "segment_ids": seg, "positions": pos}


def _trainer(encoding, **model_kw):
  mcfg = model_lib.ModelConfig(vocab_size=V, encoding=encoding, num_layers=1, d_model=16,
                               num_heads=2, num_kv_heads=1, head_dim=8, **model_kw)
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  return train.Trainer(mcfg, _train_cfg(), mesh)


STANDALONE = [n for n in encodings.NAMES if n not in encodings.MODIFIERS]
# CI trains one encoding per attention family and per kind of trained encoding state (the
# tests/test_generation.py set: rope_llama3, grape_m_ctx, acc_rot_learned, acc_rot_random_v,
# fox, grape_a_qk, grape_ap, path, path_fox, tapa) plus grape_m_rank2, whose hand-written
# reversible backward only a training step runs. Each case compiles a whole train step; the
# others share a family and a kind of state with one of these and run under -m slow.
SLOW_SMOKE = {"nope", "rope", "rope_pi", "rope_ntk", "rope_yarn", "grape_m", "grape_m_noncommuting",
              "acc_rot_random", "rope_v", "acc_rot_learned_v", "alibi", "grape_a_q", "grape_a_k",
              "tapa_linear"}
SMOKE_CASES = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SMOKE else n
               for n in STANDALONE]


def _two_steps(trainer, key):
  """Two train steps on one batch: (losses, grads of the initial params)."""
  batch = _batch(key)
  state = trainer.init_state(0)
  params0 = jax.tree.map(np.asarray, state["params"])
  losses = []
  with jax.set_mesh(trainer.mesh):
    for _ in range(2):
      state, m = trainer.train_step(state, trainer.put(batch))
      losses.append(float(m["loss"]))
  return losses, params0, jax.tree.map(np.asarray, state["params"])


@pytest.mark.parametrize("encoding", SMOKE_CASES)
def test_two_step_smoke(encoding, key):
  trainer = _trainer(encoding)
  losses, p0, p1 = _two_steps(trainer, key)
  assert np.all(np.isfinite(losses)), losses
  # Adam's first steps on a repeated batch must lower its loss, whatever the encoding.
  assert losses[1] < losses[0], losses
  # Every parameter, the encoding's own included, got a finite gradient and moved.
  flat0 = dict(jax.tree_util.tree_leaves_with_path(p0))
  for path, after in jax.tree_util.tree_leaves_with_path(p1):
    assert np.all(np.isfinite(after)), path
    assert not np.array_equal(after, flat0[path]), f"{jax.tree_util.keystr(path)} did not train"


def test_kv_shift_trains_its_gate(key):
  trainer = _trainer("rope", kv_shift=True)
  losses, p0, p1 = _two_steps(trainer, key)
  shift0 = p0["blocks"][0]["attn"]["kv_shift_params"]
  shift1 = p1["blocks"][0]["attn"]["kv_shift_params"]
  assert jax.tree.leaves(shift0), "kv_shift added no parameters"
  assert losses[1] < losses[0], losses
  for a, b in zip(jax.tree.leaves(shift0), jax.tree.leaves(shift1)):
    assert not np.array_equal(a, b)


def _config(steps=8, lengths=(24,), **model_kw):
  c = base.get_config()
  c.data.task, c.data.seq_len = "flipflop", 24
  c.model.update(encoding="rope", num_layers=1, d_model=16, num_heads=2, head_dim=8,
                 block="acc_rot", dropout=0.1, **model_kw)
  c.train.update(steps=steps, batch_size=4, warmup_steps=2, checkpoint_every=2, log_every=1)
  c.eval.update(num_batches=1, lengths=lengths)
  return c


def _train_losses(workdir):
  return [r["loss"] for r in report.read_metrics(workdir) if r["kind"] == "train"]


def test_resume_reproduces_losses(tmp_path):
  """8 steps straight == 4 steps, stop, resume to 8 (model, optimizer, data, dropout RNG)."""
  straight = train.run(_config(), str(tmp_path / "a"))
  first = train.run(_config(), str(tmp_path / "b"), stop_after=3)  # not on a save step
  assert first["interrupted"] and first["step"] == 3
  first_wall = train._prior_wall(str(tmp_path / "b"))
  assert first_wall > 0
  resume_start = time.time()
  resumed = train.run(_config(), str(tmp_path / "b"))
  # The summary's wall time spans both segments, not only the resumed one.
  assert first_wall < resumed["wall_time_s"] <= first_wall + time.time() - resume_start
  a, b = _train_losses(tmp_path / "a"), _train_losses(tmp_path / "b")
  assert len(a) == len(b) == 8
  np.testing.assert_array_equal(b, a)
  assert [r["loss"] for r in resumed["eval"]] == [r["loss"] for r in straight["eval"]]


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers can only be installed in the main thread")
def test_sigterm_saves_then_resume_finishes(tmp_path, monkeypatch):
  put = train.Trainer.put
  calls = []

  def put_then_sigterm(self, batch):  # SIGTERM arrives while step 3 runs
    calls.append(1)
    if len(calls) == 3:
      os.kill(os.getpid(), signal.SIGTERM)
    return put(self, batch)

  monkeypatch.setattr(train.Trainer, "put", put_then_sigterm)
  handler = signal.getsignal(signal.SIGTERM)
  stopped = train.run(_config(), str(tmp_path))
  monkeypatch.undo()
  assert stopped["interrupted"] and stopped["step"] == 3
  assert checkpoint.latest_step(str(tmp_path)) == 3  # not a periodic step (every 2)
  assert signal.getsignal(signal.SIGTERM) is handler  # the run restored the caller's handler
  finished = train.run(_config(), str(tmp_path))
  assert not finished["interrupted"] and finished["step"] == 8
  assert [r["step"] for r in report.read_metrics(str(tmp_path)) if r["kind"] == "train"] == list(
      range(1, 9))


def test_workdir_outputs(tmp_path):
  summary = train.run(_config(steps=3, lengths=(24, 40)), str(tmp_path))
  records = report.read_metrics(str(tmp_path))
  assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
  evals = [r for r in records if r["kind"] == "eval"]
  assert {(r["set"], r["length"]) for r in evals} == {
      (s, n) for s in ("id", "sparse", "dense") for n in (24, 40)}
  for r in evals:  # error is 1 - accuracy over the read positions, perplexity = exp(loss)
    assert r["tokens"] > 0 and r["error"] == pytest.approx(1 - r["accuracy"])
    assert r["perplexity"] == pytest.approx(np.exp(r["loss"]))
  text = (tmp_path / "report.md").read_text()
  assert "| sparse | 40" in text and "eval_vs_length.png" in text
  for name in ("loss.png", "eval_vs_length.png"):
    assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
  assert os.listdir(tmp_path / "tensorboard")
  assert json.loads((tmp_path / "summary.json").read_text())["final_loss"] == summary["final_loss"]
  # train.run times its own start-up stages, in order, from its start.
  marks = summary["startup_s"]
  assert list(marks) == ["checkpoint", "model", "data", "eval_sets", "state", "compile",
                         "first_step", "trained", "saved"]
  assert 0 <= marks["checkpoint"] and list(marks.values()) == sorted(marks.values())
  # Running a finished workdir again re-reports it without training or logging twice.
  assert train.run(_config(steps=3, lengths=(24, 40)), str(tmp_path)) == json.loads(
      (tmp_path / "summary.json").read_text())
  assert report.read_metrics(str(tmp_path)) == records


def test_nonfinite_loss_names_the_step(tmp_path):
  c = _config(steps=6)
  c.train.update(learning_rate=1e30, grad_clip=0.0, warmup_steps=0)
  with pytest.raises(train.TrainingDiverged, match=r"at step [2-6]\b"):
    train.run(c, str(tmp_path))


def test_first_nonfinite():
  assert evaluate.first_nonfinite(np.array([1.0, 2.0, np.inf, np.nan])) == 2
  assert evaluate.first_nonfinite(np.array([1.0, 2.0])) is None


def test_init_from_starts_a_run_from_another_runs_parameters(tmp_path):
  """train.init_from: a flip-flop run in byte tokens (the text task's vocabulary) starts from a
  finished run's parameters, the optimizer afresh: at a negligible learning rate it ends where
  that run ended, and far from its own seed's draw."""
  from experiments import config_checks
  from experiments import data
  from experiments.probes import load

  def config(**train_kw):
    c = _config(steps=3, lengths=())
    c.data.byte_tokens = True
    c.train.update(**train_kw)
    return c

  train.run(config(), str(tmp_path / "source"))
  started = config(steps=1, warmup_steps=0, learning_rate=1e-9, seed=7,
                   init_from=str(tmp_path / "source"))
  train.run(started, str(tmp_path / "fine_tuned"))
  drawn = config(steps=1, warmup_steps=0, learning_rate=1e-9, seed=7)
  train.run(drawn, str(tmp_path / "drawn"))
  _, source = load.restore(config(), str(tmp_path / "source"))
  _, tuned = load.restore(started, str(tmp_path / "fine_tuned"))
  _, fresh = load.restore(drawn, str(tmp_path / "drawn"))
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
  assert flat(source).size == flat(tuned).size > 1000
  np.testing.assert_allclose(flat(tuned), flat(source), atol=1e-6)
  assert np.max(np.abs(flat(fresh) - flat(source))) > 1e-2

  # What cannot start this run is refused before anything is built, naming the field.
  def check(c):
    return config_checks.check(c, workdir=str(tmp_path / "new"), data_module=data,
                               num_devices=1)
  with pytest.raises(ValueError, match=r"^train.init_from='.*nowhere' holds no checkpoint"):
    check(config(init_from=str(tmp_path / "nowhere")))
  wider = config(init_from=str(tmp_path / "source"))
  wider.model.d_model = 32
  with pytest.raises(ValueError, match=r"holds a different model \(model.d_model=16 in the "
                                       r"checkpoint, 32 in this config\)"):
    check(wider)
  other_vocab = config(init_from=str(tmp_path / "source"))
  other_vocab.data.byte_tokens = False
  with pytest.raises(ValueError, match=r"model.vocab_size=257 in the checkpoint, 5"):
    check(other_vocab)
