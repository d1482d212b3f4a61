"""The train and eval loops: steps_per_loop steps per tf.function call (the Trainer runs the work between calls)."""

from __future__ import annotations

import math
from typing import Callable, Iterator

import keras
import numpy as np
import tensorflow as tf

from mwloop.errors import UserError
from mwloop.loop import feed, update
from mwloop.step import steps, user_code
from mwloop.task import Task

SUM = tf.distribute.ReduceOp.SUM
LoopFn = Callable[[Iterator, tf.Tensor], tuple[dict[str, float], dict[str, float]]]


class SumVector:
    """A step's sums as the one vector the loop carries (one add per step: every loop variable and op costs
    ~1 % of an overhead-bound step), the keys sorted.

    Why the vector's size is an input of the loop function: the loop's state (this vector of zeros) is built
    before the step is traced, and the keys are known only from that trace. So `run` traces the loop function
    alone the first time (`get_concrete_function`, the size a TensorSpec), which names the keys, then calls it
    with their number: one trace whatever the number of sums, and nothing raised to learn it.
    """
    NUM_SUMS_SPEC = tf.TensorSpec([], tf.int32)

    def __init__(self):
        # Named by the step's first trace.
        self.keys: list[str] | None = None
        # len(keys), the loop function's last argument.
        self._num_sums: tf.Tensor | None = None

    def pack(self, sums: dict[str, tf.Tensor]) -> tf.Tensor:
        """The step's sums as the loop's vector; a trace whose step returns other keys than the first is one line."""
        if self.keys is None:
            self.keys = sorted(sums)
        elif sorted(sums) != self.keys:
            raise UserError(f"a step returned the sums {sorted(sums)}, another trace {self.keys}; "
                            f"return the same keys every step")
        return tf.stack([sums[k] for k in self.keys])

    def unpack(self, vector: tf.Tensor) -> dict[str, tf.Tensor]:
        return {k: vector[i] for i, k in enumerate(self.keys)}

    def trace(self, function: tf.types.experimental.PolymorphicFunction, *args) -> None:
        """Traces `function(*args, num_sums)` without running it (a call already traced is looked up)."""
        with user_code.one_line_errors():
            function.get_concrete_function(*args, self.NUM_SUMS_SPEC)

    def run(self, function: tf.types.experimental.PolymorphicFunction, *args):
        """`function(*args, num_sums)`, traced first if no trace has named the keys yet. Every call (and trace) of
        a train or eval loop comes here: the task's errors that TensorFlow raises on the strategy's main thread,
        outside the task's frames, become one line here too (`user_code.one_line_errors`)."""
        if self.keys is None:
            self.trace(function, *args)
        if self._num_sums is None:
            self._num_sums = tf.constant(len(self.keys), tf.int32)
        with user_code.one_line_errors():
            return function(*args, self._num_sums)


# Train steps per while-loop iteration for small models: there a step takes ~50 us and the while loop's own
# per-iteration work is ~10 % of it (BENCHMARKS.md); larger models would only pay the extra tracing.
UNROLL, UNROLL_MAX_PARAMS = 2, 20_000


def make_train_loop(strategy: tf.distribute.Strategy, task: Task, model: keras.Model,
                    optimizer: keras.optimizers.Optimizer, options: steps.StepOptions | None = None, *,
                    global_batch_size: int | None = None, skip_nonfinite: bool = False,
                    jit_compile: bool = False) -> LoopFn:
    """A function running `num_steps` train steps of `task` in one tf.function call (its `tracing_count()`: the
    traces so far, for the goodput clock's compilation time).

    It returns `(sums, status)` as Python floats: the steps' sums reduced over all replicas, and
    `status` with `nonfinite` (> 0 if a step's loss or gradients were not
    finite on some replica), `first_nonfinite` (the loop index of the first
    such step on this worker's replicas, +inf if none) and `skipped`. The
    per-replica sums ride through the while loop as one stacked PerReplica
    vector and are reduced once per call, so there is no cross-replica traffic
    for metrics inside the loop. The step itself is the step builder's
    (`mwloop.loop.update.make_update`), from `options` (`steps.StepOptions`; or, without them, the keywords:
    `global_batch_size`, `skip_nonfinite`, `jit_compile`, k = 1, no clipping): with `skip_nonfinite`, a step
    whose loss or gradients are not finite on any replica applies no update; with `jit_compile`, XLA
    compiles the forward and backward pass. A task's own `train_step` runs whole.

    With `options.accumulation_steps` k > 1 a step is one optimizer update on k micro-batches
    (`mwloop.loop.update`): the input must yield micro-batches of global_batch_size / (replicas x k)
    per replica (a ResidentFeed made with the same k; `inputs.train_input` builds both), and the
    sums, `nonfinite` and `skipped` count updates. k = 1 traces exactly the loop without accumulation.

    Each kind of call (unrolled, or not: see `train_loop` below) is traced once. The first call traces the
    loop alone, then runs it (`SumVector`); with k > 1 one trace of the forward pass on the input's batch spec
    comes before it, for the gradient groups (`update.Accumulated.prepare`).
    """
    if options is None:
        options = steps.StepOptions(global_batch_size=global_batch_size, skip_nonfinite=skip_nonfinite,
                                    jit_compile=jit_compile)
    update.check(task, options, strategy.num_replicas_in_sync)
    k = options.accumulation_steps
    sum_vector = SumVector()
    one_update = update.make_update(strategy, task, model, optimizer, options, sum_vector)

    # Explicit while_loop and cond: autograph's conversion only adds tracing time.
    @tf.function(autograph=False)
    def train_loop_fn(iterator, num_steps, unroll: int, num_sums):
        # Once per call: an iterator's next(), or a ResidentFeed's in-graph batches (no per-step GetNext).
        # Python only: it adds no op.
        _check_feed(iterator, k)
        if k == 1:
            next_batch = feed.batches(strategy, iterator, num_steps)
        else:
            # The feed counts micro-steps.
            next_batch = feed.batches(strategy, iterator, num_steps * k)

        def body(i, state, skipped):
            # `unroll` steps per loop iteration (num_steps is a multiple of it): the while loop's own
            # per-iteration work is paid once for them.
            for u in range(unroll):
                state, skipped = one_update(state, skipped, next_batch, i + u if u else i)
            return i + unroll, state, skipped

        state = strategy.run(lambda: (tf.zeros([num_sums]), tf.constant(0.0), tf.constant(1.0)))
        _, state, skipped = tf.while_loop(lambda i, state, skipped: i < num_steps, body,
                                          (tf.zeros([], num_steps.dtype), state, tf.constant(0.0)))
        totals, good, _ = state
        steps_done = tf.cast(num_steps, tf.float32)
        # Per call, not per step: how many steps were not finite is all the Trainer needs to know (via one
        # all-reduce); it rides in the vector's last entry, after the task's sums.
        totals = strategy.run(lambda t, g: tf.concat([t, [steps_done - g]], 0), args=(totals, good))
        # One all-reduce for all metrics.
        total = strategy.reduce(SUM, totals, axis=None)
        first = tf.reduce_min(strategy.experimental_local_results(good))
        # One output tensor: each output costs the caller a host transfer and a conversion per call.
        return tf.concat([total, [skipped, tf.where(first < steps_done, first, float("inf"))]], 0)

    # With accumulation the update holds its own loop over micro-steps: nothing to gain from unrolling updates.
    max_unroll = UNROLL if model.count_params() <= UNROLL_MAX_PARAMS and k == 1 else 1

    def train_loop(iterator, num_steps):
        # Calls of a multiple of `max_unroll` steps (all but boundary calls) run unrolled; the others run one
        # step per iteration in a second trace, made only if such a call comes. A remainder loop in one trace
        # would hold max_unroll + 1 copies of the step, and the graph's size is most of the time to the first
        # step (BENCHMARKS.md).
        unroll = max_unroll if int(num_steps) % max_unroll == 0 else 1
        # The accumulators' gradient groups, before the loop is traced.
        if k > 1 and sum_vector.keys is None:
            with user_code.one_line_errors():
                one_update.prepare(feed.batch_spec(iterator))
        values = sum_vector.run(train_loop_fn, iterator, tf.convert_to_tensor(num_steps), unroll).numpy().tolist()
        num_sums = len(sum_vector.keys)
        nonfinite, skipped, first_nonfinite = values[num_sums:]
        return (dict(zip(sum_vector.keys, values[:num_sums])),
                {"nonfinite": nonfinite, "skipped": skipped, "first_nonfinite": first_nonfinite})

    # A call that raised the tracing count traced.
    train_loop.tracing_count = train_loop_fn.experimental_get_tracing_count
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
    sum_vector = SumVector()

    def replica_fn(totals, batch):
        return totals + sum_vector.pack(steps.eval_step(task, model, batch))

    @tf.function(autograph=False)
    def eval_loop_fn(iterator, num_sums):
        def body(totals, has_value):
            optional = iterator.get_next_as_optional()
            totals = tf.cond(optional.has_value(),
                             lambda: strategy.run(replica_fn, args=(totals, optional.get_value())),
                             lambda: totals)
            return totals, optional.has_value()

        totals = strategy.run(lambda: tf.zeros([num_sums]))
        totals, _ = tf.while_loop(lambda totals, has_value: has_value, body, (totals, tf.constant(True)))
        return sum_vector.unpack(strategy.reduce(SUM, totals, axis=None))

    def eval_loop(iterator):
        return sum_vector.run(eval_loop_fn, iterator)

    def trace(iterator) -> None:
        """Traces the eval loop for this iterator's type without running it: a task's eval mistake (a shape, a
        key) is raised at start, before any update, rather than at the first eval with the training lost."""
        sum_vector.trace(eval_loop_fn, iterator)

    eval_loop.trace = trace
    eval_loop.tracing_count = eval_loop_fn.experimental_get_tracing_count
    return eval_loop


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


def nonfinite_message(step: int, sums: dict | None, fix: str) -> str:
    """The line of a non-finite loss: with several loss parts, the ones that were not finite (a NaN in one part is
    as often its data, a log of 0 or a division by an empty mask, as the learning rate)."""
    parts = sorted(k.removeprefix("loss_sum/") for k, v in (sums or {}).items()
                   if k.startswith("loss_sum/") and not np.all(np.isfinite(np.asarray(v, dtype=np.float64))))
    if not parts:
        return f"non-finite loss at step {step}; lower the learning rate{fix}"
    named = ", ".join(f"loss/{p}" for p in parts)
    which = "that part" if len(parts) == 1 else "those parts"
    return (f"non-finite loss at step {step} in loss part {named}; check what {which} "
            f"computes and its data (a log of 0, a division by an empty mask, bad values in its inputs), or lower the "
            f"learning rate{fix}")

