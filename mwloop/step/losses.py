"""A task's loss as parts, each normalised by a *global* count: what the replica step differentiates.

`Task.loss` (or `compute_loss`) returns one loss (values, or (values, weights)) or a dict of named parts
(`LossPart`); `loss_parts` checks them, `part_losses` divides each by its global normaliser (the global
weight sum, batch or number of elements) and weights them into the total, with the sums that report each
part (`loss_sum/<part>`, `weight_sum/<part>`). `weighted_loss` is the single-loss case, also for custom steps.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from mwloop.step import user_code
from mwloop.task import LOSS_NORMALIZERS, SKIPPED_KEY, Batch, LossPart, Sums, Task, TaskError


def _count(losses: tf.Tensor) -> tf.Tensor | float:
    """Elements of `losses` (a Python number when the shape is static: no op per step)."""
    return float(losses.shape.num_elements()) if losses.shape.is_fully_defined() else tf.cast(
        tf.size(losses), tf.float32)


def _examples(losses: tf.Tensor) -> tf.Tensor | float:
    return float(losses.shape[0]) if losses.shape[0] is not None else tf.cast(tf.shape(losses)[0], tf.float32)


def per_example_loss(task: Task, batch: Batch, outputs) -> tuple[tf.Tensor, tf.Tensor | None]:
    """The task's single-part losses (float32, [b] or [b, ...]) and weights (or None), with shape checks."""
    result = user_code.call(task, "loss", batch, outputs)
    if isinstance(result, dict):
        raise TaskError(f"task {type(task).__name__}: loss returned parts {sorted(result)}; use "
                        f"mwloop.loss_parts for a loss with several parts")
    losses, weights = result if isinstance(result, (tuple, list)) else (result, None)
    return _checked(task, losses, weights, "loss")


def _checked(task: Task, losses, weights, what: str) -> tuple[tf.Tensor, tf.Tensor | None]:
    losses = tf.cast(losses, tf.float32)
    name = type(task).__name__
    if losses.shape.rank == 0:
        raise TaskError(f"task {name}: {what} returned a scalar; return per-example values of shape [batch] "
                        f"(or [batch, tokens]) unreduced: mwloop sums them and divides by the global count")
    if weights is not None:
        weights = tf.cast(weights, tf.float32)
        if weights.shape.rank is not None and losses.shape.rank is not None and (
                weights.shape.rank != losses.shape.rank or not weights.shape.is_compatible_with(losses.shape)):
            raise TaskError(f"task {name}: {what} weights of shape {weights.shape} do not match the losses' "
                            f"{losses.shape}; return one weight per loss value")
    return losses, weights


def loss_parts(task: Task, result) -> dict[str | None, LossPart]:
    """What `Task.loss` (or `compute_loss`) returned as checked loss parts.

    A single loss (values, or (values, weights)) is the one part `None`, normalised as before parts existed
    (by `task.loss_normalization`: "weights", or "batch", which is the global number of elements). A dict
    name -> LossPart | (values, weights) | values | {"values", "weights", "normalizer"} gives named parts.
    """
    name = type(task).__name__
    if not isinstance(result, dict):
        losses, weights = result if isinstance(result, (tuple, list)) else (result, None)
        losses, weights = _checked(task, losses, weights, "loss")
        normalizer = "weights" if weights is not None and task.loss_normalization == "weights" else "elements"
        return {None: LossPart(losses, weights, normalizer)}
    if not result:
        raise TaskError(f"task {name}: loss returned no parts; return a dict part name -> LossPart")
    parts = {}
    for part_name, part in result.items():
        if not isinstance(part_name, str) or not part_name.isidentifier():
            raise TaskError(f"task {name}: loss part name {part_name!r}; use identifiers (letters, digits, _)")
        if isinstance(part, dict):
            unknown = sorted(set(part) - {"values", "weights", "normalizer"})
            if unknown or "values" not in part:
                raise TaskError(f"task {name}: loss part {part_name!r} has keys {sorted(part)}; use 'values' and "
                                f"optionally 'weights', 'normalizer'")
            part = LossPart(**part)
        elif isinstance(part, (tuple, list)):
            part = LossPart(*part)
        elif not isinstance(part, LossPart):
            part = LossPart(part)
        if part.normalizer not in LOSS_NORMALIZERS:
            raise TaskError(f"task {name}: loss part {part_name!r} has normalizer={part.normalizer!r}; use one of "
                            f"{', '.join(LOSS_NORMALIZERS)}")
        values, weights = _checked(task, part.values, part.weights, f"loss part {part_name!r}")
        parts[part_name] = LossPart(values, weights, part.normalizer)
    return parts


def without_skipped(batch: Batch) -> tuple[Batch, tf.Tensor | None]:
    """(the batch without mwloop's SKIPPED_KEY, that entry or None): the task never sees the key."""
    if not (isinstance(batch, dict) and SKIPPED_KEY in batch):
        return batch, None
    return {k: v for k, v in batch.items() if k != SKIPPED_KEY}, batch[SKIPPED_KEY]


def compute_loss(task: Task, model: keras.Model, batch: Batch, training: bool) -> tuple[dict, object]:
    """(loss parts, outputs) of the task's forward pass: `Task.compute_loss` (default: forward, then loss)."""
    batch, _ = without_skipped(batch)
    if task.overrides("compute_loss"):
        result = user_code.call(task, "compute_loss", model, batch, training)
    else:
        # Task.compute_loss's two calls, each named in a user's error (with the keys of its arguments).
        outputs = user_code.call(task, "forward", model, batch, training=training)
        result = user_code.call(task, "loss", batch, outputs), outputs
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TaskError(f"task {type(task).__name__}: compute_loss returned {type(result).__name__}; return "
                        f"(loss parts, outputs)")
    return loss_parts(task, result[0]), result[1]


def sum_keys(part: str | None) -> tuple[str, str]:
    """The sums a part reports: ("loss_sum", "weight_sum") for a single loss, with "/<part>" for a named one."""
    return ("loss_sum", "weight_sum") if part is None else (f"loss_sum/{part}", f"weight_sum/{part}")


def part_losses(parts: dict, global_batch_size: int, loss_weights: dict[str, float], *,
                defer_weights: bool = False) -> tuple[dict, Sums, dict]:
    """The losses this replica differentiates, normalised by *global* counts, and the built-in sums.

    Returns `(terms, sums, deferred)`. `terms[None]` is the weighted sum (by `loss_weights`, default 1) of
    every part whose normaliser is known on this replica now: "batch" (global batch size), "elements"
    (global loss elements) and, unless deferred, "weights" (the global sum of the part's weights: one
    all-reduce of all such parts' sums per step). With `defer_weights` (gradient accumulation: the
    normaliser is the weight sum over all micro-batches, known only at the update) each "weights" part is a
    term of its own, `sum(w * l) / its global elements`, and `deferred[part] = (weight sum key, global
    elements, loss weight)` says how to rescale its gradients at the update.
    """
    unknown = sorted(set(loss_weights) - set(parts))
    if unknown:
        raise TaskError(f"the loss weights (config.loss_weights) name {unknown}, which the loss does not return; "
                        f"its parts are {sorted(map(str, parts)) if None not in parts else 'none (one loss)'}")
    # One loss: the very ops of mwloop before loss parts (the graph is benchmarked).
    if list(parts) == [None]:
        part = parts[None]
        normalization = "weights" if part.normalizer == "weights" else "batch"
        if defer_weights and part.weights is not None and normalization == "weights":
            loss, sums = weighted_loss(part.values, part.weights, global_batch_size, "batch")
            return {None: 0.0, "": loss}, sums, {"": ("weight_sum", num_global_elements(part.values,
                                                                                         global_batch_size), 1.0)}
        loss, sums = weighted_loss(part.values, part.weights, global_batch_size, normalization)
        return {None: loss}, sums, {}
    sums: Sums = {"examples": _examples(next(iter(parts.values())).values)}
    terms, deferred, pending = {None: 0.0}, {}, []
    for name, part in parts.items():
        loss_key, weight_key = sum_keys(name)
        weighted = part.values if part.weights is None else part.values * part.weights
        loss_sum = tf.reduce_sum(weighted)
        weight = float(loss_weights.get(name, 1.0))
        if part.normalizer == "weights":
            sums[loss_key] = loss_sum
            sums[weight_key] = _count(part.values) if part.weights is None else tf.reduce_sum(part.weights)
            if defer_weights:
                elements = num_global_elements(part.values, global_batch_size)
                terms[name] = loss_sum / elements
                deferred[name] = (weight_key, elements, weight)
            else:
                pending.append((name, loss_sum, weight))
            continue
        count = global_batch_size if part.normalizer == "batch" else num_global_elements(
            part.values, global_batch_size)
        sums[loss_key] = loss_sum
        sums[weight_key] = _examples(part.values) if part.normalizer == "batch" else _count(part.values)
        terms[None] = terms[None] + weight * (loss_sum / count)
    # One all-reduce for every part normalised by its global weight sum.
    if pending:
        totals = tf.stop_gradient(tf.stack([sums[sum_keys(n)[1]] for n, _, _ in pending]))
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            totals = context.all_reduce(tf.distribute.ReduceOp.SUM, totals)
        for j, (name, loss_sum, weight) in enumerate(pending):
            terms[None] = terms[None] + weight * tf.math.divide_no_nan(loss_sum, totals[j])
    return terms, sums, deferred


def num_global_elements(losses: tf.Tensor, global_batch_size: int) -> int:
    """Loss elements in the global batch: global_batch_size x loss elements per example (static)."""
    elements_per_example = 1
    for dim in losses.shape[1:]:
        # Per-token losses need a static number of tokens.
        elements_per_example *= int(dim)
    return global_batch_size * elements_per_example


def weighted_loss(losses: tf.Tensor, weights: tf.Tensor | None, global_batch_size: int,
                  normalization: str = "weights") -> tuple[tf.Tensor, Sums]:
    """The loss this replica differentiates, scaled by the *global* count, and its sums.

    Without weights: sum(losses) / (global_batch_size * loss elements per example), what
    `tf.nn.compute_average_loss(..., global_batch_size=)` computes for [b] losses. With weights and
    "weights" normalization: sum(w * l) / (global sum of w), the global sum taken by one all-reduce
    in replica context, so replicas with more padding do not weigh more. With "batch":
    sum(w * l) / the global number of loss elements. Summed over replicas, the gradients are those
    of the global mean loss.
    """
    global_elements = num_global_elements(losses, global_batch_size)
    if weights is None:
        loss_sum = tf.reduce_sum(losses)
        return loss_sum / global_elements, {"loss_sum": loss_sum, "weight_sum": _count(losses),
                                            "examples": _examples(losses)}
    loss_sum, weight_sum = tf.reduce_sum(losses * weights), tf.reduce_sum(weights)
    if normalization == "weights":
        context = tf.distribute.get_replica_context()
        total = tf.stop_gradient(weight_sum)
        if context is not None and context.num_replicas_in_sync > 1:
            total = context.all_reduce(tf.distribute.ReduceOp.SUM, total)
        loss = tf.math.divide_no_nan(loss_sum, total)
    else:
        loss = loss_sum / global_elements
    return loss, {"loss_sum": loss_sum, "weight_sum": weight_sum, "examples": _examples(losses)}
