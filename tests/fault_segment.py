"""Training segments for tests/test_fault_injection.py, forked from one warm process.

`python -m tests.fault_segment` imports the training code once (no JAX backend yet, so no
threads: forking is safe), then reads one JSON job per line on stdin, forks a child that
runs it, and answers with the child's exit code (-9: killed by SIGKILL) and CPU seconds on
stdout. Each
child starts JAX afresh and is a real process: a SIGKILL loses everything it held.

A job trains a tiny byte-level text model (train.run) in `workdir` and, with "kill":
[step, signal, where], sends itself that signal at that step: "step" right after the step's
metrics record is written, "save" right after the step's checkpoint write was started (the
state is still being written in the background). A run stopped by SIGTERM exits 143.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback

import jax

from experiments import checkpoint
from experiments import report
from experiments import train
from experiments.configs import base

STEPS, CHECKPOINT_EVERY = 30, 5
SHUFFLE_WINDOW = 16  # rows: the first window is steps 1-8 at batch 2, with a checkpoint at 5


def config(corpus: str):
  c = base.get_config()
  c.data.update(task="text", text_dir=corpus, seq_len=16, valid_fraction=0.2,
                shuffle_window=SHUFFLE_WINDOW)
  c.model.update(encoding="rope", num_layers=1, d_model=16, num_heads=2, num_kv_heads=0,
                 head_dim=8)
  c.train.update(steps=STEPS, batch_size=2, warmup_steps=2, checkpoint_every=CHECKPOINT_EVERY,
                 log_every=1)
  c.eval.update(num_batches=0)
  return c


def _kill_at(kill) -> None:
  """Patches the run to send itself kill[1] at step kill[0], where kill[2] says."""
  step, signame, where = kill
  sig = getattr(signal, signame)
  if where == "step":
    original = report.MetricsLog.train

    def record_then_kill(self, s, metrics):
      original(self, s, metrics)
      if s == step:
        os.kill(os.getpid(), sig)

    report.MetricsLog.train = record_then_kill
  elif where == "save":
    original = checkpoint.Checkpointer.save

    def save_then_kill(self, s, *args):
      original(self, s, *args)
      if s == step:
        os.kill(os.getpid(), sig)

    checkpoint.Checkpointer.save = save_then_kill
  else:
    raise ValueError(f"kill where={where!r}: expected 'step' or 'save'")


def segment(job: dict) -> int:
  jax.config.update("jax_compilation_cache_dir", job["cache"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  if job.get("kill"):
    _kill_at(job["kill"])
  summary = train.run(config(job["corpus"]), job["workdir"])
  return 143 if summary["interrupted"] else 0


def serve() -> None:
  for line in sys.stdin:
    job = json.loads(line)
    assert threading.active_count() == 1, "a thread would not survive fork"
    pid = os.fork()
    if pid == 0:
      code = 1
      try:
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)  # stdout answers the parent: the child writes to its log only
        os.dup2(log, 2)
        code = segment(job)
      except BaseException:  # pylint: disable=broad-except  # reported in the child's log
        traceback.print_exc()
      finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status),
                      "cpu_s": usage.ru_utime + usage.ru_stime}), flush=True)


if __name__ == "__main__":
  serve()
