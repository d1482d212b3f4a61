"""Examples/s of training input from generated JPEGs: records by global index vs today's TFRecord pipeline.

    python -m benchmarks.records_speed [--images=1024 --size=256 --image_size=224 --repeats=5]

Generates `images` photo-like JPEGs (benchmarks.input_pipeline.fake_jpegs) in two class folders, converts them
with `python -m mwloop.data.convert` (timed: the converter's records/s) and with `mwloop.data.make_tfrecords`
(today's ImageNet-layout TFRecords), then times one pass of `images` training examples (decode, Inception crop,
resize, flip, normalise, batch) after 2 warm-up batches, three ways, in an order rotated every repeat:

- records: `mwloop.open_dataset(OUT/train).train_dataset(...)`: the global-index stream (reads per batch in
  Python, fingerprints checked and JPEGs decoded in tf.data's C++ threads);
- tfrecord: today's `mwloop.data.imagenet` train pipeline (interleaved files, block shuffle);
- raw: `tf.data.TFRecordDataset` over today's files with the same decode map, no shuffle (a ceiling).

Prints the medians (per wall second and per CPU second of this process) and the median per-repeat ratio of
each to `tfrecord`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from benchmarks.input_pipeline import BATCH, CTX, fake_jpegs, source, timed  # noqa: E402
from mwloop.data import convert, imagenet, indexed, make_tfrecords  # noqa: E402


def write_folders(root: str, jpegs: list[bytes]) -> str:
    for k, data in enumerate(jpegs):
        folder = os.path.join(root, "images", f"class{k % 2}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{k:06d}.jpg"), "wb") as f:
            f.write(data)
    return os.path.join(root, "images")


def raw_dataset(files: list[str], image_size: int) -> tf.data.Dataset:
    def example(record):
        image_bytes, label = imagenet._parse(record, 1)
        return {"image": imagenet.preprocess_train(image_bytes, tf.constant([0, 0], tf.int64), image_size),
                "label": label}
    return tf.data.TFRecordDataset(files, num_parallel_reads=4).repeat().map(
        example, num_parallel_calls=tf.data.AUTOTUNE).batch(BATCH, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def rate(dataset: tf.data.Dataset, num_images: int) -> tuple[float, float]:
    """Examples per wall second and per CPU second of this process (steadier under shared cores)."""
    iterator = iter(dataset)
    for _ in range(2):
        next(iterator)
    wall, cpu, images = timed(next(iterator) for _ in range(num_images // BATCH))
    return images / wall, images / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        images = write_folders(root, fake_jpegs(args.images, args.size))
        started = time.perf_counter()
        convert.convert(images, os.path.join(root, "records"), validation_fraction=0.05, progress=False)
        converter_rate = args.images / (time.perf_counter() - started)
        make_tfrecords.convert(images, os.path.join(root, "tfrecords"), shards=8, progress=False)
        variants = {
            "records": lambda: indexed.open_dataset(os.path.join(root, "records", "train"), image_size=args.image_size
                                                    ).train_dataset(CTX, global_batch_size=BATCH, seed=0),
            "tfrecord": lambda: source(os.path.join(root, "tfrecords"), args.image_size, {}).train_dataset_fn(
                BATCH, 0)(CTX),
            "raw": lambda: raw_dataset(imagenet.list_files(os.path.join(root, "tfrecords"), "train"), args.image_size),
        }
        names = list(variants)
        rates: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for repeat in range(args.repeats):
            for name in names[repeat % 3:] + names[:repeat % 3]:
                rates[name].append(rate(variants[name](), args.images))
    print(f"{args.images} JPEGs of {args.size}x{args.size} -> {args.image_size}, batch {BATCH}, {args.repeats} "
          f"repeats; converter: {converter_rate:.0f} records/s (read, write, verify)")
    for name in names:
        wall, cpu = zip(*rates[name])
        ratio_wall = statistics.median(r[0] / t[0] for r, t in zip(rates[name], rates["tfrecord"]))
        ratio_cpu = statistics.median(r[1] / t[1] for r, t in zip(rates[name], rates["tfrecord"]))
        print(f"  {name:9s} median {statistics.median(wall):6.0f} examples/s ({', '.join(f'{v:.0f}' for v in wall)}),"
              f" {statistics.median(cpu):5.0f} per CPU-s; ratio to tfrecord {ratio_wall:.2f} wall, "
              f"{ratio_cpu:.2f} per CPU-s")


if __name__ == "__main__":
    main()
