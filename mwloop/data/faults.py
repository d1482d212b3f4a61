"""Fault injection for tests and drills: NaN inputs at chosen global steps."""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from mwloop.data.sources import DatasetFn


def nan_at_steps(dataset_fn: DatasetFn, steps: Sequence[int], *, start_step: int) -> DatasetFn:
    """Wraps a train dataset_fn so the batches of global steps `steps` (1-based:
    the update that reaches step s) have NaN images, on every replica."""
    if not steps:
        return dataset_fn
    poisoned = tf.constant(sorted(steps), tf.int64)

    def wrapped(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        replicas_per_pipeline = ctx.num_replicas_in_sync // ctx.num_input_pipelines

        def poison(batch_index, batch):
            step = start_step + 1 + batch_index // replicas_per_pipeline
            bad = tf.reduce_any(tf.equal(poisoned, step))
            image = batch["image"]
            nan = tf.fill(tf.shape(image), tf.constant(float("nan"), image.dtype))  # bfloat16 inputs too
            return dict(batch, image=tf.where(bad, nan, image))

        return dataset_fn(ctx).enumerate().map(poison)

    return wrapped
