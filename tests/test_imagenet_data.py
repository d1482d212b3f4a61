"""ImageNet-layout TFRecords: the converter, and the train/eval pipelines on tiny generated JPEGs."""

import os
import subprocess
import sys

import keras
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from mwloop.data import imagenet, make_tfrecords, pipeline
from mwloop.errors import UserError
from tests.image_folders import make_fake_image_folders

SIZE = 16  # pipeline output side: small keeps the tests fast


def ctx(pipelines: int = 1, pipeline_id: int = 0, replicas: int = 1) -> tf.distribute.InputContext:
    return tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=pipeline_id,
                                      num_replicas_in_sync=replicas)


def read_examples(paths: list[str]) -> list[dict]:
    """Every record of `paths` as {'encoded', 'label', 'synset', 'filename'}."""
    features = dict(imagenet.FEATURES, **{k: tf.io.FixedLenFeature([], tf.string)
                                           for k in ("image/class/synset", "image/filename")})
    return [{k.split("/")[-1]: v.numpy() for k, v in tf.io.parse_single_example(r, features).items()}
            for r in tf.data.TFRecordDataset(paths)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """4 classes x 6 32x32 images (every 3rd a PNG) converted with 1/3 held out."""
    root = tmp_path_factory.mktemp("imagenet")
    images, out = str(root / "images"), str(root / "records")
    classes = make_fake_image_folders(images, num_classes=4, per_class=6, size=32, png_every=3)
    summary = make_tfrecords.convert(images, out, shards=3, validation_shards=2, validation_fraction=1 / 3,
                                     progress=False)
    return images, out, classes, summary


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """Records whose label is their index + 1 (one tiny JPEG each): 23 train in 3 files, 11 eval in 3."""
    out = str(tmp_path_factory.mktemp("numbered"))
    rng = np.random.default_rng(0)

    def records(n):
        return [make_tfrecords.Record(tf.io.encode_jpeg(rng.integers(0, 255, (20, 24, 3), np.uint8)).numpy(), i + 1)
                for i in range(n)]

    make_tfrecords.write_tfrecords(records(23), out, 3, "train")
    make_tfrecords.write_tfrecords(records(11), out, 3, "validation")
    return out


def source(data_dir: str, **overrides) -> "imagenet.Source":
    return imagenet.imagenet(ml_collections.ConfigDict(
        dict({"data_dir": data_dir, "image_size": SIZE, "num_classes": 4, "shuffle_buffer": 8}, **overrides)))


def take(dataset: tf.data.Dataset, num_batches: int) -> list[dict]:
    return [{k: v.numpy() for k, v in b.items()} for b in dataset.take(num_batches)]


# ---------------------------------------------------------------- converter

def test_converter_round_trips_images_and_labels(folders):
    images, out, classes, summary = folders
    assert (summary["train"], summary["validation"], summary["skipped"]) == (16, 8, [])
    assert open(os.path.join(out, "labels.txt")).read().split() == classes
    assert sorted(os.listdir(out)) == ["labels.txt", "train-00000-of-00003", "train-00001-of-00003",
                                       "train-00002-of-00003", "validation-00000-of-00002",
                                       "validation-00001-of-00002"]
    examples = read_examples(imagenet.list_files(out, "train") + imagenet.list_files(out, "validation"))
    assert len(examples) == 24
    for example in examples:
        synset = example["synset"].decode()
        assert example["label"] == classes.index(synset) + 1, "label = sorted folder index + 1"
        assert bool(tf.io.is_jpeg(example["encoded"])), "PNGs are re-encoded as JPEG"
        original = tf.io.decode_image(tf.io.read_file(os.path.join(images, synset, example["filename"].decode())),
                                      channels=3).numpy().astype(float)
        stored = tf.io.decode_jpeg(example["encoded"], channels=3).numpy().astype(float)
        assert np.abs(stored - original).mean() < 3.0
    held_out = read_examples(imagenet.list_files(out, "validation"))
    assert sorted(e["label"] for e in held_out) == [1, 1, 2, 2, 3, 3, 4, 4], "a third of each class"


def test_unreadable_image_is_skipped_and_listed(tmp_path, capsys):
    images, out = str(tmp_path / "images"), str(tmp_path / "out")
    make_fake_image_folders(images, num_classes=2, per_class=2, size=8)
    bad = os.path.join(images, "class_001", "broken.jpg")
    with open(bad, "wb") as f:
        f.write(b"\xff\xd8\xff not really a jpeg")
    assert make_tfrecords.main([f"--input={images}", f"--output={out}", "--shards=2",
                                "--validation_fraction=0"]) == 0
    err = capsys.readouterr().err
    assert "5/5 images" in err, "the progress bar counts every file"
    assert "skipped 1 unreadable images" in err and bad in err
    assert open(os.path.join(out, "skipped.txt")).read().startswith(bad + "\t")
    assert len(read_examples(imagenet.list_files(out, "train"))) == 4


def test_converter_errors_name_the_input(tmp_path, capsys):
    assert make_tfrecords.main([f"--input={tmp_path / 'nope'}", f"--output={tmp_path / 'out'}"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_count_records_reads_headers_and_rejects_truncated_files(numbered, tmp_path):
    path = imagenet.list_files(numbered, "train")[0]
    assert imagenet.count_records(path) == sum(1 for _ in tf.data.TFRecordDataset(path)) == 8
    truncated = str(tmp_path / "truncated")
    with open(path, "rb") as f, open(truncated, "wb") as g:
        g.write(f.read()[:-3])
    with pytest.raises(ValueError, match="truncated"):
        imagenet.count_records(truncated)


# ---------------------------------------------------------------- pipelines

def test_missing_or_empty_data_dir_is_one_clear_error(tmp_path):
    for data_dir in (None, str(tmp_path)):
        with pytest.raises(UserError, match="make_tfrecords"):
            source(data_dir)


@pytest.mark.slow
def test_batches_shapes_dtypes_and_label_offset(folders):
    _, out, _, _ = folders
    src = source(out)
    assert (src.input_shape, src.num_classes, src.num_train_examples, src.num_eval_examples) == \
        ((SIZE, SIZE, 3), 4, 16, 8)
    train = take(src.train_dataset_fn(8, 0, 0)(ctx(1, 0, 2)), 4)
    assert all(b["image"].shape == (4, SIZE, SIZE, 3) and b["image"].dtype == np.float32 for b in train)
    assert all(b["label"].dtype == np.int32 for b in train)
    assert sorted(set(np.concatenate([b["label"] for b in train]))) == [0, 1, 2, 3], "labels 1..4 become 0..3"
    assert abs(np.concatenate([b["image"] for b in train]).mean()) < 3, "normalised"
    shifted = take(source(out, label_offset=0).eval_dataset_fn(8)(ctx()), 1)[0]
    first = take(src.eval_dataset_fn(8)(ctx()), 1)[0]
    assert list(shifted["label"]) == list(first["label"] + 1)
    assert first["mask"].dtype == np.float32 and first["image"].shape == (8, SIZE, SIZE, 3)
    record = read_examples(imagenet.list_files(out, "validation"))[0]
    served = src.decode_image(tf.constant(record["encoded"]))  # what the exported model's serve_bytes applies
    np.testing.assert_allclose(served.numpy(), imagenet.preprocess_eval(record["encoded"], SIZE).numpy())
    assert served.shape == src.input_shape and served.dtype == tf.float32


@pytest.mark.slow
def test_image_dtype_follows_the_mixed_precision_policy(folders):
    src = source(folders[1])
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        # the policy is read when dataset_fn runs
        train_dataset_fn, eval_dataset_fn = src.train_dataset_fn(4, 0, 0), src.eval_dataset_fn(4)
        assert take(train_dataset_fn(ctx()), 1)[0]["image"].dtype == tf.bfloat16.as_numpy_dtype
        assert all(b["image"].dtype == tf.bfloat16.as_numpy_dtype for b in take(eval_dataset_fn(ctx()), 3))
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_png_bytes_decode_through_the_fallback():
    pixels = tf.constant(np.full((40, 30, 3), 200, np.uint8))
    from_png = imagenet.preprocess_eval(tf.io.encode_png(pixels), SIZE)
    from_jpeg = imagenet.preprocess_eval(tf.io.encode_jpeg(pixels, quality=100), SIZE)
    np.testing.assert_allclose(from_png.numpy(), from_jpeg.numpy(), atol=0.05)
    train = imagenet.preprocess_train(tf.io.encode_png(pixels), tf.constant([1, 2], tf.int64), SIZE)
    assert train.shape == (SIZE, SIZE, 3)


def one_epoch(data_dir: str, pipelines: int, seed: int = 0) -> list[list[int]]:
    """The labels each of `pipelines` pipelines reads in its first epoch (one example per replica batch)."""
    files = imagenet.list_files(data_dir, "train")
    labels = []
    for p in range(pipelines):
        c = ctx(pipelines, p, pipelines)
        mine, shard_elements = pipeline.shard_files(files, c)
        n = imagenet.records_per_epoch(mine, files, c, shard_elements)
        dataset = imagenet.train_dataset(files, c, image_size=SIZE, global_batch_size=pipelines, seed=seed,
                                         shuffle_buffer=4)
        labels.append([int(b["label"][0]) for b in take(dataset, n)])
    return labels


@pytest.mark.slow
@pytest.mark.parametrize("num_files", [3, 1])  # by file (3 files >= 2 pipelines), by element (1 file)
def test_two_pipelines_read_disjoint_halves_of_each_epoch(numbered, tmp_path, num_files):
    data_dir = numbered
    if num_files == 1:
        data_dir = str(tmp_path)
        records = [make_tfrecords.Record(e["encoded"], int(e["label"]))
                   for e in read_examples(imagenet.list_files(numbered, "train"))]
        make_tfrecords.write_tfrecords(records, data_dir, 1, "train")
    first, second = one_epoch(data_dir, pipelines=2)
    assert not set(first) & set(second)
    assert sorted(first + second) == list(range(23))


@pytest.mark.slow
def test_same_seed_same_order_and_another_seed_another(numbered):
    src = source(numbered)

    def stream(seed):
        return take(src.train_dataset_fn(4, seed, 0)(ctx(2, 1, 2)), 12)

    a, b, c = stream(3), stream(3), stream(4)
    assert [x["label"].tolist() for x in a] == [x["label"].tolist() for x in b]
    np.testing.assert_array_equal(np.stack([x["image"] for x in a]), np.stack([x["image"] for x in b]))
    assert [x["label"].tolist() for x in a] != [x["label"].tolist() for x in c]


@pytest.mark.slow
def test_order_ignores_the_global_seed_and_survives_op_determinism(numbered):
    """A fresh process with another global seed and op determinism on reads the same stream."""
    script = (f"import tensorflow as tf; tf.config.experimental.enable_op_determinism(); tf.random.set_seed(123)\n"
              f"from mwloop.data import imagenet\n"
              f"files = imagenet.list_files({numbered!r}, 'train')\n"
              f"d = imagenet.train_dataset(files, tf.distribute.InputContext(1, 0, 1), image_size=8, "
              f"global_batch_size=4, seed=3, shuffle_buffer=8)\n"
              f"print([b['label'].numpy().tolist() for b in d.take(10)])")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr[-2000:]
    here = imagenet.train_dataset(imagenet.list_files(numbered, "train"), ctx(), image_size=8, global_batch_size=4,
                                  seed=3, shuffle_buffer=8)
    assert out.stdout.strip().splitlines()[-1] == str([b["label"].tolist() for b in take(here, 10)])


@pytest.mark.slow
@pytest.mark.parametrize("start_step", [3, 9])  # within the first epoch, and two epochs later
def test_resume_at_a_step_continues_the_same_stream(numbered, start_step):
    src = source(numbered)
    for p in range(2):  # 2 pipelines x 2 replicas: each pipeline gives 2 batches per step
        full = take(src.train_dataset_fn(8, 5, 0)(ctx(2, p, 4)), 2 * (start_step + 3))
        resumed = take(src.train_dataset_fn(8, 5, start_step)(ctx(2, p, 4)), 6)
        tail = full[2 * start_step:]
        assert [b["label"].tolist() for b in resumed] == [b["label"].tolist() for b in tail]
        np.testing.assert_array_equal(np.stack([b["image"] for b in resumed]), np.stack([b["image"] for b in tail]))


@pytest.mark.slow
@pytest.mark.parametrize("pipelines,replicas,global_batch", [(1, 1, 4), (2, 2, 4), (2, 4, 8), (3, 3, 3)])
def test_eval_counts_every_example_once_with_equal_batches(numbered, pipelines, replicas, global_batch):
    src = source(numbered)
    steps = pipeline.num_eval_steps(src.num_eval_examples, global_batch)
    seen = []
    for p in range(pipelines):
        batches = take(src.eval_dataset_fn(global_batch)(ctx(pipelines, p, replicas)), 1000)
        assert len(batches) == steps * replicas // pipelines, "every pipeline yields the same number of batches"
        seen += [int(label) for b in batches for label, m in zip(b["label"], b["mask"]) if m == 1.0]
    assert sorted(seen) == list(range(11))


# ---------------------------------------------------------------- tuning knobs (config.dataset)

def graph_nodes(dataset: tf.data.Dataset) -> dict[str, "tf.compat.v1.NodeDef"]:
    """The top-level nodes of the dataset's graph by name: what the knobs set, as tf.data will run it."""
    graph = tf.compat.v1.GraphDef.FromString(dataset._as_serialized_graph().numpy())
    return {node.name: node for node in graph.node}


def decode_map_parallelism(dataset: tf.data.Dataset) -> int:
    """num_parallel_calls of the pipeline's (one top-level) parallel decode map, which must keep its order."""
    nodes = graph_nodes(dataset)
    (parallel_map,) = [n for n in nodes.values() if n.op.startswith("ParallelMapDataset")]
    # "default" defers to the options' deterministic=True; tiny test images rarely finish out of order,
    # so comparing outputs alone would not catch a map made nondeterministic.
    assert parallel_map.attr["deterministic"].s in (b"default", b"true")
    const = nodes[[i for i in parallel_map.input if not i.startswith("^")][-1].split(":")[0]]
    return int(tf.make_ndarray(const.attr["value"].tensor))


def count_ops(dataset: tf.data.Dataset, op: str) -> int:
    return sum(n.op == op for n in graph_nodes(dataset).values())


def test_threads_gives_train_and_eval_a_private_pool_only_when_set(numbered):
    for threads, expected in ((0, None), (2, 2)):
        src = source(numbered, threads=threads)
        for dataset in (src.train_dataset_fn(4, 0, 0)(ctx()), src.eval_dataset_fn(4)(ctx())):
            assert dataset.options().threading.private_threadpool_size == expected
            assert dataset.options().deterministic, "a private pool must not relax the order"


@pytest.mark.slow
def test_parallel_calls_and_prefetch_reach_the_decode_map_and_final_prefetch(numbered):
    default, tuned = source(numbered), source(numbered, parallel_calls=2, prefetch=0)
    for build in (lambda s: s.train_dataset_fn(4, 0, 0)(ctx()), lambda s: s.eval_dataset_fn(4)(ctx())):
        assert decode_map_parallelism(build(default)) == tf.data.AUTOTUNE
        assert decode_map_parallelism(build(tuned)) == 2
        assert count_ops(build(tuned), "PrefetchDataset") == count_ops(build(default), "PrefetchDataset") - 1


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [{"prefetch": 0}, {"parallel_calls": 2}, {"threads": 1},
                                   {"threads": 2, "parallel_calls": 1, "prefetch": 3}])
def test_tuning_knobs_do_not_change_the_examples(numbered, knobs):
    default, tuned = source(numbered), source(numbered, **knobs)
    for build, num_batches in ((lambda s: s.train_dataset_fn(4, 7, 2)(ctx(2, 1, 2)), 8),
                               (lambda s: s.eval_dataset_fn(4)(ctx()), 99)):
        expected, got = take(build(default), num_batches), take(build(tuned), num_batches)
        assert len(got) == len(expected) > 0
        for key in expected[0]:
            np.testing.assert_array_equal(np.stack([b[key] for b in got]), np.stack([b[key] for b in expected]))


def test_cached_eval_gives_the_same_batches_on_every_pass(numbered):
    expected = take(source(numbered).eval_dataset_fn(4)(ctx()), 99)
    cached = source(numbered, cache=True, parallel_calls=2).eval_dataset_fn(4)(ctx())
    for _ in range(2):  # the first pass fills the cache, the second reads it
        got = take(cached, 99)
        for key in expected[0]:
            np.testing.assert_array_equal(np.stack([b[key] for b in got]), np.stack([b[key] for b in expected]))


@pytest.mark.parametrize("knob,value", [("threads", -1), ("parallel_calls", 0), ("parallel_calls", -2),
                                        ("prefetch", -2)])
def test_bad_tuning_knob_is_a_one_line_error_at_source_creation(numbered, knob, value):
    with pytest.raises(ValueError, match=f"config.dataset.{knob}={value}; use"):
        source(numbered, **{knob: value})
