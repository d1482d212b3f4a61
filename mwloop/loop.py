"""The train and eval loops: steps_per_loop steps per tf.function call (the Trainer runs the work between calls)."""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterator

import keras
import tensorflow as tf

from mwloop import accumulation, feed, optim, steps
from mwloop.errors import UserError
from mwloop.task import Task

SUM = tf.distribute.ReduceOp.SUM
LoopFn = Callable[[Iterator, tf.Tensor], tuple[dict[str, float], dict[str, float]]]


class _MoreSums(Exception):
    """Raised while tracing: the step returns more sums than the loop's vector has slots."""


class _Slots:
    """Where a step's sums sit in the one vector the loop carries: the task's keys (sorted), then zeros.

    Why: the loop's state is built before the step is traced, and the keys are only known from that
    trace. The vector starts with SLOTS entries (every task shipped here fits); a step with more sums
    aborts its first trace and `call` traces again with as many slots as it needs. Measured on the
    overhead-bound MLP: 32 slots instead of 8 cost ~3 % of the step.
    """
    SLOTS = 8

    def __init__(self):
        self.keys: list[str] = []  # filled by the first trace of the step
        self.size = self.SLOTS

    def pack(self, sums: dict[str, tf.Tensor], size: int) -> tf.Tensor:
        """The step's sums as the loop's vector of `size` slots."""
        if not self.keys:
            if len(sums) > size:
                raise _MoreSums(len(sums))
            self.keys = sorted(sums)
        elif sorted(sums) != self.keys:
            raise UserError(f"a step returned the sums {sorted(sums)}, another trace {self.keys}; "
                             f"return the same keys every step")
        zero = tf.constant(0.0)
        return tf.stack([sums[k] for k in self.keys] + [zero] * (size - len(self.keys)))

    def unpack(self, vector: tf.Tensor) -> dict[str, tf.Tensor]:
        return {k: vector[i] for i, k in enumerate(self.keys)}

    def call(self, function: Callable, *args):
        """`function(*args, size)`, traced again with more slots if the step has more sums."""
        try:
            return function(*args, self.size)
        except _MoreSums as more:
            self.size = more.args[0]
            return function(*args, self.size)


# Train steps per while-loop iteration for small models: there a step takes ~50 us and the while loop's own
# per-iteration work is ~10 % of it (BENCHMARKS.md); larger models would only pay the extra tracing.
UNROLL, UNROLL_MAX_PARAMS = 2, 20_000


def check_skip_nonfinite(task: Task, skip_nonfinite: bool) -> None:
    """Skipping non-finite updates needs mwloop's step, which computes gradients apart from applying them."""
    if skip_nonfinite and task.overrides("train_step"):
        raise UserError(f"task {type(task).__name__} has its own train_step, which applies its updates itself, "
                         f"so mwloop cannot skip non-finite ones; set config.on_nonfinite='fail'")


def make_train_loop(strategy: tf.distribute.Strategy, task: Task, model: keras.Model,
                    optimizer: keras.optimizers.Optimizer, *, global_batch_size: int,
                    skip_nonfinite: bool = False, jit_compile: bool = False,
                    accumulation_steps: int | None = None) -> LoopFn:
    """A function running `num_steps` train steps of `task` in one tf.function call.

    It returns `(sums, status)` as Python floats: the steps' sums reduced over all replicas, and
    `status` with `nonfinite` (> 0 if a step's loss or gradients were not
    finite on some replica), `first_nonfinite` (the loop index of the first
    such step on this worker's replicas, +inf if none) and `skipped`. The
    per-replica sums ride through the while loop as one stacked PerReplica
    vector and are reduced once per call, so there is no cross-replica traffic
    for metrics inside the loop. With `skip_nonfinite`, a step whose loss or
    gradients are not finite on any replica applies no update (all replicas
    agree through one reduce). With `jit_compile`, XLA compiles the forward and
    backward pass; the update stays outside, since its cross-replica sum
    cannot live in a nested function. A task's own `train_step` runs whole.

    With `accumulation_steps` k > 1 (None: the optimizer's, which `optim.create` takes from
    config.optimizer.gradient_accumulation_steps) a step is one optimizer update on k micro-batches
    (`mwloop.accumulation`): the input must yield micro-batches of global_batch_size / (replicas x k)
    per replica (a ResidentFeed made with the same k; `inputs.train_input` builds both), and the
    sums, `nonfinite` and `skipped` count updates. k = 1 traces exactly the loop without accumulation.
    """
    check_skip_nonfinite(task, skip_nonfinite)
    k = optim.accumulation_steps(optimizer) if accumulation_steps is None else accumulation_steps
    accumulation.check(k, global_batch_size, strategy.num_replicas_in_sync, task)
    custom_step = task.overrides("train_step")
    compute_gradients = functools.partial(
        tf.function(steps.compute_gradients, jit_compile=True) if jit_compile else steps.compute_gradients, task)
    slots = _Slots()
    update = accumulation.Update(strategy, task, model, optimizer, slots, global_batch_size=global_batch_size,
                                 accumulation_steps=k, skip_nonfinite=skip_nonfinite,
                                 jit_compile=jit_compile) if k > 1 else None

    def accumulate(state, sums, finite, size: int):
        """Adds a step's sums to (stacked sums, steps before the first non-finite one, 1 while none was).

        Why so: every loop variable and op costs ~1 % of an overhead-bound step, so the sums are one
        vector (one add) and the first bad step is the count of good ones before it (no step index).
        """
        totals, good, ok = state
        if skip_nonfinite:  # a skipped step's NaN must not poison the logged means of the others
            sums = {k: tf.where(finite, v, 0.0) for k, v in sums.items()}
        # In "fail" mode a call with a bad step raises, so its (NaN) sums are never read.
        ok = ok * tf.cast(finite, tf.float32)
        return totals + slots.pack(sums, size), good + ok, ok

    @tf.autograph.experimental.do_not_convert  # no tensor-dependent control flow: skip its tracing cost
    def replica_step(state, batch, size):
        if custom_step:
            sums = steps.train_step(task, model, optimizer, batch, global_batch_size)
            return accumulate(state, sums, tf.math.is_finite(sums["loss_sum"]), size)
        grads, sums, finite = compute_gradients(model, optimizer, batch, global_batch_size)
        steps.apply_gradients(model, optimizer, grads)
        return accumulate(state, sums, finite, size)

    @tf.autograph.experimental.do_not_convert
    def replica_grads(state, batch, size):
        grads, sums, finite = compute_gradients(model, optimizer, batch, global_batch_size)
        return grads, accumulate(state, sums, finite, size), 1.0 - tf.cast(finite, tf.float32)

    @tf.function(autograph=False)  # explicit while_loop and cond: autograph's conversion only adds tracing time
    def train_loop_fn(iterator, num_steps, unroll: int, size: int):
        # Once per call: an iterator's next(), or a ResidentFeed's in-graph batches (no per-step GetNext).
        _check_feed(iterator, k)  # Python only: no op
        if update is None:
            next_batch = feed.batches(strategy, iterator, num_steps)
        else:  # the feed counts micro-steps
            next_batch = feed.batches(strategy, iterator, num_steps * k)

        def one_step(state, skipped, i):
            if update is not None:
                return update(state, skipped, next_batch, i, size)
            if not skip_nonfinite:
                return strategy.run(replica_step, args=(state, next_batch(i), size)), skipped
            grads, state, nonfinite = strategy.run(replica_grads, args=(state, next_batch(i), size))

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

        state = strategy.run(lambda: (tf.zeros([size]), tf.constant(0.0), tf.constant(1.0)))
        _, state, skipped = tf.while_loop(lambda i, state, skipped: i < num_steps, body,
                                          (tf.zeros([], num_steps.dtype), state, tf.constant(0.0)))
        totals, good, _ = state
        steps_done = tf.cast(num_steps, tf.float32)
        # Per call, not per step: how many steps were not finite is all the Trainer needs to know (via one
        # all-reduce); it rides in the vector's last slot, after the task's sums.
        num_sums = len(slots.keys)
        totals = strategy.run(lambda t, g: tf.concat([t[:num_sums], [steps_done - g]], 0), args=(totals, good))
        total = strategy.reduce(SUM, totals, axis=None)  # one all-reduce for all metrics
        first = tf.reduce_min(strategy.experimental_local_results(good))
        # One output tensor: each output costs the caller a host transfer and a conversion per call.
        return tf.concat([total, [skipped, tf.where(first < steps_done, first, float("inf"))]], 0)

    # With accumulation the update holds its own loop over micro-steps: nothing to gain from unrolling updates.
    max_unroll = UNROLL if model.count_params() <= UNROLL_MAX_PARAMS and k == 1 else 1
    traced_call = slots.call if update is None else functools.partial(update.call, slots.call)

    def train_loop(iterator, num_steps):
        # Calls of a multiple of `max_unroll` steps (all but boundary calls) run unrolled; the others run one
        # step per iteration in a second trace, made only if such a call comes. A remainder loop in one trace
        # would hold max_unroll + 1 copies of the step, and the graph's size is most of the time to the first
        # step (BENCHMARKS.md).
        unroll = max_unroll if int(num_steps) % max_unroll == 0 else 1
        values = traced_call(train_loop_fn, iterator, tf.convert_to_tensor(num_steps), unroll).numpy().tolist()
        num_sums = len(slots.keys)
        nonfinite, skipped, first_nonfinite = values[num_sums:]
        return (dict(zip(slots.keys, values[:num_sums])),
                {"nonfinite": nonfinite, "skipped": skipped, "first_nonfinite": first_nonfinite})

    return train_loop


def _check_feed(train_input, accumulation_steps: int) -> None:
    """A resident feed made for another number of micro-batches per update would read the wrong examples."""
    if isinstance(train_input, feed.FeedAtStep) and train_input.accumulation_steps != accumulation_steps:
        raise UserError(f"the train loop accumulates {accumulation_steps} micro-batches per update, its feed was made "
                        f"for {train_input.accumulation_steps}; give ResidentFeed accumulation_steps="
                        f"{accumulation_steps}")


def make_eval_loop(strategy: tf.distribute.Strategy, task: Task, model: keras.Model) -> Callable:
    """A tf.function evaluating `task` over a whole distributed iterator; returns the reduced sums.

    Batches are read with `get_next_as_optional` until every pipeline is exhausted, so finite eval sets
    with a partial last batch, or pipelines of different lengths, count every example once and never
    leave a replica waiting in a collective.
    """
    slots = _Slots()

    def replica_fn(totals, batch, size):
        return totals + slots.pack(steps.eval_step(task, model, batch), size)

    @tf.function(autograph=False)
    def eval_loop_fn(iterator, size: int):
        def body(totals, has_value):
            optional = iterator.get_next_as_optional()
            totals = tf.cond(optional.has_value(),
                             lambda: strategy.run(replica_fn, args=(totals, optional.get_value(), size)),
                             lambda: totals)
            return totals, optional.has_value()

        totals = strategy.run(lambda: tf.zeros([size]))
        totals, _ = tf.while_loop(lambda totals, has_value: has_value, body, (totals, tf.constant(True)))
        return slots.unpack(strategy.reduce(SUM, totals, axis=None))

    return lambda iterator: slots.call(eval_loop_fn, iterator)


def evaluate(task: Task, eval_loop: Callable, eval_dataset) -> dict[str, float]:
    """Eval metrics over one full pass of a distributed dataset (a fresh iterator each time)."""
    sums = eval_loop(iter(eval_dataset))
    return steps.finalize(task, {k: v.numpy() for k, v in sums.items()})


def first_nonfinite_step(status: dict[str, float], start: int) -> int | None:
    """The global step at which a loop call starting at `start` first saw a non-finite loss."""
    if not status["nonfinite"]:
        return None
    first = status["first_nonfinite"]
    return start + 1 + int(first) if math.isfinite(first) else start + 1
