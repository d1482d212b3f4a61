"""Images/sec of the ImageNet training input pipeline, per core.

    python -m benchmarks.input_pipeline [--images=512 --size=256 --image_size=224 --threads=1,2 --repeats=3]

Generates `images` JPEGs of size x size (smooth shapes plus noise, ~ImageNet
bytes per pixel), writes them as TFRecords in a temporary folder, then times
`mwloop.data.imagenet.train_dataset` (read, parse, decode + Inception crop,
resize, flip, normalise, batch) with tf.data's private thread pool limited to
each `threads` count. Prints the median over `repeats` passes of the data.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf

from mwloop.data import imagenet, make_tfrecords

BATCH = 32


def fake_jpegs(count: int, size: int, seed: int = 0) -> list[bytes]:
    """Photo-like JPEGs: a few soft discs on a gradient, with sensor noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    encoded = []
    for _ in range(count):
        image = rng.uniform(0, 255, 3) * (0.5 + 0.5 * x[..., None]) * (0.5 + 0.5 * y[..., None])
        for _ in range(5):
            cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
            disc = np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * r * r))[..., None]
            image = image * (1 - disc) + rng.uniform(0, 255, 3) * disc
        image += rng.normal(0, 12, image.shape)
        encoded.append(tf.io.encode_jpeg(np.clip(image, 0, 255).astype(np.uint8), quality=90).numpy())
    return encoded


def images_per_sec(files: list[str], num_images: int, image_size: int, threads: int) -> tuple[float, float]:
    """Images per wall second and per CPU second (of this process) over one pass of
    `num_images` training images with `threads` tf.data threads. The CPU figure
    is the per-core rate, and holds up when other processes share the cores."""
    ctx = tf.distribute.InputContext(1, 0, 1)
    dataset = imagenet.train_dataset(files, ctx, image_size=image_size, global_batch_size=BATCH, seed=0,
                                     shuffle_buffer=1024)
    options = tf.data.Options()
    options.threading.private_threadpool_size = threads
    options.threading.max_intra_op_parallelism = 1
    iterator = iter(dataset.with_options(options))
    for _ in range(2):  # warm-up: threads started, autotuning under way, buffer filled
        next(iterator)
    batches = num_images // BATCH
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next(iterator)
    return batches * BATCH / (time.perf_counter() - start), batches * BATCH / (time.process_time() - cpu_start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    jpegs = fake_jpegs(args.images, args.size)
    print(f"{args.images} JPEGs {args.size}x{args.size}, mean {np.mean([len(j) for j in jpegs]) / 1024:.0f} KiB; "
          f"output {args.image_size}x{args.image_size}, batch {BATCH}")
    with tempfile.TemporaryDirectory() as out:
        files = make_tfrecords.write_tfrecords([make_tfrecords.Record(j, 1) for j in jpegs], out, 4)
        for threads in (int(t) for t in args.threads.split(",")):
            wall, cpu = zip(*(images_per_sec(files, args.images, args.image_size, threads)
                              for _ in range(args.repeats)))
            print(f"threads={threads}: {statistics.median(wall):.0f} images/s wall "
                  f"(runs {', '.join(f'{r:.0f}' for r in wall)}), {statistics.median(cpu):.0f} images per CPU-second")


if __name__ == "__main__":
    main()
