"""What every mode builds: model, optimizer and step inside the strategy's scope, and an evaluator."""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import ml_collections
import tensorflow as tf

from mwloop import distribute, loop, models, optim
from mwloop.data import Source, pipeline


@dataclasses.dataclass
class State:
    """The trainable state a checkpoint holds."""
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    step: tf.Variable
    input_pipelines: tf.Variable  # workers that wrote the checkpoint (their data order depends on it)

    def trackables(self) -> dict:
        return {"model": self.model, "optimizer": self.optimizer, "step": self.step,
                "input_pipelines": self.input_pipelines}


def create(config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy, source: Source) -> State:
    """Builds model, optimizer (with its slots) and step eagerly, so every worker has every variable."""
    keras.mixed_precision.set_global_policy(config.mixed_precision)  # set every run: it is process-global
    with strategy.scope():
        model = build_model(config, source)
        optimizer = optim.create(config.optimizer, global_batch_size=config.train.global_batch_size,
                                 total_steps=config.train.steps)
        if config.mixed_precision == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        input_pipelines = tf.Variable(distribute.num_workers(strategy), dtype=tf.int64, trainable=False,
                                      name="input_pipelines")
    return State(model, optimizer, step, input_pipelines)


def build_model(config: ml_collections.ConfigDict, source: Source) -> keras.Model:
    """The config's model for the source's input shape and classes."""
    return models.build(config.model, input_shape=source.input_shape, num_classes=source.num_classes,
                        weight_decay=config.optimizer.weight_decay)


def make_evaluator(config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy, source: Source,
                   model: keras.Model) -> Callable[[], dict[str, float]]:
    """A function that evaluates `model` on the whole eval set once, distributed like training."""
    eval_dataset = strategy.distribute_datasets_from_function(source.eval_fn(config.eval.global_batch_size))
    eval_steps = pipeline.num_eval_steps(source.num_eval_examples, config.eval.global_batch_size)
    eval_loop = loop.make_eval_loop(strategy, model)
    return lambda: loop.evaluate(eval_loop, eval_dataset, eval_steps)
