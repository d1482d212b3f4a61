"""A task's real step run as the loop runs it, on 1 replica with the whole global batch or on N (logical CPU
devices) with consecutive slices of it, from the same seeded initial weights; and one plain-SGD update of it
(`_sgd_probe`) on N replicas against 1 (`_updates`). mwloop.testing's checks and diagnosis build on these;
the public names are importable from mwloop.testing.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from mwloop.cluster import distribute
from mwloop.run import state
from mwloop.step import steps
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
    """What `train_steps` returns: the weights after the steps, the reported metrics of the last, and its
    sums (reduced over the replicas, before `finalize`); `linear`: whether the optimizer's update is linear
    in the gradient (SGD, with or without momentum), so that equal gradients give equal weights to float noise.
    """
    weights: list[np.ndarray]
    metrics: dict[str, float]
    sums: dict[str, float] = dataclasses.field(default_factory=dict)
    linear: bool = True


def _linear(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether the optimizer's update is linear in the gradient (Keras' SGD; under a LossScaleOptimizer, its
    inner one)."""
    return isinstance(getattr(optimizer, "inner_optimizer", optimizer), keras.optimizers.SGD)


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
    # The replica step the loop runs (mwloop.loop.update builds the loop's from it).
    def step(batch):
        sums = strategy.run(lambda b: steps.replica_step(task, built.model, built.optimizer, b, options)[0],
                            args=(batch,))
        return {k: strategy.reduce(SUM, v, axis=None) for k, v in sums.items()}

    sums = None
    for _ in range(num_steps):
        sums = step(batch)
    sums = {k: float(v.numpy()) for k, v in sums.items()} if sums else {}
    metrics = steps.finalize(task, sums) if sums else {}
    return StepResult([v.numpy() for v in built.model.trainable_variables], metrics, sums,
                      _linear(built.optimizer))


def relative_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Largest |a - b| over all the arrays, relative to the largest |b| (0 when both are all zeros).

    One scale for all the weights: a variable whose gradient is zero in theory (an attention's key bias)
    stays near 0 with float noise, which a per-variable ratio would inflate to order 1.
    """
    scale = max((float(np.max(np.abs(x), initial=0.0)) for x in b), default=0.0)
    largest = max((float(np.max(np.abs(x - y), initial=0.0)) for x, y in zip(a, b)), default=0.0)
    return largest / scale if scale else largest


def _sgd_probe(task: Task, loss_weights: dict[str, float] | None = None) -> Task:
    """The task with plain SGD (no momentum, clipping, EMA, schedule; a learning rate of 100, so the update
    dwarfs the weights' float rounding), so one update is -lr x the gradient
    the step computed, whatever optimizer the config names; optionally other loss weights."""
    config = copy.deepcopy(task.config)
    config.optimizer.update({"name": "sgd", "learning_rate": 100.0, "momentum": 0.0, "nesterov": False,
                             "schedule": "constant", "warmup_steps": 0, "clip_global_norm": 0.0, "ema": False})
    probe = copy.copy(task)
    probe.config = config
    if loss_weights is not None:
        probe.loss_weights = lambda: dict(loss_weights)
    return probe


@dataclasses.dataclass
class _Updates:
    """One update of a probe (`_sgd_probe`: the update is the gradient) on N replicas against 1: the N-replica
    update ~= `ratio` x the 1-replica one plus a `residual` that is no multiple of it (its norm relative to the
    1-replica update's), `difference` = max(|ratio - 1|, residual); and both runs."""
    ratio: float
    residual: float
    difference: float
    single: StepResult
    multi: StepResult


def _updates(task: Task, global_batch: Any, num_replicas: int, seed: int,
             initial: list[np.ndarray] | None = None) -> _Updates:
    if initial is None:
        initial = train_steps(task, global_batch, num_replicas=1, num_steps=0, seed=seed).weights
    single = train_steps(task, global_batch, num_replicas=1, seed=seed)
    multi = train_steps(task, global_batch, num_replicas=num_replicas, seed=seed)
    d_single = np.concatenate([(a - b).ravel() for a, b in zip(single.weights, initial)]).astype(np.float64)
    d_multi = np.concatenate([(a - b).ravel() for a, b in zip(multi.weights, initial)]).astype(np.float64)
    norm = float(np.dot(d_single, d_single)) ** 0.5
    if not norm:
        return _Updates(1.0, 0.0, 0.0, single, multi)
    ratio = float(np.dot(d_multi, d_single)) / norm ** 2
    residual = float(np.linalg.norm(d_multi - ratio * d_single)) / norm
    return _Updates(ratio, residual, max(abs(ratio - 1.0), residual), single, multi)
