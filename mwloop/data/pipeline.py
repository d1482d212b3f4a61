"""tf.data pipelines fed by an InputContext: explicit sharding, seeded order.

Training order is a pure function of (seed, position in the stream): example
k of the endless training stream is `perm(seed, k // n)[k % n]`, where
`perm(seed, epoch)` is a stateless shuffle of the n examples. Global batch s is
stream positions [s * B, (s + 1) * B), whatever the number of workers or
replicas, because pipeline p reads positions p, p + P, p + 2P, ... and its
replicas take consecutive batches. So a run restarted at step s builds the
pipeline at position s * B (no iterator state to save), and a restart with a
different number of workers reads exactly the examples it would have read.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mwloop.errors import UserError

AUTOTUNE = tf.data.AUTOTUNE


def per_replica_batch_size(global_batch_size: int, ctx: tf.distribute.InputContext) -> int:
    """`ctx.get_per_replica_batch_size`, with a one-line error naming the fix."""
    if global_batch_size % ctx.num_replicas_in_sync:
        raise UserError(
            f"global batch size {global_batch_size} does not divide among {ctx.num_replicas_in_sync} replicas; "
            f"set it to a multiple of {ctx.num_replicas_in_sync}")
    return ctx.get_per_replica_batch_size(global_batch_size)


def explicit_sharding(dataset: tf.data.Dataset, threads: int = 0) -> tf.data.Dataset:
    """Turns tf.data auto-sharding off (our pipelines shard themselves); `threads` > 0
    runs the pipeline on a private pool of that many threads (`config.dataset.threads`)."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.deterministic = True
    # 0: TensorFlow's shared inter-op pool, which the train step's ops also use.
    if threads:
        options.threading.private_threadpool_size = threads
    return dataset.with_options(options)


def check_tuning(*, threads: int = 0, parallel_calls: int = AUTOTUNE, prefetch: int = AUTOTUNE) -> None:
    """One-line errors for tuning knobs tf.data would reject only when iterated, or misread."""
    if threads < 0:
        raise UserError(f"config.dataset.threads={threads}; use 0 (shared pool) or a thread count")
    if parallel_calls == 0 or parallel_calls < AUTOTUNE:
        raise UserError(f"config.dataset.parallel_calls={parallel_calls}; use -1 (AUTOTUNE) or a count >= 1")
    if prefetch < AUTOTUNE:
        raise UserError(f"config.dataset.prefetch={prefetch}; use -1 (AUTOTUNE), 0 (none) or a batch count")


def prefetched(dataset: tf.data.Dataset, buffer: int) -> tf.data.Dataset:
    """`dataset.prefetch(buffer)` (-1: AUTOTUNE), or `dataset` itself for 0 (`config.dataset.prefetch`)."""
    return dataset.prefetch(buffer) if buffer else dataset


def shard_files(files: list[str], ctx: tf.distribute.InputContext) -> tuple[list[str], bool]:
    """Files this pipeline reads, and whether it must still shard their elements.

    With at least as many files as pipelines each pipeline reads its own files
    (file i goes to pipeline i mod P); with fewer, every pipeline reads all files
    and keeps every P-th element, so no data is duplicated or lost.
    """
    files = sorted(files)
    if len(files) >= ctx.num_input_pipelines:
        return files[ctx.input_pipeline_id::ctx.num_input_pipelines], False
    return files, True


def epoch_permutation(num_examples: int, *, seed, epoch) -> tf.Tensor:
    """`perm(seed, epoch)`: the int64 order of the n examples in that epoch of the stream.

    The one definition of the training order: the tf.data pipeline below and
    the in-graph feed (mwloop.loop.feed) both call it, so they agree example by example.
    """
    return tf.random.experimental.stateless_shuffle(
        tf.range(num_examples, dtype=tf.int64),
        seed=tf.stack([tf.cast(seed, tf.int64), tf.cast(epoch, tf.int64)]))


def stream_indices(num_examples: int, *, seed: int, start: int, pipeline_id: int,
                   num_pipelines: int, with_epochs: bool = False) -> tf.data.Dataset:
    """Example indices of the endless training stream from position `start`,
    keeping positions congruent to `start + pipeline_id` modulo `num_pipelines`.

    One element per epoch (a vector of that epoch's indices for this pipeline),
    so the work is per epoch, not per example: `rebatch` cuts batches from it.
    `with_epochs`: each element is (indices, epochs), the second the epoch of each
    index (per-example randomness is seeded by it: `mwloop.data.indexed.example_seed`).
    """
    first_epoch = start // num_examples

    def epoch_part(epoch):
        # This pipeline's absolute positions in the epoch: the first one >= max(start, epoch * n)
        # that is congruent to start + pipeline_id, then every num_pipelines-th.
        low = tf.maximum(tf.constant(start, tf.int64), epoch * num_examples)
        first = low + tf.math.floormod(start + pipeline_id - low, tf.constant(num_pipelines, tf.int64))
        # < n: fits in int32, and the slice's bounds take one dtype.
        offset = tf.cast(first - epoch * num_examples, tf.int32)
        indices = epoch_permutation(num_examples, seed=seed, epoch=epoch)[offset::num_pipelines]
        return (indices, tf.fill(tf.shape(indices), epoch)) if with_epochs else indices

    return tf.data.Dataset.range(first_epoch, np.iinfo(np.int64).max).map(epoch_part)


def array_train_dataset(arrays: dict[str, np.ndarray], ctx: tf.distribute.InputContext, *,
                        global_batch_size: int, seed: int, start_step: int = 0, threads: int = 0) -> tf.data.Dataset:
    """Per-replica training batches of in-memory arrays from global step `start_step`."""
    batch_size = per_replica_batch_size(global_batch_size, ctx)
    num_examples = len(next(iter(arrays.values())))
    tensors = {k: tf.constant(v) for k, v in arrays.items()}
    indices = stream_indices(num_examples, seed=seed, start=start_step * global_batch_size,
                             pipeline_id=ctx.input_pipeline_id, num_pipelines=ctx.num_input_pipelines)
    # rebatch: batches cut from the per-epoch index vectors, across epoch ends, without a per-example op.
    dataset = indices.rebatch(batch_size, drop_remainder=True).map(
        lambda idx: {k: tf.gather(t, idx) for k, t in tensors.items()}, num_parallel_calls=AUTOTUNE)
    return explicit_sharding(dataset.prefetch(AUTOTUNE), threads)


def num_eval_steps(num_examples: int, global_batch_size: int) -> int:
    """Global eval steps that cover `num_examples` once, the last batch padded."""
    return -(-num_examples // global_batch_size)


def array_eval_dataset(arrays: dict[str, np.ndarray], ctx: tf.distribute.InputContext, *,
                       global_batch_size: int, threads: int = 0) -> tf.data.Dataset:
    """Per-replica eval batches covering every example exactly once.

    The set is padded to a whole number of global batches; padding examples have
    `mask` 0, so every pipeline yields the same number of batches (uneven
    pipelines would hang the collectives) and nothing is counted twice.
    """
    batch_size = per_replica_batch_size(global_batch_size, ctx)
    num_examples = len(next(iter(arrays.values())))
    padded = num_eval_steps(num_examples, global_batch_size) * global_batch_size
    tensors = {k: tf.constant(v) for k, v in arrays.items()}

    def lookup(idx):
        batch = {k: tf.gather(t, tf.minimum(idx, num_examples - 1)) for k, t in tensors.items()}
        batch["mask"] = tf.cast(idx < num_examples, tf.float32)
        return batch

    indices = tf.data.Dataset.range(padded).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    dataset = indices.batch(batch_size, drop_remainder=True).map(lookup, num_parallel_calls=AUTOTUNE)
    return explicit_sharding(dataset.cache().prefetch(AUTOTUNE), threads)
