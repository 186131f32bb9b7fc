r"""Converts a trained softmax-attention run into another encoding by distillation (the PaTH
paper's RoPE -> PaTH conversion, §4.3).

  python -m experiments.convert --config=experiments/configs/convert.py:teacher=TEACHER_WD \
      --workdir=WD [--config.model.encoding=path_fox --config.convert.mse_steps=200 ...]

The config (configs/convert.py) is the teacher's recorded run config with model.encoding the
student's, plus config.convert. The student is the teacher's model with that encoding,
initialised from the teacher (experiments/convert_student.py says how near it starts), then:

  stage 1  convert.mse_steps steps of convert.mse_batch_size x convert.mse_seq_len tokens:
           only the attention layers train (AdamW at convert.mse_learning_rate, warmup + cosine
           as in training), each fed the teacher's input to that layer, on the mean over layers
           of the MSE between its output and the teacher layer's;
  stage 2  train.steps steps of train.batch_size x data.seq_len tokens: the whole student
           trains (train.* as for any run) on KL(teacher || student) of the next-token
           distributions.
The teacher is frozen throughout. Steps count on across the stages (stage 2's first step is
mse_steps + 1); the optimizer state starts afresh at stage 2.

WD gets what a training run leaves: checkpoints (the student, resumable; WD/run.lock while it
runs), metrics.jsonl (train records carry "stage" and "mse" / "kl"), config.json, and at the
end summary.json and report.md with an evaluation against the teacher on the run's eval sets:
the teacher's and the student's held-out loss and KL(teacher || student), each over the
tokens the task scores (loss_mask); the evaluation also runs at step 0 and after stage 1.
experiments.generate then samples from WD like from any run.

A config or teacher that cannot be converted (no such workdir, a teacher that is not a
softmax encoding, a student encoding that cannot start from it) prints one `error: ...` line
and exits with status 2, before anything compiles.
"""
from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags

from experiments import cli_config

SUMMARY = "summary.json"
FIGURE = "conversion.png"

# --- the teacher ------------------------------------------------------------------------


def _model_config(stored: dict):
  from experiments import run_model
  from posenc_jax import model as model_lib
  fields = dict(stored)
  fields["encoding_kwargs"] = tuple((k, run_model._frozen(v))   # pylint: disable=protected-access
                                    for k, v in fields["encoding_kwargs"])
  return model_lib.ModelConfig(**fields)


def teacher_config(teacher: str, step: int | None):
  """The teacher's ModelConfig at `step` (None: the newest intact checkpoint); ValueError
  naming convert.teacher / convert.teacher_step."""
  from experiments import checkpoint
  where = f"convert.teacher={teacher!r}"
  if not os.path.isdir(teacher):
    raise ValueError(f"{where} does not exist; give the workdir of a trained run")
  steps = checkpoint.all_steps(teacher)
  if not steps:
    raise ValueError(f"{where} holds no checkpoint; train the teacher first")
  if step is None:
    return _model_config(checkpoint.stored_model_config(teacher)), None
  if step not in steps:
    raise ValueError(f"convert.teacher_step={step} is not among the steps {where} holds "
                     f"({', '.join(map(str, steps))})")
  step_dir = os.path.join(os.path.abspath(teacher), "checkpoints", str(step))
  reason = checkpoint.damage(step_dir, items=("state", "config"))
  if reason:
    raise ValueError(f"convert.teacher_step={step} of {where} is damaged ({reason})")
  with open(os.path.join(step_dir, "config", "metadata")) as f:
    return _model_config(json.load(f)), step


def teacher_params(teacher: str, step: int | None, abstract_params):
  """(step, parameters) of the teacher's checkpoint (`step`, or the newest intact)."""
  import jax
  import orbax.checkpoint as ocp

  from experiments import checkpoint
  if step is None:
    return checkpoint.restore_params(teacher, abstract_params)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  item = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                                 abstract_params)}
  mngr = ocp.CheckpointManager(os.path.join(os.path.abspath(teacher), "checkpoints"),
                               options=ocp.CheckpointManagerOptions(create=False))
  try:
    return step, mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True)))["state"]["params"]
  finally:
    mngr.close()


# --- checks -------------------------------------------------------------------------------


def stage1_seq_len(config) -> int:
  return config.convert.mse_seq_len or config.data.seq_len


def check(config, *, workdir: str, data_module, num_devices: int):
  """(student ModelConfig, teacher ModelConfig): every check, one ValueError naming the field."""
  from experiments import config_checks
  if "convert" not in config or config.convert.get("teacher") is None:
    raise ValueError("config.convert.teacher is not set: start from experiments/configs/"
                     "convert.py:teacher=TEACHER_WORKDIR")
  mcfg = config_checks.check(config, workdir=workdir, data_module=data_module,
                             num_devices=num_devices)
  from experiments import convert_student
  cv = config.convert
  for field in ("teacher_step", "mse_steps", "mse_batch_size", "mse_seq_len",
                "mse_learning_rate", "mse_warmup_steps", "init_beta", "init_forget_time"):
    if field not in cv:
      raise ValueError(f"config.convert.{field} is missing; start from experiments/configs/"
                       f"convert.py")
  if cv.mse_steps and cv.mse_warmup_steps >= cv.mse_steps:
    raise ValueError(f"config.convert.mse_warmup_steps={cv.mse_warmup_steps} must be below "
                     f"config.convert.mse_steps={cv.mse_steps}")
  n = stage1_seq_len(config)
  longest = data_module.max_seq_len(config.data)
  if longest is not None and n > longest:
    raise ValueError(f"config.convert.mse_seq_len={n} exceeds {longest}, the longest sequence "
                     f"data.task={config.data.task!r} supports with this config")
  data_n, fsdp_n, context_n = config_checks.check_mesh(config, num_devices)
  if cv.mse_batch_size % (data_n * fsdp_n) or n % context_n:
    raise ValueError(f"config.convert.mse_batch_size={cv.mse_batch_size} and mse_seq_len={n} "
                     f"must be multiples of the mesh's batch ({data_n * fsdp_n}) and context "
                     f"({context_n}) splits")
  tcfg, _ = teacher_config(cv.teacher, cv.teacher_step)
  convert_student.check_pair(tcfg, mcfg, teacher=cv.teacher)
  return mcfg, tcfg


# --- the run ------------------------------------------------------------------------------


class _Streams:
  """The two stages' data iterators as the one item a checkpoint stores (both positions)."""

  def __init__(self, stage1, stage2):
    self.stage1, self.stage2 = stage1, stage2

  def get_state(self) -> bytes:   # grain's checkpoint handler stores bytes as they are
    return json.dumps({"stage1": self.stage1.get_state(),
                       "stage2": self.stage2.get_state()}).encode()

  def set_state(self, state) -> None:
    self.stage1.set_state(state["stage1"])
    self.stage2.set_state(state["stage2"])

  def start_prefetch(self) -> None:
    self.stage1.start_prefetch()
    self.stage2.start_prefetch()


def _stream(config, trainer, data_module, *, batch_size: int, seq_len: int, seed: int):
  from experiments import distributed
  data = config.data.copy_and_resolve_references()
  with data.unlocked():
    data.seq_len = seq_len
  first, end = distributed.process_rows(trainer.batch_sharding, (batch_size, seq_len))
  return data_module.make_train_iter(data, batch_size=end - first, seed=seed,
                                     process_index=first // (end - first),
                                     process_count=batch_size // (end - first))


def _stage1_train_config(config):
  import ml_collections
  t, cv = config.train, config.convert
  return ml_collections.ConfigDict(dict(   # mse_steps 0: never used, but its state's shape
      steps=max(cv.mse_steps, 1), learning_rate=cv.mse_learning_rate,
      warmup_steps=cv.mse_warmup_steps if cv.mse_steps else 0, grad_clip=t.grad_clip,
      weight_decay=t.weight_decay))


class _Steps:
  """The compiled stage-1, stage-2 and evaluation steps of one teacher / student pair."""

  def __init__(self, config, student, teacher):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from experiments import convert_student as cs
    from experiments import evaluate
    from experiments import sharding
    from experiments import train

    self.student, self.teacher = student, teacher
    tx1, schedule1 = train.make_optimizer(_stage1_train_config(config))
    tx2, schedule2 = student.tx, student.schedule
    first_stage2 = config.convert.mse_steps
    mask = cs.attention_mask(student._abstract["params"])   # pylint: disable=protected-access
    repl = sharding.replicated(student.mesh)
    state_sh, batch_sh = student.state_shardings, student.batch_sharding
    masked = lambda tree: jax.tree.map(lambda x, m: x * m, tree, mask)  # noqa: E731

    def keys(state):   # as the training step draws them; nnx.Rngs made inside the trace
      key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
      drop, enc = jax.random.split(key)
      return dict(dropout=drop, encoding=enc)

    def forward(model, batch, **kw):
      return model(batch["tokens"], positions_BT=batch["positions"],
                   segment_ids_BT=batch["segment_ids"], **kw)

    def update(state, grads, tx, *, frozen):
      updates, opt = tx.update(grads, state["opt"], state["params"])
      if frozen:   # weight decay would move the frozen parameters too
        updates = masked(updates)
      return {"params": optax.apply_updates(state["params"], updates), "opt": opt,
              "step": state["step"] + 1, "rng": state["rng"]}

    def stage1(state, tparams, batch):
      ins, outs, _ = cs.teacher_layers(teacher.model(tparams), batch)
      k = keys(state)

      def loss_fn(params):
        errs = cs.layer_mse(student.model(params), ins, outs, batch, rngs=nnx.Rngs(**k))
        return jnp.mean(errs), errs

      (loss, errs), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
      # The norms before attention are frozen too. The barrier keeps XLA from optimising the
      # masked gradients into the optimizer's update: with XLA:CPU's legacy fusion emitters
      # (the tests') that took about twice as long to compile.
      grads = jax.lax.optimization_barrier(masked(grads))
      metrics = {"loss": loss, "mse": loss, "grad_norm": optax.global_norm(grads),
                 "learning_rate": schedule1(state["step"]),
                 **{f"mse_layer{i}": e for i, e in enumerate(errs)}}
      return update(state, grads, tx1, frozen=True), metrics

    def stage2(state, tparams, batch):
      want = jax.lax.stop_gradient(forward(teacher.model(tparams), batch, train=False))
      k = keys(state)

      def loss_fn(params):
        logits = forward(student.model(params), batch, rngs=nnx.Rngs(**k), train=True)
        ce, aux = evaluate.loss_and_metrics(logits, batch)
        return cs.kl(want, logits, batch), {"ce": ce, **aux}

      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
      metrics = {"loss": loss, "kl": loss, **aux, "grad_norm": optax.global_norm(grads),
                 "learning_rate": schedule2(state["step"] - first_stage2)}
      return update(state, grads, tx2, frozen=False), metrics

    def eval_step(sparams, tparams, batch):
      t = forward(teacher.model(tparams), batch, train=False)
      s = forward(student.model(sparams), batch, train=False)
      kl, _ = cs.kl_sums(t, s, batch["loss_mask"].astype(jnp.float32))
      return {"student": evaluate.token_sums(s, batch), "teacher": evaluate.token_sums(t, batch),
              "kl": kl}

    tparams_sh = teacher.param_shardings
    step_kw = dict(donate_argnums=0, in_shardings=(state_sh, tparams_sh, batch_sh),
                   out_shardings=(state_sh, repl))
    self.stage1 = jax.jit(stage1, **step_kw)
    self.stage2 = jax.jit(stage2, **step_kw)
    self.eval_step = jax.jit(eval_step, in_shardings=(student.param_shardings, tparams_sh,
                                                      batch_sh), out_shardings=repl)
    self.fresh_opt = jax.jit(tx2.init, out_shardings=state_sh["opt"])


def _evaluate(steps, sparams, tparams, eval_sets, put) -> list[dict]:
  """One record per (set, length): the student's loss, perplexity, accuracy, error, and the
  teacher's loss / error and the KL, over the tokens the task scores."""
  import jax
  import jax.numpy as jnp

  from experiments import evaluate
  records = []
  for length, sets in sorted(eval_sets.items()):
    for name, batches in sets.items():
      total = None
      for batch in batches:
        sums = steps.eval_step(sparams, tparams, put(batch))
        total = sums if total is None else jax.tree.map(jnp.add, total, sums)
      total = jax.device_get(total)
      student, teacher = evaluate.summarise(total["student"]), evaluate.summarise(total["teacher"])
      records.append({"set": name, "length": int(length), **student,
                      "teacher_loss": teacher["loss"], "teacher_error": teacher["error"],
                      "kl": float(total["kl"]) / max(float(total["student"]["count"]), 1.0)})
  return records


def run(config, workdir: str, *, data_module=None, stop_after: int | None = None) -> dict:
  """Converts config.convert.teacher into config.model.encoding in workdir (resuming from its
  checkpoint); returns the summary. stop_after: stop (saving) once this many steps are done."""
  import jax

  from experiments import checkpoint
  from experiments import errors
  from experiments import run_config
  from experiments import workdir_lock
  if data_module is None:
    from experiments import data as data_module
  started = time.time()
  mcfg, tcfg = check(config, workdir=workdir, data_module=data_module,
                     num_devices=jax.device_count())
  total = config.convert.mse_steps + config.train.steps
  if checkpoint.latest_step(workdir) is not None:
    run_config.check_resume(workdir, config)
  done = _finished(workdir, total)
  if done is not None:
    return done
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise errors.RunError(f"--workdir={workdir} cannot be created ({e.strerror}); use a "
                          f"directory you can write") from None
  with workdir_lock.hold(workdir):
    return _convert(config, workdir, mcfg=mcfg, tcfg=tcfg, data_module=data_module,
                    stop_after=stop_after, started=started)


def _finished(workdir: str, total: int) -> dict | None:
  from experiments import checkpoint
  path = os.path.join(workdir, SUMMARY)
  if checkpoint.latest_step(workdir) != total or not os.path.exists(path):
    return None
  with open(path) as f:
    summary = json.load(f)
  return summary if summary.get("step") == total else None


def _convert(config, workdir, *, mcfg, tcfg, data_module, stop_after, started) -> dict:
  import jax
  import tqdm

  from experiments import checkpoint
  from experiments import config_checks
  from experiments import report
  from experiments import run_config
  from experiments import train

  cv, t = config.convert, config.train
  first_stage2, total = cv.mse_steps, cv.mse_steps + t.steps
  last = total if stop_after is None else min(total, stop_after)
  mesh, student, stream2 = train.setup(config, mcfg, data_module)
  teacher = train.Trainer(tcfg, t, mesh, rules=config.mesh.rules)
  stream1 = _stream(config, student, data_module, batch_size=cv.mse_batch_size,
                    seq_len=stage1_seq_len(config), seed=t.seed + 1)
  streams = _Streams(stream1, stream2)
  eval_sets = train._eval_sets(  # pylint: disable=protected-access
      config, data_module, student.batch_sharding)
  stored = config_checks.stored_form(mcfg)
  ckpt = checkpoint.Checkpointer(workdir, every=t.checkpoint_every)
  log = bar = None
  try:
    with jax.set_mesh(mesh), train._sigterm_flag() as sigterm:   # pylint: disable=protected-access
      t_step, host = teacher_params(cv.teacher, cv.teacher_step,
                                    teacher._abstract["params"])  # pylint: disable=protected-access
      tparams = jax.device_put(host, teacher.param_shardings)
      steps = _Steps(config, student, teacher)
      restored = ckpt.restore(student.abstract_state(), streams)
      log = report.MetricsLog(workdir)
      if restored is None:
        step, state = 0, _initial_state(config, mcfg, tcfg, host, student, steps)
      else:
        step, state = restored
      train._keep_records_through(  # pylint: disable=protected-access
          workdir, step, final=step >= total)
      run_config.record(workdir, config, step=step)
      evaluate_now = lambda: _evaluate(  # noqa: E731
          steps, state["params"], tparams, eval_sets, student.put)
      if step == 0 and eval_sets:
        log.eval(0, evaluate_now())
      bar = tqdm.tqdm(total=total, initial=step, unit="step", dynamic_ncols=True,
                      mininterval=0.5, desc=_stage_name(mcfg, step < first_stage2))
      pending, window_start = [], time.time()
      while step < last and not sigterm["set"]:
        in_stage1 = step < first_stage2
        if step == first_stage2:   # stage 2 starts: AdamW's moments of the MSE do not carry
          state["opt"] = steps.fresh_opt(state["params"])
          bar.set_description(_stage_name(mcfg, False))
        run_step = steps.stage1 if in_stage1 else steps.stage2
        batch = next(streams.stage1 if in_stage1 else streams.stage2)
        state, metrics = run_step(state, tparams, student.put(batch))
        step += 1
        pending.append(metrics)
        bar.update(1)
        ends_stage = step == first_stage2 or step == last
        if step % t.log_every == 0 or ends_stage:
          tokens = (cv.mse_batch_size * stage1_seq_len(config) if in_stage1
                    else t.batch_size * config.data.seq_len)
          _flush(log, pending, step, 1 if in_stage1 else 2, tokens, window_start, bar)
          pending, window_start = [], time.time()
        if ckpt.should_save(step) or ends_stage:
          ckpt.save(step, state, streams, stored)
        if step == first_stage2 and step < total and eval_sets:
          log.eval(step, evaluate_now())
      bar.close()
      if step < total:   # interrupted (SIGTERM or stop_after)
        if pending:
          _flush(log, pending, step, 1 if step <= first_stage2 else 2, 0, window_start, None)
        if step > 0:
          ckpt.save(step, state, streams, stored)
        return {"encoding": mcfg.encoding, "step": step, "interrupted": True}
      final_eval = evaluate_now() if eval_sets else []
      log.eval(step, final_eval)
  finally:
    if bar is not None:
      bar.close()
    ckpt.close()
    if log is not None:
      log.close()
  summary = _summary(config, workdir, mcfg, tcfg, t_step, final_eval, started)
  with open(os.path.join(workdir, SUMMARY), "w") as f:
    json.dump(summary, f, indent=1)
  write_report(workdir, summary)
  return summary


def _initial_state(config, mcfg, tcfg, teacher_host, student, steps) -> dict:
  """The train state at step 0: the student initialised from the teacher, fresh AdamW.

  Only the encoding's own parameters are drawn (per layer, from train.seed as the training
  loop's init_state splits it); every other one is the teacher's, so the model's whole init
  is not compiled for values that would be replaced."""
  import copy

  import jax
  import jax.numpy as jnp

  from experiments import convert_student
  init_key, train_key = jax.random.split(jax.random.key(config.train.seed))
  draw = jax.jit(lambda key: mcfg.encoding_fn().init(key, mcfg.dims))
  fresh = copy.deepcopy(student._abstract["params"])   # pylint: disable=protected-access
  for i, key in enumerate(jax.random.split(init_key, mcfg.num_layers)):
    fresh["blocks"][i]["attn"]["enc_params"] = jax.device_get(draw(key))
  # From host copies: the student's buffers are donated at every step, the teacher's not.
  params = jax.device_put(convert_student.student_params(
      tcfg, jax.device_get(teacher_host), mcfg, fresh, init_beta=config.convert.init_beta,
      init_forget_time=config.convert.init_forget_time), student.param_shardings)
  repl = student.state_shardings["step"]
  return {"params": params, "opt": steps.fresh_opt(params),
          "step": jax.device_put(jnp.zeros((), jnp.int32), repl),
          "rng": jax.device_put(jax.random.key_data(train_key), repl)}


def _stage_name(mcfg, stage1: bool) -> str:
  return f"{mcfg.encoding} {'stage 1 (mse)' if stage1 else 'stage 2 (kl)'}"


def _flush(log, pending, step, stage, tokens_per_step, window_start, bar) -> None:
  """Writes the last logged step's values (and the window's mean loss); a NaN / inf loss
  stops the run (train.TrainingDiverged)."""
  import math

  import jax
  import numpy as np

  from experiments import train
  host = jax.device_get(pending)
  losses = np.array([m["loss"] for m in host], np.float64)
  if not np.isfinite(losses).all():
    bad = step - len(host) + 1 + int(np.flatnonzero(~np.isfinite(losses))[0])
    raise train.TrainingDiverged(f"loss diverged at step {bad} (stage {stage}): "
                                 f"{losses[~np.isfinite(losses)][0]}")
  record = {k: float(v) for k, v in host[-1].items()}
  record.update(stage=stage, loss_window_mean=float(losses.mean()),
                tokens_per_s=tokens_per_step * len(host) / max(time.time() - window_start, 1e-9))
  log.train(step, record)
  if bar is not None and math.isfinite(losses[-1]):
    bar.set_postfix({"mse" if stage == 1 else "kl": f"{losses[-1]:.4g}"})


def _summary(config, workdir, mcfg, tcfg, t_step, final_eval, started) -> dict:
  import jax

  from experiments import report
  records = [r for r in report.read_metrics(workdir) if r["kind"] == "train"]
  cv, t = config.convert, config.train

  def stage(n, steps, batch, seq_len, lr, key):
    rs = [r for r in records if r.get("stage") == n]
    return {"steps": steps, "batch_size": batch, "seq_len": seq_len, "learning_rate": lr,
            "tokens": steps * batch * seq_len, "loss": key,
            "first": rs[0][key] if rs else None, "last": rs[-1][key] if rs else None}

  stages = [stage(1, cv.mse_steps, cv.mse_batch_size, stage1_seq_len(config),
                  cv.mse_learning_rate, "mse"),
            stage(2, t.steps, t.batch_size, config.data.seq_len, t.learning_rate, "kl")]
  return {"encoding": mcfg.encoding, "kv_shift": mcfg.kv_shift,
          "step": cv.mse_steps + t.steps, "final_loss": records[-1]["loss"] if records else None,
          "eval": final_eval, "wall_time_s": time.time() - started, "task": config.data.task,
          "seq_len": config.data.seq_len, "interrupted": False,
          "tokens_seen": sum(s["tokens"] for s in stages),
          "teacher": {"workdir": os.path.abspath(cv.teacher), "encoding": tcfg.encoding,
                      "step": t_step},
          "stages": stages,
          "device": f"{jax.devices()[0].device_kind} x{jax.device_count()}",
          "jax": jax.__version__, "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def write_report(workdir: str, summary: dict) -> str:
  """report.md: the run report (experiments.report) plus the teacher-vs-student table and
  the two stages' loss curves (conversion.png)."""
  from experiments import report
  text = report.write_run_report(workdir, summary)
  records = [r for r in report.read_metrics(workdir) if r["kind"] == "train"]
  _plot_stages(records, os.path.join(workdir, FIGURE), summary["encoding"])
  tch = summary["teacher"]
  rows = [[r["set"], r["length"], f"{r['teacher_loss']:.4f}", f"{r['loss']:.4f}",
           f"{r['kl']:.4g}"] for r in summary["eval"]]
  stages = [[f"{i + 1} ({s['loss']})", s["steps"], f"{s['tokens']:,}", s["learning_rate"],
             "-" if s["first"] is None else f"{s['first']:.4g}",
             "-" if s["last"] is None else f"{s['last']:.4g}"]
            for i, s in enumerate(summary["stages"])]
  text += "\n".join([
      "", f"## Converted from {tch['encoding']} ({tch['workdir']}, step {tch['step'] or 'newest'})",
      "", report.markdown_table(["stage", "steps", "tokens", "learning rate", "first logged",
                                 "last logged"], stages), "",
      report.markdown_table(["set", "length", "teacher loss", "student loss",
                             "KL(teacher‖student)"], rows) if rows else "(no evaluation)",
      "", f"![the two stages' losses]({FIGURE})", ""])
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(text)
  return text


def _plot_stages(records, path: str, title: str) -> None:
  import matplotlib.pyplot as plt

  from experiments import report
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
  for ax, stage, key in ((axes[0], 1, "mse"), (axes[1], 2, "kl")):
    rs = [r for r in records if r.get("stage") == stage]
    ax.plot([r["step"] for r in rs], [r[key] for r in rs], marker=".")
    ax.set(xlabel="step", ylabel=key, title=f"{title}: stage {stage} ({key})")
    if rs:
      report.log_or_symlog(ax, [r[key] for r in rs], what=key)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv) -> None:
  cli_config.start(argv)
  from experiments import compilation
  config, workdir = flags.FLAGS["config"].value, flags.FLAGS.workdir
  compilation.enable_cache(config.train.get("compile_cache_dir"))
  cli_config.finish_run(lambda: run(config, workdir), workdir, config_errors=(ValueError,))
  with open(os.path.join(workdir, "report.md")) as f:
    print(f.read())


if __name__ == "__main__":
  # Defined here, not on import: experiments.generate (which the tests import beside this
  # module) defines --workdir too.
  cli_config.define_config_flag()
  flags.DEFINE_string("workdir", None, "The student's workdir.")
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main, flags_parser=cli_config.parse_flags)
