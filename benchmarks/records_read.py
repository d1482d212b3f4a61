"""Random reads by global index: an offset index over TFRecord files vs ArrayRecord, both in tf.data.

    .venv/bin/python benchmarks/records_read.py [--records=20000 --record_bytes=16384 --rounds=3]

Writes the same random (incompressible) payloads both ways into 8 files each, then reads one uniform
permutation of all records in batches of 128 through tf.data (`map(numpy_function(read))`, AUTOTUNE
parallelism), the two readers interleaved round by round; also a plain sequential TFRecordDataset pass over
the same TFRecord files for reference, and each reader's cost per record called from Python directly.
The files sit in the page cache: this measures the readers' CPU cost, the part that competes with decoding.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf
from array_record.python.array_record_data_source import ArrayRecordDataSource
from array_record.python.array_record_module import ArrayRecordWriter

from mwloop.data import indexed as indexed_lib
from mwloop.data import records as records_lib

FILES, BATCH = 8, 128


def write_both(folder: str, payloads: list[bytes]) -> tuple[records_lib.Records, ArrayRecordDataSource]:
    names, rows, array_paths = [], [], []
    for number, part in enumerate(np.array_split(np.arange(len(payloads)), FILES)):
        name = f"part-{number:05d}"
        chunk = [payloads[i] for i in part]
        with tf.io.TFRecordWriter(os.path.join(folder, name)) as writer:
            for payload in chunk:
                writer.write(payload)
        names.append(name)
        rows.append(records_lib.index_file(number, chunk))
        array_path = os.path.join(folder, f"array-{number:05d}.array_record")
        writer = ArrayRecordWriter(array_path, "group_size:1")
        for payload in chunk:
            writer.write(payload)
        writer.close()
        array_paths.append(array_path)
    records_lib.write_manifest(folder, names, np.concatenate(rows), {})
    return records_lib.open_records(folder), ArrayRecordDataSource(array_paths)


def tf_pass(read, order: np.ndarray) -> float:
    """Records/s of one pass reading `order` in batches through tf.data (`read`: indices -> tf.string)."""
    dataset = tf.data.Dataset.from_tensor_slices(order).batch(BATCH).map(read, num_parallel_calls=tf.data.AUTOTUNE)
    started = time.perf_counter()
    count = sum(int(tf.size(batch)) for batch in dataset)
    assert count == len(order)
    return count / (time.perf_counter() - started)


def sequential_pass(files: list[str]) -> float:
    started = time.perf_counter()
    count = sum(1 for _ in tf.data.TFRecordDataset(files, num_parallel_reads=4))
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--record_bytes", type=int, default=16_384)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    payloads = [rng.bytes(args.record_bytes) for _ in range(args.records)]
    with tempfile.TemporaryDirectory() as folder:
        indexed, array_source = write_both(folder, payloads)
        probe = rng.permutation(args.records)[:2000]
        assert list(indexed.read(probe)[0]) == [payloads[i] for i in probe]
        assert list(array_source.__getitems__(probe.tolist())) == [payloads[i] for i in probe]

        def read_array(idx: np.ndarray) -> np.ndarray:
            return np.array(array_source.__getitems__(idx.tolist()), dtype=object)

        figures: dict[str, list[float]] = {"offset index": [], "ArrayRecord": [], "TFRecordDataset (sequential)": []}
        for round_number in range(args.rounds):
            order = np.random.default_rng(round_number).permutation(args.records)
            # The offset index as the training pipeline reads it: Python reads, fingerprints checked in C++.
            figures["offset index"].append(tf_pass(lambda idx: indexed_lib.read_batch(indexed, idx), order))
            figures["ArrayRecord"].append(tf_pass(
                lambda idx: tf.numpy_function(read_array, [idx], tf.string, stateful=False), order))
            figures["TFRecordDataset (sequential)"].append(sequential_pass(indexed.files))
        per_record = {}
        for name, read in (("offset index (unchecked)", indexed.read), ("ArrayRecord", read_array)):
            started = time.perf_counter()
            for start in range(0, 4096, BATCH):
                read(probe[start % 2000:start % 2000 + BATCH])
            per_record[name] = (time.perf_counter() - started) / 4096 * 1e6
    print(f"{args.records} records of {args.record_bytes} B in {FILES} files, batches of {BATCH}, {args.rounds} rounds")
    for name, values in figures.items():
        print(f"  {name:30s} median {statistics.median(values):9.0f} records/s  "
              f"(rounds: {', '.join(f'{v:.0f}' for v in values)})")
    for name, micros in per_record.items():
        print(f"  {name:30s} {micros:.1f} us per record, called from Python")


if __name__ == "__main__":
    main()
