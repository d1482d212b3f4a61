"""train_and_evaluate: strategy, data, model, checkpoint and loop, wired together."""

from __future__ import annotations

import datetime
import os
import time

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mwloop import checkpoint, data, distribute, loop, models, optim, preemption, workdir_lock
from mwloop.data import faults, pipeline
from mwloop.writers import MetricWriter

MODES = ("train", "eval", "train_and_eval")
# Errors that mean "the input is wrong": main turns them into one line and exit 1.
USER_ERRORS = (ValueError, FileNotFoundError, FloatingPointError, checkpoint.CheckpointError,
               distribute.ClusterConfigError, workdir_lock.WorkdirBusyError)


def _check(config: ml_collections.ConfigDict, mode: str, num_replicas: int) -> None:
    """One-line errors for settings that cannot work, before anything is written."""
    if mode not in MODES:
        raise ValueError(f"--mode={mode!r} is unknown; use one of {', '.join(MODES)}")
    for name in ("train", "eval"):
        batch = config[name].global_batch_size
        if batch <= 0 or batch % num_replicas:
            raise ValueError(
                f"config.{name}.global_batch_size={batch} does not divide among {num_replicas} replicas; "
                f"set it to a positive multiple of {num_replicas}")
    if config.on_nonfinite not in ("fail", "skip"):
        raise ValueError(f"config.on_nonfinite={config.on_nonfinite!r}; use 'fail' or 'skip'")


def _log_train(total_steps: int, writer: MetricWriter, learning_rate):
    def log(step: int, metrics: dict[str, float]) -> None:
        metrics = dict(metrics, learning_rate=learning_rate())
        eta = datetime.timedelta(seconds=round(metrics.pop("eta_s")))
        logging.info("step %d/%d loss %.4f accuracy %.4f %.0f examples/s lr %.4g ETA %s", step, total_steps,
                     metrics["loss"], metrics["accuracy"], metrics["examples_per_sec"], metrics["learning_rate"],
                     eta)
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
    """Trains (and/or evaluates) `config` in `workdir`, resuming from its checkpoints.

    Returns the final eval metrics (empty in mode 'train').
    """
    strategy = strategy or distribute.create_strategy(config.distribution)  # first: before any other op
    _check(config, mode, strategy.num_replicas_in_sync)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(config.seed)
    chief = distribute.is_chief(strategy)
    logging.info("strategy %s: %d replicas, %d workers, chief=%s", type(strategy).__name__,
                 strategy.num_replicas_in_sync, distribute.num_workers(strategy), chief)

    source = data.get_source(config.dataset)
    total_steps = config.train.steps
    keras.mixed_precision.set_global_policy(config.mixed_precision)  # set every run: it is process-global
    with strategy.scope():
        model = models.build(config.model, input_shape=source.input_shape, num_classes=source.num_classes,
                             weight_decay=config.optimizer.weight_decay)
        optimizer = optim.create(config.optimizer, global_batch_size=config.train.global_batch_size,
                                 total_steps=total_steps)
        if config.mixed_precision == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer.build(model.trainable_variables)  # eagerly, on every worker, before restore
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    lock = workdir_lock.acquire(workdir) if chief else None
    ckpt = checkpoint.Checkpointer(strategy, workdir, max_to_keep=config.train.max_to_keep,
                                   model=model, optimizer=optimizer, step=step)
    restored = ckpt.restore()
    writer = MetricWriter(workdir, enabled=chief)
    if restored:
        logging.info("resumed from step %d (%s)", int(step.numpy()), restored)
        writer.truncate_after(int(step.numpy()))
    writer.write_config(config)

    watcher = preemption.PreemptionWatcher(strategy, ckpt)
    profiler = Profiler(os.path.join(workdir, "summaries"), *config.profile_steps, enabled=chief)
    eval_dataset = strategy.distribute_datasets_from_function(source.eval_fn(config.eval.global_batch_size))
    eval_steps = pipeline.num_eval_steps(source.num_eval_examples, config.eval.global_batch_size)
    eval_loop = loop.make_eval_loop(strategy, model)
    results: dict[str, float] = {}

    def run_eval(at_step: int) -> None:
        t0 = time.perf_counter()
        results.update(loop.evaluate(eval_loop, eval_dataset, eval_steps))
        logging.info("eval at step %d: loss %.4f accuracy %.4f on %d examples (%.1fs)", at_step,
                     results["loss"], results["accuracy"], results["examples"], time.perf_counter() - t0)
        writer.write(at_step, "eval", results)

    try:
        if mode in ("train", "train_and_eval"):
            start = int(step.numpy())
            if start >= total_steps:
                logging.info("already trained to step %d of %d; nothing to train", start, total_steps)
            else:
                dataset_fn = faults.nan_at_steps(source.train_fn(config.train.global_batch_size, config.seed, start),
                                                 [s for s in config.nan_at_steps if s > 0], start_step=start)
                train_dataset = strategy.distribute_datasets_from_function(dataset_fn)
                train_loop = loop.make_train_loop(strategy, model, optimizer,
                                                  global_batch_size=config.train.global_batch_size,
                                                  skip_nonfinite=config.on_nonfinite == "skip",
                                                  jit_compile=config.jit_compile)
                loop.run(train_loop=train_loop, iterator=iter(train_dataset), step=step, total_steps=total_steps,
                         steps_per_loop=config.train.steps_per_loop, log_every=config.train.log_every_steps,
                         eval_every=config.train.eval_every_steps if mode == "train_and_eval" else 0,
                         checkpoint_every=config.train.checkpoint_every_steps,
                         global_batch_size=config.train.global_batch_size,
                         skip_nonfinite=config.on_nonfinite == "skip",
                         hooks=loop.Hooks(log=_log_train(total_steps, writer,
                                                         lambda: optim.current_learning_rate(optimizer)),
                                          evaluate=run_eval if mode == "train_and_eval" else None,
                                          checkpoint=lambda at: _save_finite(ckpt, model, at),
                                          after_loop=lambda at: (profiler.update(at), watcher.check(at))))
        if mode == "eval" or (mode == "train_and_eval" and not results):
            run_eval(int(step.numpy()))
    finally:
        writer.close()
        watcher.close()
        profiler.update(total_steps)
        if lock:
            lock.close()
    return results


def default_workdir(config: ml_collections.ConfigDict) -> str:
    """runs/<config name>, e.g. runs/resnet-digits."""
    return os.path.join("runs", config.name)
