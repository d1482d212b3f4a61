"""Users' data as records addressed by global index, in one command.

    python -m mwloop.data.convert --input=IMAGES --output=OUT     # a folder of class folders of images
    python -m mwloop.data.convert --input=ARRAYS.npz --output=OUT # arrays of one length (x, y, ...)
    python -m mwloop.data.convert --input=TABLE.csv --output=OUT  # a table: CSV, TSV or Parquet (with pyarrow)
        [--validation_fraction=0.1 --seed=0 --records_per_file=1024]
    python -m mwloop.data.convert --input='DIR/train-*' --output=OUT   # existing TFRecords, indexed in place

writes OUT/train (and OUT/validation when --validation_fraction > 0), each a records dataset
(`mwloop.data.records`): TFRecord files, their index and a manifest. A task opens one with
`mwloop.open_dataset(OUT + "/train")`.

Resumable: each file is written under a temporary name and renamed when whole, then its index part is
saved; a rerun with the same arguments skips the files already whole and writes the rest. Verified at the
end: every record is read back and checked against its checksum, and the count against the input's.
Images that do not decode are skipped, listed at the end and in OUT/skipped.txt (exit 0: the rest is usable).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import struct
import sys
from typing import Callable, Iterable, Sequence

import numpy as np
import tensorflow as tf
import tqdm

from mwloop.data import make_tfrecords, records, tables
from mwloop.errors import UserError

ARGUMENTS = "convert.json"
# Payload -> None: the item is skipped (an image that does not decode), with the reason.
ToPayload = Callable[[object], "bytes | tuple[None, str]"]


@dataclasses.dataclass(frozen=True)
class Split:
    """What one split's dataset is made of: the items in order, how each becomes a payload, its features."""
    items: Sequence
    to_payload: ToPayload
    features: dict
    meta: dict


def _bytes_feature(value: bytes) -> tf.train.Feature:
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def example(features: dict[str, bytes]) -> bytes:
    """A serialized tf.train.Example of raw bytes features (what `open_dataset`'s decoder parses)."""
    return tf.train.Example(features=tf.train.Features(
        feature={k: _bytes_feature(v) for k, v in features.items()})).SerializeToString()


def write_split(root: str, split: Split, records_per_file: int, progress: bool = True) -> dict:
    """Writes `split` as a records dataset in `root`, resuming after the files already whole; then verifies it.

    Returns:
      {"records": count, "skipped": [(item, reason)], "index_sha256": the index's digest}.
    """
    os.makedirs(root, exist_ok=True)
    chunks = [split.items[i:i + records_per_file] for i in range(0, len(split.items), records_per_file)]
    names, parts, skipped = [], [], []
    bar = tqdm.tqdm(total=len(split.items), unit="rec", desc=os.path.basename(root), disable=not progress,
                    file=sys.stderr)
    for number, chunk in enumerate(chunks):
        name = f"part-{number:05d}"
        path, part_index = os.path.join(root, name), os.path.join(root, f".{name}.index.npy")
        if os.path.exists(path) and os.path.exists(part_index):
            rows = np.load(part_index)
            with open(part_index + ".skipped") as f:
                done = json.load(f)
        else:
            payloads, done = [], []
            for item in chunk:
                payload = split.to_payload(item)
                if isinstance(payload, tuple):
                    done.append((str(item), payload[1]))
                else:
                    payloads.append(payload)
            with tf.io.TFRecordWriter(path + ".tmp") as writer:
                for payload in payloads:
                    writer.write(payload)
            os.replace(path + ".tmp", path)
            rows = records.index_file(number, payloads)
            _save_atomically(part_index + ".skipped", json.dumps(done).encode())
            np.save(part_index + ".tmp.npy", rows)
            os.replace(part_index + ".tmp.npy", part_index)
        names.append(name)
        parts.append(rows)
        skipped += done
        bar.update(len(chunk))
    bar.close()
    index = np.concatenate(parts) if parts else np.zeros(0, records.INDEX_DTYPE)
    records.write_manifest(root, names, index, split.features, **split.meta)
    verify(root, len(split.items) - len(skipped))
    return {"records": len(index), "skipped": skipped, "index_sha256": records.index_digest(index)}


def _save_atomically(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def verify(root: str, expected: int, chunk: int = 4096) -> None:
    """Reads every record of `root` back against its fingerprint and counts them.

    Raises:
      RecordsError: a record does not match its checksum, or the count is not `expected`.
    """
    dataset = records.open_records(root)
    if len(dataset) != expected:
        raise records.RecordsError(f"{root} holds {len(dataset)} records where {expected} were written; "
                                   f"delete it and convert again")
    for start in range(0, len(dataset), chunk):
        positions = np.arange(start, min(start + chunk, len(dataset)))
        dataset.check(positions, dataset.read(positions)[0])
    dataset.close()


def _split_order(count: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) positions: a seeded fraction to validation."""
    order = np.random.default_rng(seed).permutation(count)
    num_validation = int(round(count * fraction))
    return np.sort(order[num_validation:]), np.sort(order[:num_validation])


def image_splits(input_dir: str, fraction: float, seed: int) -> dict[str, Split]:
    """Class folders of images: each record is {"image": JPEG bytes, "label": int64 class number}."""
    classes = make_tfrecords.class_folders(input_dir)
    images = make_tfrecords.list_images(input_dir, classes)
    train, validation = make_tfrecords.split_validation(images, [label for _, label in images], fraction, seed)

    def to_payload(item):
        path, label = item
        try:
            image = make_tfrecords.read_image(path, label, classes[label])
        except (tf.errors.InvalidArgumentError, ValueError) as e:
            return None, make_tfrecords._reason(e)
        return example({"image": image.encoded, "label": np.int64(label).tobytes()})

    features = {"image": {"encoding": "jpeg"}, "label": {"dtype": "int64", "shape": []}}
    meta = {"kind": "images", "classes": classes}
    return {name: Split(items, to_payload, features, meta)
            for name, items in (("train", train), ("validation", validation)) if items}


def array_splits(path: str, fraction: float, seed: int) -> dict[str, Split]:
    """An .npz of arrays of one length: each record holds one row of every array, as raw bytes."""
    try:
        arrays = dict(np.load(path))
    except (OSError, ValueError) as e:
        raise UserError(f"--input={path} is not a readable .npz file ({e}); give arrays saved by np.savez") from None
    return column_splits(path, arrays, fraction, seed)


def column_splits(path: str, arrays: dict[str, np.ndarray], fraction: float, seed: int) -> dict[str, Split]:
    """Arrays (or a table's columns) of one length: each record holds one row of every one (raw bytes; UTF-8 for
    strings), decoded by `open_dataset` as {name: value}."""
    lengths = {k: len(v) for k, v in arrays.items()}
    if not arrays or len(set(lengths.values())) != 1:
        raise UserError(f"--input={path} holds arrays of lengths {lengths}; give arrays of one length")
    features = {k: tables.feature_spec(v) for k, v in arrays.items()}

    def to_payload(row):
        return example({k: tables.cell_bytes(v, row) for k, v in arrays.items()})

    train, validation = _split_order(next(iter(lengths.values())), fraction, seed)
    return {name: Split(items, to_payload, features, {"kind": "arrays"})
            for name, items in (("train", train), ("validation", validation)) if len(items)}


def scan_tfrecords(path: str) -> list[bytes]:
    """The payloads of an uncompressed TFRecord file, in order (its framing checked by length)."""
    payloads = []
    with open(path, "rb") as f:
        while header := f.read(records.HEADER_BYTES):
            length = struct.unpack("<Q", header[:8])[0] if len(header) == records.HEADER_BYTES else -1
            payload = f.read(length) if length >= 0 else b""
            if length < 0 or len(payload) != length or len(f.read(records.FOOTER_BYTES)) != records.FOOTER_BYTES:
                raise UserError(f"{path} is truncated or not an uncompressed TFRecord file (at record "
                                f"{len(payloads)}); give whole, uncompressed TFRecord files")
            payloads.append(payload)
    return payloads


def index_tfrecords(pattern: str, root: str, progress: bool = True) -> dict:
    """Indexes existing TFRecord files in place (they are not copied): `root` gets a manifest and an index naming
    them by absolute path. Resumable per file, verified at the end, as `write_split`."""
    paths = sorted(os.path.abspath(p) for p in glob.glob(pattern))
    if not paths:
        raise UserError(f"--input={pattern} matches no file; give a glob of TFRecord files, e.g. 'DIR/train-*'")
    os.makedirs(root, exist_ok=True)
    parts = []
    for number, path in enumerate(tqdm.tqdm(paths, unit="file", desc=os.path.basename(root), disable=not progress,
                                            file=sys.stderr)):
        part_index = os.path.join(root, f".file-{number:05d}.index.npy")
        if not os.path.exists(part_index):
            np.save(part_index + ".tmp.npy", records.index_file(number, scan_tfrecords(path)))
            os.replace(part_index + ".tmp.npy", part_index)
        parts.append(np.load(part_index))
    index = np.concatenate(parts)
    records.write_manifest(root, paths, index, {}, kind="tfrecords")
    verify(root, len(index))
    return {"records": len(index), "skipped": [], "index_sha256": records.index_digest(index)}


def convert(input_path: str, output: str, *, validation_fraction: float = 0.1, seed: int = 0,
            records_per_file: int = 1024, progress: bool = True) -> dict:
    """Writes OUT/train and OUT/validation from a folder of class folders, an .npz or a table (CSV, TSV, Parquet), or
    indexes TFRecord files in place (a glob); returns a summary per split."""
    if not 0 <= validation_fraction < 1:
        raise UserError(f"--validation_fraction={validation_fraction}; use a value in [0, 1)")
    if records_per_file < 1:
        raise UserError(f"--records_per_file={records_per_file}; use at least 1")
    arguments = {"input": os.path.abspath(input_path), "validation_fraction": validation_fraction, "seed": seed,
                 "records_per_file": records_per_file}
    os.makedirs(output, exist_ok=True)
    arguments_path = os.path.join(output, ARGUMENTS)
    if os.path.exists(arguments_path):
        with open(arguments_path) as f:
            before = json.load(f)
        if before != arguments:
            raise UserError(f"--output={output} holds a conversion with other arguments ({before}); resume it with "
                            f"those, or pick a new --output")
    else:
        _save_atomically(arguments_path, json.dumps(arguments).encode())
    if glob.has_magic(input_path):
        return {"train": index_tfrecords(input_path, os.path.join(output, "train"), progress)}
    if input_path.endswith(".npz"):
        splits = array_splits(input_path, validation_fraction, seed)
    elif tables.is_table(input_path):
        splits = column_splits(input_path, tables.read_table(input_path), validation_fraction, seed)
    else:
        splits = image_splits(input_path, validation_fraction, seed)
    summary = {name: write_split(os.path.join(output, name), split, records_per_file, progress)
               for name, split in splits.items()}
    skipped = [entry for result in summary.values() for entry in result["skipped"]]
    if splits and not any(result["records"] for result in summary.values()):
        raise UserError(f"no item of {input_path} could be read (first: {skipped[0]}); nothing usable was written")
    if skipped:
        with open(os.path.join(output, "skipped.txt"), "w") as f:
            f.writelines(f"{item}\t{reason}\n" for item, reason in skipped)
    return summary


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mwloop.data.convert", description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True,
                        help="a folder of class folders of images, an .npz, a table (.csv, .tsv, .parquet), "
                             "or a glob of TFRecord files (quoted)")
    parser.add_argument("--output", required=True, help="folder for train/ and validation/")
    parser.add_argument("--validation_fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0, help="the train/validation split")
    parser.add_argument("--records_per_file", type=int, default=1024)
    args = parser.parse_args(argv)
    try:
        summary = convert(args.input, args.output, validation_fraction=args.validation_fraction, seed=args.seed,
                          records_per_file=args.records_per_file)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, result in summary.items():
        print(f"{name}: {result['records']} records in {os.path.join(args.output, name)}, verified "
              f"(index sha256 {result['index_sha256'][:16]})")
        for item, reason in result["skipped"]:
            print(f"  skipped {item}: {reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
