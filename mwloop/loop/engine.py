"""Which train loop a strategy runs, behind one object, so the Trainer never asks which strategy it has.

Two engines: the plain loop (`loops.py`: `strategy.run` of the replica step inside one tf.function per call,
fed by `inputs.train_input`) for the default, Mirrored and MultiWorkerMirrored strategies; and the parameter
servers' (`ps.py`: the chief schedules one-update steps on the workers over per-worker datasets, and evaluates
by itself with the default strategy).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import ml_collections
import tensorflow as tf

from mwloop.cluster import distribute
from mwloop.loop import inputs, loops, ps
from mwloop.step import steps
from mwloop.task import Task


@dataclasses.dataclass(frozen=True)
class Engine:
    """How a run on one kind of strategy trains.

    Attributes:
      parameter_servers: whether this is the parameter servers' engine (for the checks that differ).
      eval_strategy: the strategy the evaluators run under (the chief alone under parameter servers).
      nonfinite_fix: what a non-finite loss's error suggests besides a lower learning rate.
    """
    parameter_servers: bool
    eval_strategy: tf.distribute.Strategy
    nonfinite_fix: str
    _train_input: Callable[..., Any]
    _make_train_loop: Callable[..., Callable]

    def train_input(self, config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy, task: Task,
                    step: tf.Variable) -> Any:
        """What the train loop reads from the current `step` on."""
        return self._train_input(config, strategy, task, step)

    def make_train_loop(self, config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy, task: Task,
                        model: keras.Model, optimizer: keras.optimizers.Optimizer) -> Callable:
        """`train_loop(train_input, num_steps) -> (sums, status)`, as `loops.make_train_loop` documents."""
        return self._make_train_loop(strategy, task, model, optimizer, steps.StepOptions.from_config(config))


def for_strategy(strategy: tf.distribute.Strategy) -> Engine:
    """The engine `strategy` trains with."""
    if distribute.is_parameter_server(strategy):
        return Engine(parameter_servers=True, eval_strategy=tf.distribute.get_strategy(), nonfinite_fix="",
                      _train_input=lambda config, strategy, task, step: ps.train_input(config, strategy, task),
                      _make_train_loop=ps.make_train_loop)
    return Engine(parameter_servers=False, eval_strategy=strategy,
                  nonfinite_fix=", or set config.on_nonfinite='skip' to skip such updates",
                  _train_input=inputs.train_input, _make_train_loop=loops.make_train_loop)
