"""Pure per-replica step functions.

Each takes what it needs (model, optimizer, batch, global batch size) and
returns per-replica sums; the loop reduces them across replicas with
`strategy.reduce(SUM)` and divides once. Nothing here touches files, flags or
the strategy object, so the steps run and are tested without a cluster.
"""

from __future__ import annotations

import keras
import tensorflow as tf

Batch = dict[str, tf.Tensor]
Sums = dict[str, tf.Tensor]
METRIC_KEYS = ("loss_sum", "correct", "count")


def zero_sums(keys: tuple[str, ...] = METRIC_KEYS) -> Sums:
    """The additive identity of a step's sums."""
    return {k: tf.constant(0.0) for k in keys}


def add_sums(a: Sums, b: Sums) -> Sums:
    """Elementwise sum of two step results."""
    return {k: a[k] + b[k] for k in a}


def _per_example(model: keras.Model, batch: Batch, training: bool,
                 label_smoothing: float = 0.0) -> tuple[tf.Tensor, tf.Tensor]:
    logits = tf.cast(model(batch["image"], training=training), tf.float32)
    labels = tf.cast(batch["label"], tf.int32)
    if label_smoothing:
        loss = keras.losses.categorical_crossentropy(tf.one_hot(labels, tf.shape(logits)[-1]), logits,
                                                     from_logits=True, label_smoothing=label_smoothing)
    else:
        loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
    return loss, correct


def compute_gradients(model: keras.Model, optimizer: keras.optimizers.Optimizer, batch: Batch,
                      global_batch_size: int,
                      label_smoothing: float = 0.0) -> tuple[list[tf.Tensor], Sums, tf.Tensor]:
    """This replica's gradients of the global mean loss, its sums, and whether both are finite.

    The loss is scaled by the *global* batch size, so the gradients the
    optimizer sums across replicas equal the gradient of the global mean loss.
    `finite` (a bool) is False when this replica's loss or gradients hold a NaN or Inf (under a
    LossScaleOptimizer: its loss; the optimizer itself skips updates whose gradients overflowed).
    """
    with tf.GradientTape() as tape:
        per_example_loss, correct = _per_example(model, batch, training=True, label_smoothing=label_smoothing)
        loss_sum = tf.reduce_sum(per_example_loss)
        # What tf.nn.compute_average_loss computes, without its per-step checks (each op is ~1 % of a small step).
        loss = loss_sum / global_batch_size
        if model.losses:
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        scaled_loss = optimizer.scale_loss(loss)
    grads = tape.gradient(scaled_loss, model.trainable_variables)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # Gradients of the scaled loss overflow while the scale is too high: the optimizer skips those
        # updates and lowers the scale. Only a non-finite loss is a real failure.
        finite = tf.math.is_finite(loss)
    else:  # one check: a sum is finite only if every term is
        finite = tf.math.is_finite(tf.add_n([loss] + [tf.reduce_sum(g) for g in grads]))
    sums = {"loss_sum": loss_sum, "correct": tf.reduce_sum(correct), "count": tf.cast(tf.size(correct), tf.float32)}
    return grads, sums, finite


def apply_gradients(model: keras.Model, optimizer: keras.optimizers.Optimizer, grads: list[tf.Tensor]) -> None:
    """The optimizer update (it sums the gradients across replicas)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        grads = _share_overflow(grads)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


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


def train_step(model: keras.Model, optimizer: keras.optimizers.Optimizer, batch: Batch,
               global_batch_size: int, label_smoothing: float = 0.0) -> Sums:
    """One optimizer update on this replica's batch; returns this replica's sums."""
    grads, sums, _ = compute_gradients(model, optimizer, batch, global_batch_size, label_smoothing)
    apply_gradients(model, optimizer, grads)
    return sums


def eval_step(model: keras.Model, batch: Batch) -> Sums:
    """Sums over this replica's eval batch; padding examples (mask 0) count for nothing."""
    per_example_loss, correct = _per_example(model, batch, training=False)
    mask = batch.get("mask", tf.ones_like(correct))
    return {"loss_sum": tf.reduce_sum(per_example_loss * mask), "correct": tf.reduce_sum(correct * mask),
            "count": tf.reduce_sum(mask)}


def finalize(sums: dict[str, float]) -> dict[str, float]:
    """Mean loss and accuracy from reduced sums (the one division)."""
    count = max(float(sums["count"]), 1.0)
    return {"loss": float(sums["loss_sum"]) / count, "accuracy": float(sums["correct"]) / count,
            "examples": float(sums["count"])}
