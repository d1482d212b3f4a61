"""Class folders of JPEG/PNG images -> ImageNet-layout TFRecords.

    python -m mwloop.data.make_tfrecords --input=IMAGES --output=OUT --shards=N
        [--validation_shards=M --validation_fraction=0.1 --seed=0 --label_offset=1]

IMAGES holds one sub-folder per class; class i in sorted folder order gets
label i + label_offset (1-based by default, like the common ImageNet
conversion), listed in OUT/labels.txt. A seeded `validation_fraction` of each
class goes to validation-*; the rest, shuffled, to train-*. JPEGs are kept as
they are (RGB or grey); everything else (PNG, GIF, BMP, CMYK JPEG) is
re-encoded as an RGB JPEG. A file that does not decode is skipped, listed at
the end and in OUT/skipped.txt; the exit status stays 0 (the data set is still
usable).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from typing import Iterable, Sequence

import numpy as np
import tensorflow as tf

from mwloop.errors import UserError

JPEG_QUALITY = 95


@dataclasses.dataclass(frozen=True)
class Record:
    """One image as stored: JPEG bytes, its label and where it came from."""
    encoded: bytes
    label: int
    height: int = 0
    width: int = 0
    synset: str = ""
    filename: str = ""


def to_example(record: Record) -> tf.train.Example:
    """The standard ImageNet TFRecord features."""
    def b(value: bytes):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))

    def i(value: int):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))

    return tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": b(record.encoded), "image/format": b(b"JPEG"), "image/class/label": i(record.label),
        "image/class/synset": b(record.synset.encode()), "image/filename": b(record.filename.encode()),
        "image/height": i(record.height), "image/width": i(record.width), "image/channels": i(3)}))


def shard_names(output: str, split: str, shards: int) -> list[str]:
    """OUT/split-00000-of-0000N ... (the common ImageNet naming)."""
    return [os.path.join(output, f"{split}-{i:05d}-of-{shards:05d}") for i in range(shards)]


def write_tfrecords(records: Sequence[Record], output: str, shards: int, split: str = "train") -> list[str]:
    """Writes `records` in order into `shards` files of near-equal size; returns their paths."""
    if shards < 1:
        raise UserError(f"shards={shards}; use at least 1")
    try:
        tf.io.gfile.makedirs(output)
    except (tf.errors.OpError, OSError) as e:
        raise UserError(f"--output={output} cannot be made a directory ({getattr(e, 'message', e)}); "
                        f"pick another --output") from None
    paths = shard_names(output, split, shards)
    for path, part in zip(paths, np.array_split(np.arange(len(records)), shards)):
        with tf.io.TFRecordWriter(path) as writer:
            for index in part:
                writer.write(to_example(records[index]).SerializeToString())
    return paths


def read_image(path: str, label: int, synset: str) -> Record:
    """The file as a Record of RGB-decodable JPEG bytes; raises on anything that does not decode."""
    data = tf.io.read_file(path)
    # InvalidArgumentError if unreadable.
    rgb = tf.io.decode_image(data, channels=3, expand_animations=False)
    height, width, _ = rgb.shape
    if bool(tf.io.is_jpeg(data)) and int(tf.io.extract_jpeg_shape(data)[2]) in (1, 3):
        # A grey or RGB JPEG: what the pipeline decodes, kept byte for byte.
        encoded = data.numpy()
    else:
        # PNG, GIF, BMP, CMYK JPEG: TF's decoder made it RGB.
        encoded = tf.io.encode_jpeg(rgb, quality=JPEG_QUALITY).numpy()
    return Record(encoded, label, height, width, synset, os.path.basename(path))


def class_folders(input_dir: str) -> list[str]:
    """Sorted class sub-folders of `input_dir` (hidden ones ignored)."""
    if not os.path.isdir(input_dir):
        raise UserError(f"--input={input_dir!r} is not a directory; give a folder of class sub-folders")
    classes = sorted(d for d in os.listdir(input_dir)
                     if not d.startswith(".") and os.path.isdir(os.path.join(input_dir, d)))
    if not classes:
        raise UserError(f"--input={input_dir!r} has no sub-folders; put each class's images in its own")
    return classes


def list_images(input_dir: str, classes: list[str]) -> list[tuple[str, int]]:
    """(path, class index) of every non-hidden file, in sorted order."""
    return [(os.path.join(input_dir, name, f), index) for index, name in enumerate(classes)
            for f in sorted(os.listdir(os.path.join(input_dir, name)))
            if not f.startswith(".") and os.path.isfile(os.path.join(input_dir, name, f))]


def split_validation(items: list, labels: list[int], fraction: float, seed: int) -> tuple[list, list]:
    """(train, validation): a seeded `fraction` of each class to validation; train shuffled."""
    rng = np.random.default_rng(seed)
    train, validation = [], []
    for label in sorted(set(labels)):
        members = [item for item, item_label in zip(items, labels) if item_label == label]
        members = [members[i] for i in rng.permutation(len(members))]
        num_validation = int(round(len(members) * fraction))
        validation += members[:num_validation]
        train += members[num_validation:]
    return [train[i] for i in rng.permutation(len(train))], validation


class Progress:
    """A one-line progress bar on stderr, redrawn at most 10 times a second."""

    def __init__(self, total: int, stream=None, width: int = 30):
        self.total, self.width, self.last = max(total, 1), width, 0.0
        # sys.stderr looked up now, not at import: tests and callers redirect it.
        self.stream = stream or sys.stderr

    def update(self, done: int) -> None:
        now = time.monotonic()
        if done < self.total and now - self.last < 0.1:
            return
        self.last = now
        filled = self.width * done // self.total
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} images")
        if done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def _reason(error: Exception) -> str:
    """The first line of an error, without TensorFlow's op decorations."""
    message = getattr(error, "message", None) or str(error) or type(error).__name__
    message = re.sub(r"\{\{.*?\}\}\s*", "", message.strip().splitlines()[0])
    return re.sub(r"\s*\[Op:.*$", "", message)


def read_all(images: list[tuple[str, int]], classes: list[str], label_offset: int,
             progress: Progress | None = None) -> tuple[list[Record], list[tuple[str, str]]]:
    """Records of the readable images, and (path, reason) of the others."""
    records, skipped = [], []
    for done, (path, index) in enumerate(images, 1):
        try:
            records.append(read_image(path, index + label_offset, classes[index]))
        except (tf.errors.InvalidArgumentError, ValueError) as e:
            skipped.append((path, _reason(e)))
        if progress:
            progress.update(done)
    return records, skipped


def convert(input_dir: str, output: str, *, shards: int, validation_shards: int = 0,
            validation_fraction: float = 0.1, seed: int = 0, label_offset: int = 1,
            progress: bool = True) -> dict:
    """Writes OUT/train-*, validation-*, labels.txt (and skipped.txt if any); returns a summary."""
    if not 0 <= validation_fraction < 1:
        raise UserError(f"--validation_fraction={validation_fraction}; use a value in [0, 1)")
    classes = class_folders(input_dir)
    images = list_images(input_dir, classes)
    records, skipped = read_all(images, classes, label_offset, Progress(len(images)) if progress else None)
    # Shards of 0 records would train forever on nothing.
    if not records:
        reason = f"all {len(skipped)} images are unreadable (first: {skipped[0][0]}: {skipped[0][1]})" if skipped \
            else "it holds no images"
        raise UserError(f"no image of {input_dir} could be read: {reason}; nothing was written")
    train, validation = split_validation(records, [r.label for r in records], validation_fraction, seed)
    validation_shards = validation_shards or max(1, shards // 8)
    write_tfrecords(train, output, shards, "train")
    write_tfrecords(validation, output, validation_shards, "validation")
    with open(os.path.join(output, "labels.txt"), "w") as f:
        f.writelines(f"{name}\n" for name in classes)
    if skipped:
        with open(os.path.join(output, "skipped.txt"), "w") as f:
            f.writelines(f"{path}\t{reason}\n" for path, reason in skipped)
    return {"classes": len(classes), "train": len(train), "validation": len(validation),
            "skipped": skipped}


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mwloop.data.make_tfrecords", description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="folder of class sub-folders of JPEG/PNG images")
    parser.add_argument("--output", required=True, help="folder for train-*, validation-*, labels.txt")
    parser.add_argument("--shards", type=int, default=8, help="train files")
    parser.add_argument("--validation_shards", type=int, default=0, help="validation files (0: shards // 8, >= 1)")
    parser.add_argument("--validation_fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0, help="the train/validation split and the train order")
    parser.add_argument("--label_offset", type=int, default=1, help="label of the first class folder")
    return parser.parse_args(argv)


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = convert(args.input, args.output, shards=args.shards, validation_shards=args.validation_shards,
                          validation_fraction=args.validation_fraction, seed=args.seed,
                          label_offset=args.label_offset)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {summary['train']} train and {summary['validation']} validation images of "
          f"{summary['classes']} classes to {args.output}")
    if summary["skipped"]:
        print(f"skipped {len(summary['skipped'])} unreadable images (listed in "
              f"{os.path.join(args.output, 'skipped.txt')}):", file=sys.stderr)
        for path, reason in summary["skipped"]:
            print(f"  {path}: {reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
