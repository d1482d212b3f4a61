"""The resident feed yields exactly the tf.data pipeline's global batches, and resumes at any step."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from mwloop.config import base as config_base
from mwloop.data import pipeline
from mwloop.loop import feed
from mwloop.loop import loops as loop
from mwloop.tasks.classification import ImageClassification

NUM_EXAMPLES, GLOBAL_BATCH, SEED = 37, 8, 3  # 37 is prime: batches straddle epoch boundaries
TASK = ImageClassification(config_base.base_config())  # its step: the loss and accuracy on {image, label}


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"image": rng.standard_normal((NUM_EXAMPLES, 4), dtype=np.float32),
            "label": np.arange(NUM_EXAMPLES, dtype=np.int32)}  # label = example id: order is visible


@pytest.fixture
def strategy_of(mirrored_strategy):
    """Strategy by name; 'mirrored' is conftest's one per process (a second one would share collective
    keys with it and abort other tests' all-reduces)."""
    return lambda name: tf.distribute.get_strategy() if name == "default" else mirrored_strategy


def _global(strategy: tf.distribute.Strategy, per_replica) -> dict[str, np.ndarray]:
    """A global batch: the replicas' batches concatenated in replica order."""
    parts = strategy.experimental_local_results(per_replica)
    return {k: np.concatenate([p[k].numpy() for p in parts]) for k in parts[0]}


def pipeline_batches(strategy, arrays, start_step: int, num_steps: int) -> list[dict[str, np.ndarray]]:
    dataset_fn = functools.partial(pipeline.array_train_dataset, arrays, global_batch_size=GLOBAL_BATCH,
                                   seed=SEED, start_step=start_step)
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    return [_global(strategy, next(iterator)) for _ in range(num_steps)]


def feed_batches(strategy, resident: feed.ResidentFeed, start_step: int,
                 num_steps: int) -> list[dict[str, np.ndarray]]:
    """The global batches `feed.batches` gives a loop call of `num_steps` from `start_step`."""
    step = tf.Variable(start_step, dtype=tf.int64)

    @tf.function
    def call_batches():
        next_batch = feed.batches(strategy, resident.at(step), num_steps)
        return [next_batch(tf.constant(i)) for i in range(num_steps)]

    return [_global(strategy, b) for b in call_batches()]


@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
@pytest.mark.parametrize("start_step", [0, 7])
@pytest.mark.parametrize("gather_per_call,steps_per_call", [(True, None), (False, None), (True, 12)])
def test_feed_yields_the_pipeline_batches(strategy_of, strategy_name, start_step, gather_per_call, steps_per_call):
    strategy, arrays = strategy_of(strategy_name), _arrays()
    resident = feed.ResidentFeed(strategy, arrays, global_batch_size=GLOBAL_BATCH, seed=SEED,
                                 gather_per_call=gather_per_call, steps_per_call=steps_per_call)
    expected = pipeline_batches(strategy, arrays, start_step, 12)  # 96 examples: crosses 2 epochs
    got = feed_batches(strategy, resident, start_step, 12)
    for step, (want, have) in enumerate(zip(expected, got)):
        np.testing.assert_array_equal(have["label"], want["label"], err_msg=f"step {start_step + step}")
        np.testing.assert_array_equal(have["image"], want["image"])


@pytest.mark.slow
def test_resume_reads_the_same_batches(mirrored_strategy):
    strategy, arrays = mirrored_strategy, _arrays()
    resident = feed.ResidentFeed(strategy, arrays, global_batch_size=GLOBAL_BATCH, seed=SEED)
    whole = feed_batches(strategy, resident, 0, 20)
    resumed = feed_batches(strategy, resident, 13, 7)
    for want, have in zip(whole[13:], resumed):
        np.testing.assert_array_equal(have["label"], want["label"])


def test_a_call_longer_than_steps_per_call_is_an_error():
    resident = feed.ResidentFeed(tf.distribute.get_strategy(), _arrays(), global_batch_size=GLOBAL_BATCH, seed=SEED,
                                 steps_per_call=4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="more steps than the feed's steps_per_call"):
        feed_batches(tf.distribute.get_strategy(), resident, 0, 5)


@pytest.mark.parametrize("pipelines,local,per_replica", [(1, 1, 8), (1, 2, 4), (2, 2, 2), (3, 1, 5)])
def test_max_epochs_spanned_bounds_every_call(pipelines, local, per_replica):
    """The static bound covers every replica's positions for every start step and call length."""
    stream_layout = feed.Layout(pipelines * local * per_replica, per_replica, pipelines, local)
    for max_steps in (1, 3, 10):
        bound = feed.max_epochs_spanned(stream_layout, NUM_EXAMPLES, max_steps)
        for replica in range(pipelines * local):
            for first in range(0, 40):
                epochs = feed.stream_positions(stream_layout, replica, first, max_steps).numpy() // NUM_EXAMPLES
                assert epochs.max() - epochs.min() + 1 <= bound


def test_stream_positions_of_a_multi_worker_layout():
    """2 pipelines x 2 local replicas: each global batch is B consecutive positions, split 4 ways."""
    stream_layout = feed.Layout(global_batch_size=8, per_replica_batch_size=2, num_pipelines=2, local_replicas=2)
    positions = [feed.stream_positions(stream_layout, r, 5, 1).numpy()[0] for r in range(4)]
    # pipeline p reads positions p, p + 2, ...; its local replicas take consecutive batches
    np.testing.assert_array_equal(positions, [[40, 42], [44, 46], [41, 43], [45, 47]])


def test_global_batch_that_does_not_divide_is_a_clear_error(mirrored_strategy):
    with pytest.raises(ValueError, match="multiple of 2"):
        feed.ResidentFeed(mirrored_strategy, _arrays(), global_batch_size=7, seed=SEED)


@pytest.mark.slow
@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
def test_train_loop_matches_the_iterator_loop(strategy_of, strategy_name):
    """Same model, same batches: the resident loop's weights equal mwloop's loop's after 2 calls."""
    strategy, arrays = strategy_of(strategy_name), _arrays()
    arrays = {"image": arrays["image"], "label": arrays["label"] % 3}

    def build():
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
            optimizer = keras.optimizers.SGD(0.1)
            optimizer.build(model.trainable_variables)
            step = tf.Variable(0, dtype=tf.int64)
        return model, optimizer, step

    model_a, opt_a, _ = build()
    iterator_loop = loop.make_train_loop(strategy, TASK, model_a, opt_a, global_batch_size=GLOBAL_BATCH)
    dataset_fn = functools.partial(pipeline.array_train_dataset, arrays, global_batch_size=GLOBAL_BATCH, seed=SEED)
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    model_b, opt_b, step = build()
    resident = feed.ResidentFeed(strategy, arrays, global_batch_size=GLOBAL_BATCH, seed=SEED, steps_per_call=5)
    resident_loop = loop.make_train_loop(strategy, TASK, model_b, opt_b, global_batch_size=GLOBAL_BATCH)
    for num_steps in (5, 4):
        sums_a, _ = iterator_loop(iterator, tf.constant(num_steps))
        sums_b, _ = resident_loop(resident.at(step), tf.constant(num_steps))
        step.assign_add(num_steps)
        assert float(sums_b["loss_sum"]) == pytest.approx(float(sums_a["loss_sum"]), rel=1e-5)
    for a, b in zip(model_a.weights, model_b.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_unrolled_calls_equal_single_steps():
    """The loop runs small models 2 steps per iteration in calls of an even length, one per iteration in
    the others (a second trace): calls of 4+1 and 2+3 steps train bitwise like 5 one-step calls (the same
    ops in the same order), so a resume at any step continues an uninterrupted run exactly."""
    strategy, arrays = tf.distribute.get_strategy(), _arrays()
    arrays = {"image": arrays["image"], "label": arrays["label"] % 3}
    results = []
    for calls in ([4, 1], [2, 3], [1] * 5):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64)
        resident = feed.ResidentFeed(strategy, arrays, global_batch_size=GLOBAL_BATCH, seed=SEED, steps_per_call=5)
        train_loop = loop.make_train_loop(strategy, TASK, model, optimizer, global_batch_size=GLOBAL_BATCH)
        loss = 0.0
        for num_steps in calls:
            loss += float(train_loop(resident.at(step), tf.constant(num_steps))[0]["loss_sum"])
            step.assign_add(num_steps)
        results.append((loss, [w.numpy() for w in model.weights]))
    assert loop.UNROLL == 2
    for loss, weights in results[:2]:
        assert loss == pytest.approx(results[2][0], rel=1e-6)  # summed per call: another grouping
        for a, b in zip(weights, results[2][1]):
            np.testing.assert_array_equal(a, b)
