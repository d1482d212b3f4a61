"""Gradient accumulation: one optimizer update per k micro-batches, on every strategy.

Keras' own `gradient_accumulation_steps` accumulates inside a `tf.cond` of the optimizer, which cannot hold
the cross-replica sum of the gradients under tf.distribute. Here the train loop does it: each replica sums
its gradients over k micro-batches locally (a `tf.while_loop` of `strategy.run`, no cross-replica traffic),
then one `optimizer.apply_gradients` sums them across replicas and applies one update. The accumulators are
loop-local tensors, never variables: a loop call ends on an update boundary, so a checkpoint never holds a
half-filled accumulator and resume needs nothing new.

`config.train.global_batch_size` (B) stays the effective global batch of one update; a replica's micro-batch
holds B / (replicas x k) examples. The update equals one step on the whole effective batch:

- losses without weights (or with `loss_normalization="batch"`): each micro-batch's loss is divided by the
  effective global count, so the summed gradients are those of the global mean loss as they are;
- `loss_normalization="weights"`: the normaliser is the global weight sum over all k micro-batches, known
  only after the last one. Each micro-batch's weighted loss is divided by the constant global count instead,
  and at the update the summed gradients are multiplied by global count / (all-reduced weight sum): one
  scalar all-reduce per update. The model's regularization losses, which must not be rescaled, then get
  gradients of their own (only for a task that has both weights and regularization: `Retrace`).

Regularization losses are added divided by k (and by the replicas, `tf.nn.scale_regularization_loss`): the
k micro-batches of every replica add up to one penalty. The step counter, the learning-rate schedule and
every interval count optimizer updates.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import keras
import tensorflow as tf

from mwloop import steps
from mwloop.errors import UserError
from mwloop.task import Batch, Task

SUM = tf.distribute.ReduceOp.SUM


def check(accumulation_steps: int, global_batch_size: int, num_replicas: int, task: Task | None = None) -> None:
    """One-line errors for an accumulation that cannot work: k < 1, a task's own train_step (it applies its
    updates itself), a global batch that does not divide into k micro-batches per replica."""
    k = accumulation_steps
    if not isinstance(k, int) or k < 1:
        raise UserError(f"config.optimizer.gradient_accumulation_steps={k!r}; use 1 (one update per batch) or "
                        f"more micro-batches per update")
    if k == 1:
        return
    if task is not None and task.overrides("train_step"):
        raise UserError(f"task {type(task).__name__} has its own train_step, which applies its updates itself, so "
                        f"mwloop cannot accumulate its gradients; set config.optimizer.gradient_accumulation_steps=1")
    if global_batch_size <= 0 or global_batch_size % (num_replicas * k):
        raise UserError(f"config.train.global_batch_size={global_batch_size} does not divide into {k} micro-batches "
                        f"on each of {num_replicas} replica(s); set it to a multiple of {num_replicas} x {k} = "
                        f"{num_replicas * k}, or change config.optimizer.gradient_accumulation_steps")


class Retrace(Exception):
    """Raised while tracing: the task's loss has weights normalised by their global sum and the model has
    regularization losses, so the update needs their gradients apart; the loop traces again with them."""


@dataclasses.dataclass
class _Trace:
    """What the micro-step's trace found out, for the update traced after it."""
    none_grads: tuple[int, ...] = ()  # variables without a gradient: None at the update, as without accumulation
    global_elements: int | None = None  # set when the gradients await division by the global weight sum


class Update:
    """One accumulated optimizer update inside the train loop's tf.function (cross-replica context).

    `update(state, skipped, next_batch, i, size)` runs micro-steps i*k .. i*k+k-1 of the call
    (`next_batch` counts micro-steps), then the update; `state` is the loop's per-replica
    (sums vector, good steps, ok) and `skipped` the count of skipped updates, as in `loop.make_train_loop`.
    """

    def __init__(self, strategy: tf.distribute.Strategy, task: Task, model: keras.Model,
                 optimizer: keras.optimizers.Optimizer, slots, *, global_batch_size: int,
                 accumulation_steps: int, skip_nonfinite: bool, jit_compile: bool):
        self.strategy, self.task, self.model, self.optimizer = strategy, task, model, optimizer
        self.slots = slots  # the loop's _Slots: where each sum sits in the vector the loop carries
        self.global_batch_size, self.k = global_batch_size, accumulation_steps
        self.skip_nonfinite = skip_nonfinite
        self.separate_regularization = False  # set by `call` when the first trace raised Retrace
        self.trace = _Trace()
        self.micro_gradients = tf.function(self._micro_gradients, jit_compile=True) if jit_compile \
            else self._micro_gradients

    def call(self, traced_call: Callable, *args):
        """`traced_call(*args)`, traced again with separate regularization gradients if a trace asks."""
        try:
            return traced_call(*args)
        except Retrace:
            self.separate_regularization = True
            return traced_call(*args)

    # ---------------------------------------------------------------- replica context
    def _micro_gradients(self, batch: Batch, separate_regularization: bool):
        """This replica's gradients of one micro-batch (and of the regularization apart, or None), its sums,
        and whether both are finite. Summed over micro-batches and replicas: the update's gradients."""
        task, model, variables = self.task, self.model, self.model.trainable_variables
        with tf.GradientTape(persistent=separate_regularization) as tape:
            outputs = task.forward(model, batch, training=True)
            losses, weights = steps.per_example_loss(task, batch, outputs)
            # "batch": divided by the effective global count, no all-reduce; exact unless deferred below.
            loss, sums = steps.weighted_loss(losses, weights, self.global_batch_size, "batch")
            deferred = weights is not None and task.loss_normalization == "weights"
            self.trace.global_elements = steps.num_global_elements(losses, self.global_batch_size) if deferred \
                else None
            regularization = (tf.nn.scale_regularization_loss(tf.add_n(model.losses)) / self.k
                              if model.losses else None)
            apart = deferred and regularization is not None
            if apart and not separate_regularization:
                raise Retrace()
            if regularization is not None and not apart:
                loss += regularization
            scaled_loss = self.optimizer.scale_loss(loss)
            scaled_regularization = self.optimizer.scale_loss(regularization) if apart else None
        grads = tape.gradient(scaled_loss, variables)
        regularization_grads = tape.gradient(scaled_regularization, variables) if apart else None
        sums = steps.with_metrics(task, batch, outputs, losses, weights, sums)
        total = loss + regularization if apart else loss
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            finite = tf.math.is_finite(total)  # overflowing scaled gradients: the optimizer skips the update
        else:
            finite = tf.math.is_finite(tf.add_n([total] + [tf.reduce_sum(g) for g in grads + (
                regularization_grads or []) if g is not None]))
        return grads, regularization_grads, sums, finite

    def _add_micro_batch(self, accumulated, batch: Batch, size: int):
        """Adds one micro-batch to this replica's (sums vector, gradients, [regularization gradients], finite)."""
        self._check_batch(batch)
        sums_vector, grads, *regularization, finite = accumulated
        new_grads, new_regularization, sums, new_finite = self.micro_gradients(batch, self.separate_regularization)
        self.trace.none_grads = tuple(i for i, g in enumerate(new_grads) if g is None)
        added = [_add(a, g) for a, g in zip(grads, new_grads)]
        if regularization:
            regularization = [[_add(a, g) for a, g in zip(regularization[0], new_regularization)]]
        return (sums_vector + self.slots.pack(sums, size), added, *regularization, tf.logical_and(finite, new_finite))

    def _check_batch(self, batch: Batch) -> None:
        """An input built for another k (or none) would train on the wrong examples: refuse it while tracing."""
        want = self.global_batch_size // (self.strategy.num_replicas_in_sync * self.k)
        got = tf.nest.flatten(batch)[0].shape[0]
        if got is not None and got != want:
            raise UserError(f"the train input yields per-replica batches of {got} examples; with {self.k} "
                            f"micro-batches per update of {self.global_batch_size} on "
                            f"{self.strategy.num_replicas_in_sync} replica(s) they must hold {want}: build the input "
                            f"for micro-batches (mwloop.inputs.train_input does)")

    def _finish(self, state, accumulated):
        """The update's gradients (rescaled by the global weight sum if deferred), the loop state with the
        update's sums, and 1.0 if this replica saw a non-finite loss or gradient."""
        sums_vector, grads, *regularization, finite = accumulated
        if self.trace.global_elements is not None:  # one scalar all-reduce per update
            local = sums_vector[self.slots.keys.index("weight_sum")]
            context = tf.distribute.get_replica_context()
            total = context.all_reduce(SUM, local) if context.num_replicas_in_sync > 1 else local
            scale = tf.math.divide_no_nan(float(self.trace.global_elements), total)
            grads = [g * scale for g in grads]
            if regularization:
                grads = [g + r for g, r in zip(grads, regularization[0])]
        # tf.identity: placed on this replica's device. A while loop's outputs carry no device, and the
        # optimizer's all-reduce sends each gradient to its tensor's device (empty: "destinations can not be
        # empty" under MultiWorkerMirroredStrategy with one device per worker).
        grads = [None if i in self.trace.none_grads else tf.identity(g) for i, g in enumerate(grads)]
        totals, good, ok = state
        if self.skip_nonfinite:  # a skipped update's NaN must not poison the logged means of the others
            sums_vector = tf.where(finite, sums_vector, 0.0)
        ok = ok * tf.cast(finite, tf.float32)
        return (totals + sums_vector, good + ok, ok), grads, 1.0 - tf.cast(finite, tf.float32)

    def _finish_and_apply(self, state, accumulated):
        state, grads, _ = self._finish(state, accumulated)
        steps.apply_gradients(self.model, self.optimizer, grads)
        return state

    # ---------------------------------------------------------------- cross-replica context
    def __call__(self, state, skipped, next_batch: Callable, i, size: int):
        strategy, k = self.strategy, self.k

        def zeros():
            grads = [tf.zeros(v.shape, v.dtype) for v in self.model.trainable_variables]
            regularization = [[tf.zeros_like(g) for g in grads]] if self.separate_regularization else []
            return (tf.zeros([size]), grads, *regularization, tf.constant(True))

        def micro_step(j, accumulated):
            batch = next_batch(i * k + j)
            return j + 1, strategy.run(self._add_micro_batch, args=(accumulated, batch, size))

        _, accumulated = tf.while_loop(lambda j, accumulated: j < k, micro_step,
                                       (tf.zeros([], i.dtype), strategy.run(zeros)))
        if not self.skip_nonfinite:
            return strategy.run(self._finish_and_apply, args=(state, accumulated)), skipped
        state, grads, nonfinite = strategy.run(self._finish, args=(state, accumulated))

        def apply():
            strategy.run(functools.partial(steps.apply_gradients, self.model, self.optimizer), args=(grads,))
            return skipped
        # One reduce per update: a bad micro-batch on any replica skips the whole update on every replica.
        return state, tf.cond(strategy.reduce(SUM, nonfinite, axis=None) == 0, apply, lambda: skipped + 1.0)


def _add(accumulated: tf.Tensor, grad) -> tf.Tensor:
    """accumulated + grad, dense (an embedding's IndexedSlices too); a variable without a gradient adds 0."""
    return accumulated if grad is None else accumulated + tf.convert_to_tensor(grad)
