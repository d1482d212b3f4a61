"""Records on disk read by global index: the same records per step for any number of input pipelines, resume
at any step without reading what came before, per-example seeds. Real files written by each test."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import tensorflow as tf

from mwloop.data import convert, indexed

NUM_RECORDS, GLOBAL_BATCH = 250, 24


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> indexed.OnDisk:
    folder = tmp_path_factory.mktemp("arrays")
    np.savez(folder / "arrays.npz", x=np.arange(NUM_RECORDS, dtype=np.int64),
             y=np.arange(NUM_RECORDS, dtype=np.float32).reshape(-1, 1) * 0.5)
    convert.convert(str(folder / "arrays.npz"), str(folder / "out"), validation_fraction=0, records_per_file=64,
                    progress=False)
    on_disk = indexed.open_dataset(str(folder / "out" / "train"))

    def decode(data, seed):
        example = on_disk.decode(data, seed)
        return {"x": example["x"], "noise": tf.random.stateless_uniform([], seed, maxval=2**31, dtype=tf.int64)}
    return indexed.OnDisk(on_disk.records, decode)


def steps(on_disk: indexed.OnDisk, pipelines: int, replicas: int, num_steps: int, start_step: int = 0,
          seed: int = 7) -> list[list[tuple[int, int]]]:
    """For each global step: its (global index, seeded noise) pairs over every replica of every pipeline, in
    the order read (a step across an epoch boundary may hold a record twice, with two epochs' seeds)."""
    per_pipeline = []
    for pipeline_id in range(pipelines):
        ctx = tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=pipeline_id,
                                         num_replicas_in_sync=replicas)
        data = on_disk.train_dataset(ctx, global_batch_size=GLOBAL_BATCH, seed=seed, start_step=start_step)
        # Its local replicas take consecutive batches: one per replica per step.
        per_pipeline.append(list(data.take(num_steps * replicas // pipelines).as_numpy_iterator()))
    out = []
    for step in range(num_steps):
        seen: list[tuple[int, int]] = []
        for batches in per_pipeline:
            local = len(batches) // num_steps
            for batch in batches[step * local:(step + 1) * local]:
                seen += zip(batch["x"].tolist(), batch["noise"].tolist())
        assert len(seen) == GLOBAL_BATCH
        out.append(seen)
    return out


def digest(per_step: list[list[tuple[int, int]]]) -> str:
    """The per-step sets (sorted: the order within a step depends on how its rows are split)."""
    return hashlib.sha256(repr([sorted(s) for s in per_step]).encode()).hexdigest()[:16]


@pytest.mark.slow
def test_the_same_records_and_seeds_per_step_for_1_to_4_input_pipelines(dataset):
    # 100 steps of 24 are 2400 positions: 9.6 epochs of 250 records, so several epoch boundaries.
    reference = steps(dataset, 1, 1, 100)
    hashes = {(1, 1): digest(reference)}
    for pipelines, replicas in ((2, 2), (3, 3), (4, 4), (2, 4)):
        hashes[(pipelines, replicas)] = digest(steps(dataset, pipelines, replicas, 100))
    print("steps 0-99, (pipelines, replicas) -> sha256 of the per-step (index, seed) sets:", hashes)
    assert len(set(hashes.values())) == 1, hashes
    # Each epoch is a permutation: every record exactly once per 250 positions (one pipeline: dict order is
    # stream order).
    stream = [x for s in reference for x, _ in s]
    for epoch in range(len(stream) // NUM_RECORDS):
        assert sorted(stream[epoch * NUM_RECORDS:(epoch + 1) * NUM_RECORDS]) == list(range(NUM_RECORDS))
    # The epochs' orders differ (a new permutation per epoch), and so do a record's seeds in two epochs.
    assert stream[:NUM_RECORDS] != stream[NUM_RECORDS:2 * NUM_RECORDS]
    noises: dict[int, set[int]] = {}
    for s in reference:
        for x, noise in s:
            noises.setdefault(x, set()).add(noise)
    assert max(len(v) for v in noises.values()) > 1


def test_resume_at_any_step_reads_the_same_records_as_a_run_from_zero(dataset):
    reference = steps(dataset, 1, 1, 30)
    # Step 9 crosses the first epoch boundary (positions 216..239 < 250 <= 240..263 at step 10).
    for start in (9, 10, 21):
        assert steps(dataset, 1, 1, 30 - start, start_step=start) == reference[start:]
    assert [sorted(s) for s in steps(dataset, 3, 3, 5, start_step=10)] == [sorted(s) for s in reference[10:15]]


def test_another_seed_another_order(dataset):
    assert digest(steps(dataset, 1, 1, 3, seed=1)) != digest(steps(dataset, 1, 1, 3, seed=2))


def test_example_seed_is_a_function_of_seed_index_and_epoch():
    seeds = {(s, i, e): tuple(indexed.example_seed(s, tf.constant(i, tf.int64), tf.constant(e, tf.int64)).numpy())
             for s in (0, 1) for i in (0, 1, 2**40) for e in (0, 3)}
    assert len(set(seeds.values())) == len(seeds)
    assert tuple(indexed.example_seed(1, tf.constant(2**40, tf.int64), tf.constant(3)).numpy()) == seeds[(1, 2**40, 3)]


def test_a_task_trains_from_records_and_resumes_with_another_worker_count(tmp_path, monkeypatch):
    import mwloop
    from mwloop.cluster import distribute
    from mwloop.run import state, train
    from tests import records_task
    config = records_task.get_config(records_task.write_records(str(tmp_path / "data")))
    config.train.steps = 10
    with mwloop.Trainer(config, str(tmp_path / "run")) as trainer:
        trainer.train()
        assert trainer.step == 10
        run, task, strategy = trainer.state, trainer.task, trainer.strategy
    # A checkpoint of 2 workers resumed by 1: the same records per step, so accepted.
    run.input_pipelines.assign(2)
    state.check_input_pipelines(run, task, strategy)
    assert int(run.input_pipelines.numpy()) == 1
    # An elastic job refuses a task whose own train_dataset shards by worker, at the start, in one line: before
    # the strategy exists (no cluster start-up), from the command line's path and the Trainer's.
    monkeypatch.setenv(distribute.ELASTIC_ENV, "2:3")
    own = records_task.get_config("own")
    own.train.global_batch_size = own.eval.global_batch_size = 48
    refused = r"^an elastic job \(--num_workers=2:3\) needs data .* OwnFiles.train_dataset shards its own way; give"
    with monkeypatch.context() as strategy_forbidden:
        def no_strategy(*args, **kwargs):
            raise AssertionError("the strategy was made before the elastic job's data was checked")
        strategy_forbidden.setattr(distribute, "create_strategy", no_strategy)
        with pytest.raises(mwloop.TaskError, match=refused):
            train.train_and_evaluate(own, str(tmp_path / "own"))
        with pytest.raises(mwloop.TaskError, match=refused):
            mwloop.Trainer(own, str(tmp_path / "own"))
    config.train.global_batch_size = config.eval.global_batch_size = 48
    with mwloop.Trainer(config, str(tmp_path / "elastic")):
        pass
