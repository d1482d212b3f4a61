"""The step builder: one optimizer update of the train loop, built in one place.

`make_update(strategy, task, model, optimizer, options, sum_vector)` returns `update(state, skipped, next_batch,
i)`, the loop's step i in cross-replica context, for every kind of step:

- k = 1: `strategy.run` of `steps.replica_step` (forward, loss parts, global normalisation, loss scaling,
  gradients, clipping by the norm of the cross-replica sum, apply; or the task's own train_step);
- with `options.skip_nonfinite`: the gradients first, then the update only if every replica's were finite
  (`_apply_unless_nonfinite`, the one place an update is skipped);
- k > 1 (`Accumulated`): k micro-steps of `steps.gradients` summed on each replica, then one update.

The per-replica pieces are `mwloop.step.steps`' (the parameter servers' step and mwloop.testing run
`steps.replica_step` too); `check` holds every refusal of a setting a step cannot honour. `state` is the
loop's per-replica (sums vector, good steps, ok) and `skipped` the count of skipped updates.

Gradient accumulation (k = `optimizer.gradient_accumulation_steps` > 1): one optimizer update per k
micro-batches, on every strategy.

Keras' own `gradient_accumulation_steps` accumulates inside a `tf.cond` of the optimizer, which cannot hold
the cross-replica sum of the gradients under tf.distribute. Here the train loop does it
(`Accumulated` below): each replica sums its gradients over k micro-batches
locally (a `tf.while_loop` of `strategy.run`, no cross-replica traffic), then one
`optimizer.apply_gradients` sums them across replicas and applies one update. The accumulators are loop-local
tensors, never variables: a loop call ends on an update boundary, so a checkpoint never holds a half-filled
accumulator and resume needs nothing new.

`config.train.global_batch_size` (B) stays the effective global batch of one update; a replica's micro-batch
holds B / (replicas x k) examples. The update equals one step on the whole effective batch:

- losses without weights (or with `loss_normalization="batch"`): each micro-batch's loss is divided by the
  effective global count, so the summed gradients are those of the global mean loss as they are;
- `loss_normalization="weights"` (or a loss part with normalizer "weights"): the normaliser is the global
  weight sum over all k micro-batches, known only after the last one. Each micro-batch's weighted loss is
  divided by the constant global count instead, and at the update the summed gradients are multiplied by
  global count / (all-reduced weight sum): one all-reduce per update, of every such part's weight sum. Each
  such part, and the rest (other parts, the model's regularization losses), which must not be rescaled by
  it, then get gradients of their own (a persistent tape). Those gradient groups are learned before the
  loop is traced (`Accumulated.prepare`: one trace of the forward pass on the input's batch spec), for the
  accumulators are built before the micro-step is traced.

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

from mwloop.config import check as config_check
from mwloop.errors import UserError
from mwloop.step import steps
from mwloop.step.steps import StepOptions
from mwloop.task import Batch, Task

SUM = tf.distribute.ReduceOp.SUM


def check(task: Task, options: StepOptions, num_replicas: int) -> None:
    """One-line errors for step options the task's step cannot honour, before anything is built."""
    config_check.check_step(accumulation_steps=options.accumulation_steps,
                            global_batch_size=options.global_batch_size, num_replicas=num_replicas,
                            custom_train_step=steps.custom_step(task), skip_nonfinite=options.skip_nonfinite)


def step_gradients(task: Task, options: StepOptions) -> Callable:
    """compute_gradients(model, optimizer, batch, options) of the task, XLA-compiled with options.jit_compile.

    Without autograph, like the loop's own tf.function: the task's code runs as written whether compiled or
    not, and its errors keep their type and the user's file:line (autograph rewrites them into a StagingError
    of a paragraph, pointing into its generated copies of the user's functions)."""
    return functools.partial(tf.function(steps.compute_gradients, jit_compile=True, autograph=False)
                             if options.jit_compile else steps.compute_gradients, task)


def make_update(strategy: tf.distribute.Strategy, task: Task, model: keras.Model,
                optimizer: keras.optimizers.Optimizer, options: StepOptions, sum_vector) -> "Update":
    """The loop's optimizer update for `options` (see the module docstring); `sum_vector`
    (`mwloop.loop.loops.SumVector`) packs a step's sums into the loop's vector."""
    cls = Update if options.accumulation_steps == 1 else Accumulated
    return cls(strategy, task, model, optimizer, options, sum_vector)


class Update:
    """One update of k = 1 (cross-replica context): `update(state, skipped, next_batch, i)`."""

    def __init__(self, strategy: tf.distribute.Strategy, task: Task, model: keras.Model,
                 optimizer: keras.optimizers.Optimizer, options: StepOptions, sum_vector):
        self.strategy, self.task, self.model, self.optimizer = strategy, task, model, optimizer
        self.options, self.sum_vector = options, sum_vector
        self.compute = step_gradients(task, options)

    def tally(self, state, sums, finite):
        """Adds a step's sums to (stacked sums, steps before the first non-finite one, 1 while none was).

        Why so: every loop variable and op costs ~1 % of an overhead-bound step, so the sums are one
        vector (one add) and the first bad step is the count of good ones before it (no step index).
        """
        totals, good, ok = state
        # A skipped step's NaN must not poison the logged means of the others.
        if self.options.skip_nonfinite:
            sums = {k: tf.where(finite, v, 0.0) for k, v in sums.items()}
        # In "fail" mode a call with a bad step raises, so its (NaN) sums are never read.
        ok = ok * tf.cast(finite, tf.float32)
        return totals + self.sum_vector.pack(sums), good + ok, ok

    # No tensor-dependent control flow: skip its tracing cost.
    @tf.autograph.experimental.do_not_convert
    def _replica_step(self, state, batch):
        sums, finite = steps.replica_step(self.task, self.model, self.optimizer, batch, self.options, self.compute)
        return self.tally(state, sums, finite)

    @tf.autograph.experimental.do_not_convert
    def _replica_gradients(self, state, batch):
        grads, sums, finite = self.compute(self.model, self.optimizer, batch, self.options)
        return grads, self.tally(state, sums, finite), 1.0 - tf.cast(finite, tf.float32)

    def __call__(self, state, skipped, next_batch: Callable, i):
        if not self.options.skip_nonfinite:
            return self.strategy.run(self._replica_step, args=(state, next_batch(i))), skipped
        grads, state, nonfinite = self.strategy.run(self._replica_gradients, args=(state, next_batch(i)))
        return state, _apply_unless_nonfinite(self, grads, nonfinite, skipped)


def _apply_unless_nonfinite(update: Update, grads, nonfinite, skipped):
    """Cross-replica: applies `grads` unless some replica's `nonfinite` is > 0 (one reduce decides it alike
    on every replica); returns `skipped`, plus 1 if this update was skipped."""
    strategy = update.strategy

    def apply():
        strategy.run(functools.partial(steps.apply_gradients, update.model, update.optimizer,
                                       clip_global_norm=update.options.clip_global_norm), args=(grads,))
        return skipped
    return tf.cond(strategy.reduce(SUM, nonfinite, axis=None) == 0, apply, lambda: skipped + 1.0)


@dataclasses.dataclass
class _MicroStepFindings:
    """What the micro-step's trace found out, for the update traced after it in the same loop trace.

    Attributes:
      variables_without_gradient: indices of the variables no loss reaches: None at the update, as without
        accumulation.
      deferred: group -> (weight sum key, global elements, loss weight), as `steps.part_losses` returns it.
    """
    variables_without_gradient: tuple[int, ...] = ()
    deferred: dict = dataclasses.field(default_factory=dict)


class Accumulated(Update):
    """One accumulated optimizer update (the module docstring gives the arithmetic): micro-steps
    i*k .. i*k+k-1 of the call (`next_batch` counts micro-steps), then the update."""

    def __init__(self, *args):
        super().__init__(*args)
        self.k = self.options.accumulation_steps
        # What the accumulators hold: learned by `prepare`.
        self.gradient_groups: tuple | None = None
        self.findings = _MicroStepFindings()
        # autograph=False, as in step_gradients.
        self.micro_gradients = tf.function(self._micro_gradients, jit_compile=True, autograph=False) \
            if self.options.jit_compile else self._micro_gradients

    def prepare(self, batch_spec) -> None:
        """Learns the gradient groups (one accumulator each) from a trace of the forward pass on `batch_spec`
        (one replica's micro-batch), once: the accumulators are built before the micro-step is traced."""
        if self.gradient_groups is None:
            self.gradient_groups = steps.gradient_groups(self.task, self.model, batch_spec, self.options)

    # ---------------------------------------------------------------- replica context
    def _micro_gradients(self, batch: Batch):
        """This replica's gradients of one micro-batch by group, its sums, and whether both are finite. Summed
        over micro-batches and replicas (deferred groups rescaled): the update's gradients."""
        grads, sums, finite, deferred = steps.gradients(self.task, self.model, self.optimizer, batch, self.options,
                                                        defer_weights=True)
        if tuple(grads) != self.gradient_groups:
            raise UserError(f"a step's loss has the gradient groups {tuple(grads)} (None: the parts normalised now; "
                            f"a name: a part normalised by its weight sum), another trace {self.gradient_groups}; "
                            f"return the same loss parts with the same normalizers every step")
        self.findings.deferred = deferred
        return [grads[g] for g in self.gradient_groups], sums, finite

    def _add_micro_batch(self, accumulated, batch: Batch):
        """Adds one micro-batch to this replica's (its micro-batches' summed sums, gradients by group, finite)."""
        self._check_batch(batch)
        update_sums, groups, finite = accumulated
        new_groups, sums, new_finite = self.micro_gradients(batch)
        self.findings.variables_without_gradient = tuple(i for i in range(len(new_groups[0]))
                                                         if all(g[i] is None for g in new_groups))
        added = [[_add(a, g) for a, g in zip(old, new)] for old, new in zip(groups, new_groups)]
        return update_sums + self.sum_vector.pack(sums), added, tf.logical_and(finite, new_finite)

    def _check_batch(self, batch: Batch) -> None:
        """An input built for another k (or none) would train on the wrong examples: refuse it while tracing."""
        want = self.options.global_batch_size // (self.strategy.num_replicas_in_sync * self.k)
        got = tf.nest.flatten(batch)[0].shape[0]
        if got is not None and got != want:
            raise UserError(f"the train input yields per-replica batches of {got} examples; with {self.k} "
                            f"micro-batches per update of {self.options.global_batch_size} on "
                            f"{self.strategy.num_replicas_in_sync} replica(s) they must hold {want}: build the "
                            f"input for micro-batches (mwloop.loop.inputs.train_input does)")

    def _finish(self, state, accumulated):
        """The update's gradients (deferred groups rescaled by their global weight sums), the loop state with
        the update's sums, and 1.0 if this replica saw a non-finite loss or gradient."""
        update_sums, groups, finite = accumulated
        deferred = self.findings.deferred
        # One all-reduce per update of every deferred part's weight sum.
        if deferred:
            local = tf.stack([update_sums[self.sum_vector.keys.index(key)] for key, _, _ in deferred.values()])
            context = tf.distribute.get_replica_context()
            totals = context.all_reduce(SUM, local) if context.num_replicas_in_sync > 1 else local
        grads = None
        for group, group_grads in zip(self.gradient_groups, groups):
            if group in deferred:
                _, elements, weight = deferred[group]
                scale = tf.math.divide_no_nan(float(elements) * weight, totals[list(deferred).index(group)])
                group_grads = [g * scale for g in group_grads]
            grads = group_grads if grads is None else [a + b for a, b in zip(grads, group_grads)]
        # tf.identity: placed on this replica's device. A while loop's outputs carry no device, and the
        # optimizer's all-reduce sends each gradient to its tensor's device (empty: "destinations can not be
        # empty" under MultiWorkerMirroredStrategy with one device per worker).
        grads = [None if i in self.findings.variables_without_gradient else tf.identity(g)
                 for i, g in enumerate(grads)]
        totals_vector, good, ok = state
        # A skipped update's NaN must not poison the logged means of the others.
        if self.options.skip_nonfinite:
            update_sums = tf.where(finite, update_sums, 0.0)
        ok = ok * tf.cast(finite, tf.float32)
        return (totals_vector + update_sums, good + ok, ok), grads, 1.0 - tf.cast(finite, tf.float32)

    def _finish_and_apply(self, state, accumulated):
        state, grads, _ = self._finish(state, accumulated)
        steps.apply_gradients(self.model, self.optimizer, grads, self.options.clip_global_norm)
        return state

    # ---------------------------------------------------------------- cross-replica context
    def __call__(self, state, skipped, next_batch: Callable, i):
        strategy, k = self.strategy, self.k
        if self.gradient_groups is None:
            raise RuntimeError("Accumulated.prepare(batch_spec) must run before the update is traced")

        def zeros(state):
            grads = [tf.zeros(v.shape, v.dtype) for v in self.model.trainable_variables]
            return tf.zeros_like(state[0]), [list(grads) for _ in self.gradient_groups], tf.constant(True)

        def micro_step(j, accumulated):
            batch = next_batch(i * k + j)
            return j + 1, strategy.run(self._add_micro_batch, args=(accumulated, batch))

        _, accumulated = tf.while_loop(lambda j, accumulated: j < k, micro_step,
                                       (tf.zeros([], i.dtype), strategy.run(zeros, args=(state,))))
        if not self.options.skip_nonfinite:
            return strategy.run(self._finish_and_apply, args=(state, accumulated)), skipped
        state, grads, nonfinite = strategy.run(self._finish, args=(state, accumulated))
        # One reduce per update: a bad micro-batch on any replica skips the whole update on every replica.
        return state, _apply_unless_nonfinite(self, grads, nonfinite, skipped)


def _add(accumulated: tf.Tensor, grad) -> tf.Tensor:
    """accumulated + grad, dense (an embedding's IndexedSlices too); a variable without a gradient adds 0."""
    return accumulated if grad is None else accumulated + tf.convert_to_tensor(grad)
