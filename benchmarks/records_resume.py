"""Time to the first training batch when resuming at position 0 vs near the end of an epoch of 200k records.

    python -m benchmarks.records_resume [--records=200000 --repeats=5 --row_floats=1024]

Converts `records` array rows of `row_floats` float32 with `python -m mwloop.data.convert`, then, in an
order alternated every repeat, opens the dataset and builds its training stream at step 0 and at the step
whose position is 99.5% of the way through the epoch, and times open + build + the first batch (the process's
own start-up is the same for both and left out). For reference, the same for today's way of resuming a file
stream: a TFRecordDataset over the same files that skips the records before the position (`records.skip(offset)`
in mwloop.data.imagenet).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from mwloop.data import convert, indexed  # noqa: E402

BATCH = 256
CTX = tf.distribute.InputContext(1, 0, 1)


def first_batch_indexed(root: str, step: int) -> float:
    started = time.perf_counter()
    on_disk = indexed.open_dataset(root)
    next(iter(on_disk.train_dataset(CTX, global_batch_size=BATCH, seed=0, start_step=step)))
    return time.perf_counter() - started


def first_batch_skip(files: list[str], step: int) -> float:
    started = time.perf_counter()
    next(iter(tf.data.TFRecordDataset(files).skip(step * BATCH).batch(BATCH)))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--row_floats", type=int, default=1024, help="float32 per record (4 kB by default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rng = np.random.default_rng(0)
        np.savez(os.path.join(folder, "rows.npz"), x=rng.standard_normal((args.records, args.row_floats), np.float32),
                 y=rng.integers(0, 10, args.records))
        started = time.perf_counter()
        convert.convert(os.path.join(folder, "rows.npz"), folder, validation_fraction=0, records_per_file=16384,
                        progress=False)
        converted = time.perf_counter() - started
        root = os.path.join(folder, "train")
        files = indexed.open_dataset(root).records.files
        late = int(args.records * 0.995) // BATCH
        times: dict[str, list[float]] = {k: [] for k in ("indexed@0", "indexed@late", "skip@0", "skip@late")}
        for repeat in range(args.repeats):
            order = [("0", 0), ("late", late)][::1 if repeat % 2 == 0 else -1]
            for name, step in order:
                times[f"indexed@{name}"].append(first_batch_indexed(root, step))
                times[f"skip@{name}"].append(first_batch_skip(files, step))
    print(f"{args.records} records of {args.row_floats * 4} B ({converted:.1f} s to convert: "
          f"{args.records / converted:.0f} records/s), "
          f"batch {BATCH}, late = step {late} (position {late * BATCH}), {args.repeats} repeats")
    for name, values in times.items():
        print(f"  {name:14s} median {statistics.median(values) * 1000:7.1f} ms  "
              f"({', '.join(f'{v * 1000:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
