"""The likely cause of a task's step on N replicas differing from 1 (`diagnose`): from one plain-SGD update
(replica_steps.py), an update N times too large, or no multiple of the 1-replica one, told apart by the
per-example losses and outputs; each loss part alone; sums that are not additive. Importable from
mwloop.testing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from mwloop.run import state
from mwloop.step import losses, steps
from mwloop.task import Task, TaskError
from mwloop.testing.replica_steps import _sgd_probe, _Updates, _updates, distribute_batch, replica_strategy


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
