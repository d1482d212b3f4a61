"""train_and_evaluate: strategy, data, model, checkpoint and loop, wired together."""

from __future__ import annotations

import datetime
import functools
import os
import time

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mwloop import checkpoint, distribute, export, inputs, loop, optim, preemption, sidecar, state, steps, workdir_lock
from mwloop import task as task_lib
from mwloop.errors import UserError
from mwloop.writers import MetricWriter, format_metrics

MODES = ("train", "eval", "train_and_eval", "continuous_eval", "export")
# Errors that mean "the input is wrong": main turns them into one line and exit 2 (errors.USER_ERROR).
USER_ERRORS = (UserError, FloatingPointError)  # FloatingPointError: a non-finite loss, named with its step


def _check(config: ml_collections.ConfigDict, mode: str, num_replicas: int, task: task_lib.Task) -> None:
    """One-line errors for settings that cannot work, before anything is written."""
    if mode not in MODES:
        raise UserError(f"--mode={mode!r} is unknown; use one of {', '.join(MODES)}")
    if config.train.steps < 1:
        raise UserError(f"config.train.steps={config.train.steps}; train for at least 1 step")
    if config.train.steps_per_loop < 1:
        raise UserError(f"config.train.steps_per_loop={config.train.steps_per_loop}; use 1 or more steps per "
                         f"loop call")
    for key in ("log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
        if config.train[key] < 0:
            raise UserError(f"config.train.{key}={config.train[key]}; use 0 (never) or a number of steps")
    for name in ("train", "eval"):
        batch = config[name].global_batch_size
        if batch <= 0 or batch % num_replicas:
            raise UserError(
                f"config.{name}.global_batch_size={batch} does not divide among {num_replicas} replicas; "
                f"set it to a positive multiple of {num_replicas}")
    loop.check_accumulation(config.optimizer.gradient_accumulation_steps, config.train.global_batch_size,
                            num_replicas, task)
    if config.on_nonfinite not in ("fail", "skip"):
        raise UserError(f"config.on_nonfinite={config.on_nonfinite!r}; use 'fail' or 'skip'")
    if config.train.feed not in ("resident", "iterator"):
        raise UserError(f"config.train.feed={config.train.feed!r}; use 'resident' or 'iterator'")
    loop.check_skip_nonfinite(task, config.on_nonfinite == "skip")


def _log_train(total_steps: int, writer: MetricWriter, learning_rate):
    def log(step: int, metrics: dict[str, float]) -> None:
        if not writer.enabled:  # not the chief: progress only; the chief logs and writes the metrics
            logging.info("step %d/%d", step, total_steps)
            return
        metrics = dict(metrics, learning_rate=learning_rate())
        eta = datetime.timedelta(seconds=round(metrics.pop("eta_s")))
        logging.info("step %d/%d %s %.0f examples/s lr %.4g ETA %s", step, total_steps,
                     format_metrics(metrics, skip=("examples", "examples_per_sec", "learning_rate")),
                     metrics["examples_per_sec"], metrics["learning_rate"], eta)
        writer.write(step, "train", metrics)
    return log


class Profiler:
    """A TensorBoard profile of steps [first, last], at loop-call granularity."""

    def __init__(self, logdir: str, first: int, last: int, *, enabled: bool):
        self.logdir, self.first, self.last = logdir, first, last
        self.enabled, self.running = enabled and last > first, False

    def update(self, step: int) -> None:
        """Starts or stops the profiler after the loop call that reached `step`."""
        if self.enabled and not self.running and self.first <= step < self.last:
            tf.profiler.experimental.start(self.logdir)
            self.running = True
            logging.info("profiling from step %d to %s", step, self.logdir)
        elif self.running and step >= self.last:
            tf.profiler.experimental.stop()
            self.running, self.enabled = False, False
            logging.info("profile written at step %d", step)


def _save_finite(ckpt: checkpoint.Checkpointer, model: keras.Model, step: int) -> None:
    """Saves, unless a weight is NaN or Inf: such a checkpoint would poison every resume."""
    if not all(bool(tf.reduce_all(tf.math.is_finite(v))) for v in model.weights):
        raise FloatingPointError(f"weights are not finite at step {step}; not saving a checkpoint. "
                                 f"Lower the learning rate and resume from the last checkpoint")
    ckpt.save(step)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, mode: str = "train_and_eval",
                       strategy: tf.distribute.Strategy | None = None) -> dict[str, float]:
    """Runs `mode` for `config` in `workdir`, resuming from its checkpoints.

    Modes: train, eval, train_and_eval, continuous_eval (side-car: evaluate
    each new checkpoint), export (SavedModel of the latest checkpoint). An
    `evaluator` task in TF_CONFIG always runs continuous_eval. Returns the last
    eval metrics (empty when there was no eval).
    """
    if distribute.is_evaluator():  # outside the training cluster: a local side-car
        mode = "continuous_eval"
        strategy = strategy or tf.distribute.get_strategy()
    elif mode == "train_and_eval" and distribute.cluster_has_evaluator():
        logging.info("TF_CONFIG lists an evaluator task: it evaluates, so the trainers only train")
        mode = "train"
    strategy = strategy or distribute.create_strategy(config.distribution)  # first: before any other op
    task = task_lib.resolve(config.task, config)
    _check(config, mode, strategy.num_replicas_in_sync, task)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(config.seed)
    logging.info("%s with %s: %d replicas, %d workers, chief=%s", mode, type(strategy).__name__.lstrip("_"),
                 strategy.num_replicas_in_sync, distribute.num_workers(strategy), distribute.is_chief(strategy))
    if mode == "continuous_eval":
        return sidecar.continuous_eval(config, workdir, strategy, task)
    chief = distribute.is_chief(strategy)
    run_state = state.create(config, strategy, task)
    lock = workdir_lock.acquire(workdir) if chief else None
    try:
        ckpt = checkpoint.Checkpointer(strategy, workdir, max_to_keep=config.train.max_to_keep,
                                       **run_state.trackables())
        restored = ckpt.restore()
        if not restored and mode == "eval" or not restored and mode == "export" and not config.export_untrained:
            raise checkpoint.CheckpointError(
                f"--mode={mode}: no checkpoint in {ckpt.directory} to {mode}; train first, or check --workdir"
                + (" (or set --config.export_untrained=True to export the initial weights)" if mode == "export"
                   else ""))
        writer = MetricWriter(workdir, enabled=chief)
        if restored:
            logging.info("resumed from step %d (%s)", int(run_state.step.numpy()), restored)
            _check_input_pipelines(run_state, task, strategy)
        if mode in ("train", "train_and_eval"):
            # Events past the checkpoint (or of a run that died before its first one) describe weights
            # that were never saved: the rerun writes them again.
            writer.truncate_after(int(run_state.step.numpy()))
        if mode == "export":
            return _export(config, workdir, strategy, task, run_state) and {}
        evaluator = state.make_evaluator(config, strategy, task, run_state.model) if mode != "train" else None
        if evaluator is None and mode == "eval":
            raise UserError(f"--mode=eval: task {type(task).__name__} has no eval data; give it eval_arrays or "
                             f"eval_dataset")
        if mode in ("train", "train_and_eval"):
            inputs.check_train_arrays(task)
            if chief:
                checkpoint.check_writable(ckpt.directory)
        writer.write_config(config)
        results: dict[str, float] = {}

        def run_eval(at_step: int) -> None:
            t0 = time.perf_counter()
            results.update(evaluator())
            if writer.enabled:
                logging.info("eval at step %d: %s on %d examples (%.1fs)", at_step,
                             format_metrics(results, skip=("examples",)), results["examples"],
                             time.perf_counter() - t0)
            writer.write(at_step, "eval", results)

        periodic_eval = run_eval if evaluator and mode == "train_and_eval" else None
        first_step, started = int(run_state.step.numpy()), time.perf_counter()
        exported = None
        try:
            if mode in ("train", "train_and_eval"):
                _train(config, workdir, strategy, task, run_state, ckpt, writer, periodic_eval)
                if config.optimizer.ema:  # the final eval and the export use the averaged weights
                    run_state.optimizer.finalize_variable_values(run_state.model.trainable_variables)
                    results.clear()
                exported = _export(config, workdir, strategy, task, run_state)
            if evaluator and (mode == "eval" or (mode == "train_and_eval" and not results)):
                run_eval(int(run_state.step.numpy()))
        finally:
            writer.close()
        if chief and mode in ("train", "train_and_eval"):
            logging.info("%s", _summary(config, workdir, ckpt, first_step, int(run_state.step.numpy()),
                                        time.perf_counter() - started, results, exported))
        return results
    finally:
        if lock:
            lock.close()


def _summary(config: ml_collections.ConfigDict, workdir: str, ckpt: checkpoint.Checkpointer, first_step: int,
             last_step: int, wall_s: float, results: dict[str, float], exported: str | None) -> str:
    """The end of a run in a few lines: what was done, the final eval, and where everything is."""
    trained = last_step - first_step
    speed = (f" ({trained * config.train.global_batch_size / wall_s:,.0f} examples/s with eval and saves)"
             if trained and wall_s > 0 else "")
    latest = checkpoint.saved_checkpoints(ckpt.directory)
    lines = [f"done: steps {first_step} -> {last_step} of {config.train.steps} in {wall_s:.1f} s{speed}"]
    if results:
        lines.append(f"  final eval     {format_metrics(results, skip=('examples',))} on {results['examples']:.0f} "
                     f"examples")
    lines.append(f"  checkpoints    {ckpt.directory} (latest {os.path.basename(latest[0]) if latest else 'none'})")
    if exported:
        lines.append(f"  export         {exported}")
    lines.append(f"  metrics        {os.path.join(workdir, 'metrics.jsonl')}")
    lines.append(f"  tensorboard    tensorboard --logdir {os.path.join(workdir, 'summaries')}")
    return "\n".join(lines)


def _check_input_pipelines(run_state: state.State, task: task_lib.Task, strategy: tf.distribute.Strategy) -> None:
    """A resume with another number of input pipelines (workers) than the checkpoint's.

    In-memory data reads the same examples at every step whatever the number
    of workers, so that resume is exact. File-backed data splits its files by
    worker, so its order would change and part of an epoch could repeat: that
    is refused rather than silently trained on.
    """
    written, now = int(run_state.input_pipelines.numpy()), distribute.num_workers(strategy)
    if written == now:
        return
    if task.train_arrays() is None:
        raise UserError(f"the checkpoint was written by {written} worker(s) and this run has {now}; "
                         f"{type(task).__name__}'s data resumes exactly only with the same number: run with "
                         f"{written}, or start a fresh --workdir")
    logging.info("resuming a run of %d worker(s) with %d: in-memory data reads the same examples per step",
                 written, now)
    run_state.input_pipelines.assign(now)


def _train(config: ml_collections.ConfigDict, workdir: str, strategy: tf.distribute.Strategy, task: task_lib.Task,
           run_state: state.State, ckpt: checkpoint.Checkpointer, writer: MetricWriter, run_eval) -> None:
    """The training part of a run: from the restored step to config.train.steps."""
    start, total_steps = int(run_state.step.numpy()), config.train.steps
    if start >= total_steps:
        logging.info("already trained to step %d of %d; nothing to train", start, total_steps)
        return
    train_input = inputs.train_input(config, strategy, task, run_state.step)
    skip_nonfinite = config.on_nonfinite == "skip"
    train_loop = loop.make_train_loop(strategy, task, run_state.model, run_state.optimizer,
                                      global_batch_size=config.train.global_batch_size,
                                      skip_nonfinite=skip_nonfinite, jit_compile=config.jit_compile)
    watcher = preemption.PreemptionWatcher(strategy, ckpt)
    profiler = Profiler(os.path.join(workdir, "summaries"), *config.profile_steps, enabled=writer.enabled)
    hooks = loop.Hooks(log=_log_train(total_steps, writer, lambda: optim.current_learning_rate(run_state.optimizer)),
                       evaluate=run_eval, checkpoint=lambda at: _save_finite(ckpt, run_state.model, at),
                       after_loop=lambda at: (profiler.update(at), watcher.check(at)))
    try:
        loop.run(train_loop=train_loop, iterator=train_input, step=run_state.step, total_steps=total_steps,
                 steps_per_loop=config.train.steps_per_loop, log_every=config.train.log_every_steps,
                 eval_every=config.train.eval_every_steps if run_eval else 0,
                 checkpoint_every=config.train.checkpoint_every_steps,
                 global_batch_size=config.train.global_batch_size, skip_nonfinite=skip_nonfinite, hooks=hooks,
                 finalize=functools.partial(steps.finalize, task))
    finally:
        watcher.close()
        profiler.update(total_steps)


def _export(config: ml_collections.ConfigDict, workdir: str, strategy: tf.distribute.Strategy, task: task_lib.Task,
            run_state: state.State) -> str | None:
    """The chief exports a SavedModel of the current weights to workdir/export (if config.export)."""
    if not (config.export and distribute.is_chief(strategy)):
        return None
    directory = export.export(run_state.model, task, os.path.join(workdir, "export"))
    logging.info("exported a SavedModel of step %d to %s", int(run_state.step.numpy()), directory)
    return directory


def default_workdir(config: ml_collections.ConfigDict) -> str:
    """runs/<config name>, e.g. runs/resnet-digits."""
    return os.path.join("runs", config.name)
