"""The converter and bad data: each damage to a records dataset is one line naming the file (and the record),
never a silent skip. Real files written by each test."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from mwloop.data import convert, indexed, records
from mwloop.step import graph_checks


def write_arrays(folder, count=40, records_per_file=16) -> str:
    np.savez(folder / "arrays.npz", x=np.arange(count, dtype=np.int32).reshape(-1, 1).repeat(3, 1),
             label=np.arange(count, dtype=np.int64) % 5)
    out = folder / "out"
    convert.convert(str(folder / "arrays.npz"), str(out), validation_fraction=0.25, records_per_file=records_per_file,
                    progress=False)
    return str(out)


def test_arrays_round_trip_by_global_index(tmp_path):
    out = write_arrays(tmp_path)
    train, validation = records.open_records(f"{out}/train"), records.open_records(f"{out}/validation")
    assert (len(train), len(validation)) == (30, 10)
    decode = indexed.open_dataset(f"{out}/train").decode
    rows = [decode(tf.constant(data), tf.constant([0, 0], tf.int64)) for data in train.read([29, 0, 15])[0]]
    xs = [int(row["x"][0]) for row in rows]
    # Every train row is itself (x = [i, i, i], label = i % 5) and no row is in both splits.
    assert all(row["x"].numpy().tolist() == [x] * 3 and int(row["label"]) == x % 5 for row, x in zip(rows, xs))
    everything = [int(decode(tf.constant(d), tf.constant([0, 0], tf.int64))["x"][0])
                  for split in (train, validation) for d in split.read(np.arange(len(split)))[0]]
    assert sorted(everything) == list(range(40))
    # The files are plain TFRecords too.
    assert sum(1 for _ in tf.data.TFRecordDataset(train.files)) == 30


def _table_rows(out: str) -> list[dict]:
    on_disk = indexed.open_dataset(f"{out}/train")
    rows = [on_disk.decode(tf.constant(d), tf.constant([0, 0], tf.int64))
            for d in on_disk.records.read(np.arange(len(on_disk.records)))[0]]
    return sorted(({k: v.numpy() for k, v in row.items()} for row in rows), key=lambda row: int(row["id"]))


def test_tables_csv_and_parquet_convert_with_their_column_types(tmp_path):
    (tmp_path / "t.csv").write_text("id,score,name\n0,1.5,ann\n1,,bob\n2,-3,\"c, d\"\n3,7,\n")
    summary = convert.convert(str(tmp_path / "t.csv"), str(tmp_path / "csv"), validation_fraction=0, progress=False)
    assert summary["train"]["records"] == 4
    features = records.open_records(str(tmp_path / "csv" / "train")).features
    assert {k: f["dtype"] for k, f in features.items()} == {"id": "<i8", "score": "<f8", "name": "string"}
    rows = _table_rows(str(tmp_path / "csv"))
    assert [int(r["id"]) for r in rows] == [0, 1, 2, 3]
    assert [r["name"] for r in rows] == [b"ann", b"bob", b"c, d", b""]
    assert rows[0]["score"] == 1.5 and np.isnan(rows[1]["score"]) and rows[2]["score"] == -3.0
    # A ragged row is one line naming the line.
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n3\n")
    with pytest.raises(convert.UserError, match=r"^--input=.*bad.csv line 3 has 1 cells where the header has 2"):
        convert.convert(str(tmp_path / "bad.csv"), str(tmp_path / "bad"), progress=False)
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow
    parquet.write_table(pyarrow.table({"id": np.arange(3, dtype=np.int32), "ok": [True, False, True],
                                       "name": ["x", "y", "zé"]}), str(tmp_path / "t.parquet"))
    convert.convert(str(tmp_path / "t.parquet"), str(tmp_path / "pq"), validation_fraction=0, progress=False)
    rows = _table_rows(str(tmp_path / "pq"))
    assert [(int(r["id"]), bool(r["ok"]), r["name"].decode()) for r in rows] == [(0, True, "x"), (1, False, "y"),
                                                                                (2, True, "zé")]
    assert rows[0]["id"].dtype == np.int32


def test_images_from_class_folders(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        os.makedirs(tmp_path / "images" / name)
        for k in range(5):
            pixels = rng.integers(0, 255, (40 + k, 48, 3), dtype=np.uint8)
            encode = tf.io.encode_png if k == 0 else tf.io.encode_jpeg
            tf.io.write_file(str(tmp_path / "images" / name / f"{k}.{'png' if k == 0 else 'jpg'}"), encode(pixels))
    (tmp_path / "images" / "dog" / "broken.jpg").write_bytes(b"not an image")
    summary = convert.convert(str(tmp_path / "images"), str(tmp_path / "out"), validation_fraction=0.2,
                              records_per_file=3, progress=False)
    assert summary["train"]["records"] + summary["validation"]["records"] == 10
    assert "broken.jpg" in (tmp_path / "out" / "skipped.txt").read_text()
    on_disk = indexed.open_dataset(str(tmp_path / "out" / "train"), image_size=32)
    assert on_disk.records.meta["classes"] == ["cat", "dog"]
    ctx = tf.distribute.InputContext()
    batch = next(iter(on_disk.train_dataset(ctx, global_batch_size=4, seed=0)))
    assert batch["image"].shape == (4, 32, 32, 3) and set(batch["label"].numpy()) <= {0, 1}


def test_a_conversion_resumes_after_the_files_already_whole(tmp_path, capsys):
    out = write_arrays(tmp_path)
    train = f"{out}/train"
    digest = json.load(open(f"{train}/{records.MANIFEST}"))["index_sha256"]
    # Killed while writing the second file: no manifest, a temp file, the last file without its index part.
    os.remove(f"{train}/{records.MANIFEST}")
    os.remove(f"{train}/.part-00001.index.npy")
    shutil.copy(f"{train}/part-00000", f"{train}/part-00001.tmp")
    written_before = os.path.getmtime(f"{train}/part-00000")
    assert convert.main(["--input", str(tmp_path / "arrays.npz"), "--output", out, "--validation_fraction", "0.25",
                         "--records_per_file", "16"]) == 0
    assert json.load(open(f"{train}/{records.MANIFEST}"))["index_sha256"] == digest
    assert os.path.getmtime(f"{train}/part-00000") == written_before
    assert "train: 30 records" in capsys.readouterr().out
    # Other arguments into the same folder: refused, not mixed.
    assert convert.main(["--input", str(tmp_path / "arrays.npz"), "--output", out, "--seed", "3"]) == 2
    assert "other arguments" in capsys.readouterr().err


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_bad_data_is_one_line_naming_the_file_and_record(tmp_path):
    out = write_arrays(tmp_path)
    train = f"{out}/train"
    data = records.open_records(train)
    part = data.files[1]
    # A flipped byte in record 20 (file 1, its 5th record): found when that record is read, named with its index.
    row = data.index[20]
    flip_byte(part, int(row["offset"]) + records.HEADER_BYTES + 3)
    data.check(np.arange(16), data.read(np.arange(16))[0])
    with pytest.raises(records.RecordsError, match=rf"{part}: record 20 \(offset {int(row['offset'])}\) does not "
                                                   r"match its checksum.*mwloop.data.convert"):
        data.check([3, 20], data.read([3, 20])[0])
    # ... and through tf.data and the loop's error handling: one line, a UserError (exit 2).
    on_disk = indexed.open_dataset(train)
    dataset = on_disk.train_dataset(tf.distribute.InputContext(), global_batch_size=30, seed=0)
    with pytest.raises(graph_checks.DataCheckError, match=rf"^{part}: record 20 \(offset \d+\) does not match"):
        with graph_checks.one_line_errors():
            next(iter(dataset))
    # Grown, truncated, missing: refused when opened, before anything is read.
    with open(part, "ab") as f:
        f.write(b"x")
    with pytest.raises(records.RecordsError, match=rf"{part} has \d+ bytes where \d+ were indexed: it was changed"):
        records.open_records(train)
    os.truncate(part, 100)
    with pytest.raises(records.RecordsError, match=rf"{part} has 100 bytes .* it was truncated after indexing"):
        records.open_records(train)
    os.remove(part)
    with pytest.raises(records.RecordsError, match=rf"{part} is missing"):
        records.open_records(train)
    # An index that is not the manifest's: refused.
    np.save(f"{out}/validation/{records.INDEX}", data.index[:10])
    with pytest.raises(records.RecordsError, match="does not match .*records.json"):
        records.open_records(f"{out}/validation")
    with pytest.raises(records.RecordsError, match="has no records.json"):
        records.open_records(str(tmp_path))


def test_a_file_truncated_after_opening_names_the_record(tmp_path):
    out = write_arrays(tmp_path)
    data = records.open_records(f"{out}/train")
    os.truncate(data.files[0], int(data.index[10]["offset"]) + 20)
    with pytest.raises(records.RecordsError, match=r"part-00000: record 10 .* is cut short"):
        data.read([10])


def test_existing_tfrecords_are_indexed_in_place(tmp_path):
    from mwloop.data import make_tfrecords
    records_in = [make_tfrecords.Record(tf.io.encode_jpeg(np.full((20, 30, 3), k * 20, np.uint8)).numpy(), k + 1)
                  for k in range(6)]
    paths = make_tfrecords.write_tfrecords(records_in, str(tmp_path / "tf"), shards=2)
    sizes = [os.path.getsize(p) for p in paths]
    convert.convert(str(tmp_path / "tf" / "train-*"), str(tmp_path / "out"), progress=False)
    # Not copied: the index names the files where they are, unchanged.
    assert [os.path.getsize(p) for p in paths] == sizes and not any((tmp_path / "out" / "train").glob("part-*"))
    on_disk = indexed.open_dataset(str(tmp_path / "out" / "train"), image_size=8)
    assert on_disk.records.files == [os.path.abspath(p) for p in paths]
    batch = next(iter(on_disk.train_dataset(tf.distribute.InputContext(), global_batch_size=6, seed=0)))
    # ImageNet layout: labels from 1 in the files, from 0 in the batch; one epoch of 6 is every record once.
    assert sorted(batch["label"].numpy().tolist()) == list(range(6)) and batch["image"].shape == (6, 8, 8, 3)
    os.truncate(paths[1], sizes[1] - 1)
    with pytest.raises(convert.UserError, match=r"train-00001-of-00002 is truncated"):
        convert.scan_tfrecords(paths[1])


def test_reads_are_grouped_per_replica_batch_one_request_per_record_in_disk_order(tmp_path):
    """How reads are grouped, counted on a disk made slow (1 ms per request): one Python call per per-replica
    batch, one positioned read per record, sorted by (file, offset) within the call."""
    import threading
    import time
    out = write_arrays(tmp_path, count=40, records_per_file=8)
    opened = records.open_records(f"{out}/train")
    # Each call's requests, kept per thread: tf.data runs several calls at once.
    calls, current = [], threading.local()

    class SlowDisk(records.Records):
        def read(self, positions):
            current.requests = []
            result = super().read(positions)
            calls.append((len(positions), current.requests))
            return result

        def _read_at(self, file_number, offset, length):
            current.requests.append((file_number, offset))
            time.sleep(0.001)
            return super()._read_at(file_number, offset, length)

    slow = SlowDisk(opened.root, opened.files, opened.index, opened.features, opened.meta)
    ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    dataset = indexed.train_dataset(slow, ctx, global_batch_size=16, seed=0, decode=indexed.decode_arrays(
        opened.features))
    started = time.perf_counter()
    batch = next(iter(dataset))
    assert batch["x"].shape == (4, 3)
    # Per-replica batches of 16 / 4 = 4 records: each call reads 4, one request each, in disk order.
    assert calls and all(size == 4 and len(requests) == 4 and requests == sorted(requests)
                         for size, requests in calls), calls
    print(f"{len(calls)} calls, {sum(len(r) for _, r in calls)} requests of 1 ms before the first batch: "
          f"{time.perf_counter() - started:.3f} s")


def test_eval_reads_every_record_once_with_a_mask_on_any_pipeline_count(tmp_path):
    out = write_arrays(tmp_path)
    validation = indexed.open_dataset(f"{out}/validation")
    expected = sorted(int(validation.decode(tf.constant(d), tf.constant([0, 0], tf.int64))["x"][0])
                      for d in validation.records.read(np.arange(len(validation.records)))[0])
    for pipelines in (1, 2, 3):
        seen, batches = [], []
        for pipeline_id in range(pipelines):
            ctx = tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=pipeline_id,
                                             num_replicas_in_sync=pipelines)
            per_pipeline = list(validation.eval_dataset(ctx, global_batch_size=3 * pipelines).as_numpy_iterator())
            batches.append(len(per_pipeline))
            seen += [int(x[0]) for b in per_pipeline for x, m in zip(b["x"], b["mask"]) if m == 1]
        # 10 records: every one counted once, the pipelines yield equal numbers of batches.
        assert sorted(seen) == expected and len(set(batches)) == 1, (pipelines, seen, batches)


@pytest.mark.slow
def test_opted_in_bad_records_are_replaced_counted_and_capped(tmp_path):
    import mwloop
    from tests import records_task
    folder = records_task.write_records(str(tmp_path / "data"))
    train = f"{folder}/train"
    data = records.open_records(train)
    # Two neighbours damaged in place (same size): both are replaced by global index 12, at any pipeline count.
    for position in (10, 11):
        flip_byte(data.files[0], int(data.index[position]["offset"]) + records.HEADER_BYTES + 5)
    on_disk = indexed.open_dataset(train)
    substitute = on_disk.decode(tf.constant(data.read([12])[0][0]), tf.constant([0, 0], tf.int64))["inputs"].numpy()
    epoch = records_task.NUM_RECORDS // 24

    def read(pipelines):
        rows = []
        for pipeline_id in range(pipelines):
            ctx = tf.distribute.InputContext(pipelines, pipeline_id, pipelines)
            batches = on_disk.train_dataset(ctx, global_batch_size=24, seed=3, skip_bad_records=0.1).take(epoch)
            rows.append([(b["inputs"].numpy(), b[mwloop.task.SKIPPED_KEY].numpy()) for b in batches])
        # Per step: every pipeline's rows, as (features, skipped) sorted.
        return [sorted((tuple(x.tolist()), float(s)) for p in range(pipelines) for x, s in zip(*rows[p][step]))
                for step in range(epoch)]

    one, two = read(1), read(2)
    assert one == two
    replaced = [row for step in one for row in step if row[1] == 1.0]
    assert len(replaced) == 2 and all(row[0] == tuple(substitute.tolist()) for row in replaced)
    # Through a run: counted in the train metrics; above the allowed fraction, one line naming the setting.
    config = records_task.get_config(folder)
    config.train.update(steps=25, steps_per_loop=25, log_every_steps=25, checkpoint_every_steps=0, global_batch_size=24)
    config.eval.global_batch_size = 24
    config.dataset.skip_bad_records = 0.01
    with mwloop.Trainer(config, str(tmp_path / "run")) as trainer:
        trainer.train()
        assert trainer.metrics["train"][mwloop.task.SKIPPED_KEY] == 2.0
        window = dict(trainer.metrics["train"])
    # The same window with a stricter fraction: the Log action's check is one line, on every worker alike.
    from mwloop.run import actions
    config.dataset.skip_bad_records = 0.001
    with pytest.raises(mwloop.UserError, match=r"^2 of the 600 training examples of steps 1-25 were bad records, "
                                               r"replaced: more than config.dataset.skip_bad_records=0.001"):
        actions._check_skipped_records(config, window, 0, 25)


def test_an_eval_meets_a_bad_record_by_the_training_rule(tmp_path):
    """Default: one line naming the file and record (exit 2 under mwloop.main, which wraps the run in
    graph_checks.one_line_errors). Opted in: the record counts for nothing, is counted, and the fraction caps it."""
    import mwloop
    from mwloop.task import SKIPPED_KEY
    from tests import records_task
    from tests.tiny_task import tiny_config
    folder = records_task.write_records(str(tmp_path / "data"))
    shutil.copytree(f"{folder}/train", tmp_path / "val")
    data = records.open_records(str(tmp_path / "val"))
    flip_byte(data.files[0], int(data.index[20]["offset"]) + records.HEADER_BYTES + 5)

    class EvalRecords(records_task.RecordsTask):
        def eval_arrays(self):
            return None

        def eval_dataset(self, ctx, *, global_batch_size):
            return mwloop.open_dataset(str(tmp_path / "val")).eval_dataset(
                ctx, global_batch_size=global_batch_size, skip_bad_records=self.config.dataset.skip_bad_records)

    def evaluate(skip_bad_records: float) -> dict[str, float]:
        config = tiny_config(EvalRecords, **{"dataset.skip_bad_records": skip_bad_records})
        config.dataset.data_dir = folder
        with mwloop.Trainer(config, str(tmp_path / f"run{skip_bad_records}")) as trainer:
            return trainer.evaluate()["eval"]

    with pytest.raises(graph_checks.DataCheckError, match=rf"^{data.files[0]}: record 20 \(offset \d+\) does not "
                                                          r"match its checksum"), graph_checks.one_line_errors():
        evaluate(0.0)
    metrics = evaluate(0.01)
    assert (metrics["examples"], metrics[SKIPPED_KEY]) == (records_task.NUM_RECORDS - 1, 1.0)
    # A stricter fraction: one line, on every worker alike (the sums are global).
    from mwloop.run import evaluation
    strict = evaluation.Evaluation({}, None, None, ema=False, skip_bad_records=0.001)
    with pytest.raises(mwloop.UserError, match=r"^1 of the 600 examples of eval at step 0 were bad records, skipped: "
                                               r"more than config.dataset.skip_bad_records=0.001 of them"):
        strict._check_skipped("eval", 0, metrics)


def test_opted_in_records_that_do_not_decode_are_replaced_and_counted(tmp_path):
    from mwloop.data import make_tfrecords
    from mwloop.task import SKIPPED_KEY
    good = [make_tfrecords.Record(tf.io.encode_jpeg(np.full((20, 30, 3), k * 20, np.uint8)).numpy(), k % 2 + 1)
            for k in range(11)]
    # Record 4's image is not an image: its bytes are as indexed (TFRecords indexed in place), its decode fails.
    make_tfrecords.write_tfrecords(good[:4] + [make_tfrecords.Record(b"not an image", 1)] + good[4:],
                                   str(tmp_path / "tf"), shards=2)
    convert.convert(str(tmp_path / "tf" / "train-*"), str(tmp_path / "out"), progress=False)
    on_disk = indexed.open_dataset(str(tmp_path / "out" / "train"), image_size=16)
    batches = on_disk.train_dataset(tf.distribute.InputContext(), global_batch_size=4, seed=0, skip_bad_records=0.5)
    # Three epochs of 12 records: every batch whole, the bad record replaced and counted once per epoch.
    skipped = [b[SKIPPED_KEY].numpy() for b in batches.take(9)]
    assert all(len(s) == 4 for s in skipped) and sum(s.sum() for s in skipped) == 3
    # Without opting in, the decode's error stops the stream.
    with pytest.raises(tf.errors.InvalidArgumentError):
        for _ in on_disk.train_dataset(tf.distribute.InputContext(), global_batch_size=4, seed=0).take(3):
            pass


def test_the_imagenet_recipe_reads_records_by_global_index(tmp_path, monkeypatch):
    from mwloop.cluster import distribute
    from mwloop.config import schema
    from mwloop.loop import inputs
    from mwloop.run import build
    from mwloop.tasks.classification import ImageClassification
    from tests.helpers import load_config
    from tests.image_folders import make_fake_image_folders
    make_fake_image_folders(str(tmp_path / "folders"), num_classes=3, per_class=8, size=40)
    convert.convert(str(tmp_path / "folders"), str(tmp_path / "data"), validation_fraction=0.25, progress=False)
    config = schema.TABLE.complete(load_config("resnet", "imagenet_records", **{
        "dataset.data_dir": str(tmp_path / "data"), "dataset.image_size": 32, "dataset.num_classes": 0,
        "train.global_batch_size": 6, "eval.global_batch_size": 4}))
    task = ImageClassification(config)
    # The training input is mwloop's stream over train_records (the classes counted from the manifest) ...
    assert task.train_records() is task.source.train_records and task.source.num_classes == 3
    batch = next(iter(inputs.train_dataset_fn(config, task, start_step=0)(tf.distribute.InputContext())))
    assert batch["image"].shape == (6, 32, 32, 3) and set(batch["label"].numpy()) <= {0, 1, 2}
    # ... the eval set every validation record once (6 of the 24 images, padded to whole batches) ...
    masks = [b["mask"].numpy() for b in task.eval_dataset(tf.distribute.InputContext(), global_batch_size=4)]
    assert sum(m.sum() for m in masks) == 6 and len(masks) == 2
    # ... so an elastic job accepts the recipe.
    monkeypatch.setenv(distribute.ELASTIC_ENV, "2:3")
    assert build.check_elastic_data_early(config).source.name == "records"
