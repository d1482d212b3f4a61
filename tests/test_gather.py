"""Losses over the whole global batch: `mwloop.gather_global_batch` and the retrieval example (issue 30).

One replica gets the values back (offset 0). On 2 mirrored replicas every replica gets every row, in replica
order, with its own offset (also for uneven rows and mixed dtypes), and the gradient through the gather is
the 1-replica gradient. The shipped dual encoder (in-batch negatives over the global batch) trains the same
on 1 replica, 2 mirrored replicas (its step) and 2 workers (a run on MultiWorkerMirroredStrategy through
the launcher, with tf.data input: ids straight from the input are gathered, the "destinations can not be
empty" case), its exported endpoints give the eval's recall, and local negatives train another model.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import mwloop
from benchmarks.retrieval import checkpoint_weights, endpoint_recall, largest_relative_difference
from examples.retrieval import DualEncoder
from mwloop import testing
from mwloop.run import train
from tests import warm_main
from tests.helpers import ROOT, load_config, read_metrics

# A short run of the example, short enough for 2 workers to start and finish in ~30 s on 2 cores. SGD with
# momentum rather than the config's Adam: Adam divides each gradient by its own running scale, which turns
# float noise of near-zero gradients into full-size steps (the example's Adam, 40 steps: 1.5e-6 on 2 mirrored
# replicas, 9e-6 on 2 workers; SGD: 4e-7, 6e-7). 2000 eval pairs: the last eval batch (208 of 256) is padded,
# and padding must be no candidate.
SHORT = {"train.steps": 40, "train.steps_per_loop": 20, "train.log_every_steps": 20, "train.eval_every_steps": 40,
         "train.checkpoint_every_steps": 40, "dataset.num_eval_pairs": 2000, "optimizer.name": "sgd",
         "optimizer.learning_rate": 0.5, "optimizer.momentum": 0.9}
PLAIN_SGD = {"optimizer.name": "sgd", "optimizer.learning_rate": 0.5, "optimizer.momentum": 0.0,
             "optimizer.schedule": "constant"}


def retrieval_config(**overrides):
    return load_config("retrieval", **{"distribution.strategy": "default", **overrides})


def first_batch(task: DualEncoder, size: int = 128) -> dict[str, np.ndarray]:
    return {k: v[:size] for k, v in task.train_arrays().items()}


def eval_event(workdir) -> dict:
    return [e for e in read_metrics(str(workdir)) if e["split"] == "eval"][-1]


# --------------------------------------------------------------------------------------------- one replica
def test_one_replica_gets_its_values_back_with_offset_0():
    values = {"embedding": tf.reshape(tf.range(6, dtype=tf.float32), [3, 2]), "id": tf.constant([7, 8, 9])}
    rows, offset = mwloop.gather_global_batch(values)
    assert int(offset) == 0 and set(rows) == {"embedding", "id"}
    np.testing.assert_array_equal(rows["embedding"], values["embedding"])
    np.testing.assert_array_equal(rows["id"], values["id"])
    traced = tf.function(lambda x: mwloop.gather_global_batch(x))(values["embedding"])
    assert isinstance(traced, mwloop.GlobalBatch) and traced.rows.shape == (3, 2) and int(traced.offset) == 0


def test_mistakes_are_one_line_errors(mirrored_strategy):
    with pytest.raises(mwloop.TaskError, match="got a scalar"):
        mwloop.gather_global_batch(tf.constant(1.0))
    with pytest.raises(mwloop.TaskError, match=r"values with \[2, 3\] rows"):
        mwloop.gather_global_batch([tf.ones([2, 4]), tf.ones([3])])
    with mirrored_strategy.scope(), pytest.raises(mwloop.TaskError, match="cross-replica context"):
        mwloop.gather_global_batch(tf.ones([2]))


# -------------------------------------------------------------------------------------- 2 mirrored replicas
@pytest.mark.slow
@pytest.mark.parametrize("first_replica_rows", [3, 4, 6])
def test_two_replicas_get_every_row_in_replica_order(mirrored_strategy, first_replica_rows):
    """Even and uneven rows (a partial eval batch: 4 + 2, and 6 + 0), floats and ints in one call."""
    features = np.arange(12, dtype=np.float32).reshape(6, 2)
    ids = np.arange(100, 106, dtype=np.int32)

    def rows_of(ctx):
        take = slice(0, first_replica_rows) if ctx.replica_id_in_sync_group == 0 else slice(first_replica_rows, 6)
        return {"features": tf.constant(features[take]), "id": tf.constant(ids[take])}

    @tf.function
    def gather(values):
        return mirrored_strategy.run(mwloop.gather_global_batch, args=(values,))

    rows, offset = gather(mirrored_strategy.experimental_distribute_values_from_function(rows_of))
    assert [int(o) for o in mirrored_strategy.experimental_local_results(offset)] == [0, first_replica_rows]
    for replica_rows in mirrored_strategy.experimental_local_results(rows["features"]):
        np.testing.assert_array_equal(replica_rows, features)
    for replica_ids in mirrored_strategy.experimental_local_results(rows["id"]):
        np.testing.assert_array_equal(replica_ids, ids)


def info_nce_gradients(strategy, queries: np.ndarray, documents: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """d(loss)/d(queries), d(loss)/d(documents) and the loss of InfoNCE over the global batch, each replica
    holding consecutive rows and scaling its examples' sum by the global batch (as mwloop does), the
    replicas' gradients of their own rows concatenated and their losses summed."""
    global_batch_size, num_replicas = len(queries), strategy.num_replicas_in_sync
    per_replica = global_batch_size // num_replicas

    def replica_fn(q, d):
        with tf.GradientTape() as tape:
            tape.watch([q, d])
            all_documents, offset = mwloop.gather_global_batch(d)
            logits = tf.matmul(q, all_documents, transpose_b=True)
            labels = offset + tf.range(tf.shape(q)[0])
            loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)) / global_batch_size
        return tape.gradient(loss, [q, d]) + [loss]

    def rows_of(array):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(array[ctx.replica_id_in_sync_group * per_replica:][:per_replica]))

    d_queries, d_documents, loss = tf.function(lambda q, d: strategy.run(replica_fn, args=(q, d)))(
        rows_of(queries), rows_of(documents))

    def joined(value):
        return np.concatenate([np.asarray(v) for v in strategy.experimental_local_results(value)])
    return joined(d_queries), joined(d_documents), float(sum(strategy.experimental_local_results(loss)))


@pytest.mark.slow
def test_the_gradient_through_the_gather_is_the_one_replica_gradient(mirrored_strategy):
    """all_gather's gradient hands each replica the gradient of its own rows summed over every replica's loss;
    with each loss scaled by the global batch that is the gradient of the global mean loss."""
    rng = np.random.default_rng(0)
    queries, documents = (rng.standard_normal((16, 8)).astype(np.float32) for _ in range(2))
    one = info_nce_gradients(tf.distribute.get_strategy(), queries, documents)
    two = info_nce_gradients(mirrored_strategy, queries, documents)
    assert abs(two[2] - one[2]) <= 1e-6 * one[2]
    for name, a, b in (("queries", two[0], one[0]), ("documents", two[1], one[1])):
        assert np.max(np.abs(a - b)) <= 1e-6 * np.max(np.abs(b)), name
    print(f"InfoNCE over 16 rows: 2 replicas vs 1, largest gradient difference "
          f"{max(np.max(np.abs(two[i] - one[i])) / np.max(np.abs(one[i])) for i in (0, 1)):.1e} (relative)")


@pytest.mark.slow
def test_the_example_step_on_two_replicas_is_the_one_replica_step_and_local_negatives_are_not(mirrored_strategy):
    """The example's real step through mwloop.testing: one plain-SGD update (the gradient) and 5 Adam updates on
    2 replicas equal 1 replica; with local negatives (on 1 replica the same as global ones) 2 replicas differ by
    orders of magnitude more, and report a lower loss and a better recall: fewer negatives."""
    figures = {}
    for name, optimizer, steps in (("sgd", PLAIN_SGD, 1), ("adam", {}, 5)):
        runs = {}
        for negatives in ("global", "local"):
            task = DualEncoder(retrieval_config(**optimizer, **{"model.negatives": negatives}))
            runs[negatives] = testing.train_steps(task, first_batch(task), num_replicas=2, num_steps=steps)
        one = testing.train_steps(task, first_batch(task), num_replicas=1, num_steps=steps)
        figures[name] = {negatives: (testing.relative_difference(two.weights, one.weights),
                                     two.metrics["loss"] - one.metrics["loss"],
                                     two.metrics["recall_at_1"] - one.metrics["recall_at_1"])
                         for negatives, two in runs.items()}
    print("2 replicas vs 1 (weights, loss, recall@1 differences):", figures)
    for name, tolerance in (("sgd", 1e-6), ("adam", 2e-6)):
        weights, loss, recall = figures[name]["global"]
        assert weights < tolerance and abs(loss) < 1e-6 and recall == 0.0, (name, figures[name])
        weights, loss, recall = figures[name]["local"]
        assert weights > 1e-2 and loss < -0.1 and recall >= 0.0, (name, figures[name])
    assert figures["adam"]["local"][2] > 0.05


# ------------------------------------------------------------------------------------- runs of the example
@pytest.fixture(scope="module")
def one_replica_run(tmp_path_factory):
    """The example trained on 1 replica (the default strategy) in this process: the reference of the runs."""
    workdir = tmp_path_factory.mktemp("retrieval") / "one_replica"
    train.train_and_evaluate(retrieval_config(**SHORT), str(workdir))
    return workdir


@pytest.mark.slow
def test_recall_from_the_two_exported_endpoints_is_the_eval_recall(one_replica_run):
    """Embed the eval queries and documents with the SavedModel's `query` and `document` endpoints and rank each
    eval batch's documents as the eval does (the last batch partial): recall@k equals the eval's metric."""
    config = retrieval_config(**SHORT)
    recall = endpoint_recall(os.path.join(one_replica_run, "export", "latest"), config)
    event = eval_event(one_replica_run)
    for k, value in recall.items():
        assert abs(value - event[f"recall_at_{k}"]) <= 1.0 / config.dataset.num_eval_pairs, (k, value, event)
    print(f"recall from the exported endpoints {list(recall.values())}, eval "
          f"{[event[f'recall_at_{k}'] for k in recall]}")


@pytest.mark.slow
def test_two_workers_train_like_one_replica(tmp_path, one_replica_run):
    """MultiWorkerMirroredStrategy, 2 worker processes through the launcher, tf.data input (the example gathers
    doc ids straight from it): the checkpoint equals the 1-replica one to float rounding, and so does the eval
    (its last batch padded)."""
    workdir = tmp_path / "two_workers"
    overrides = {**SHORT, "train.feed": "iterator", "export": False}
    command = [sys.executable, "-m", "mwloop.launch", "--num_workers=2", "--max_restarts=0", "--",
               f"--config={os.path.join(ROOT, 'configs', 'retrieval.py')}", f"--workdir={workdir}",
               *(f"--config.{k}={v}" for k, v in overrides.items())]
    run = subprocess.run(command, env=warm_main.serving(dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")),
                         cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-5000:]
    assert re.search(r"\[worker 0\] .*CollectiveAllReduceStrategy: 2 replicas, 2 workers", run.stderr)
    difference = largest_relative_difference(checkpoint_weights(workdir, 40), checkpoint_weights(one_replica_run, 40))
    print(f"2 workers vs 1 replica after 40 SGD steps: largest relative weight difference {difference:.1e}")
    assert difference < 1e-5  # measured 6e-7
    one, two = eval_event(one_replica_run), eval_event(workdir)
    # Weights equal to rounding can still flip a near-tie: one eval query of 2000 at most.
    assert abs(two["recall_at_1"] - one["recall_at_1"]) <= 1 / 2000 and two["loss"] == pytest.approx(one["loss"],
                                                                                                     rel=1e-5)
