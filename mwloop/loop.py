"""The training loop: steps_per_loop steps per tf.function call, periodic work between calls."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Iterator

import keras
import tensorflow as tf
from absl import logging

from mwloop import feed, steps

SUM = tf.distribute.ReduceOp.SUM
LoopFn = Callable[[Iterator, tf.Tensor], dict[str, tf.Tensor]]


def reduce_sums(strategy: tf.distribute.Strategy, sums: dict) -> dict[str, tf.Tensor]:
    """SUM-reduces per-replica scalar sums across all replicas with one all-reduce.

    The scalars travel as one stacked vector: one collective instead of one
    per metric (and MultiWorkerMirroredStrategy cannot reduce a dict at all).
    """
    keys = sorted(sums)
    stacked = strategy.run(lambda values: tf.stack([values[k] for k in keys]), args=(sums,))
    total = strategy.reduce(SUM, stacked, axis=None)
    return {k: total[i] for i, k in enumerate(keys)}


# Train steps per while-loop iteration for small models: there a step takes ~50 us and the while loop's own
# per-iteration work is ~10 % of it (BENCHMARKS.md); larger models would only pay the extra tracing.
UNROLL, UNROLL_MAX_PARAMS = 2, 20_000


def make_train_loop(strategy: tf.distribute.Strategy, model: keras.Model,
                    optimizer: keras.optimizers.Optimizer, *, global_batch_size: int,
                    label_smoothing: float = 0.0, skip_nonfinite: bool = False, jit_compile: bool = False) -> LoopFn:
    """A function running `num_steps` train steps in one tf.function call; returns their summed metrics.

    The per-replica sums ride through the while loop as one stacked
    PerReplica vector and are reduced once per call, so there is no
    cross-replica traffic for metrics inside the loop. `nonfinite` is > 0 if
    a step's loss or gradients were not finite on some replica;
    `first_nonfinite` is the loop index of the first such step on this
    worker's replicas (+inf if none). With `skip_nonfinite`, a step whose loss
    or gradients are not finite on any replica applies no update (all replicas
    agree through one reduce). With `jit_compile`, XLA compiles the forward and
    backward pass; the update stays outside, since its cross-replica sum
    cannot live in a nested function.
    """
    compute_gradients = functools.partial(
        tf.function(steps.compute_gradients, jit_compile=True) if jit_compile else steps.compute_gradients,
        global_batch_size=global_batch_size, label_smoothing=label_smoothing)
    keys = steps.METRIC_KEYS

    def accumulate(state, sums, finite):
        """Adds a step's sums to (stacked sums, steps before the first non-finite one, 1 while none was).

        Why so: every loop variable and op costs ~1 % of an overhead-bound step, so the sums are one
        vector (one add) and the first bad step is the count of good ones before it (no step index).
        """
        totals, good, ok = state
        if skip_nonfinite:  # a skipped step's NaN must not poison the logged means of the others
            sums = {k: tf.where(finite, v, 0.0) for k, v in sums.items()}
        # In "fail" mode a call with a bad step raises, so its (NaN) sums are never read.
        ok = ok * tf.cast(finite, tf.float32)
        return totals + tf.stack([sums[k] for k in keys]), good + ok, ok

    @tf.autograph.experimental.do_not_convert  # no tensor-dependent control flow: skip its tracing cost
    def replica_step(state, batch):
        grads, sums, finite = compute_gradients(model, optimizer, batch)
        steps.apply_gradients(model, optimizer, grads)
        return accumulate(state, sums, finite)

    @tf.autograph.experimental.do_not_convert
    def replica_grads(state, batch):
        grads, sums, finite = compute_gradients(model, optimizer, batch)
        return grads, accumulate(state, sums, finite), 1.0 - tf.cast(finite, tf.float32)

    @tf.function(autograph=False)  # explicit while_loop and cond: autograph's conversion only adds tracing time
    def train_loop_fn(iterator, num_steps, unroll: int):
        # Once per call: an iterator's next(), or a ResidentFeed's in-graph batches (no per-step GetNext).
        next_batch = feed.batches(strategy, iterator, num_steps)

        def one_step(state, skipped, i):
            if not skip_nonfinite:
                return strategy.run(replica_step, args=(state, next_batch(i))), skipped
            grads, state, nonfinite = strategy.run(replica_grads, args=(state, next_batch(i)))

            def apply():
                strategy.run(functools.partial(steps.apply_gradients, model, optimizer), args=(grads,))
                return skipped
            return state, tf.cond(strategy.reduce(SUM, nonfinite, axis=None) == 0, apply, lambda: skipped + 1.0)

        def body(i, state, skipped):
            # `unroll` steps per loop iteration (num_steps is a multiple of it): the while loop's own
            # per-iteration work is paid once for them.
            for u in range(unroll):
                state, skipped = one_step(state, skipped, i + u if u else i)
            return i + unroll, state, skipped

        state = strategy.run(lambda: (tf.zeros([len(keys)]), tf.constant(0.0), tf.constant(1.0)))
        _, state, skipped = tf.while_loop(lambda i, state, skipped: i < num_steps, body,
                                          (tf.zeros([], num_steps.dtype), state, tf.constant(0.0)))
        totals, good, _ = state
        steps_done = tf.cast(num_steps, tf.float32)
        # Per call, not per step: how many steps were not finite is all loop.run needs to know (via one all-reduce).
        totals = strategy.run(lambda t, g: tf.concat([t, [steps_done - g]], 0), args=(totals, good))
        total = strategy.reduce(SUM, totals, axis=None)  # one all-reduce for all metrics
        first = tf.reduce_min(strategy.experimental_local_results(good))
        return dict({k: total[j] for j, k in enumerate(keys)}, nonfinite=total[len(keys)],
                    first_nonfinite=tf.where(first < steps_done, first, float("inf")), skipped=skipped)

    max_unroll = UNROLL if model.count_params() <= UNROLL_MAX_PARAMS else 1

    def train_loop(iterator, num_steps):
        # Calls of a multiple of `max_unroll` steps (all but boundary calls) run unrolled; the others run one
        # step per iteration in a second trace, made only if such a call comes. A remainder loop in one trace
        # would hold max_unroll + 1 copies of the step, and the graph's size is most of the time to the first
        # step (BENCHMARKS.md).
        unroll = max_unroll if int(num_steps) % max_unroll == 0 else 1
        return train_loop_fn(iterator, tf.convert_to_tensor(num_steps), unroll)

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
        return reduce_sums(strategy, sums)

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
    """Work between loop calls; each hook takes the current step."""
    log: Callable[[int, dict[str, float]], None]
    evaluate: Callable[[int], None] | None
    checkpoint: Callable[[int], None]
    after_loop: Callable[[int], None] = lambda step: None  # e.g. preemption: save and exit


def first_nonfinite_step(sums: dict[str, float], start: int) -> int | None:
    """The global step at which a loop call starting at `start` first saw a non-finite loss."""
    if not sums["nonfinite"]:
        return None
    first = sums["first_nonfinite"]
    return start + 1 + int(first) if math.isfinite(first) else start + 1


def run(*, train_loop: LoopFn, iterator: Iterator, step: tf.Variable, total_steps: int,
        steps_per_loop: int, log_every: int, eval_every: int, checkpoint_every: int,
        global_batch_size: int, skip_nonfinite: bool, hooks: Hooks) -> None:
    """Trains from `step` to `total_steps`, calling hooks at their intervals and at the end.

    A non-finite loss raises FloatingPointError naming the step (before any
    checkpoint of that window is written) unless `skip_nonfinite`, where the
    loop skipped those updates and this logs and counts them.
    """
    start = current = int(step.numpy())
    window: dict[str, float] = {}
    window_start, window_time, t_start = start, time.perf_counter(), time.perf_counter()
    skipped = 0
    while current < total_steps:
        stop = min(current + steps_per_loop, next_boundary(current, total_steps, log_every, eval_every,
                                                           checkpoint_every))
        sums = {k: float(v) for k, v in train_loop(iterator, tf.constant(stop - current)).items()}
        bad_step = first_nonfinite_step(sums, current)
        if bad_step is not None and not skip_nonfinite:
            raise FloatingPointError(f"non-finite loss at step {bad_step}; lower the learning rate, or set "
                                     f"config.on_nonfinite='skip' to skip such updates")
        if bad_step is not None:
            skipped += round(sums["skipped"])
            logging.warning("skipped %d non-finite update(s) from step %d (%d so far)", round(sums["skipped"]),
                            bad_step, skipped)
        for k in steps.METRIC_KEYS:
            window[k] = window.get(k, 0.0) + sums[k]
        current = stop
        step.assign(current, read_value=False)  # no read back: ~10 us a call
        final = current == total_steps
        if due(current, log_every) or final:
            elapsed = time.perf_counter() - window_time
            metrics = steps.finalize(window)
            metrics["examples_per_sec"] = (current - window_start) * global_batch_size / max(elapsed, 1e-9)
            metrics["eta_s"] = (total_steps - current) * (time.perf_counter() - t_start) / (current - start)
            if skip_nonfinite:
                metrics["skipped_nonfinite"] = float(skipped)
            hooks.log(current, metrics)
            window, window_start = {}, current
        if hooks.evaluate and (due(current, eval_every) or final):
            hooks.evaluate(current)
        if due(current, checkpoint_every) or final:
            hooks.checkpoint(current)
        hooks.after_loop(current)
        if not window:  # a new window: its speed excludes the periodic work above
            window_time = time.perf_counter()
    logging.info("training done at step %d", current)
