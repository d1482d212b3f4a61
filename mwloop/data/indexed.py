"""Training batches read from records on disk by global index: the in-memory feed's promises for files.

The order is the one `mwloop.data.pipeline` gives in-memory arrays: stream position k holds record
`perm(seed, k // n)[k % n]`, a uniform permutation of all n records per epoch, a pure function of
(seed, epoch). Global step s reads positions [s * B, (s + 1) * B); input pipeline p of P reads only its rows
of each global batch (positions p, p + P, ...), so every worker reads 1/P of the data and every step holds
the same records whatever P is. A run resumed at step s starts reading at position s * B: no record before
it is read, and the time to the first batch does not grow with the position.

Per-example randomness (crops, flips, masking) is seeded by (seed, global index, epoch) through
`example_seed`: a user's decode function gets that seed, so augmentation is the same at any worker count and
on resume.

How reads are grouped: the indices of one per-replica batch go to one `Records.read` call (Python, run by
`tf.numpy_function` from tf.data's threads, several batches at once); decoding runs per example in tf.data's
C++ threads (`map(num_parallel_calls)`).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from mwloop.data import imagenet, pipeline, tables
from mwloop.data.records import Records, RecordsError, fingerprints, open_records
from mwloop.errors import DATA_CHECK_MARK, UserError
from mwloop.task import MASK_KEY, SKIPPED_KEY

AUTOTUNE = tf.data.AUTOTUNE
# How far past a bad record the search for its substitute goes (skip_bad_records): farther, the record is dropped
# and counted like one that does not decode.
MAX_HOPS = 64
# Decode: (record bytes, seed [2] int64) -> one example (a dict of tensors).
Decode = Callable[[tf.Tensor, tf.Tensor], Any]


def example_seed(seed: int | tf.Tensor, index: tf.Tensor, epoch: tf.Tensor) -> tf.Tensor:
    """The stateless seed ([2] int64) of the record at global `index` in `epoch` of a run seeded `seed`.

    Args:
      seed: the run's seed.
      index: the record's global index.
      epoch: the epoch it is read in (augmentation differs per epoch).
    Returns:
      A seed for `tf.random.stateless_*` and `tf.image.stateless_*`.
    """
    base = tf.stack([tf.cast(seed, tf.int64), tf.cast(epoch, tf.int64)])
    return tf.random.experimental.stateless_fold_in(base, tf.cast(index, tf.int64))


def index_batches(num_records: int, ctx: tf.distribute.InputContext, *, global_batch_size: int, seed: int,
                  start_step: int = 0) -> tf.data.Dataset:
    """This pipeline's per-replica batches of (global indices, epochs) from global step `start_step`."""
    batch_size = pipeline.per_replica_batch_size(global_batch_size, ctx)
    stream = pipeline.stream_indices(num_records, seed=seed, start=start_step * global_batch_size,
                                     pipeline_id=ctx.input_pipeline_id, num_pipelines=ctx.num_input_pipelines,
                                     with_epochs=True)
    return stream.rebatch(batch_size, drop_remainder=True)


def _marked(function: Callable) -> Callable:
    """`function` with its RecordsError marked as a data check: the train loop turns the TensorFlow error that
    carries it into that one line (mwloop.step.graph_checks), exit 2."""
    def call(*args):
        try:
            return function(*args)
        except RecordsError as e:
            raise RecordsError(f"{DATA_CHECK_MARK}{e}") from None
    return call


@functools.cache
def _free_readers_before_exit() -> None:
    """A tf.data iterator whose map calls Python (the reader's numpy_function) waits, when it is destroyed, for
    the calls in flight; destroyed while the interpreter finalizes, those calls can never take the GIL again and
    the process hangs after its last line (seen once in ~20 runs). At exit, while threads still run Python,
    collect what holds them (a run's iterators are in reference cycles once its functions return)."""
    atexit.register(gc.collect)


def read_batch(records: Records, indices: tf.Tensor) -> tf.Tensor:
    """The payloads (tf.string [len(indices)]) of the records at `indices`: read by `records.read` in Python,
    their fingerprints checked here in C++ (off the GIL); a mismatch raises the RecordsError naming the record."""
    _free_readers_before_exit()
    data, expected = tf.numpy_function(_marked(records.read), [indices], (tf.string, tf.int64), stateful=False,
                                       name="read_records")
    found = fingerprints(data)

    def fail():
        return tf.numpy_function(_marked(records.fail_checksum), [indices, found], tf.string, stateful=False)

    def checked():
        return data

    data = tf.cond(tf.reduce_all(tf.equal(found, expected)), checked, fail)
    data.set_shape(indices.shape)
    return data


def read_batch_skipping(records: Records, indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """`read_batch` that replaces each bad record (its bytes not the indexed ones: changed, or cut short) by the
    next good record in global index order within MAX_HOPS, a substitute that is the same at any worker count.

    Returns:
      (payloads tf.string [len(indices)], replaced: bool, True where a record was bad, lost: bool, True where
      no good record was found within MAX_HOPS: the caller must not train on that payload).
    """
    _free_readers_before_exit()
    read = _marked(functools.partial(records.read, short_ok=True))
    data, expected = tf.numpy_function(read, [indices], (tf.string, tf.int64), stateful=False, name="read_records")
    data.set_shape(indices.shape)
    expected.set_shape(indices.shape)
    ok = tf.equal(fingerprints(data), expected)
    num_records = tf.constant(len(records), tf.int64)

    def more(hop, substitutes, data, ok):
        return tf.logical_and(hop < MAX_HOPS, tf.logical_not(tf.reduce_all(ok)))

    def next_record(hop, substitutes, data, ok):
        substitutes = tf.where(ok, substitutes, (substitutes + 1) % num_records)
        slots = tf.where(tf.logical_not(ok))
        new, expected = tf.numpy_function(read, [tf.gather_nd(substitutes, slots)], (tf.string, tf.int64),
                                          stateful=False)
        new.set_shape([None])
        data = tf.tensor_scatter_nd_update(data, slots, new)
        ok = tf.tensor_scatter_nd_update(ok, slots, tf.equal(fingerprints(new), expected))
        return hop + 1, substitutes, data, ok

    replaced = tf.logical_not(ok)
    _, _, data, ok = tf.while_loop(more, next_record, (tf.constant(0), tf.cast(indices, tf.int64), data, ok))
    return data, replaced, tf.logical_not(ok)


def train_dataset(records: Records, ctx: tf.distribute.InputContext, *, global_batch_size: int, seed: int,
                  start_step: int = 0, decode: Decode, parallel_calls: int = AUTOTUNE, prefetch: int = AUTOTUNE,
                  threads: int = 0, skip_bad_records: float = 0.0) -> tf.data.Dataset:
    """Endless per-replica training batches of `decode`d records from global step `start_step`.

    Args:
      records: the opened dataset (`open_records`).
      ctx: this input pipeline's InputContext.
      global_batch_size: examples per step over all replicas.
      seed: the run's seed: the epoch order and every example's seed.
      start_step: the global step to start at (resume): reading starts at position start_step * B.
      decode: (record bytes, seed) -> one example; the seed is `example_seed(seed, index, epoch)`.
      parallel_calls, prefetch, threads: speed only (config.dataset); the batches are the same for any.
      skip_bad_records: > 0 (config.dataset.skip_bad_records): a bad record is replaced by the next good one in
        global index order and each example (a dict) gets SKIPPED_KEY, 1.0 where that happened (mwloop sums
        it; its Log action stops the run above the fraction); 0: a bad record fails the run in one line.
    Returns:
      A tf.data.Dataset of per-replica batches.
    """
    batch_size = pipeline.per_replica_batch_size(global_batch_size, ctx)
    batches = index_batches(len(records), ctx, global_batch_size=global_batch_size, seed=seed,
                            start_step=start_step)
    if skip_bad_records > 0:
        examples = _skipping_bad_records(records, batches, seed, decode, parallel_calls, skip_bad_records)
        dataset = pipeline.prefetched(examples.batch(batch_size, drop_remainder=True), prefetch)
        return pipeline.explicit_sharding(dataset, threads)

    # Named functions, not lambdas: autograph cannot find the source of several lambdas on one line and warns.
    def read(idx, epoch):
        return idx, epoch, read_batch(records, idx)

    def decode_one(idx, epoch, data):
        return decode(data, example_seed(seed, idx, epoch))

    # Several batches are read at once; deterministic=True (explicit_sharding) keeps them in order.
    examples = batches.map(read, num_parallel_calls=AUTOTUNE).unbatch().map(decode_one,
                                                                            num_parallel_calls=parallel_calls)
    dataset = pipeline.prefetched(examples.batch(batch_size, drop_remainder=True), prefetch)
    return pipeline.explicit_sharding(dataset, threads)


def _skipping_bad_records(records: Records, batches: tf.data.Dataset, seed: int, decode: Decode, parallel_calls: int,
                          skip_bad_records: float) -> tf.data.Dataset:
    """The examples of `batches` with bad records replaced and marked (SKIPPED_KEY 1.0), as `train_dataset` says.

    A record whose bytes are not the indexed ones is replaced by the next good record in global index order
    (`read_batch_skipping`: the same at any worker count). One whose bytes are as indexed but whose decode fails
    (a bad JPEG in TFRecords indexed in place), or with no good record within MAX_HOPS, is dropped
    (`ignore_errors`) and its place taken by a copy of the pipeline's next example, marked: the batches keep their
    size and their steps, but that copy depends on the number of input pipelines.
    """
    def read(idx, epoch):
        return (idx, epoch, *read_batch_skipping(records, idx))

    def decode_numbered(number, element):
        idx, epoch, data, replaced, lost = element
        with tf.control_dependencies([tf.debugging.assert_equal(lost, False, message="no good record")]):
            example = decode(tf.identity(data), example_seed(seed, idx, epoch))
        if not isinstance(example, dict):
            raise UserError(f"config.dataset.skip_bad_records={skip_bad_records} needs examples that are dicts (it "
                            f"adds {SKIPPED_KEY!r}), and the decode function returns {type(example).__name__}; "
                            f"return a dict, or set it to 0")
        return number, {**example, SKIPPED_KEY: tf.cast(replaced, tf.float32)}

    def gaps(expected, numbered):
        number, example = numbered
        return number + 1, (number - expected, example)

    def filled(gap, example):
        marked = {**example, SKIPPED_KEY: tf.constant(1.0)}
        return tf.data.Dataset.from_tensors(marked).repeat(gap).concatenate(tf.data.Dataset.from_tensors(example))

    examples = batches.map(read, num_parallel_calls=AUTOTUNE).unbatch().enumerate()
    decoded = examples.map(decode_numbered, num_parallel_calls=parallel_calls).ignore_errors()
    return decoded.scan(tf.constant(0, tf.int64), gaps).flat_map(filled)


def eval_dataset(records: Records, ctx: tf.distribute.InputContext, *, global_batch_size: int, decode: Decode,
                 parallel_calls: int = AUTOTUNE, prefetch: int = AUTOTUNE, threads: int = 0,
                 skip_bad_records: float = 0.0) -> tf.data.Dataset:
    """Per-replica eval batches covering every record exactly once, with `mask` (1 real, 0 padding).

    As in-memory eval arrays (`pipeline.array_eval_dataset`): the records are padded to a whole number of
    global batches, pipeline p takes positions p, p + P, ...; so every pipeline yields the same number of
    batches. Decoding gets the seed of (0, index, 0): fixed, as an eval's should be.

    Args:
      skip_bad_records: 0: a bad record (its bytes not the indexed ones) stops the eval in one line naming it, as
        training does. > 0 (config.dataset.skip_bad_records): it counts for nothing (mask 0; the next good record's
        bytes are decoded in its place) and each example gets SKIPPED_KEY, 1.0 for a bad record, which mwloop sums
        as the eval metric of that name (`run.evaluation` stops above the fraction).
      Other arguments: as `train_dataset`'s.
    """
    batch_size = pipeline.per_replica_batch_size(global_batch_size, ctx)
    num_records = len(records)
    padded = pipeline.num_eval_steps(num_records, global_batch_size) * global_batch_size

    def read(idx):
        clipped = tf.minimum(idx, num_records - 1)
        if skip_bad_records <= 0:
            return idx, read_batch(records, clipped), tf.zeros_like(idx, tf.bool)
        data, replaced, lost = read_batch_skipping(records, clipped)
        # A bad record with no good one within MAX_HOPS after it: nothing sound to decode; one line naming it.
        data = tf.cond(tf.reduce_any(lost), lambda: _fail_lost(records, clipped, lost), lambda: data)
        return idx, data, tf.logical_and(replaced, idx < num_records)

    def decode_one(idx, data, bad):
        example = decode(data, example_seed(0, idx, 0))
        example[MASK_KEY] = tf.cast(tf.logical_and(idx < num_records, tf.logical_not(bad)), tf.float32)
        if skip_bad_records > 0:
            example[SKIPPED_KEY] = tf.cast(bad, tf.float32)
        return example

    indices = tf.data.Dataset.range(padded).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    examples = indices.batch(batch_size, drop_remainder=True).map(read, num_parallel_calls=AUTOTUNE).unbatch().map(
        decode_one, num_parallel_calls=parallel_calls)
    dataset = pipeline.prefetched(examples.batch(batch_size, drop_remainder=True), prefetch)
    return pipeline.explicit_sharding(dataset, threads)


def _fail_lost(records: Records, indices: tf.Tensor, lost: tf.Tensor) -> tf.Tensor:
    """Raises (in the graph, as a data check) the RecordsError naming the first of `indices` marked `lost`."""
    def fail(indices, lost):
        first = int(indices[np.flatnonzero(lost)[0]])
        raise records.record_error(first, f"and the {MAX_HOPS} records after it do not match their checksums")
    failed = tf.numpy_function(_marked(fail), [indices, lost], tf.string, stateful=False)
    failed.set_shape(indices.shape)
    return failed


# ---------------------------------------------------------------- opening a dataset with its decoder

@dataclasses.dataclass(frozen=True)
class OnDisk:
    """A records dataset and how one record becomes an example: what `Task.train_records` returns.

    Attributes:
      records: the opened records (`mwloop.data.records.open_records`).
      decode: (record bytes, example seed) -> one example.
    """
    records: Records
    decode: Decode

    def train_dataset(self, ctx: tf.distribute.InputContext, **kwargs) -> tf.data.Dataset:
        """`train_dataset` over these records with this decoder (kwargs: global_batch_size, seed, ...)."""
        return train_dataset(self.records, ctx, decode=self.decode, **kwargs)

    def eval_dataset(self, ctx: tf.distribute.InputContext, **kwargs) -> tf.data.Dataset:
        """`eval_dataset` over these records with this decoder (kwargs: global_batch_size, ...): what a task's
        own `eval_dataset(ctx, *, global_batch_size)` returns."""
        return eval_dataset(self.records, ctx, decode=self.decode, **kwargs)


def decode_arrays(features: dict) -> Decode:
    """The decoder of an arrays dataset (`convert` from .npz or a table): each feature's raw bytes as its dtype and
    shape; a string column as a tf.string scalar."""
    spec = {k: tf.io.FixedLenFeature([], tf.string) for k in features}

    def value(data: tf.Tensor, feature: dict) -> tf.Tensor:
        if feature["dtype"] == tables.STRING:
            return data
        return tf.reshape(tf.io.decode_raw(data, tf.dtypes.as_dtype(np.dtype(feature["dtype"]))), feature["shape"])

    def decode(data: tf.Tensor, seed: tf.Tensor) -> dict[str, tf.Tensor]:
        del seed  # arrays are not augmented; a task's own decode can use it
        parsed = tf.io.parse_single_example(data, spec)
        return {k: value(parsed[k], f) for k, f in features.items()}
    return decode


def decode_images(image_size: int, augment: bool = True) -> Decode:
    """The decoder of an images dataset (`convert` from class folders): {"image": float [s, s, 3], "label"}.

    Args:
      image_size: the side of the square image.
      augment: the Inception crop and a flip seeded by the example's seed; False: the centre crop.
    """
    spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.string)}

    def decode(data: tf.Tensor, seed: tf.Tensor) -> dict[str, tf.Tensor]:
        parsed = tf.io.parse_single_example(data, spec)
        label = tf.cast(tf.reshape(tf.io.decode_raw(parsed["label"], tf.int64), []), tf.int32)
        image = imagenet.preprocess_train(parsed["image"], seed, image_size) if augment \
            else imagenet.preprocess_eval(parsed["image"], image_size)
        return {"image": image, "label": label}
    return decode


def decode_imagenet_layout(image_size: int, augment: bool = True, label_offset: int = 1) -> Decode:
    """The decoder of indexed ImageNet-layout TFRecords (`image/encoded`, `image/class/label` from `label_offset`)."""
    def decode(data: tf.Tensor, seed: tf.Tensor) -> dict[str, tf.Tensor]:
        image_bytes, label = imagenet._parse(data, label_offset)
        image = imagenet.preprocess_train(image_bytes, seed, image_size) if augment \
            else imagenet.preprocess_eval(image_bytes, image_size)
        return {"image": image, "label": label}
    return decode


def _default_decode(records: Records, image_size: int, augment: bool) -> Decode:
    kind = records.meta.get("kind")
    if kind == "images":
        return decode_images(image_size, augment)
    if kind == "arrays":
        return decode_arrays(records.features)
    first = tf.train.Example.FromString(records.read([0])[0][0]) if len(records) else None
    if first is not None and {"image/encoded", "image/class/label"} <= set(first.features.feature):
        return decode_imagenet_layout(image_size, augment)
    raise UserError(f"{records.root} indexes TFRecords of a layout of your own; pass "
                    f"open_dataset(..., decode=fn), fn(record_bytes, seed) -> example")


def open_dataset(root: str, decode: Decode | None = None, image_size: int = 224, augment: bool = True) -> OnDisk:
    """Opens a records dataset for training, checked against its files: the one call a task makes.

    Args:
      root: a dataset folder written by `python -m mwloop.data.convert` (OUT/train).
      decode: (record bytes, example seed) -> example; default: the converter's own layout (arrays as written,
        images cropped to `image_size` and flipped, seeded per example), or indexed ImageNet-layout TFRecords.
      image_size: for an images dataset with the default decoder.
      augment: the default images decoder's random crop and flip; False (eval): the centre crop.
    Returns:
      An `OnDisk` for `Task.train_records`.
    """
    records = open_records(root)
    return OnDisk(records, decode or _default_decode(records, image_size, augment))
