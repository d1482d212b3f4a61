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
    sums (reduced over the replicas, before `finalize`)."""
    weights: list[np.ndarray]
    metrics: dict[str, float]
    sums: dict[str, float] = dataclasses.field(default_factory=dict)


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
    def step(batch):  # the replica step the loop runs (mwloop.loop.update builds the loop's from it)
        sums = strategy.run(lambda b: steps.replica_step(task, built.model, built.optimizer, b, options)[0],
                            args=(batch,))
        return {k: strategy.reduce(SUM, v, axis=None) for k, v in sums.items()}

    sums = None
    for _ in range(num_steps):
        sums = step(batch)
    sums = {k: float(v.numpy()) for k, v in sums.items()} if sums else {}
    metrics = steps.finalize(task, sums) if sums else {}
    return StepResult([v.numpy() for v in built.model.trainable_variables], metrics, sums)


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
    """Asserts that the task's real step (mwloop's, through `compute_loss`, or its own `train_step`) on
    `num_replicas` x B/N equals 1 replica x B: the updated weights (relative to the largest weight) and every
    reported metric to `rtol`. On failure the message names the likely cause (`diagnose`).

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
    if bad:
        causes = diagnose(task, global_batch, num_replicas=num_replicas, seed=seed)
        raise AssertionError(f"{num_replicas} replicas differ from 1 by more than {rtol} (relative): {bad}; "
                             f"likely cause: {'; '.join(causes) or 'unknown (no single-step symptom)'}")
    return figures


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


def _update_ratio(task: Task, global_batch: Any, num_replicas: int, seed: int) -> tuple[float, float, StepResult,
                                                                                       StepResult]:
    """One SGD update on N replicas against 1: (r, residual) with multi-update ~= r x single update, residual
    the part that is not a multiple of it (relative to the single update's norm), and both results."""
    initial = train_steps(task, global_batch, num_replicas=1, num_steps=0, seed=seed).weights
    single = train_steps(task, global_batch, num_replicas=1, seed=seed)
    multi = train_steps(task, global_batch, num_replicas=num_replicas, seed=seed)
    d_single = np.concatenate([(a - b).ravel() for a, b in zip(single.weights, initial)]).astype(np.float64)
    d_multi = np.concatenate([(a - b).ravel() for a, b in zip(multi.weights, initial)]).astype(np.float64)
    norm = float(np.dot(d_single, d_single))
    if not norm:
        return 1.0, 0.0, single, multi
    ratio = float(np.dot(d_multi, d_single)) / norm
    residual = float(np.linalg.norm(d_multi - ratio * d_single)) / norm ** 0.5
    return ratio, residual, single, multi


def _update_cause(ratio: float, residual: float, num_replicas: int, what: str, tolerance: float) -> str | None:
    """The likely cause of an update `ratio` x the 1-replica update (with a `residual` that is no multiple)."""
    if residual <= tolerance and abs(ratio - 1.0) <= tolerance:
        return None
    if residual <= 0.05 and abs(ratio - num_replicas) <= 0.05 * num_replicas:
        return (f"{what} update is {ratio:.3f}x the 1-replica update on {num_replicas} replicas: divided per replica "
                f"(by the per-replica batch or a per-replica mean) instead of the global count; return unreduced "
                f"values (mwloop divides by the global count), or in a custom step use mwloop.weighted_loss "
                f"with the global batch size")
    if residual <= 0.05 and abs(ratio - 1.0 / num_replicas) <= 0.05 / num_replicas:
        return (f"{what} update is {ratio:.3f}x the 1-replica update: divided by the number of replicas twice "
                f"(mwloop's global normalisation already accounts for them)")
    if residual > tolerance:
        return (f"{what} update is no multiple of the 1-replica update (residual {residual:.3g}, ratio "
                f"{ratio:.3f}): normalised by a count of each replica's own data, e.g. per-token losses divided "
                f"by each replica's own token count or weight sum, or one loss part divided by the local batch; "
                f"normalise by the global count (LossPart normalizer 'weights' / 'batch', or "
                f"mwloop.weighted_loss in a custom step)")
    return f"{what} update is {ratio:.3f}x the 1-replica update on {num_replicas} replicas"


def diagnose(task: Task, global_batch: Any, *, num_replicas: int = 2, seed: int = 0,
             tolerance: float = 1e-4) -> list[str]:
    """Likely causes of the task's step on N replicas differing from 1, from one plain-SGD update of its real
    step (so an update is the step's gradient): an update N times too large (a loss divided per replica), one
    that is no multiple of the 1-replica update (a per-replica normaliser: each replica's own token count,
    a part divided by the local batch), each loss part alone (mwloop's step with loss parts), and sums that
    are not additive (a metric_sums mean: N times the 1-replica sum). Empty if nothing looks wrong."""
    causes = []
    probe = _sgd_probe(task)
    ratio, residual, single, multi = _update_ratio(probe, global_batch, num_replicas, seed)
    cause = _update_cause(ratio, residual, num_replicas, "the", tolerance)
    parts = sorted(k[len("loss_sum/"):] for k in single.sums if k.startswith("loss_sum/"))
    if cause and parts and not steps.custom_step(task):  # which part: each alone (the others weigh 0)
        for part in parts:
            alone = _sgd_probe(task, {p: float(p == part) for p in parts})
            part_cause = _update_cause(*_update_ratio(alone, global_batch, num_replicas, seed)[:2], num_replicas,
                                       f"loss part {part!r}:", tolerance)
            if part_cause:
                causes.append(part_cause)
    if cause and not causes:
        causes.append(cause)
    for key, value in single.sums.items():
        got = multi.sums.get(key)
        if got is None or abs(got - value) <= tolerance * max(abs(value), 1e-12):
            continue
        built_in = key in ("loss_sum", "weight_sum", "examples") or key.startswith(("loss_sum/", "weight_sum/"))
        if built_in and cause:  # the loss sums of a misscaled loss: the update's cause says it
            continue
        source = "the step's" if built_in else "metric_sums'"
        factor = got / value if value else float("inf")
        if abs(factor - num_replicas) <= 0.05 * num_replicas:
            causes.append(f"{source} sum {key!r} is {factor:.3f}x the 1-replica sum on {num_replicas} replicas: a "
                          f"per-replica mean (or another non-additive value), not a sum; return "
                          f"reduce_sum(... * weights) and divide in finalize")
        else:
            causes.append(f"{source} sum {key!r} is {got:.6g} on {num_replicas} replicas and {value:.6g} on 1: not "
                          f"additive over replicas (a mean, max or ratio?); return sums, divide in finalize")
    return causes


def assert_loss_scaled_by_global_batch(task: Task, global_batch: Any, *, num_replicas: int = 2,
                                       rtol: float = 1e-6, seed: int = 0) -> float:
    """Asserts that one update of the task's real step (mwloop's, through `compute_loss`, or its own
    `train_step`) on N replicas equals the 1-replica update of the whole batch: that the replicas' gradients
    add up to the gradient of the global mean loss. Runs the step with plain SGD (one update = the gradient).

    A loss divided by the per-replica batch gives an update N times too large; one divided by each replica's
    own token count (or one part divided by the local batch) an update that is no multiple of it; the
    failure names the likely cause (and the part, for mwloop's step with loss parts).

    Returns:
      The largest difference of the N-replica update from the 1-replica one, relative to its norm.
    """
    ratio, residual, _, _ = _update_ratio(_sgd_probe(task), global_batch, num_replicas, seed)
    difference = max(abs(ratio - 1.0), residual)
    if difference > rtol:
        causes = [c for c in diagnose(task, global_batch, num_replicas=num_replicas, seed=seed, tolerance=rtol)
                  if "sum" not in c.split(":")[0]] or [f"the update is {ratio:.6f}x (residual {residual:.3g})"]
        raise AssertionError(f"the {num_replicas} replicas' update differs from the 1-replica update of the global "
                             f"batch by {difference:.3g}: the loss is not scaled by the global count; likely "
                             f"cause: {'; '.join(causes)}")
    return difference
