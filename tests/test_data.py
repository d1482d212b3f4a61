"""Input pipelines: explicit sharding, seeded order, resume position, eval coverage."""

import numpy as np
import pytest
import tensorflow as tf

from mwloop.data import pipeline

NUM_EXAMPLES = 50
ARRAYS = {"image": np.arange(NUM_EXAMPLES, dtype=np.float32)[:, None], "label": np.arange(NUM_EXAMPLES, dtype=np.int32)}


def ctx(pipelines: int = 1, pipeline_id: int = 0, replicas: int = 1) -> tf.distribute.InputContext:
    return tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=pipeline_id,
                                      num_replicas_in_sync=replicas)


def labels(dataset: tf.data.Dataset, num_batches: int) -> list[list[int]]:
    return [b["label"].numpy().tolist() for b in dataset.take(num_batches)]


def global_batches(pipelines: int, replicas: int, global_batch: int, steps: int, **kw) -> list[list[int]]:
    """The examples of each global step, assembled as the strategy would: pipeline p
    feeds its replicas consecutive batches."""
    per_pipeline_replicas = replicas // pipelines
    streams = [labels(pipeline.array_train_dataset(ARRAYS, ctx(pipelines, p, replicas), global_batch_size=global_batch,
                                                   **kw), steps * per_pipeline_replicas) for p in range(pipelines)]
    return [sum((streams[p][s * per_pipeline_replicas + r] for p in range(pipelines)
                 for r in range(per_pipeline_replicas)), []) for s in range(steps)]


def test_two_pipelines_read_disjoint_halves_of_the_global_batch():
    one = global_batches(1, 1, 16, steps=10, seed=3)
    two = global_batches(2, 2, 16, steps=10, seed=3)
    four = global_batches(2, 4, 16, steps=10, seed=3)
    first, second = (labels(pipeline.array_train_dataset(ARRAYS, ctx(2, p, 2), global_batch_size=16, seed=3), 10)
                     for p in (0, 1))
    for step in range(10):
        if step < NUM_EXAMPLES // 16:  # within one epoch no example repeats, so the halves are disjoint
            assert not set(first[step]) & set(second[step]), "pipelines must read disjoint examples"
        assert sorted(first[step] + second[step]) == sorted(one[step]) == sorted(two[step]) == sorted(four[step])


def test_every_example_once_per_epoch_and_order_is_seeded():
    stream = sum(global_batches(1, 1, 10, steps=10, seed=0), [])
    assert sorted(stream[:NUM_EXAMPLES]) == list(range(NUM_EXAMPLES))
    assert sorted(stream[NUM_EXAMPLES:]) == list(range(NUM_EXAMPLES))
    assert stream[:NUM_EXAMPLES] != stream[NUM_EXAMPLES:], "each epoch has its own order"
    assert stream == sum(global_batches(1, 1, 10, steps=10, seed=0), [])
    assert stream != sum(global_batches(1, 1, 10, steps=10, seed=1), [])


@pytest.mark.parametrize("pipelines,replicas", [(1, 1), (2, 2)])
def test_start_step_resumes_the_same_stream(pipelines, replicas):
    full = global_batches(pipelines, replicas, 8, steps=20, seed=5)
    resumed = global_batches(pipelines, replicas, 8, steps=13, seed=5, start_step=7)
    assert resumed == full[7:]


def test_resume_with_another_number_of_workers_reads_the_same_examples():
    written_by_two = global_batches(2, 2, 8, steps=20, seed=5)
    resumed_by_one = global_batches(1, 1, 8, steps=13, seed=5, start_step=7)
    assert [sorted(b) for b in resumed_by_one] == [sorted(b) for b in written_by_two[7:]]


def test_global_batch_that_does_not_divide_is_a_clear_error():
    with pytest.raises(ValueError, match="does not divide among 3 replicas"):
        pipeline.array_train_dataset(ARRAYS, ctx(1, 0, 3), global_batch_size=16, seed=0)


@pytest.mark.parametrize("pipelines,replicas,global_batch", [(1, 1, 16), (2, 2, 16), (2, 4, 12), (3, 3, 9)])
def test_eval_counts_every_example_exactly_once(pipelines, replicas, global_batch):
    steps = pipeline.num_eval_steps(NUM_EXAMPLES, global_batch)
    seen, batches = [], []
    for p in range(pipelines):
        dataset = pipeline.array_eval_dataset(ARRAYS, ctx(pipelines, p, replicas), global_batch_size=global_batch)
        batches.append(len(list(dataset)))
        for batch in dataset:
            seen += [int(label) for label, m in zip(batch["label"].numpy(), batch["mask"].numpy()) if m == 1.0]
    assert sorted(seen) == list(range(NUM_EXAMPLES))
    assert batches == [steps * replicas // pipelines] * pipelines, "uneven pipelines would hang collectives"


def test_files_shard_by_file_when_enough_else_by_element():
    files = [f"f{i}" for i in range(5)]
    assert pipeline.shard_files(files, ctx(2, 1, 2)) == (["f1", "f3"], False)
    assert pipeline.shard_files(files, ctx(5, 4, 5)) == (["f4"], False)
    assert pipeline.shard_files(files[:1], ctx(2, 1, 2)) == (["f0"], True)


def test_auto_sharding_is_off():
    dataset = pipeline.array_train_dataset(ARRAYS, ctx(), global_batch_size=4, seed=0)
    assert dataset.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.OFF


def test_threads_gives_array_pipelines_a_private_pool_from_the_config():
    from mwloop import data
    from mwloop.config import base as config_base
    from mwloop.data import source
    cfg = config_base.base_config().dataset
    assert cfg.threads == 0, "default: TensorFlow's shared pool, as before the knob"
    for threads, expected in ((0, None), (3, 3)):
        cfg.threads = threads
        src = data.get_source(cfg)
        for dataset in (src.train_dataset_fn(4, 0)(ctx()), src.eval_dataset_fn(4)(ctx())):
            assert dataset.options().threading.private_threadpool_size == expected
    with pytest.raises(ValueError, match="config.dataset.threads=-1"):
        source.arrays_source("bad", ARRAYS, ARRAYS, 10, threads=-1)
