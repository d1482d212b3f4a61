"""Fault injection for tests and drills: NaN inputs at chosen global steps."""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from mwloop.data.source import DatasetFn


def nan_at_steps(dataset_fn: DatasetFn, steps: Sequence[int], *, start_step: int,
                 accumulation_steps: int = 1) -> DatasetFn:
    """Wraps a train dataset_fn so the batches of global steps `steps` (1-based:
    the update that reaches step s) have NaN in every floating-point input, on every replica.

    With k micro-batches per update (`accumulation_steps`), the dataset yields micro-batches and
    all k of the update's are poisoned; `start_step` counts updates."""
    if not steps:
        return dataset_fn
    poisoned = tf.constant(sorted(steps), tf.int64)

    def wrapped(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        replicas_per_pipeline = ctx.num_replicas_in_sync // ctx.num_input_pipelines

        def poison(batch_index, batch):
            step = start_step + 1 + batch_index // (replicas_per_pipeline * accumulation_steps)
            bad = tf.reduce_any(tf.equal(poisoned, step))

            def nan_if_bad(value):
                if not value.dtype.is_floating:
                    return value
                nan = tf.fill(tf.shape(value), tf.constant(float("nan"), value.dtype))  # bfloat16 inputs too
                return tf.where(bad, nan, value)
            return tf.nest.map_structure(nan_if_bad, batch)

        return dataset_fn(ctx).enumerate().map(poison)

    return wrapped
