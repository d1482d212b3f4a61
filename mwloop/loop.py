"""The training loop: steps_per_loop steps per tf.function call, periodic work between calls."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Iterator

import keras
import tensorflow as tf
from absl import logging

from mwloop import steps

SUM = tf.distribute.ReduceOp.SUM
LoopFn = Callable[[Iterator, tf.Tensor], dict[str, tf.Tensor]]


def make_train_loop(strategy: tf.distribute.Strategy, model: keras.Model,
                    optimizer: keras.optimizers.Optimizer, *, global_batch_size: int,
                    jit_compile: bool = False) -> LoopFn:
    """A tf.function running `num_steps` train steps; returns the summed metrics of those steps.

    The per-replica sums ride through the `tf.range` loop as PerReplica values
    and are reduced once per call, so there is no cross-replica traffic for
    metrics inside the loop.
    """
    step_fn = tf.function(steps.train_step, jit_compile=True) if jit_compile else steps.train_step

    def replica_fn(sums, batch):
        return steps.add_sums(sums, step_fn(model, optimizer, batch, global_batch_size))

    @tf.function
    def train_loop(iterator, num_steps):
        sums = strategy.run(steps.zero_sums)
        for _ in tf.range(num_steps):
            sums = strategy.run(replica_fn, args=(sums, next(iterator)))
        return strategy.reduce(SUM, sums, axis=None)

    return train_loop


def make_eval_loop(strategy: tf.distribute.Strategy, model: keras.Model) -> LoopFn:
    """A tf.function running `num_steps` eval steps; returns the summed metrics."""

    def replica_fn(sums, batch):
        return steps.add_sums(sums, steps.eval_step(model, batch))

    @tf.function
    def eval_loop(iterator, num_steps):
        sums = strategy.run(steps.zero_sums)
        for _ in tf.range(num_steps):
            sums = strategy.run(replica_fn, args=(sums, next(iterator)))
        return strategy.reduce(SUM, sums, axis=None)

    return eval_loop


def evaluate(eval_loop: LoopFn, eval_dataset, num_steps: int) -> dict[str, float]:
    """Mean eval metrics over one full pass (a fresh iterator each time)."""
    sums = eval_loop(iter(eval_dataset), tf.constant(num_steps))
    return steps.finalize({k: v.numpy() for k, v in sums.items()})


def due(step: int, every: int) -> bool:
    """Whether periodic work with period `every` (0 = never) falls at `step`."""
    return every > 0 and step % every == 0


def next_boundary(step: int, total: int, *periods: int) -> int:
    """The first step after `step` at which some periodic work is due, or `total`."""
    return min([total] + [(step // p + 1) * p for p in periods if p > 0])


@dataclasses.dataclass
class Hooks:
    """Periodic work between loop calls; each hook takes the current step."""
    log: Callable[[int, dict[str, float]], None]
    evaluate: Callable[[int], None] | None
    checkpoint: Callable[[int], None]


def run(*, train_loop: LoopFn, iterator: Iterator, step: tf.Variable, total_steps: int,
        steps_per_loop: int, log_every: int, eval_every: int, checkpoint_every: int,
        global_batch_size: int, hooks: Hooks) -> None:
    """Trains from `step` to `total_steps`, calling hooks at their intervals and at the end."""
    start = int(step.numpy())
    window_sums: dict[str, float] = {}
    window_start, window_time, t_start = start, time.perf_counter(), time.perf_counter()
    current = start
    while current < total_steps:
        stop = min(current + steps_per_loop, next_boundary(current, total_steps, log_every, eval_every,
                                                           checkpoint_every))
        sums = train_loop(iterator, tf.constant(stop - current))
        for k, v in sums.items():
            window_sums[k] = window_sums.get(k, 0.0) + float(v)
        current = stop
        step.assign(current)
        if not math.isfinite(window_sums["loss_sum"]):
            raise FloatingPointError(
                f"non-finite training loss at step {current} (between steps {window_start} and {current}); "
                f"lower the learning rate or set config.on_nonfinite='skip'")
        final = current == total_steps
        if due(current, log_every) or final:
            elapsed = time.perf_counter() - window_time
            metrics = steps.finalize(window_sums)
            metrics["examples_per_sec"] = (current - window_start) * global_batch_size / max(elapsed, 1e-9)
            metrics["eta_s"] = (total_steps - current) * (time.perf_counter() - t_start) / (current - start)
            hooks.log(current, metrics)
            window_sums, window_start = {}, current
        if hooks.evaluate and (due(current, eval_every) or final):
            hooks.evaluate(current)
        if due(current, checkpoint_every) or final:
            hooks.checkpoint(current)
        if not window_sums:  # a new window: its speed excludes the periodic work above
            window_time = time.perf_counter()
    logging.info("training done at step %d", current)
