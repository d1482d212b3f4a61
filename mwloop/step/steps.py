"""Pure per-replica step functions over a Task (the loss and its parts: mwloop.step.losses).

Each takes what it needs (task, model, optimizer, batch, global batch size) and
returns per-replica sums; the loop reduces them across replicas with
`strategy.reduce(SUM)` and divides once (`finalize`). Nothing here touches
files, flags or the strategy object, so the steps run and are tested without a
cluster. Shape mistakes in a task are raised while tracing, before any update.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import keras
import tensorflow as tf

from mwloop.step import user_code
from mwloop.step.losses import (
    compute_loss,
    part_losses,
    sum_keys,
    weighted_loss,
    without_skipped,
)
from mwloop.task import BUILT_IN_SUMS, MASK_KEY, SKIPPED_KEY, Batch, LossPart, Sums, Task, TaskError


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How mwloop's replica step runs: explicit arguments of the step builder, never attributes hung on
    the Keras optimizer.

    Attributes:
      global_batch_size: examples per optimizer update over all replicas (the effective batch).
      accumulation_steps: micro-batches per update (config.optimizer.gradient_accumulation_steps).
      clip_global_norm: clip the cross-replica sum of the gradients to this global norm (0: off).
      skip_nonfinite: an update whose loss or gradients are not finite on any replica is not applied.
      jit_compile: XLA compiles the forward and backward pass.
    """
    global_batch_size: int
    accumulation_steps: int = 1
    clip_global_norm: float = 0.0
    skip_nonfinite: bool = False
    jit_compile: bool = False

    @classmethod
    def from_config(cls, config, **changes) -> "StepOptions":
        """A run's options from its config (`changes` override single fields)."""
        options = cls(global_batch_size=config.train.global_batch_size,
                      accumulation_steps=config.optimizer.get("gradient_accumulation_steps", 1),
                      clip_global_norm=float(config.optimizer.get("clip_global_norm", 0.0) or 0.0),
                      skip_nonfinite=config.get("on_nonfinite", "fail") == "skip",
                      jit_compile=bool(config.get("jit_compile", False)))
        return dataclasses.replace(options, **changes)


def check_sums(task: Task, sums: Sums, where: str) -> Sums:
    """Sums as float32 scalars; a non-scalar or a missing built-in sum is a one-line TaskError."""
    name = type(task).__name__
    if not isinstance(sums, dict):
        raise TaskError(f"task {name}: {where} returned {type(sums).__name__}; return a dict name -> scalar sum")
    part_sums = [k for k in sums if str(k).startswith("loss_sum/")]
    required = ("examples",) + (tuple(f"weight_sum/{k[9:]}" for k in part_sums) if part_sums
                                else ("loss_sum", "weight_sum"))
    missing = [k for k in BUILT_IN_SUMS + required if k in required and k not in sums]
    if missing:
        raise TaskError(f"task {name}: {where} returned no {', '.join(missing)}; a custom step must return "
                        f"them (see mwloop.weighted_loss)")
    checked = {}
    for key, value in sums.items():
        value = tf.cast(value, tf.float32)
        if value.shape.rank != 0:
            raise TaskError(f"task {name}: {where} sum {key!r} has shape {value.shape}; metric sums must be "
                            f"scalars (reduce_sum over the batch), which mwloop adds across replicas")
        checked[key] = value
    return checked


def _takes_mask(task: Task) -> bool:
    """Whether the task's metric_sums has the `mask` keyword (older ones take (batch, outputs, weights))."""
    parameters = inspect.signature(task.metric_sums).parameters
    return "mask" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def with_metrics(task: Task, batch: Batch, outputs, parts: dict, sums: Sums, mask: tf.Tensor | None = None) -> Sums:
    """`sums` with the task's metric sums added, checked.

    metric_sums gets loss-shaped weights (the loss weights, or ones; times the eval padding mask): for a
    single loss a tensor, for loss parts a dict part -> weights; and, if it takes it, `mask=` the per-example
    mask ([b]: 1 for a real example, 0 for eval padding). A batch's SKIPPED_KEY (bad records replaced) is summed
    under its own name, and taken out of the batch the task sees.
    """
    batch, skipped = without_skipped(batch)
    if skipped is not None:
        sums = {**sums, SKIPPED_KEY: tf.reduce_sum(tf.cast(skipped, tf.float32))}
    weights = {}
    for name, part in parts.items():
        # Static shapes: a constant that grappler folds away in `x * weights`.
        if part.weights is None:
            weights[name] = tf.ones(part.values.shape) if part.values.shape.is_fully_defined() else tf.ones_like(
                part.values)
        else:
            weights[name] = part.weights
    weights = weights[None] if list(weights) == [None] else weights
    extra = {}
    if _takes_mask(task):
        values = next(iter(parts.values())).values
        if mask is None:
            mask = tf.ones(values.shape[:1]) if values.shape[:1].is_fully_defined() else tf.ones(tf.shape(values)[:1])
        extra["mask"] = mask
    metrics = user_code.call(task, "metric_sums", batch, outputs, weights, **extra)
    if not isinstance(metrics, dict):
        raise TaskError(f"task {type(task).__name__}: metric_sums returned {type(metrics).__name__}; return a dict "
                        f"name -> scalar sum")
    clash = sorted(k for k in metrics if k in BUILT_IN_SUMS or str(k).startswith(("loss_sum/", "weight_sum/")))
    if clash:
        raise TaskError(f"task {type(task).__name__}: metric_sums returned {clash}, which mwloop computes "
                        f"itself; rename them")
    return check_sums(task, {**sums, **metrics}, "metric_sums")


def gradients(task: Task, model: keras.Model, optimizer: keras.optimizers.Optimizer, batch: Batch,
              options: StepOptions, *, defer_weights: bool = False):
    """This replica's gradients of the loss (the one replica step's forward and backward pass).

    Returns `(grads, sums, finite, deferred)`: `grads` maps a gradient group to the gradients of its loss
    (group None: every part normalised now plus the model's regularization; with `defer_weights`, one group
    per part normalised by its weight sum over all micro-batches, rescaled at the update as `deferred`
    says, see `part_losses`; a persistent tape, which in a graph costs nothing at run time). `finite`
    is False when the loss or the gradients hold a NaN or Inf (under a LossScaleOptimizer: the loss; the
    optimizer itself skips updates whose gradients overflowed).
    """
    variables = model.trainable_variables
    with tf.GradientTape(persistent=defer_weights) as tape:
        losses, parts, outputs, sums, deferred = _losses(task, model, batch, options, defer_weights)
        scaled = {group: optimizer.scale_loss(value) for group, value in losses.items()}
    grads = {group: tape.gradient(value, variables) for group, value in scaled.items()}
    sums = with_metrics(task, batch, outputs, parts, sums)
    total = losses[None] if list(losses) == [None] else tf.add_n(list(losses.values()))
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # Gradients of the scaled loss overflow while the scale is too high: the optimizer skips those
        # updates and lowers the scale. Only a non-finite loss is a real failure.
        finite = tf.math.is_finite(total)
    else:
        # One check: a sum is finite only if every term is.
        finite = tf.math.is_finite(tf.add_n([total] + [tf.reduce_sum(g) for group in grads.values() for g in group
                                                       if g is not None]))
    return grads, sums, finite, deferred


def _losses(task: Task, model: keras.Model, batch: Batch, options: StepOptions, defer_weights: bool):
    """The forward pass: `(losses, parts, outputs, sums, deferred)`, the losses by gradient group (see
    `gradients`); `gradient_groups` traces only this."""
    parts, outputs = compute_loss(task, model, batch, training=True)
    terms, sums, deferred = part_losses(parts, options.global_batch_size, task.loss_weights(),
                                        defer_weights=defer_weights)
    loss = terms[None]
    # k micro-batches of every replica add up to one penalty.
    if model.losses:
        regularization = tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        loss += regularization if options.accumulation_steps == 1 else regularization / options.accumulation_steps
    losses = {group: terms[group] for group in deferred}
    # A group of no loss at all has no gradients to compute.
    if not (isinstance(loss, float) and deferred):
        losses = {None: loss, **losses}
    return losses, parts, outputs, sums, deferred


def gradient_groups(task: Task, model: keras.Model, batch_spec, options: StepOptions) -> tuple:
    """The gradient groups of `gradients(..., defer_weights=True)` on batches of `batch_spec` (a nest of
    tf.TensorSpec: one replica's batch), learned by tracing the forward pass once in a graph that never runs.

    Why: an accumulating loop holds one accumulator per group, built before its micro-step is traced. The
    trace runs in the caller's replica context (the default strategy's when the loop is called, as the
    Trainer does, outside the strategy's scope: one trace, no collective), or in each replica's under a
    strategy's scope. A task's mistake in its forward pass or loss is raised here, as the loop's trace
    would raise it.

    Returns:
      The groups in the order `gradients` returns them: None (every part normalised now, plus the model's
      regularization) unless there is no such loss, then each part normalised by its deferred weight sum.
    """
    groups = []

    def forward(batch):
        losses, *_ = _losses(task, model, batch, options, defer_weights=True)
        groups.append(tuple(losses))

    def probe(batch):
        if tf.distribute.in_cross_replica_context():
            tf.distribute.get_strategy().run(forward, args=(batch,))
        else:
            forward(batch)

    tf.function(probe, autograph=False).get_concrete_function(batch_spec)
    return groups[0]


def compute_gradients(task: Task, model: keras.Model, optimizer: keras.optimizers.Optimizer, batch: Batch,
                      options: StepOptions) -> tuple[list[tf.Tensor], Sums, tf.Tensor]:
    """This replica's gradients of the global mean loss (one update's), its sums, and whether both are finite."""
    grads, sums, finite, _ = gradients(task, model, optimizer, batch, options)
    return grads[None], sums, finite


def apply_gradients(model: keras.Model, optimizer: keras.optimizers.Optimizer, grads: list[tf.Tensor],
                    clip_global_norm: float = 0.0) -> None:
    """The optimizer update (it sums the gradients across replicas), clipped by the global norm of the
    cross-replica sum (`clip_global_norm` > 0): what one replica holding the whole batch would clip.

    Keras' own `global_clipnorm` clips the gradients each replica gives the optimizer, before it sums them
    (measured: 0.13 relative difference in the weights after 20 updates on 2 replicas vs 1); mwloop's
    optimizers have it off. A custom train_step calls this to clip like mwloop's step.
    """
    loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if loss_scaled:
        grads = _share_overflow(grads)
    clip_norm = clip_global_norm
    if clip_norm:
        # The gradients are still scaled: so is the norm they may have.
        if loss_scaled:
            clip_norm = clip_norm * tf.cast(optimizer.dynamic_scale, tf.float32)
        grads = _clip_by_global_norm_of_sum(grads, clip_norm)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def _clip_by_global_norm_of_sum(grads: list[tf.Tensor], clip_norm) -> list[tf.Tensor]:
    """This replica's gradients scaled so that their cross-replica sum has a global norm <= clip_norm.

    The scale is that of the sum (linear: scaling each part scales the sum), which costs one all-reduce
    of the gradients per update on several replicas, only with clipping on. Keras' formula: a non-finite
    norm gives a non-finite scale, so an overflow stays one (and the LossScaleOptimizer skips it).
    """
    ctx = tf.distribute.get_replica_context()
    present = [g for g in grads if g is not None]
    total = present if ctx is None or ctx.num_replicas_in_sync == 1 else ctx.all_reduce(
        tf.distribute.ReduceOp.SUM, present)
    norm = tf.linalg.global_norm(total)
    scale = clip_norm * tf.minimum(1.0 / norm, 1.0 / clip_norm) + (norm - norm)
    return [g if g is None else g * tf.cast(scale, g.dtype) for g in grads]


def _share_overflow(grads: list[tf.Tensor]) -> list[tf.Tensor]:
    """Makes one replica's gradient overflow every replica's.

    Keras' LossScaleOptimizer decides whether to skip an update from the gradients it is given, before
    they are summed across replicas (from the first replica's alone under MirroredStrategy), so replicas
    whose own gradients are finite applied a sum holding another's Inf (measured: non-finite weights
    within 12 steps on 2 replicas). One scalar all-reduce per step makes the decision common.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return grads
    local = 1.0 - tf.cast(tf.math.is_finite(tf.add_n([tf.reduce_sum(g) for g in grads])), tf.float32)
    overflow = ctx.all_reduce(tf.distribute.ReduceOp.SUM, local)
    return [grads[0] * tf.cast(tf.where(overflow > 0, float("nan"), 1.0), grads[0].dtype)] + list(grads[1:])


def custom_step(task: Task) -> bool:
    """Whether the task applies its own updates (a whole `train_step`): what mwloop's step adds (accumulation,
    skipping non-finite updates) is then not available, and clipping is the step's (`apply_gradients`)."""
    return task.overrides("train_step")


def replica_step(task: Task, model: keras.Model, optimizer: keras.optimizers.Optimizer, batch: Batch,
                 options: StepOptions, compute=None) -> tuple[Sums, tf.Tensor]:
    """One optimizer update on this replica's batch: the one replica step of the loop, parameter servers and
    mwloop.testing. The task's own train_step if it has one, else forward, loss parts, global normalisation,
    loss scaling, gradients (`compute`: compute_gradients, or an XLA-compiled one), clipping, apply.

    Returns (sums, finite): finite is False when the loss (or gradients) were not finite on this replica.
    """
    if custom_step(task):
        sums = check_sums(task, user_code.call(task, "train_step", model, optimizer, batch,
                                               options.global_batch_size), "train_step")
        loss_sums = [v for k, v in sums.items() if k == "loss_sum" or k.startswith("loss_sum/")]
        return sums, tf.math.is_finite(loss_sums[0] if len(loss_sums) == 1 else tf.add_n(loss_sums))
    grads, sums, finite = (compute or functools.partial(compute_gradients, task))(model, optimizer, batch, options)
    apply_gradients(model, optimizer, grads, options.clip_global_norm)
    return sums, finite


def eval_step(task: Task, model: keras.Model, batch: Batch) -> Sums:
    """Sums over this replica's eval batch; examples with `mask` 0 (padding) count for nothing."""
    if task.overrides("eval_step"):
        return check_sums(task, user_code.call(task, "eval_step", model, batch), "eval_step")
    parts, outputs = compute_loss(task, model, batch, training=False)
    mask = batch.get(MASK_KEY) if isinstance(batch, dict) else None
    if mask is not None and mask.shape.rank != 1:
        raise TaskError(f"task {type(task).__name__}: the eval batch's {MASK_KEY!r} has shape {mask.shape}; mwloop "
                        f"reads {MASK_KEY!r} as the per-example padding mask [batch]: rename your key")
    # A single loss reports the weighted mean sum(w * l) / sum(w) whatever its training normaliser, as Keras'
    # evaluate does (the equality tests pin it); named parts report by their own normalisers.
    if list(parts) == [None]:
        losses, weights = parts[None].values, parts[None].weights
        if mask is not None:
            mask = tf.reshape(tf.cast(mask, tf.float32), [-1] + [1] * (losses.shape.rank - 1))
            weights = mask * tf.ones_like(losses) if weights is None else weights * mask
        # Only the sums are used: the normalization does not matter.
        _, sums = weighted_loss(losses, weights, global_batch_size=1, normalization="batch")
        example_mask = None
        if mask is not None:
            sums["examples"] = tf.reduce_sum(mask)
            example_mask = tf.reshape(mask, [-1])
        return with_metrics(task, batch, outputs, {None: LossPart(losses, weights)}, sums, example_mask)
    first = next(iter(parts.values())).values
    example_mask = tf.ones(tf.shape(first)[:1]) if mask is None else tf.cast(mask, tf.float32)
    sums: Sums = {"examples": tf.reduce_sum(example_mask)}
    masked = {}
    for name, part in parts.items():
        loss_key, weight_key = sum_keys(name)
        shaped = tf.reshape(example_mask, [-1] + [1] * (part.values.shape.rank - 1)) * tf.ones_like(part.values)
        weights = shaped if part.weights is None else part.weights * shaped
        sums[loss_key] = tf.reduce_sum(part.values * weights)
        if part.normalizer == "weights":
            sums[weight_key] = tf.reduce_sum(weights)
        elif part.normalizer == "batch":
            sums[weight_key] = sums["examples"]
        else:
            sums[weight_key] = tf.reduce_sum(shaped)
        masked[name] = LossPart(part.values, weights, part.normalizer)
    return with_metrics(task, batch, outputs, masked, sums, example_mask)


def finalize(task: Task, sums: dict[str, float]) -> dict[str, float]:
    """Reported values from globally reduced sums: mean loss (and each part's, `loss/<part>`; the total
    `loss` is their sum weighted by `task.loss_weights()`), examples, and the task's own."""
    sums = {k: float(v) for k, v in sums.items()}
    parts = [k[len("loss_sum/"):] for k in sums if k.startswith("loss_sum/")]
    if parts:
        results = {}
        loss_weights = task.loss_weights()
        for part in parts:
            weight_sum = sums[f"weight_sum/{part}"]
            results[f"loss/{part}"] = sums[f"loss_sum/{part}"] / weight_sum if weight_sum else 0.0
        results = {"loss": sum(float(loss_weights.get(p, 1.0)) * results[f"loss/{p}"] for p in parts), **results}
        results["examples"] = sums["examples"]
    else:
        weight_sum = sums["weight_sum"]
        results = {"loss": sums["loss_sum"] / weight_sum if weight_sum else 0.0, "examples": sums["examples"]}
    if SKIPPED_KEY in sums:
        results[SKIPPED_KEY] = sums[SKIPPED_KEY]
    results.update({k: float(v) for k, v in task.finalize(sums).items()})
    return results
