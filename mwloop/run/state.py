"""What every mode builds: model, optimizer and step inside the strategy's scope, and an evaluator."""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mwloop.cluster import distribute
from mwloop.errors import UserError
from mwloop.loop import inputs
from mwloop.loop import loops as loop
from mwloop.step import optim, steps
from mwloop.task import Task, TaskError


@dataclasses.dataclass
class State:
    """The trainable state a checkpoint holds.

    Attributes:
      input_pipelines: the workers that wrote the checkpoint (their data order depends on it).
      extras: the task's own trackables (Task.checkpoint_items).
    """
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    step: tf.Variable
    input_pipelines: tf.Variable
    extras: dict

    def trackables(self) -> dict:
        """What the checkpoint holds, by name."""
        items = {"model": self.model, "optimizer": self.optimizer, "step": self.step,
                 "input_pipelines": self.input_pipelines}
        if self.extras:
            items["task"] = tf.train.Checkpoint(**self.extras)
        return items


def create(config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy, task: Task) -> State:
    """Builds model, optimizer (with its slots) and step eagerly, so every worker has every variable."""
    # Set every run: it is process-global.
    keras.mixed_precision.set_global_policy(config.mixed_precision)
    with strategy.scope():
        model = task.build_model()
        if not isinstance(model, keras.Model):
            raise TaskError(f"{type(task).__name__}.build_model returned {type(model).__name__}, not a keras.Model")
        optimizer = build_optimizer(config, custom_train_step=steps.custom_step(task), task=task)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        input_pipelines = tf.Variable(distribute.num_workers(strategy), dtype=tf.int64, trainable=False,
                                      name="input_pipelines")
        extras = dict(task.checkpoint_items())
    return State(model, optimizer, step, input_pipelines, extras)


def build_optimizer(config: ml_collections.ConfigDict, *, custom_train_step: bool = False, task: Task | None = None
                    ) -> keras.optimizers.Optimizer:
    """The optimizer a run of `config` trains with: the task's own (`Task.build_optimizer`) or the configured
    one, with its schedule and EMA, Keras' per-replica clipping off (mwloop's step clips the cross-replica sum:
    `steps.StepOptions.clip_global_norm`, `steps.apply_gradients(..., clip_global_norm)`), loss scaling under
    mixed_float16.

    Args:
      config: the run's config (its `optimizer`, `train` and `mixed_precision` keys).
      custom_train_step: the task has its own whole train_step (Keras then clips as configured).
      task: the task, whose `build_optimizer` (if it has one) makes the optimizer.
    Returns:
      The optimizer, not yet built (call `optimizer.build(model.trainable_variables)`, in the strategy's
      scope for a distributed run).
    """
    optimizer = optim.create(config.optimizer, global_batch_size=config.train.global_batch_size,
                             total_steps=config.train.steps, task=task)
    # mwloop's step clips the cross-replica sum (steps.StepOptions).
    if not custom_train_step:
        optimizer.global_clipnorm = None
    if config.mixed_precision == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def make_evaluators(config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy, task: Task,
                    model: keras.Model) -> dict[str, Callable[[], dict[str, float]]]:
    """Functions that evaluate `model` once on each of the task's eval sets, distributed like training, by
    split name ("eval", "eval_<name>"); empty when the task has no eval data."""
    def evaluator(eval_dataset) -> Callable[[], dict[str, float]]:
        eval_loop = loop.make_eval_loop(strategy, task, model)
        # Eval mistakes show now, before any update (the trace is kept for later).
        eval_loop.trace(iter(eval_dataset))
        return lambda: loop.evaluate(task, eval_loop, eval_dataset)
    return {split: evaluator(dataset) for split, dataset in inputs.eval_datasets(config, strategy, task).items()}


def check_input_pipelines(run_state: State, task: Task, strategy: tf.distribute.Strategy) -> None:
    """A resume with another number of input pipelines (workers) than the checkpoint's.

    In-memory arrays and records read by global index (train_records) read the same examples at every step
    whatever the number of workers, so that resume is exact. A task's own train_dataset splits its files by
    worker, so its order would change and part of an epoch could repeat: that is refused rather than silently
    trained on.
    """
    written, now = int(run_state.input_pipelines.numpy()), distribute.num_workers(strategy)
    if written == now:
        return
    if not inputs.keeps_order_across_worker_counts(task):
        raise UserError(f"the checkpoint was written by {written} worker(s) and this run has {now}; "
                        f"{type(task).__name__}'s data resumes exactly only with the same number: run with "
                        f"{written}, or start a fresh --workdir (or give the task train_records: docs/data.md)")
    logging.info("resuming a run of %d worker(s) with %d: the data reads the same examples per step",
                 written, now)
    run_state.input_pipelines.assign(now)
