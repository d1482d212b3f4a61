"""ImageNet-layout TFRecords: Inception-crop training and centre-crop eval pipelines.

Layout (what `mwloop.data.make_tfrecords` writes and the common ImageNet
conversion uses): files `train-*` and `validation-*` in `data_dir`, each record
a `tf.train.Example` with `image/encoded` (JPEG bytes; PNG also decodes) and
`image/class/label` (int64, `label_offset`-based: 1..1000 for ImageNet).

Training order is a pure function of (seed, this pipeline's files, position):
epoch e of pipeline p reads its files in a stateless shuffle of (seed, e),
interleaved, then shuffled in blocks of `shuffle_buffer` records by stateless
permutations of (seed, e, block); the random crop and flip of the example at
stream position k are seeded by (seed, p, k). So a run
resumed at step s skips whole epochs without reading them, and the rest of one
epoch as raw records (no decoding), and continues with exactly the batches it
would have read. That holds for the same number of input pipelines (workers):
with another number the files split differently and the order differs (each
example is still read once per epoch, but not in the same steps).

Eval reads a contiguous range of the validation records per pipeline (record
counts come from the files' record headers), padded with `mask` 0 examples so
every pipeline yields the same number of batches and each example counts once.
"""

from __future__ import annotations

import functools
import os
import struct

import keras
import ml_collections
import numpy as np
import tensorflow as tf

from mwloop.data import pipeline
from mwloop.data.source import DatasetFn, Source
from mwloop.errors import UserError

AUTOTUNE = tf.data.AUTOTUNE
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)
# Eval: a centre crop of image_size / (image_size + 32) of the short side.
CROP_PADDING = 32
# Files read at once; fixed (not AUTOTUNE) because it fixes the example order.
CYCLE_LENGTH = 16
FEATURES = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
            "image/class/label": tf.io.FixedLenFeature([], tf.int64)}


# ---------------------------------------------------------------- files

def list_files(data_dir: str, split: str) -> list[str]:
    """Sorted `split-*` files in `data_dir`."""
    return sorted(tf.io.gfile.glob(os.path.join(data_dir, f"{split}-*")))


def count_records(path: str) -> int:
    """Records in an uncompressed TFRecord file, from the length headers only.

    Seeks past each payload instead of reading it: 0.13 s per 100k records
    in the page cache here; on remote file systems every seek is a request.
    """
    opener = open if "://" not in path else tf.io.gfile.GFile
    count, position = 0, 0
    with opener(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        while position < size:
            f.seek(position)
            header = f.read(8)
            if len(header) < 8:
                break
            position += 8 + 4 + struct.unpack("<Q", header)[0] + 4  # length, crc, payload, crc
            count += 1
    if position != size:
        raise UserError(f"{path} is truncated or not an uncompressed TFRecord file")
    return count


def _missing_data_error(data_dir, what: str) -> UserError:
    return UserError(
        f"config.dataset.data_dir={data_dir!r} {what}; point config.dataset.data_dir at a folder with "
        f"train-* and validation-* TFRecord files, or make one from class folders of images with "
        f"`python -m mwloop.data.make_tfrecords --input=IMAGES --output=DIR`")


# ---------------------------------------------------------------- one image

def _decode_and_crop(image_bytes: tf.Tensor, window_fn) -> tf.Tensor:
    """uint8 [h, w, 3] crop `window_fn(shape) -> [y, x, h, w]`; JPEGs decode only the window."""
    def jpeg():
        window = window_fn(tf.io.extract_jpeg_shape(image_bytes))
        return tf.io.decode_and_crop_jpeg(image_bytes, window, channels=3)

    def other():
        """PNG, GIF, BMP: decode all, then slice."""
        image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
        y, x, h, w = tf.unstack(window_fn(tf.shape(image)))
        return image[y:y + h, x:x + w]

    return tf.cond(tf.io.is_jpeg(image_bytes), jpeg, other)


def center_window(shape: tf.Tensor, image_size: int) -> tf.Tensor:
    """The central square of image_size / (image_size + CROP_PADDING) of the short side."""
    height, width = shape[0], shape[1]
    side = tf.cast(image_size / (image_size + CROP_PADDING) * tf.cast(tf.minimum(height, width), tf.float32),
                   tf.int32)
    return tf.stack([(height - side + 1) // 2, (width - side + 1) // 2, side, side])


def inception_window(shape: tf.Tensor, image_size: int, seed: tf.Tensor) -> tf.Tensor:
    """A random crop of 8%-100% of the area, aspect 3/4..4/3; the centre crop when
    10 tries find none (the sampler then returns the whole image)."""
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed, min_object_covered=0.1,
        aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    sampled = tf.stack([begin[0], begin[1], size[0], size[1]])
    whole = tf.reduce_all(tf.equal(size[:2], shape[:2]))
    return tf.where(whole, center_window(shape, image_size), sampled)


def _normalize(image: tf.Tensor, dtype) -> tf.Tensor:
    image = (image - tf.constant(MEAN_RGB, image.dtype)) / tf.constant(STDDEV_RGB, image.dtype)
    return tf.cast(image, dtype)


def preprocess_train(image_bytes: tf.Tensor, seed: tf.Tensor, image_size: int, dtype=tf.float32) -> tf.Tensor:
    """Inception crop, resize, horizontal flip, normalise; `seed` [2] fixes the randomness."""
    crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    image = _decode_and_crop(image_bytes, lambda shape: inception_window(shape, image_size, crop_seed))
    image = tf.image.resize(image, [image_size, image_size])
    image = tf.image.stateless_random_flip_left_right(image, flip_seed)
    return _normalize(image, dtype)


def preprocess_eval(image_bytes: tf.Tensor, image_size: int, dtype=tf.float32) -> tf.Tensor:
    """Centre crop, resize, normalise."""
    image = _decode_and_crop(image_bytes, lambda shape: center_window(shape, image_size))
    return _normalize(tf.image.resize(image, [image_size, image_size]), dtype)


def _parse(record: tf.Tensor, label_offset: int) -> tuple[tf.Tensor, tf.Tensor]:
    features = tf.io.parse_single_example(record, FEATURES)
    return features["image/encoded"], tf.cast(features["image/class/label"] - label_offset, tf.int32)


def _compute_dtype() -> tf.DType:
    """The Keras policy's compute dtype, read when a dataset_fn runs (the run sets the policy first)."""
    return tf.as_dtype(keras.mixed_precision.global_policy().compute_dtype)


# ---------------------------------------------------------------- training

def _read(files: tf.Tensor, num_files: int) -> tf.data.Dataset:
    """Records of `files`, CYCLE_LENGTH files read in parallel, in a deterministic order."""
    return tf.data.Dataset.from_tensor_slices(files).interleave(
        tf.data.TFRecordDataset, cycle_length=min(CYCLE_LENGTH, num_files), block_length=1,
        num_parallel_calls=AUTOTUNE, deterministic=True)


def _epoch_records(files: list[str], ctx: tf.distribute.InputContext, shard_elements: bool, seed: int,
                   shuffle_buffer: int, epoch: tf.Tensor) -> tf.data.Dataset:
    """This pipeline's records of epoch `epoch`, in the order fixed by (seed, epoch)."""
    epoch_seed = tf.stack([tf.constant(seed, tf.int64), epoch])
    order = tf.random.experimental.stateless_shuffle(tf.range(len(files), dtype=tf.int64), seed=epoch_seed)
    records = _read(tf.gather(tf.constant(files), order), len(files))
    if shard_elements:
        records = records.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return block_shuffle(records, shuffle_buffer, epoch_seed)


def block_shuffle(records: tf.data.Dataset, block_size: int, seed: tf.Tensor) -> tf.data.Dataset:
    """Shuffles each block of `block_size` records by a stateless permutation of (seed, block).

    Not `Dataset.shuffle`: its order also depends on the global seed, and a
    tensor seed fails under `enable_op_determinism` (TF 2.21).
    """
    def shuffle(index, block):
        order = tf.random.experimental.stateless_shuffle(
            tf.range(tf.shape(block, out_type=tf.int64)[0]),
            seed=tf.random.experimental.stateless_fold_in(seed, index))
        return tf.data.Dataset.from_tensor_slices(tf.gather(block, order))

    # prefetch(1): the next block is read while this one is consumed
    return records.batch(block_size).prefetch(1).enumerate().flat_map(shuffle)


def records_per_epoch(files: list[str], all_files: list[str], ctx: tf.distribute.InputContext,
                      shard_elements: bool) -> int:
    """How many records this pipeline reads per epoch (counted from the files' headers)."""
    if not shard_elements:
        return sum(count_records(f) for f in files)
    total = sum(count_records(f) for f in all_files)
    return len(range(ctx.input_pipeline_id, total, ctx.num_input_pipelines))


def train_dataset(train_files: list[str], ctx: tf.distribute.InputContext, *, image_size: int,
                  global_batch_size: int, seed: int, start_step: int = 0, label_offset: int = 1,
                  shuffle_buffer: int = 10_000, threads: int = 0, parallel_calls: int = AUTOTUNE,
                  prefetch: int = AUTOTUNE) -> tf.data.Dataset:
    """Endless per-replica training batches {'image', 'label'} from global step `start_step`.

    Resuming at `start_step` continues exactly the stream a run from step 0
    would have read, for the same seed and number of input pipelines only; with
    another number of pipelines (workers) the order differs (module docstring).
    `threads`, `parallel_calls` and `prefetch` tune speed only (`config.dataset`,
    docs/data.md): the batches are the same for any setting.
    """
    batch_size = pipeline.per_replica_batch_size(global_batch_size, ctx)
    dtype = _compute_dtype()
    files, shard_elements = pipeline.shard_files(train_files, ctx)
    # This pipeline's position in its stream of records.
    start = start_step * (global_batch_size // ctx.num_input_pipelines)
    first_epoch, offset = 0, 0
    if start:
        first_epoch, offset = divmod(start, records_per_epoch(files, train_files, ctx, shard_elements))
    epochs = tf.data.Dataset.range(first_epoch, np.iinfo(np.int64).max)
    records = epochs.flat_map(functools.partial(_epoch_records, files, ctx, shard_elements, seed, shuffle_buffer))
    base_seed = tf.constant([seed, ctx.input_pipeline_id], tf.int64)

    def example(position, record):
        image_bytes, label = _parse(record, label_offset)
        seed_k = tf.random.experimental.stateless_fold_in(base_seed, position)
        return {"image": preprocess_train(image_bytes, seed_k, image_size, dtype), "label": label}

    # The options' deterministic=True keeps the map's output in order whatever its parallelism.
    dataset = records.skip(offset).enumerate(start).map(example, num_parallel_calls=parallel_calls)
    return pipeline.explicit_sharding(pipeline.prefetched(dataset.batch(batch_size, drop_remainder=True), prefetch),
                                      threads)


# ---------------------------------------------------------------- eval

def file_slices(counts: list[int], first: int, last: int) -> list[tuple[int, int, int]]:
    """(file index, skip, take) covering records [first, last) of the files in order."""
    slices, file_start = [], 0
    for index, count in enumerate(counts):
        skip, stop = max(first - file_start, 0), min(last - file_start, count)
        if stop > skip:
            slices.append((index, skip, stop - skip))
        file_start += count
    return slices


def eval_dataset(eval_files: list[str], counts: list[int], ctx: tf.distribute.InputContext, *, image_size: int,
                 global_batch_size: int, label_offset: int = 1, cache: bool = False, threads: int = 0,
                 parallel_calls: int = AUTOTUNE, prefetch: int = AUTOTUNE) -> tf.data.Dataset:
    """Per-replica eval batches {'image', 'label', 'mask'} covering every record exactly once.

    `cache` keeps the encoded records after the first pass; it and `threads`,
    `parallel_calls`, `prefetch` change speed only, as in `train_dataset`.

    Pipeline p reads records [p * share, (p + 1) * share) of the padded set
    (`pipeline.num_eval_steps` global batches); the padding has `mask` 0, so
    every pipeline yields the same number of batches.
    """
    batch_size = pipeline.per_replica_batch_size(global_batch_size, ctx)
    dtype = _compute_dtype()
    total = sum(counts)
    share = pipeline.num_eval_steps(total, global_batch_size) * global_batch_size // ctx.num_input_pipelines
    first = ctx.input_pipeline_id * share
    slices = file_slices(counts, first, min(first + share, total))
    num_real = sum(take for _, _, take in slices)
    names = tf.constant([eval_files[i] for i, _, _ in slices], tf.string)
    skips, takes = (tf.constant([s[k] for s in slices], tf.int64) for k in (1, 2))
    records = tf.data.Dataset.from_tensor_slices((names, skips, takes)).interleave(
        lambda name, skip, take: tf.data.TFRecordDataset(name).skip(skip).take(take),
        cycle_length=max(1, min(CYCLE_LENGTH, len(slices))), num_parallel_calls=AUTOTUNE, deterministic=True)
    # The encoded bytes of this pipeline's share, kept after the first pass.
    if cache:
        records = records.cache()

    def example(record):
        image_bytes, label = _parse(record, label_offset)
        return {"image": preprocess_eval(image_bytes, image_size, dtype), "label": label,
                "mask": tf.constant(1.0, tf.float32)}

    padding = tf.data.Dataset.from_tensors({"image": tf.zeros([image_size, image_size, 3], dtype),
                                            "label": tf.constant(0, tf.int32), "mask": tf.constant(0.0)})
    dataset = records.map(example, num_parallel_calls=parallel_calls).concatenate(padding.repeat(share - num_real))
    return pipeline.explicit_sharding(pipeline.prefetched(dataset.batch(batch_size, drop_remainder=True), prefetch),
                                      threads)


# ---------------------------------------------------------------- the Source

def tuning_knobs(cfg: ml_collections.ConfigDict) -> dict[str, int]:
    """`threads`, `parallel_calls`, `prefetch` of `config.dataset` (defaults: today's tf.data behaviour), checked."""
    knobs = {"threads": cfg.get("threads", 0), "parallel_calls": cfg.get("parallel_calls", AUTOTUNE),
             "prefetch": cfg.get("prefetch", AUTOTUNE)}
    pipeline.check_tuning(**knobs)
    return knobs


def imagenet(cfg: ml_collections.ConfigDict) -> Source:
    """TFRecords in `cfg.data_dir` as a Source (see the module docstring for the layout)."""
    data_dir = cfg.get("data_dir")
    if not data_dir or not tf.io.gfile.isdir(data_dir):
        raise _missing_data_error(data_dir, "is not a directory")
    train_files, eval_files = list_files(data_dir, "train"), list_files(data_dir, "validation")
    if not train_files or not eval_files:
        raise _missing_data_error(data_dir, f"has no {'train' if not train_files else 'validation'}-* files")
    image_size, label_offset = cfg.get("image_size", 224), cfg.get("label_offset", 1)
    # Checked before counting records: a bad knob fails at once.
    tuning = tuning_knobs(cfg)
    eval_counts = [count_records(f) for f in eval_files]
    num_train = cfg.get("num_train_examples", 0) or sum(count_records(f) for f in train_files)
    # An empty stream would spin at 100 % CPU, never giving a batch.
    if not num_train or not sum(eval_counts):
        raise _missing_data_error(data_dir, f"has 0 {'train' if not num_train else 'validation'} records")

    def train_dataset_fn(global_batch_size: int, seed: int, start_step: int = 0) -> DatasetFn:
        return functools.partial(train_dataset, train_files, image_size=image_size,
                                 global_batch_size=global_batch_size, seed=seed, start_step=start_step,
                                 label_offset=label_offset, shuffle_buffer=cfg.get("shuffle_buffer", 10_000), **tuning)

    def eval_dataset_fn(global_batch_size: int) -> DatasetFn:
        return functools.partial(eval_dataset, eval_files, eval_counts, image_size=image_size,
                                 global_batch_size=global_batch_size, label_offset=label_offset,
                                 cache=cfg.get("cache", False), **tuning)

    return Source("imagenet", (image_size, image_size, 3), cfg.get("num_classes", 1000), num_train,
                  sum(eval_counts), train_dataset_fn, eval_dataset_fn,
                  decode_image=functools.partial(preprocess_eval, image_size=image_size))  # float32, for serving
