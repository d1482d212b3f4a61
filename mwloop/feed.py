"""Resident feed: training batches computed inside the train loop from (seed, step).

Why: on an overhead-bound model the per-step `GetNext` on a tf.data iterator
(a cross-thread hand-off per step, plus the producer threads competing for the
same cores) costs about half the step time. For in-memory arrays there is no
need for an iterator at all: the example order is a pure function of
(seed, stream position) (see `mwloop.data.pipeline`), so each replica computes
the indices of a whole loop call in the graph, once per call, and gathers
its batch per step from arrays resident on its own device.

The batches are exactly those of `pipeline.array_train_dataset` fed through
`strategy.distribute_datasets_from_function`: pipeline p of P reads stream
positions p, p + P, ...; its L local replicas take consecutive per-replica
batches. So local replica l of pipeline p at global step s reads positions

    p + P * (s * B / P + l * b + t),   t = 0 .. b - 1

(B global, b per-replica batch size), whatever step the run started at:
resume needs only the step, no iterator state.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from mwloop import steps
from mwloop.data import pipeline

SUM = tf.distribute.ReduceOp.SUM
Arrays = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one replica's examples sit in the global stream (see the module docstring)."""
    global_batch_size: int
    per_replica_batch_size: int
    num_pipelines: int
    local_replicas: int


def layout(strategy: tf.distribute.Strategy, global_batch_size: int) -> Layout:
    """The stream layout of `strategy`, with the same batch-size check as the tf.data pipeline."""
    num_replicas = strategy.num_replicas_in_sync
    num_pipelines = getattr(strategy.extended, "_num_workers", 1)  # one input pipeline per worker
    ctx = tf.distribute.InputContext(num_pipelines, 0, num_replicas)
    return Layout(global_batch_size, pipeline.per_replica_batch_size(global_batch_size, ctx), num_pipelines,
                  num_replicas // num_pipelines)


def stream_positions(lay: Layout, replica_id, first_step, num_steps) -> tf.Tensor:
    """[num_steps, b] int64 stream positions replica `replica_id` reads in steps first_step.. ."""
    replica_id = tf.cast(replica_id, tf.int64)
    pipeline_id, local = replica_id // lay.local_replicas, replica_id % lay.local_replicas
    step = tf.cast(first_step, tf.int64) + tf.range(tf.cast(num_steps, tf.int64))
    within = (step[:, None] * (lay.global_batch_size // lay.num_pipelines) + local * lay.per_replica_batch_size
              + tf.range(lay.per_replica_batch_size, dtype=tf.int64)[None, :])
    return pipeline_id + lay.num_pipelines * within


def example_indices(positions: tf.Tensor, num_examples: int, seed: int) -> tf.Tensor:
    """Example index at each stream position: perm(seed, pos // n)[pos % n], vectorised.

    Only the epochs the positions span are shuffled, once per call (not per step).
    """
    epoch, offset = positions // num_examples, positions % num_examples
    first_epoch = tf.reduce_min(epoch)
    epochs = tf.range(first_epoch, tf.reduce_max(epoch) + 1)
    perms = tf.map_fn(lambda e: pipeline.epoch_permutation(num_examples, seed=seed, epoch=e), epochs,
                      fn_output_signature=tf.TensorSpec([num_examples], tf.int64))
    return tf.gather_nd(perms, tf.stack([epoch - first_epoch, offset], axis=-1))


class ResidentFeed:
    """In-memory training arrays held on every replica's device, indexed in the graph.

    `indices(first_step, num_steps)` (replica context, once per loop call)
    gives the [num_steps, b] example indices of this replica; `batch(arrays,
    indices, i)` (replica context, per step) gathers step i's batch.
    """

    def __init__(self, strategy: tf.distribute.Strategy, arrays: Arrays, *, global_batch_size: int, seed: int):
        self.layout = layout(strategy, global_batch_size)
        self.seed = seed
        self.num_examples = len(next(iter(arrays.values())))
        # One copy per replica device, made once: no host-to-device copy per step on accelerators.
        self.arrays = strategy.experimental_distribute_values_from_function(
            lambda ctx: {k: tf.identity(v) for k, v in arrays.items()})
        self.replica_ids = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(ctx.replica_id_in_sync_group, tf.int64))

    def indices(self, replica_id, first_step, num_steps) -> tf.Tensor:
        """This replica's example indices for steps first_step .. first_step + num_steps - 1."""
        # The order is defined on the CPU (as in tf.data): the same RNG kernel on every device type.
        with tf.device("/cpu:0"):
            positions = stream_positions(self.layout, replica_id, first_step, num_steps)
            return example_indices(positions, self.num_examples, self.seed)

    @staticmethod
    def batch(arrays: dict[str, tf.Tensor], indices: tf.Tensor, i) -> steps.Batch:
        """Step i's per-replica batch of a call."""
        return {k: tf.gather(v, indices[i]) for k, v in arrays.items()}


def make_train_loop(strategy: tf.distribute.Strategy, model: keras.Model, optimizer: keras.optimizers.Optimizer,
                    feed: ResidentFeed, *, global_batch_size: int,
                    jit_compile: bool = False) -> Callable[[tf.Variable, tf.Tensor], dict[str, tf.Tensor]]:
    """`train_loop(step, num_steps)`: like `loop.make_train_loop`, fed by `feed` instead of an iterator.

    `step` is the global step the call starts at (the run's step variable,
    which `loop.run` advances after each call); the batches are those the
    tf.data pipeline would yield from that step.
    """
    step_fn = tf.function(steps.train_step, jit_compile=True) if jit_compile else steps.train_step

    def replica_fn(sums, arrays, indices, i):
        return steps.add_sums(sums, step_fn(model, optimizer, feed.batch(arrays, indices, i), global_batch_size))

    @tf.function
    def train_loop(step, num_steps):
        first_step = tf.convert_to_tensor(step)
        indices = strategy.run(feed.indices, args=(feed.replica_ids, first_step, num_steps))
        sums = strategy.run(steps.zero_sums)
        for i in tf.range(num_steps):
            sums = strategy.run(replica_fn, args=(sums, feed.arrays, indices, i))
        return strategy.reduce(SUM, sums, axis=None)

    return train_loop
