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

What N replicas must agree on with 1, whatever the optimizer: the gradient the optimizer is given (the
cross-replica sum, measured as one update of plain SGD, which is the gradient), the loss and every reported
metric. The weights after the steps are compared too when the optimizer is SGD (linear in the gradient, so
float noise stays float noise); an adaptive optimizer (Adam, Lion, ...) turns float noise in a gradient that
is zero in theory into full-size steps (Adam's first step is ~lr x sign(g)), so its weights are reported,
not compared.
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
from mwloop.step import losses, steps
from mwloop.task import Task, TaskError

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


def assert_replicas_agree(task: Task, global_batch: Any, *, num_replicas: int = 2, num_steps: int = 1,
                          rtol: float = 1e-5, seed: int = 0) -> dict[str, float]:
    """Asserts that the task's real step (mwloop's, through `compute_loss`, or its own `train_step`) on
    `num_replicas` x B/N trains like 1 replica x B, from the same initial weights, on what N replicas must agree
    on whatever the optimizer, each to `rtol`:

    - the gradients: the gradient the optimizer is given (the replicas' gradients summed across replicas)
      against the 1-replica gradient of the whole batch, from one update of the real step with plain SGD (an
      update is then -lr x that gradient), before an adaptive optimizer could turn float noise into full-size
      steps; the figure `assert_loss_scaled_by_global_batch` returns (g_N = r x g_1 + a residual:
      max(|r - 1|, |residual| / |g_1|));
    - the loss and every reported metric of the last of `num_steps` steps with the task's own optimizer
      (relative to the 1-replica value);
    - `weights` after those steps (the largest difference relative to the largest weight), when the optimizer
      is SGD. Any other (Adam, Lion, ...) divides each gradient by its own scale: float noise of 1e-9 in a
      gradient that is zero in theory becomes a full-size step (Adam's first is ~lr x sign(g)), so with them
      the figure is returned but not compared.

    Fails too if the step did not move the weights. On failure the message names the likely cause (`diagnose`).

    Returns:
      The figures: `weights` and one per reported metric (the gradients' is
      `assert_loss_scaled_by_global_batch`'s; a failure's message shows it as `gradients`).
    """
    initial = train_steps(task, global_batch, num_replicas=1, num_steps=0, seed=seed).weights
    single = train_steps(task, global_batch, num_replicas=1, num_steps=num_steps, seed=seed)
    multi = train_steps(task, global_batch, num_replicas=num_replicas, num_steps=num_steps, seed=seed)
    assert relative_difference(single.weights, initial) > rtol, \
        "the step did not move the weights: nothing would be compared"
    updates = _updates(_sgd_probe(task), global_batch, num_replicas, seed, initial)
    figures = {"weights": relative_difference(multi.weights, single.weights)}
    assert multi.metrics.keys() == single.metrics.keys(), (multi.metrics.keys(), single.metrics.keys())
    for key, value in single.metrics.items():
        figures[key] = abs(multi.metrics[key] - value) / max(abs(value), 1e-12)
    compared = {"gradients": updates.difference, **figures}
    bad = {k: v for k, v in compared.items() if v > rtol and (k != "weights" or single.linear)}
    if bad:
        causes, _ = _diagnose(task, global_batch, num_replicas, seed, 1e-4, updates)
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


def _compare_rows(single: np.ndarray, per_replica: list[np.ndarray], tolerance: float) -> tuple[str, float] | None:
    """One replica's values of the whole batch (`single`) against the N replicas' values of their slices:
    ("same" | "scaled" (by one factor per replica) | "differs", the largest difference relative to the
    largest 1-replica value); None for values that are not one row per example."""
    if sum(len(v) for v in per_replica) != len(single):
        return None
    if any(v.shape[1:] != single.shape[1:] for v in per_replica):
        # A [b, b] loss: each replica's values cover its own examples only.
        return "differs", float("inf")
    scale = max(float(np.max(np.abs(single), initial=0.0)), 1e-12)
    verdict, largest, start = "same", 0.0, 0
    for values in per_replica:
        got = values.astype(np.float64).ravel()
        want = single[start:start + len(values)].astype(np.float64).ravel()
        start += len(values)
        largest = max(largest, float(np.max(np.abs(got - want), initial=0.0)) / scale)
        if float(np.max(np.abs(got - want), initial=0.0)) <= tolerance * scale:
            continue
        norm = float(np.dot(want, want))
        factor = float(np.dot(got, want)) / norm if norm else 0.0
        scaled = float(np.max(np.abs(got - factor * want), initial=0.0)) <= tolerance * scale
        verdict = "scaled" if scaled and verdict != "differs" else "differs"
    return verdict, largest


@dataclasses.dataclass
class _Examples:
    """Whether each example's values on N replicas are those of 1 replica with the whole batch, from the same
    weights: `outputs` (the model's outputs with one row per example, "same" or "differs") and `parts` (part
    -> the per-example losses' verdict, "" for a single loss), each with its largest relative difference
    (`_compare_rows`)."""
    outputs: tuple[str, float]
    parts: dict[str, tuple[str, float]]


def _per_example(task: Task, global_batch: Any, num_replicas: int, seed: int) -> dict:
    """The task's model outputs and per-example (weighted) losses of its forward pass (`compute_loss`) from the
    initial weights, on `num_replicas`: {"outputs": [per output: [per replica: array]], "parts": {...}}."""
    strategy = replica_strategy(num_replicas)
    keras.utils.set_random_seed(seed)
    built = state.create(task.config, strategy, task)

    def replica(batch):
        parts, outputs = losses.compute_loss(task, built.model, batch, training=True)
        values = {"" if name is None else name: part.values if part.weights is None else part.values * part.weights
                  for name, part in parts.items()}
        rows = [o for o in tf.nest.flatten(outputs) if isinstance(o, tf.Tensor) and o.shape.rank]
        return {"outputs": rows, "parts": values}

    result = tf.function(lambda batch: strategy.run(replica, args=(batch,)))(distribute_batch(strategy,
                                                                                                 global_batch))
    return tf.nest.map_structure(lambda v: [x.numpy() for x in strategy.experimental_local_results(v)], result)


def _examples(task: Task, global_batch: Any, num_replicas: int, seed: int, tolerance: float = 1e-4
              ) -> _Examples | None:
    """The per-example comparison (`_Examples`) of the task's loss, or None if it has none to call (a custom
    train_step alone) or it cannot be called outside its step."""
    if not (task.overrides("loss") or task.overrides("compute_loss")):
        return None
    try:
        single = _per_example(task, global_batch, 1, seed)
        multi = _per_example(task, global_batch, num_replicas, seed)
    except TaskError:
        return None
    outputs = [_compare_rows(s[0], m, tolerance) for s, m in zip(single["outputs"], multi["outputs"])]
    worst = max(filter(None, outputs), key=lambda o: (o[0] != "same", o[1]), default=("same", 0.0))
    parts = {name: _compare_rows(values[0], multi["parts"][name], tolerance) or ("same", 0.0)
             for name, values in single["parts"].items()}
    return _Examples(("same" if worst[0] == "same" else "differs", worst[1]), parts)


GATHER = ("the loss of an example depends on other examples of its replica only: gather across replicas "
          "(mwloop.gather_global_batch)")


def _update_cause(updates: _Updates, num_replicas: int, what: str, tolerance: float,
                  examples=lambda: None, part: str | None = None) -> str | None:
    """The likely cause of an update `ratio` x the 1-replica update (with a `residual` that is no multiple);
    `examples()` the per-example comparison (`_examples`, or None), asked only for an update that is no
    multiple, of `part` (None: any part)."""
    ratio, residual = updates.ratio, updates.residual
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
        update = f"{what} update is no multiple of the 1-replica update (residual {residual:.3g}, ratio {ratio:.3f})"
        found = examples()
        if found is not None and found.outputs[0] == "differs":
            return (f"{update}, and the model's outputs of each example differ from the 1-replica ones by "
                    f"{found.outputs[1]:.3g}: the model's output for an example depends on other examples of its "
                    f"replica, e.g. per-replica batch statistics (BatchNormalization: use synchronized=True), or "
                    f"on random numbers (dropout: turn it off for this check)")
        verdicts = [] if found is None else [v for name, v in found.parts.items() if part in (None, name)]
        differs = [v for v in verdicts if v[0] == "differs"]
        if differs:
            return (f"{update}, and the per-example losses differ from those of the whole batch on 1 replica by "
                    f"{max(v[1] for v in differs):.3g}, by no factor per replica: {GATHER}")
        return (f"{update}: normalised by a count of each replica's own data, e.g. per-token losses divided "
                f"by each replica's own token count or weight sum, or one loss part divided by the local batch; "
                f"normalise by the global count (LossPart normalizer 'weights' / 'batch', or "
                f"mwloop.weighted_loss in a custom step)" + (f"; or, if the loss compares examples (in-batch "
                                                             f"negatives), {GATHER}" if found is None else ""))
    return f"{what} update is {ratio:.3f}x the 1-replica update on {num_replicas} replicas"


def diagnose(task: Task, global_batch: Any, *, num_replicas: int = 2, seed: int = 0,
             tolerance: float = 1e-4) -> list[str]:
    """Likely causes of the task's step on N replicas differing from 1, from one plain-SGD update of its real
    step (so an update is the step's gradient): an update N times too large (a loss divided per replica); one
    that is no multiple of the 1-replica update, told apart by the per-example losses of the task's loss (from
    the same weights, N replicas' against those of the whole batch on 1): equal or off by one factor per
    replica, a per-replica normaliser (each replica's own token count, a part divided by the local batch);
    otherwise a loss of an example that depends on other examples of its replica only (in-batch negatives
    without a gather), or a model whose outputs do (per-replica batch statistics); each loss part alone
    (mwloop's step with loss parts); and sums that are not additive (a metric_sums mean: N times the 1-replica
    sum). Empty if nothing looks wrong."""
    return _diagnose(task, global_batch, num_replicas, seed, tolerance)[0]


def _diagnose(task: Task, global_batch: Any, num_replicas: int, seed: int, tolerance: float,
              updates: _Updates | None = None) -> tuple[list[str], bool]:
    """`diagnose`'s causes, and whether they include a local cross-example interaction."""
    causes, compared = [], []

    # Built once, and only for an update that is no multiple of the 1-replica one.
    def examples():
        if not compared:
            compared.append(_examples(task, global_batch, num_replicas, seed))
        return compared[0]

    updates = updates or _updates(_sgd_probe(task), global_batch, num_replicas, seed)
    single, multi = updates.single, updates.multi
    cause = _update_cause(updates, num_replicas, "the", tolerance, examples)
    parts = sorted(k[len("loss_sum/"):] for k in single.sums if k.startswith("loss_sum/"))
    # Find which part: each alone (the others weigh 0).
    if cause and parts and not steps.custom_step(task):
        for part in parts:
            alone = _sgd_probe(task, {p: float(p == part) for p in parts})
            part_cause = _update_cause(_updates(alone, global_batch, num_replicas, seed), num_replicas,
                                       f"loss part {part!r}:", tolerance, examples, part)
            if part_cause:
                causes.append(part_cause)
    if cause and not causes:
        causes.append(cause)
    local = any(GATHER in c or "other examples of its replica" in c for c in causes)
    for key, value in single.sums.items():
        got = multi.sums.get(key)
        if got is None or abs(got - value) <= tolerance * max(abs(value), 1e-12):
            continue
        built_in = key in ("loss_sum", "weight_sum", "examples") or key.startswith(("loss_sum/", "weight_sum/"))
        # The loss sums of a misscaled loss: the update's cause says it.
        if built_in and cause:
            continue
        source = "the step's" if built_in else "metric_sums'"
        factor = got / value if value else float("inf")
        if abs(factor - num_replicas) <= 0.05 * num_replicas:
            causes.append(f"{source} sum {key!r} is {factor:.3f}x the 1-replica sum on {num_replicas} replicas: a "
                          f"per-replica mean (or another non-additive value), not a sum; return "
                          f"reduce_sum(... * weights) and divide in finalize")
        else:
            causes.append(f"{source} sum {key!r} is {got:.6g} on {num_replicas} replicas and {value:.6g} on 1: not "
                          f"additive over replicas (a mean, max or ratio?); return sums, divide in finalize"
                          + ("; or, like the loss, computed over the examples of its replica only: gather across "
                             "replicas (mwloop.gather_global_batch)" if local else ""))
    return causes, local


def assert_loss_scaled_by_global_batch(task: Task, global_batch: Any, *, num_replicas: int = 2,
                                       rtol: float = 1e-6, seed: int = 0) -> float:
    """Asserts that one update of the task's real step (mwloop's, through `compute_loss`, or its own
    `train_step`) on N replicas equals the 1-replica update of the whole batch: that the replicas' gradients
    add up to the gradient of the global mean loss. Runs the step with plain SGD (one update = the gradient).

    A loss divided by the per-replica batch gives an update N times too large; one divided by each replica's
    own token count (or one part divided by the local batch) an update that is no multiple of it, and so does
    a loss whose examples see only their own replica's (in-batch negatives without a gather), which the
    per-example losses tell apart; the failure names the likely cause (and the part, for mwloop's step with
    loss parts).

    Returns:
      The largest difference of the N-replica update (the gradient) from the 1-replica one, relative to its
      norm: max(|r - 1|, |residual| / |g_1|) for g_N = r x g_1 + a residual.
    """
    updates = _updates(_sgd_probe(task), global_batch, num_replicas, seed)
    difference = updates.difference
    if difference > rtol:
        causes, local = _diagnose(task, global_batch, num_replicas, seed, rtol, updates)
        causes = [c for c in causes if "sum" not in c.split(":")[0]] or [
            f"the update is {updates.ratio:.6f}x (residual {updates.residual:.3g})"]
        what = ("the loss is not that of the global batch" if local else
                "the loss is not scaled by the global count")
        raise AssertionError(f"the {num_replicas} replicas' update differs from the 1-replica update of the global "
                             f"batch by {difference:.3g}: {what}; likely cause: {'; '.join(causes)}")
    return difference
