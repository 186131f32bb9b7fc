"""Training: the sharded, jitted train step and the loop around it.

The train state is one pytree of arrays, so it is donated, sharded and checkpointed whole:

  params  the model's nnx.Param values as a nested dict (nnx.to_pure_dict)
  opt     optax AdamW state (warmup + cosine schedule, global-norm clipping)
  step    int32 number of completed steps
  rng     uint32 key data; step s draws its dropout / encoding keys from fold_in(rng, s),
          so a resumed run draws exactly the keys an uninterrupted one would

`Trainer` owns the compiled functions; `run` is the loop (data, logging, evaluation,
checkpoints, SIGTERM, divergence guard, report) inside the workdir's lock.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx
from flax import traverse_util

from experiments import checkpoint
from experiments import compilation
from experiments import config_checks
from experiments import distributed
from experiments import divergence
from experiments import errors
from experiments import evaluate
from experiments import report
from experiments import run_config
from experiments import sharding
from experiments import startup
from experiments import workdir_lock
from posenc_jax import model as model_lib

SUMMARY = "summary.json"
CONFIG = run_config.CONFIG  # the run's whole config, for readers such as experiments.generate
WALL = "wall_time.json"  # training seconds of a run's interrupted segments, summed on resume
BATCH_KEYS = ("tokens", "targets", "loss_mask", "segment_ids", "positions")


class TrainingDiverged(RuntimeError):
  """The loss diverged (experiments.divergence); the message names the step."""


def make_optimizer(t) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warmup and cosine decay to 10%; decay only on matrices."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, t.learning_rate, warmup_steps=t.warmup_steps, decay_steps=t.steps,
      end_value=0.1 * t.learning_rate)
  decay_mask = lambda params: traverse_util.path_aware_map(
      lambda path, _: path[-1] in ("kernel", "embedding"), params)
  parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
  parts.append(optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=t.weight_decay,
                           mask=decay_mask))
  return optax.chain(*parts), schedule


class Trainer:
  """Compiled init / train / eval functions for one model, optimizer and mesh."""

  def __init__(self, mcfg: model_lib.ModelConfig, train_cfg, mesh, *, rules=sharding.DEFAULT_RULES):
    self.mcfg, self.mesh, self.rules = mcfg, mesh, tuple(tuple(r) for r in rules)
    shard = functools.partial(sharding.shard, rules=self.rules)
    self._build = lambda key: model_lib.Transformer(mcfg, rngs=nnx.Rngs(params=key), shard=shard)
    abstract_model = nnx.eval_shape(lambda: self._build(jax.random.key(0)))
    self.graphdef, self.template, self.rest = nnx.split(abstract_model, nnx.Param, ...)
    abstract_params = nnx.to_pure_dict(self.template)
    logical = traverse_util.unflatten_dict(
        {tuple(p): v.get_metadata().get("out_sharding")
         for p, v in nnx.to_flat_state(self.template)})
    self.param_shardings = sharding.named_shardings(logical, abstract_params, mesh,
                                                    rules=self.rules)
    self.tx, self.schedule = make_optimizer(train_cfg)
    repl = sharding.replicated(mesh)
    # The state's shapes, kept for restores (tracing _init_state again would rebuild the model).
    self._abstract = {"params": abstract_params,
                      "opt": jax.eval_shape(self.tx.init, abstract_params),
                      "step": jax.ShapeDtypeStruct((), jnp.int32),
                      "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))}
    opt_shardings = optax.tree_map_params(
        self.tx, lambda _, s: s, self._abstract["opt"],
        self.param_shardings, transform_non_params=lambda _: repl)
    self.state_shardings = {"params": self.param_shardings, "opt": opt_shardings,
                            "step": repl, "rng": repl}
    self.batch_sharding = sharding.batch_sharding(mesh, rules=self.rules)
    self._init_jit = jax.jit(self._init_state, out_shardings=self.state_shardings)
    # init_state draws through JAX's threefry GPU kernel (_threefry_kernel) only when no
    # parameter is sharded: the kernel is one custom call that XLA cannot split over devices,
    # so each device would draw whole sharded parameters (and four hash inputs of their size).
    self.threefry_kernel = all(s.is_fully_replicated
                               for s in jax.tree.leaves(self.param_shardings))
    self.train_step = jax.jit(self._train_step, donate_argnums=0,
                              in_shardings=(self.state_shardings, self.batch_sharding),
                              out_shardings=(self.state_shardings, repl))
    self.eval_step = jax.jit(self._eval_step, in_shardings=(self.param_shardings,
                                                            self.batch_sharding),
                             out_shardings=repl)

  def init_state(self, seed: int) -> dict:
    """The train state of a fresh run, on the devices: parameters drawn from `seed`."""
    with _threefry_kernel() if self.threefry_kernel else contextlib.nullcontext():
      return self._init_jit(seed)

  def model(self, params) -> model_lib.Transformer:
    """The NNX model holding `params` (a pure dict); cheap, usable inside jit."""
    state = jax.tree.map(lambda x: x, self.template)  # fresh Variables to fill in
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(self.graphdef, state, self.rest)

  def _init_state(self, seed):
    init_key, train_key = jax.random.split(jax.random.key(seed))
    params = nnx.to_pure_dict(nnx.state(self._build(init_key), nnx.Param))
    return {"params": params, "opt": self.tx.init(params), "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(train_key)}

  def _logits(self, params, batch, *, rngs, train):
    return self.model(params)(batch["tokens"], positions_BT=batch["positions"],
                              segment_ids_BT=batch["segment_ids"], rngs=rngs, train=train)

  def _train_step(self, state, batch):
    key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
    drop_key, enc_key = jax.random.split(key)

    def loss_fn(params):
      rngs = nnx.Rngs(dropout=drop_key, encoding=enc_key)
      logits = self._logits(params, batch, rngs=rngs, train=True)
      return evaluate.loss_and_metrics(logits, batch)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt = self.tx.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": loss, **metrics, "grad_norm": optax.global_norm(grads),
               "learning_rate": self.schedule(state["step"])}
    return {"params": params, "opt": opt, "step": state["step"] + 1, "rng": state["rng"]}, metrics

  def _eval_step(self, params, batch):
    return evaluate.token_sums(self._logits(params, batch, rngs=None, train=False), batch)

  def put(self, batch: dict) -> dict:
    """Host numpy batch (this process's rows) -> global arrays sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(batch[k]))
            for k in BATCH_KEYS}

  def abstract_state(self):
    """The train state's shapes, dtypes and shardings (what a restore fills in)."""
    return checkpoint.abstract(self._abstract, self.state_shardings)


def _start_from(trainer: Trainer, state: dict, source: str) -> dict:
  """state with the parameters of `source`'s newest intact checkpoint (train.init_from; the
  optimizer's state stays the fresh one). config_checks.check_init_from vetted the model."""
  step, params = checkpoint.restore_params(source, trainer.abstract_state()["params"])
  print(f"parameters from {source} (step {step}); the optimizer starts afresh", file=sys.stderr)
  return {**state, "params": jax.device_put(params, trainer.param_shardings)}


@contextlib.contextmanager
def _threefry_kernel():
  """Lowers the PRNG's threefry hash to JAX's GPU kernel while inside (elsewhere: no effect).

  XLA inlines the hash into each initializer's fusion, and compiling those fusions made up
  most of a GPU run's start-up; the kernel computes the same hash of the same counters, so the
  parameters are the same bits. Only the init uses it: inside the train step the inlined hash
  fuses with dropout, where the kernel would write the random bits to memory first.
  """
  flag = "jax_threefry_gpu_kernel_lowering"
  before = getattr(jax.config, flag)
  jax.config.update(flag, True)
  try:
    yield
  finally:
    jax.config.update(flag, before)


@contextlib.contextmanager
def _compile_report(bar):
  """Around a segment's first step: writes the time it spent compiling on its own line above
  the progress bar (None: nothing)."""
  if bar is None:
    yield
    return
  with compilation.timed() as spent:
    yield
  bar.write(compilation.describe(spent), file=sys.stderr)


@contextlib.contextmanager
def _sigterm_flag():
  """Yields a dict whose "set" turns True on SIGTERM (so the loop can save and stop)."""
  flag = {"set": False}
  try:
    previous = signal.signal(signal.SIGTERM, lambda *_: flag.update(set=True))
  except ValueError:  # not the main thread: no handler, never set
    previous = None
  try:
    yield flag
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)


def _eval_sets(config, data_module, batch_sharding) -> dict:
  e = config.eval
  sets = {}
  for n in (config_checks.eval_lengths(config) if e.num_batches else ()):
    whole = e.batch_size or config.train.batch_size
    first, end = distributed.process_rows(batch_sharding, (whole, n))
    sets[n] = data_module.make_eval_sets(
        config.data, seq_len=n, batch_size=end - first, num_batches=e.num_batches, seed=e.seed,
        process_index=first // (end - first), process_count=whole // (end - first))
  return sets


def setup(config, mcfg, data_module, *, timeline: startup.Timeline | None = None):
  """-> (mesh, Trainer, this process's training stream) for a checked config (`mcfg`)."""
  t = config.train
  timeline = timeline or startup.Timeline()
  data_n, fsdp_n, context_n = config_checks.check_mesh(config, jax.device_count())
  mesh = sharding.make_mesh(data=data_n, fsdp=fsdp_n, context=context_n)
  trainer = Trainer(mcfg, t, mesh, rules=config.mesh.rules)
  timeline.mark("model")
  # This process reads the rows its devices hold (all of them in a run of one process).
  first, end = distributed.process_rows(trainer.batch_sharding,
                                        (t.batch_size, config.data.seq_len))
  train_iter = data_module.make_train_iter(config.data, batch_size=end - first, seed=t.seed,
                                           process_index=first // (end - first),
                                           process_count=t.batch_size // (end - first))
  timeline.mark("data")
  return mesh, trainer, train_iter


def run(config, workdir: str, *, data_module=None, mcfg=None, stop_after: int | None = None,
        timeline: startup.Timeline | None = None) -> dict:
  """Trains config's model in workdir (resuming if it holds a checkpoint); returns a summary.

  A workdir whose run already reached config.train.steps is not trained again: its summary
  is returned (with a note on stderr when it went past them). Problems the user can fix (a
  workdir in use by another run, not writable, trained under another config, holding no
  intact checkpoint) raise errors.RunError before the first step; a failed checkpoint write
  raises it when found. A diverging loss raises TrainingDiverged, keeping the checkpoints
  from before it.
  stop_after: stop (saving a checkpoint) once this many steps are done, as if interrupted.
  timeline: the command's start-up marks so far (None: timed from this call); the summary
    keeps them as `startup_s`.
  """
  if data_module is None:
    from experiments import data as data_module
  started = time.time()
  timeline = timeline or startup.Timeline(origin=started)
  if mcfg is None:
    mcfg = config_checks.check(config, workdir=workdir, data_module=data_module,
                               num_devices=jax.device_count())
  divergence.check_config(config.train)
  if checkpoint.latest_step(workdir) is not None:
    run_config.check_resume(workdir, config)
  finished = _finished_summary(workdir, config.train.steps)
  if finished is not None:
    return finished
  primary = jax.process_index() == 0
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise errors.RunError(f"--workdir={workdir} cannot be created ({e.strerror}); "
                          f"use a directory you can write") from None
  with workdir_lock.hold(workdir, enabled=primary):
    try:
      return _train(config, workdir, data_module=data_module, mcfg=mcfg, stop_after=stop_after,
                    started=started, primary=primary, timeline=timeline)
    except OSError as e:  # the workdir's own files (records, config, reports)
      inside = e.filename and os.path.abspath(e.filename).startswith(os.path.abspath(workdir))
      if e.errno not in _WRITE_ERRNOS or not inside:
        raise
      raise errors.RunError(f"writing {e.filename} failed ({e.strerror}); fix the cause and "
                            f"run the same command to resume") from None


# What a full disk, a quota or a read-only / unwritable workdir raise on write.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def _train(config, workdir: str, *, data_module, mcfg, stop_after, started: float,
           primary: bool, timeline: startup.Timeline) -> dict:
  t = config.train
  ckpt = checkpoint.Checkpointer(workdir, every=t.checkpoint_every, primary=primary)
  timeline.mark("checkpoint")
  log = bar = None
  try:
    mesh, trainer, train_iter = setup(config, mcfg, data_module, timeline=timeline)
    eval_sets = _eval_sets(config, data_module, trainer.batch_sharding)
    timeline.mark("eval_sets")
    evaluate_now = lambda params: evaluate.evaluate_all(trainer.eval_step, params, eval_sets,
                                                        trainer.put)
    stored = config_checks.stored_form(mcfg)
    with jax.set_mesh(mesh), _sigterm_flag() as sigterm:
      restored = ckpt.restore(trainer.abstract_state(), train_iter)
      step, state = restored if restored is not None else (0, trainer.init_state(t.seed))
      if restored is None and t.get("init_from"):
        state = _start_from(trainer, state, t.init_from)
      jax.block_until_ready(state)
      timeline.mark("state")
      # Records past the restored step were written by a segment that did not count; every
      # process reads the same records (its divergence guard decides as process 0's does),
      # process 0 rewrites the file.
      kept = _keep_records_through(workdir, step, final=step >= t.steps, write=primary)
      if primary:
        run_config.record(workdir, config, step=step)
        _reopen_finished_run(workdir)
      log = report.MetricsLog(workdir, enabled=primary)
      guard = divergence.Guard(
          vocab_size=mcfg.vocab_size, factor=t.divergence_factor, margin=t.divergence_margin,
          patience=t.divergence_patience,
          recent=[r["loss"] for r in kept if r["kind"] == "train"][-divergence.LEVEL_WINDOW:])
      tokens_per_step = t.batch_size * config.data.seq_len
      last = min(t.steps, stop_after) if stop_after is not None else t.steps
      bar = tqdm.tqdm(total=t.steps, initial=step, desc=mcfg.encoding, unit="step",
                      dynamic_ncols=True, mininterval=0.5)
      losses = _Losses(guard, first_step=step + 1)
      pending, window_start = [], time.time()
      first_step = step
      while step < last and not sigterm["set"]:
        with _compile_report(bar if primary and step == first_step else None):
          state, metrics = trainer.train_step(state, trainer.put(next(train_iter)))
        if step == first_step:
          timeline.mark("compile")  # jit compiles before it dispatches the step
          jax.block_until_ready(metrics["loss"])
          timeline.mark("first_step")
          if primary:
            bar.write(timeline.line(), file=sys.stderr)
        step += 1
        pending.append(metrics)
        losses.add(metrics["loss"])
        bar.update(1)
        if step % t.log_every == 0 or step == last:
          _flush_or_stop(losses, log, pending, step, tokens_per_step, window_start, bar)
          pending, window_start = [], time.time()
        if config.eval.every and step % config.eval.every == 0 and step < t.steps and eval_sets:
          log.eval(step, evaluate_now(state["params"]))
        if ckpt.should_save(step) or step == last:
          _save_unless_diverging(ckpt, losses, step, state, train_iter, stored)
      bar.close()
      timeline.mark("trained")
      if step < t.steps:  # interrupted (SIGTERM, whenever it came, or stop_after)
        _flush_or_stop(losses, log, pending, step, tokens_per_step, window_start, None)
        if step > 0:
          _save_unless_diverging(ckpt, losses, step, state, train_iter, stored)  # if not yet
        ckpt.wait()
        if primary:
          _write_prior_wall(workdir, _prior_wall(workdir) + time.time() - started)
        return {"encoding": mcfg.encoding, "step": step, "interrupted": True}
      final_eval = evaluate_now(state["params"]) if eval_sets else []
      log.eval(step, final_eval)
  except TrainingDiverged as e:
    if bar is not None:
      bar.close()
    ckpt.close()
    good = checkpoint.latest_step(workdir)
    raise TrainingDiverged(
        f"{e}; "
        f"{'no checkpoint kept' if good is None else f'checkpoint step {good} is from before it'}; "
        f"lower config.train.learning_rate and rerun with "
        f"--config.train.allow_config_change=True (or in a new --workdir)") from None
  finally:
    if bar is not None:
      bar.close()  # so that an error line starts on a line of its own
    ckpt.close()  # waits for the asynchronous save; RunError if it failed
    timeline.mark("saved")
    if log is not None:
      log.close()
  summary = {"encoding": mcfg.encoding, "kv_shift": mcfg.kv_shift, "step": step,
             "final_loss": log.last_loss(), "eval": final_eval,
             # Over every segment, where the run resumed after interruptions.
             "wall_time_s": _prior_wall(workdir) + time.time() - started,
             "task": config.data.task,
             "seq_len": config.data.seq_len, "interrupted": False,
             # Where and when it trained, for results gathered over several machines/calls.
             "tokens_seen": int(step) * int(config.train.batch_size) * int(config.data.seq_len),
             "device": f"{jax.devices()[0].device_kind} x{jax.device_count()}",
             # Seconds from the command's start to the end of each start-up stage.
             "startup_s": dict(timeline.marks),
             "jax": jax.__version__, "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
  if primary:
    with open(os.path.join(workdir, SUMMARY), "w") as f:
      json.dump(summary, f, indent=1)
    report.write_run_report(workdir, summary)
  return summary


def _flush_or_stop(losses, log, pending, step, tokens_per_step, window_start, bar) -> None:
  """Records the steps in `pending` (if any); TrainingDiverged if their losses diverged."""
  diverged = losses.check()
  if pending:
    _flush(log, pending, step, tokens_per_step, window_start, bar)
  if diverged:
    raise TrainingDiverged(diverged)


def _save_unless_diverging(ckpt, losses, step, state, train_iter, stored) -> None:
  """Saves `step`, except in a run of high losses: the last checkpoint stays a good one."""
  diverged = losses.check()
  if diverged:
    raise TrainingDiverged(diverged)
  if not losses.in_streak:
    ckpt.save(step, state, train_iter, stored)


class _Losses:
  """Each step's loss, read back from the device only when checked (at log and save steps,
  so the loop never waits on the device in between) and fed to the divergence guard."""

  def __init__(self, guard: divergence.Guard, *, first_step: int):
    self._guard, self._next_step, self._unchecked = guard, first_step, []

  def add(self, loss) -> None:
    self._unchecked.append(loss)

  @property
  def in_streak(self) -> bool:
    return self._guard.in_streak

  def check(self) -> str | None:
    """Feeds the unchecked losses to the guard; why the run diverged, or None."""
    values, self._unchecked = jax.device_get(self._unchecked), []
    for loss in values:
      why = self._guard.update(self._next_step, float(loss))
      self._next_step += 1
      if why is not None:
        return why
    return None


def _reopen_finished_run(workdir: str) -> None:
  """A finished run trained on (more steps): its summary goes, its wall time becomes the
  earlier segments' time, so the new summary's wall time spans the whole run."""
  path = os.path.join(workdir, SUMMARY)
  if os.path.exists(path):
    with open(path) as f:
      _write_prior_wall(workdir, float(json.load(f)["wall_time_s"]))
    os.remove(path)


def _prior_wall(workdir: str) -> float:
  """Seconds the run's earlier, interrupted segments took (0 for a fresh run)."""
  path = os.path.join(workdir, WALL)
  if not os.path.exists(path):
    return 0.0
  with open(path) as f:
    return float(json.load(f)["seconds"])


def _write_prior_wall(workdir: str, seconds: float) -> None:
  with open(os.path.join(workdir, WALL), "w") as f:
    json.dump({"seconds": seconds}, f)


def _finished_summary(workdir: str, steps: int) -> dict | None:
  """The summary of a run in `workdir` that already trained `steps` steps (or more), or None.

  A run past `steps` keeps its summary untouched, with a note on stderr; one past `steps`
  without a summary (stopped later than `steps`) is a RunError.
  """
  done = checkpoint.latest_step(workdir)
  if done is None or done < steps:
    return None
  path = os.path.join(workdir, SUMMARY)
  summary = None
  if os.path.exists(path):
    with open(path) as f:
      summary = json.load(f)
  if summary is None or summary.get("step") != done:
    if done == steps:
      return None  # its final evaluation and summary did not happen: the rerun does them
    raise errors.RunError(f"--workdir={workdir} is already at step {done}, past "
                          f"config.train.steps={steps}; rerun with config.train.steps >= "
                          f"{done} to continue training")
  if done > steps:
    print(f"{workdir}: already at step {done} >= config.train.steps={steps}; rerunning with "
          f"more steps continues training", file=sys.stderr, flush=True)
  return summary


def _keep_records_through(workdir: str, step: int, *, final: bool,
                          write: bool = True) -> list[dict]:
  """Rewrites metrics.jsonl without the records past `step` (and, when `step` ends the run,
  without its final evaluation, which the run redoes); returns the records kept.

  Written to a temporary file and renamed, so a kill here leaves the old or the new file;
  a line cut short by an earlier kill is dropped.
  """
  path = os.path.join(workdir, report.METRICS)
  if not os.path.exists(path):
    return []
  kept = []
  with open(path) as f:
    for line in f:
      try:
        r = json.loads(line)
      except ValueError:
        continue
      if r["step"] < step or (r["step"] == step and not (final and r["kind"] == "eval")):
        kept.append(r)
  if not write:
    return kept
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in kept)
  os.replace(tmp, path)
  return kept


def _flush(log, pending: list, step: int, tokens_per_step: int, window_start: float,
           bar) -> float:
  """Writes the metrics of the steps in `pending` (ending at `step`)."""
  host = jax.device_get(pending)  # waits for the steps: only now is the window's time known
  tok_s = tokens_per_step * len(host) / max(time.time() - window_start, 1e-9)
  losses = np.array([m["loss"] for m in host], np.float64)
  # One record per logged step: that step's own values (exact, comparable across runs)
  # plus the window's mean loss.
  record = {k: float(v) for k, v in host[-1].items()}
  record["loss_window_mean"] = float(losses.mean())
  record["tokens_per_s"] = tok_s
  log.train(step, record)
  if bar is not None:
    bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tok_s:,.0f}")
  return float(losses[-1])
