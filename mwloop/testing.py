"""Helpers for unit tests of a user's task and step functions.

Typical use (pytest):

    # conftest.py, before anything starts TensorFlow's runtime
    import mwloop.testing
    mwloop.testing.split_cpu(2)

    # test_my_task.py
    def test_two_replicas_equal_one():
        task = MyTask(my_config.get_config())
        figures = mwloop.testing.assert_replicas_agree(task, global_batch, num_replicas=2)
        mwloop.testing.assert_loss_scaled_by_global_batch(task, global_batch, num_replicas=2)

The checks run the task's real per-replica train step (mwloop's, or the task's
own `train_step`) as the loop runs it: on 1 replica with the whole global batch
and on N replicas (logical CPU devices) with consecutive slices of it, from the
same initial weights. Randomness inside the step (dropout) and per-replica
statistics (BatchNormalization, unless synchronized) legitimately differ
between the two; test with them off.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from mwloop import distribute, state, steps
from mwloop.task import Task

SUM = tf.distribute.ReduceOp.SUM
_strategies: dict[int, tf.distribute.Strategy] = {}


def split_cpu(num_devices: int) -> None:
    """Splits the CPU into `num_devices` logical devices, so MirroredStrategy has that many replicas.

    Call before TensorFlow's runtime starts (at the top of conftest.py, or first thing in a fresh
    process); later it raises RuntimeError naming the fix.
    """
    distribute.configure_cpu_devices(num_devices)


def replica_strategy(num_replicas: int) -> tf.distribute.Strategy:
    """The default strategy for 1 replica, else a MirroredStrategy over `num_replicas` logical CPUs.

    One strategy per size and process: several MirroredStrategies in one process share collective keys
    and can abort each other's all-reduces.
    """
    if num_replicas == 1:
        return tf.distribute.get_strategy()
    cpus = tf.config.list_logical_devices("CPU")
    if len(cpus) < num_replicas:
        raise RuntimeError(f"{num_replicas} replicas need {num_replicas} logical CPU devices, this process has "
                           f"{len(cpus)}; call mwloop.testing.split_cpu({num_replicas}) before TensorFlow starts "
                           f"(top of conftest.py)")
    if num_replicas not in _strategies:
        _strategies[num_replicas] = tf.distribute.MirroredStrategy([d.name for d in cpus[:num_replicas]])
    return _strategies[num_replicas]


def distribute_batch(strategy: tf.distribute.Strategy, global_batch: Any) -> Any:
    """A global batch (a nest of arrays) as per-replica values: replica r gets the r-th consecutive slice."""
    num_replicas = strategy.num_replicas_in_sync
    sizes = {len(v) for v in tf.nest.flatten(global_batch)}
    if len(sizes) != 1 or next(iter(sizes)) % num_replicas:
        raise ValueError(f"batch sizes {sorted(sizes)} do not divide into {num_replicas} equal replica slices")
    per_replica = next(iter(sizes)) // num_replicas

    def slice_for(ctx: tf.distribute.ValueContext):
        r = ctx.replica_id_in_sync_group
        return tf.nest.map_structure(lambda v: tf.constant(np.asarray(v)[r * per_replica:(r + 1) * per_replica]),
                                     global_batch)
    return strategy.experimental_distribute_values_from_function(slice_for)


@dataclasses.dataclass
class StepResult:
    """What `train_steps` returns: the weights after the steps and the reported metrics of the last."""
    weights: list[np.ndarray]
    metrics: dict[str, float]


def train_steps(task: Task, global_batch: Any, *, num_replicas: int = 1, num_steps: int = 1,
                seed: int = 0) -> StepResult:
    """Builds the task's model and optimizer (from `task.config`, seeded) on `num_replicas` replicas and
    runs its train step `num_steps` times on `global_batch`.

    Args:
      task: the task under test; its config gives the optimizer.
      global_batch: a nest of arrays, the whole global batch (its size is the global batch size).
      num_replicas: replicas the batch is split over (logical CPU devices; see `split_cpu`).
      num_steps: updates on the same batch.
      seed: Keras' seed for the initial weights.
    Returns:
      The trainable weights after the steps, and the last step's finalized metrics.
    """
    strategy = replica_strategy(num_replicas)
    global_batch_size = len(tf.nest.flatten(global_batch)[0])
    keras.utils.set_random_seed(seed)
    built = state.create(task.config, strategy, task)
    batch = distribute_batch(strategy, global_batch)

    options = steps.StepOptions.from_config(task.config, global_batch_size=global_batch_size, accumulation_steps=1,
                                            skip_nonfinite=False, jit_compile=False)

    @tf.function
    def step(batch):  # the replica step the loop runs (mwloop.update builds the loop's from it)
        sums = strategy.run(lambda b: steps.replica_step(task, built.model, built.optimizer, b, options)[0],
                            args=(batch,))
        return {k: strategy.reduce(SUM, v, axis=None) for k, v in sums.items()}

    sums = None
    for _ in range(num_steps):
        sums = step(batch)
    metrics = steps.finalize(task, {k: v.numpy() for k, v in sums.items()}) if sums else {}
    return StepResult([v.numpy() for v in built.model.trainable_variables], metrics)


def relative_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Largest |a - b| over all the arrays, relative to the largest |b| (0 when both are all zeros).

    One scale for all the weights: a variable whose gradient is zero in theory (an attention's key bias)
    stays near 0 with float noise, which a per-variable ratio would inflate to order 1.
    """
    scale = max((float(np.max(np.abs(x), initial=0.0)) for x in b), default=0.0)
    largest = max((float(np.max(np.abs(x - y), initial=0.0)) for x, y in zip(a, b)), default=0.0)
    return largest / scale if scale else largest


def assert_replicas_agree(task: Task, global_batch: Any, *, num_replicas: int = 2, num_steps: int = 1,
                          rtol: float = 1e-5, seed: int = 0) -> dict[str, float]:
    """Asserts that the task's step on `num_replicas` x B/N equals 1 replica x B: the updated weights
    (relative to the largest weight) and every reported metric to `rtol`.

    Use SGD in the task's config for this check: Adam divides each gradient by its own running scale,
    so a gradient that is zero in theory turns float noise into full-size steps.

    Returns:
      The figures: `weights` (largest relative difference over the variables) and one per metric.
    """
    single = train_steps(task, global_batch, num_replicas=1, num_steps=num_steps, seed=seed)
    multi = train_steps(task, global_batch, num_replicas=num_replicas, num_steps=num_steps, seed=seed)
    initial = train_steps(task, global_batch, num_replicas=1, num_steps=0, seed=seed).weights
    assert relative_difference(single.weights, initial) > rtol, \
        "the step did not move the weights: nothing would be compared"
    figures = {"weights": relative_difference(multi.weights, single.weights)}
    assert multi.metrics.keys() == single.metrics.keys(), (multi.metrics.keys(), single.metrics.keys())
    for key, value in single.metrics.items():
        figures[key] = abs(multi.metrics[key] - value) / max(abs(value), 1e-12)
    bad = {k: v for k, v in figures.items() if v > rtol}
    assert not bad, f"{num_replicas} replicas differ from 1 by more than {rtol} (relative): {bad}"
    return figures


def assert_loss_scaled_by_global_batch(task: Task, global_batch: Any, *, num_replicas: int = 2,
                                       rtol: float = 1e-6, seed: int = 0) -> float:
    """Asserts that the losses the replicas differentiate add up to the 1-replica loss of the whole batch.

    That is what makes the summed gradients those of the global mean loss: a loss divided by the
    per-replica batch (or by a replica's own token count) adds up to N times too much (or to a
    padding-dependent mix). Uses mwloop's loss scaling (`steps.weighted_loss`) on the task's loss.

    Returns:
      The relative difference between the summed per-replica losses and the 1-replica loss.
    """
    global_batch_size = len(tf.nest.flatten(global_batch)[0])
    totals = []
    for replicas in (1, num_replicas):
        strategy = replica_strategy(replicas)
        keras.utils.set_random_seed(seed)
        with strategy.scope():
            model = task.build_model()

        def replica_loss(batch):
            losses, weights = steps.per_example_loss(task, batch, task.forward(model, batch, training=False))
            return steps.weighted_loss(losses, weights, global_batch_size, task.loss_normalization)[0]

        per_replica = tf.function(lambda b: strategy.reduce(SUM, strategy.run(replica_loss, args=(b,)), axis=None))
        totals.append(float(per_replica(distribute_batch(strategy, global_batch))))
    difference = abs(totals[1] - totals[0]) / max(abs(totals[0]), 1e-12)
    assert difference <= rtol, (f"the {num_replicas} replicas' losses add up to {totals[1]}, the 1-replica loss "
                                f"of the global batch is {totals[0]}: the loss is not scaled by the global count")
    return difference
