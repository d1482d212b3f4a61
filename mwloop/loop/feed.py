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

With gradient accumulation (k micro-batches per optimizer update) the feed is
the same stream cut into micro-batches of B / k: update s reads micro-steps
s * k .. s * k + k - 1, which together hold exactly the stream positions
[s * B, (s + 1) * B) that update s reads without accumulation. So the examples
of an update do not depend on k (nor on the number of replicas), and resume
still needs only the update step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import numpy as np
import tensorflow as tf

from mwloop.cluster import distribute
from mwloop.config import check as config_check
from mwloop.data import pipeline
from mwloop.step import steps

Arrays = dict[str, np.ndarray]
# Per-replica batch size in bytes up to which a call gathers at once.
PER_CALL_GATHER_BYTES = 256 * 1024


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
    num_pipelines = distribute.num_workers(strategy)
    ctx = tf.distribute.InputContext(num_pipelines, 0, num_replicas)
    return Layout(global_batch_size, pipeline.per_replica_batch_size(global_batch_size, ctx), num_pipelines,
                  num_replicas // num_pipelines)


def stream_positions(stream_layout: Layout, replica_id, first_step, num_steps) -> tf.Tensor:
    """[num_steps, b] int64 stream positions replica `replica_id` reads in steps first_step.. ."""
    replica_id = tf.cast(replica_id, tf.int64)
    pipeline_id, local = replica_id // stream_layout.local_replicas, replica_id % stream_layout.local_replicas
    step = tf.cast(first_step, tf.int64) + tf.range(tf.cast(num_steps, tf.int64))
    batch = stream_layout.per_replica_batch_size
    within = (step[:, None] * (stream_layout.global_batch_size // stream_layout.num_pipelines) + local * batch
              + tf.range(batch, dtype=tf.int64)[None, :])
    return pipeline_id + stream_layout.num_pipelines * within


def max_epochs_spanned(stream_layout: Layout, num_examples: int, max_steps: int) -> int:
    """How many epochs one replica's positions of a call of up to `max_steps` steps can touch.

    Its positions lie in an interval of at most max_steps * B integers, which meets at most
    (max_steps * B - 1) // n + 2 epochs of n positions.
    """
    return (max_steps * stream_layout.global_batch_size - 1) // num_examples + 2


def example_indices(positions: tf.Tensor, num_examples: int, seed: int, num_epochs: int | None = None) -> tf.Tensor:
    """Example index at each stream position: perm(seed, pos // n)[pos % n], vectorised.

    The epochs the positions span are shuffled once per call (not per step). With a static
    `num_epochs` bound the shuffles are unrolled (cheap to trace); without one, a `tf.map_fn`
    shuffles exactly the epochs spanned.
    """
    epoch, offset = positions // num_examples, positions % num_examples
    first_epoch = tf.reduce_min(epoch)
    if num_epochs is None:
        epochs = tf.range(first_epoch, tf.reduce_max(epoch) + 1)
        perms = tf.map_fn(lambda e: pipeline.epoch_permutation(num_examples, seed=seed, epoch=e), epochs,
                          fn_output_signature=tf.TensorSpec([num_examples], tf.int64))
    else:
        perms = tf.stack([pipeline.epoch_permutation(num_examples, seed=seed, epoch=first_epoch + j)
                          for j in range(num_epochs)])
    return tf.gather_nd(perms, tf.stack([epoch - first_epoch, offset], axis=-1))


class ResidentFeed:
    """In-memory training arrays held on every replica's device, indexed in the graph.

    Pass `feed.at(step)` to the train loop where an iterator would go; the
    loop asks `batches(strategy, source, num_steps)` once per call for a
    `next_batch(i)`, which costs one slice (or one gather) per step.
    """

    def __init__(self, strategy: tf.distribute.Strategy, arrays: Arrays, *, global_batch_size: int, seed: int,
                 steps_per_call: int | None = None, gather_per_call: bool | None = None,
                 accumulation_steps: int = 1):
        """`global_batch_size`: examples per optimizer update (the effective batch).
        `steps_per_call`: the most updates one loop call takes (config.train.steps_per_loop); with it
        the per-call index set-up is a fixed number of shuffles (faster to trace), and a longer call
        is an error. `accumulation_steps` (k): the feed yields k micro-batches of global_batch_size / k
        per update (see the module docstring); its steps are then micro-steps."""
        config_check.check_step(accumulation_steps=accumulation_steps, global_batch_size=global_batch_size,
                                num_replicas=strategy.num_replicas_in_sync)
        self.strategy = strategy
        self.accumulation_steps = accumulation_steps
        self.layout = layout(strategy, global_batch_size // accumulation_steps)
        self.seed = seed
        self.num_examples = len(next(iter(arrays.values())))
        # One replica's (micro-)batch, as `batch` slices it: for what must be known before the loop is traced.
        self.batch_spec = {k: tf.TensorSpec((self.layout.per_replica_batch_size,) + v.shape[1:],
                                            tf.convert_to_tensor(v[:1]).dtype) for k, v in arrays.items()}
        self.steps_per_call = None if steps_per_call is None else steps_per_call * accumulation_steps
        self.num_epochs = None if steps_per_call is None else max_epochs_spanned(self.layout, self.num_examples,
                                                                                  self.steps_per_call)
        batch_bytes = self.layout.per_replica_batch_size * sum(v[0].nbytes for v in arrays.values())
        # Small batches: gather a whole call's examples at once, then slice per step (one op per array
        # instead of a gather). Large ones: gather per step, so a call's batches are never all in memory.
        self.gather_per_call = batch_bytes <= PER_CALL_GATHER_BYTES if gather_per_call is None else gather_per_call
        # One copy per replica device, made once: no host-to-device copy per step on accelerators.
        self.arrays = strategy.experimental_distribute_values_from_function(
            lambda ctx: {k: tf.identity(v) for k, v in arrays.items()})
        self.replica_ids = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(ctx.replica_id_in_sync_group, tf.int64))

    def at(self, step: tf.Variable) -> "FeedAtStep":
        """What the train loop consumes: this feed, read from `step` (the run's step variable) each call."""
        return FeedAtStep(self, step)

    def indices(self, replica_id, first_step, num_steps) -> tf.Tensor:
        """This replica's [num_steps, b] example indices for steps first_step .. first_step + num_steps - 1."""
        # The order is defined on the CPU (as in tf.data): the same RNG kernel on every device type.
        with tf.device("/cpu:0"):
            positions = stream_positions(self.layout, replica_id, first_step, num_steps)
            return example_indices(positions, self.num_examples, self.seed, self.num_epochs)

    def call_examples(self, arrays: dict[str, tf.Tensor], indices: tf.Tensor) -> dict[str, tf.Tensor]:
        """Replica context, once per call: what `batch` slices (the examples, or just the indices)."""
        if self.gather_per_call:
            return {k: tf.gather(v, indices) for k, v in arrays.items()}
        return {"indices": indices, **arrays}

    def batch(self, examples: dict[str, tf.Tensor], i) -> steps.Batch:
        """Replica context, per step: step i's per-replica batch of a call."""
        if self.gather_per_call:
            return {k: v[i] for k, v in examples.items()}
        indices = examples["indices"][i]
        return {k: tf.gather(v, indices) for k, v in examples.items() if k != "indices"}

    def next_batch_fn(self, first_step, num_steps) -> Callable[[tf.Tensor], steps.Batch]:
        """Cross-replica context, once per call: `next_batch(i)` for the call's steps."""
        # More would read past the shuffled epochs.
        if self.steps_per_call is not None:
            tf.debugging.assert_less_equal(tf.cast(num_steps, tf.int64), tf.constant(self.steps_per_call, tf.int64),
                                           message="a loop call takes more steps than the feed's steps_per_call")
        examples = self.strategy.run(lambda replica_id, arrays: self.call_examples(
            arrays, self.indices(replica_id, first_step, num_steps)), args=(self.replica_ids, self.arrays))
        return lambda i: self.strategy.run(self.batch, args=(examples, i))


# Hashed by identity: one trace per run.
@dataclasses.dataclass(frozen=True, eq=False)
class FeedAtStep:
    """A ResidentFeed bound to the run's step variable (the loop's stand-in for an iterator).

    Attributes:
      step: the optimizer updates done; the feed's first micro-step is step * k.
    """
    feed: ResidentFeed
    step: tf.Variable

    @property
    def accumulation_steps(self) -> int:
        return self.feed.accumulation_steps


# Plain Python building graph ops, no tensor-dependent control flow: autograph would only add tracing time.
@tf.autograph.experimental.do_not_convert
def batches(strategy: tf.distribute.Strategy, train_input, num_steps) -> Callable[[tf.Tensor], steps.Batch]:
    """`next_batch(i)` for loop step i of a call, from an iterator or a `FeedAtStep`.

    Call once per loop call, inside the tf.function, before the `tf.while_loop` of steps. With a feed of k
    micro-batches per update, `num_steps` and `i` count micro-steps (the call's first is step * k).
    """
    # The iterator already knows its strategy; kept so callers read alike.
    del strategy
    if isinstance(train_input, FeedAtStep):
        first = tf.convert_to_tensor(train_input.step)
        # No op for k = 1: that graph stays as benchmarked.
        if train_input.accumulation_steps > 1:
            first = first * train_input.accumulation_steps
        return train_input.feed.next_batch_fn(first, num_steps)
    return lambda i: next(train_input)


def batch_spec(train_input: Iterator | FeedAtStep) -> Any:
    """One replica's batch (a nest of tf.TensorSpec) of a distributed iterator or a `FeedAtStep`, as the step gets
    it: what an accumulating update learns its gradient groups from before its loop is traced."""
    if isinstance(train_input, FeedAtStep):
        return train_input.feed.batch_spec
    # A distributed iterator's spec holds each local replica's (PerReplicaSpec); their batches are alike.
    return tf.nest.map_structure(lambda spec: getattr(spec, "_value_specs", (spec,))[0], train_input.element_spec)
