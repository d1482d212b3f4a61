"""What every mode builds: model, optimizer and step inside the strategy's scope, and an evaluator."""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import ml_collections
import tensorflow as tf

from mwloop import distribute, inputs, loop, optim
from mwloop.task import Task, TaskError


@dataclasses.dataclass
class State:
    """The trainable state a checkpoint holds."""
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    step: tf.Variable
    input_pipelines: tf.Variable  # workers that wrote the checkpoint (their data order depends on it)
    extras: dict  # the task's own trackables (Task.checkpoint_items)

    def trackables(self) -> dict:
        """What the checkpoint holds, by name."""
        items = {"model": self.model, "optimizer": self.optimizer, "step": self.step,
                 "input_pipelines": self.input_pipelines}
        if self.extras:
            items["task"] = tf.train.Checkpoint(**self.extras)
        return items


def create(config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy, task: Task) -> State:
    """Builds model, optimizer (with its slots) and step eagerly, so every worker has every variable."""
    keras.mixed_precision.set_global_policy(config.mixed_precision)  # set every run: it is process-global
    with strategy.scope():
        model = task.build_model()
        if not isinstance(model, keras.Model):
            raise TaskError(f"{type(task).__name__}.build_model returned {type(model).__name__}, not a keras.Model")
        optimizer = optim.create(config.optimizer, global_batch_size=config.train.global_batch_size,
                                 total_steps=config.train.steps)
        if config.mixed_precision == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        input_pipelines = tf.Variable(distribute.num_workers(strategy), dtype=tf.int64, trainable=False,
                                      name="input_pipelines")
        extras = dict(task.checkpoint_items())
    return State(model, optimizer, step, input_pipelines, extras)


def make_evaluator(config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy, task: Task,
                   model: keras.Model) -> Callable[[], dict[str, float]] | None:
    """A function that evaluates `model` on the task's whole eval set once, distributed like training;
    None when the task has no eval data."""
    eval_dataset = inputs.eval_dataset(config, strategy, task)
    if eval_dataset is None:
        return None
    eval_loop = loop.make_eval_loop(strategy, task, model)
    return lambda: loop.evaluate(task, eval_loop, eval_dataset)
