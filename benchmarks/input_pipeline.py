"""Images/s of the ImageNet input pipelines under each tf.data tuning knob, side by side.

    python -m benchmarks.input_pipeline [--images=1024 --size=256 --image_size=224 --repeats=7 --eval_passes=3]

Generates `images` JPEGs of size x size (smooth shapes plus noise, ~ImageNet
bytes per pixel), writes them as the train-* and validation-* TFRecords of one
temporary folder, and times the real `mwloop.data.imagenet` Source built from
`config.dataset` with each variant's knobs (threads, parallel_calls, prefetch,
cache):

- train variants: one pass of `images` training images (read, parse, decode +
  Inception crop, resize, flip, normalise, batch) after 2 warm-up batches;
- eval variants: `eval_passes` full passes over the validation set after a
  first, untimed one (which fills the cache where cache=True), each with a new
  iterator, as each evaluation makes, iterator start-up included. Several
  short passes, because single 0.5 s passes swing by a third with the load.

Every repeat runs every variant once, in an order rotated by one each repeat,
so changing load on shared cores hits all variants alike. Per variant: the
median images per wall second and per CPU second (all threads of this
process: the per-core rate, which holds up better under load than the wall
rate), and the median over repeats of the per-repeat ratio of its rates to the
reference (train: `default`; eval: `eval cache=False`). `default again` is
the default a second time: its ratio shows the noise of the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads: one INFO line per dataset otherwise

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from mwloop.data import imagenet, make_tfrecords  # noqa: E402

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


CTX = tf.distribute.InputContext(1, 0, 1)
TRAIN = {  # name -> config.dataset overrides; the first is the reference of the train ratios
    "default": {},
    "default again": {},
    "threads=1": {"threads": 1},
    "threads=2": {"threads": 2},
    "parallel_calls=1": {"parallel_calls": 1},
    "prefetch=0": {"prefetch": 0},
}
EVAL = {"eval cache=False": {"cache": False}, "eval cache=True": {"cache": True}}  # first: the eval reference


def source(data_dir: str, image_size: int, knobs: dict) -> imagenet.Source:
    """The ImageNet Source as a run builds it from `config.dataset`, with `knobs` set."""
    return imagenet.imagenet(ml_collections.ConfigDict(dict(
        {"data_dir": data_dir, "image_size": image_size, "num_classes": 1, "shuffle_buffer": 1024}, **knobs)))


def timed(batches) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (this process) and images to exhaust the iterable `batches`."""
    start, cpu_start, images = time.perf_counter(), time.process_time(), 0
    for batch in batches:
        images += int(batch["label"].shape[0])
    return time.perf_counter() - start, time.process_time() - cpu_start, images


def train_rates(src: imagenet.Source, num_images: int) -> tuple[float, float]:
    """Images per wall second and per CPU second over `num_images` training images."""
    iterator = iter(src.train_dataset_fn(BATCH, 0)(CTX))
    for _ in range(2):  # warm-up: threads started, autotuning under way, shuffle block read
        next(iterator)
    wall, cpu, images = timed(next(iterator) for _ in range(num_images // BATCH))
    return images / wall, images / cpu


def eval_rates(src: imagenet.Source, passes: int) -> tuple[float, float]:
    """Images per wall second and per CPU second of eval passes 2 .. passes + 1 over the eval set."""
    dataset = src.eval_dataset_fn(BATCH)(CTX)
    for _ in dataset:  # first pass: fills the cache when cache=True, warms the page cache in any case
        pass
    wall, cpu, images = timed(batch for _ in range(passes) for batch in dataset)
    return images / wall, images / cpu


def measure(data_dir: str, args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """(wall rate, CPU rate) of every variant per repeat, the variants' order rotated each repeat."""
    variants = [(name, knobs, True) for name, knobs in TRAIN.items()] + [(n, k, False) for n, k in EVAL.items()]
    rates = {name: [] for name, _, _ in variants}
    for repeat in range(args.repeats):
        shift = repeat % len(variants)
        for name, knobs, is_train in variants[shift:] + variants[:shift]:
            src = source(data_dir, args.image_size, knobs)
            rates[name].append(train_rates(src, args.images) if is_train else eval_rates(src, args.eval_passes))
    return rates


def table(rates: dict[str, list[tuple[float, float]]]) -> str:
    """A markdown table: median rates, their wall range, and median per-repeat ratios to the reference."""
    lines = ["| variant | images/s wall (median, min-max) | images per CPU-s | ratio wall | ratio per CPU-s |",
             "|---|---|---|---|---|"]
    for group in (TRAIN, EVAL):
        reference = rates[next(iter(group))]
        for name in group:
            wall, cpu = zip(*rates[name])
            ratio_wall = statistics.median(r[0] / d[0] for r, d in zip(rates[name], reference))
            ratio_cpu = statistics.median(r[1] / d[1] for r, d in zip(rates[name], reference))
            lines.append(f"| {name} | {statistics.median(wall):.0f} ({min(wall):.0f}-{max(wall):.0f}) | "
                         f"{statistics.median(cpu):.0f} | {ratio_wall:.2f} | {ratio_cpu:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1024, help="generated JPEGs; one pass of them is timed")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--eval_passes", type=int, default=3, help="timed eval passes per variant and repeat")
    args = parser.parse_args()
    start = time.perf_counter()
    jpegs = fake_jpegs(args.images, args.size)
    print(f"{args.images} JPEGs {args.size}x{args.size}, mean {np.mean([len(j) for j in jpegs]) / 1024:.0f} KiB; "
          f"output {args.image_size}x{args.image_size}, batch {BATCH}, {args.repeats} repeats")
    with tempfile.TemporaryDirectory() as out:
        records = [make_tfrecords.Record(j, 1) for j in jpegs]
        for split in ("train", "validation"):
            make_tfrecords.write_tfrecords(records, out, 4, split)
        print(table(measure(out, args)))
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
