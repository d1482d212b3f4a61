"""Step functions, tested alone: global-batch loss scaling and masked eval sums."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mwloop import steps
from mwloop.models import mlp

GLOBAL_BATCH = 16


def build(seed: int = 0) -> tuple[keras.Model, keras.optimizers.Optimizer]:
    keras.utils.set_random_seed(seed)
    model = mlp.mlp(input_shape=(8,), num_classes=3, hidden=(5,), kernel_regularizer=keras.regularizers.L2(1e-2))
    optimizer = keras.optimizers.SGD(0.5)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"image": rng.standard_normal((GLOBAL_BATCH, 8)).astype(np.float32),
            "label": rng.integers(0, 3, GLOBAL_BATCH).astype(np.int32)}


def test_two_replica_update_equals_single_device_update_on_the_global_batch(mirrored_strategy):
    model, optimizer = build()
    single_sums = steps.train_step(model, optimizer, {k: tf.constant(v) for k, v in batch().items()}, GLOBAL_BATCH)
    expected = [v.numpy() for v in model.trainable_variables]

    strategy = mirrored_strategy
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        mirrored_model, mirrored_optimizer = build()
    full = batch()
    halves = strategy.experimental_distribute_values_from_function(
        lambda ctx: {k: v[ctx.replica_id_in_sync_group::2] for k, v in full.items()})
    per_replica = strategy.run(tf.function(lambda b: steps.train_step(mirrored_model, mirrored_optimizer, b,
                                                                      GLOBAL_BATCH)), args=(halves,))
    sums = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    initial = build()[0].trainable_variables
    for got, want, start in zip(mirrored_model.trainable_variables, expected, initial):
        assert not np.allclose(want, start.numpy()), "the update must move the weights"
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-6)
    for key in steps.METRIC_KEYS:
        np.testing.assert_allclose(sums[key].numpy(), single_sums[key].numpy(), rtol=1e-6)
    assert float(sums["count"]) == GLOBAL_BATCH


def test_eval_step_counts_only_unmasked_examples():
    model, _ = build()
    data = {k: tf.constant(v) for k, v in batch().items()}
    full = steps.eval_step(model, data)
    mask = np.zeros(GLOBAL_BATCH, np.float32)
    mask[:5] = 1.0
    head = steps.eval_step(model, {k: v[:5] for k, v in data.items()})
    masked = steps.eval_step(model, dict(data, mask=tf.constant(mask)))
    assert float(full["count"]) == GLOBAL_BATCH and float(masked["count"]) == 5
    for key in steps.METRIC_KEYS:
        np.testing.assert_allclose(masked[key].numpy(), head[key].numpy(), rtol=1e-6)


def test_finalize_divides_once():
    assert steps.finalize({"loss_sum": 3.0, "correct": 2.0, "count": 4.0}) == {
        "loss": 0.75, "accuracy": 0.5, "examples": 4.0}


@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
def test_overflowing_scaled_gradients_are_skipped_not_failed(strategy_name, request):
    """mixed_float16: gradients of the scaled loss overflow while the loss scale is too high; Keras'
    LossScaleOptimizer skips those updates and lowers the scale, so the loop must not call them
    non-finite; and on 2 replicas (where Keras alone let one replica's Inf through) no weight goes bad."""
    from mwloop import loop
    strategy = (request.getfixturevalue("mirrored_strategy") if strategy_name == "mirrored"
                else tf.distribute.get_strategy())
    keras.mixed_precision.set_global_policy("mixed_float16")  # conftest resets it after the test
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = mlp.mlp(input_shape=(8,), num_classes=3, hidden=(5,))
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0 ** 30)
        optimizer.build(model.trainable_variables)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(batch()).repeat())
    train_loop = loop.make_train_loop(strategy, model, optimizer, global_batch_size=GLOBAL_BATCH)
    sums = train_loop(iter(dataset), tf.constant(20))
    assert float(sums["nonfinite"]) == 0 and np.isfinite(float(sums["loss_sum"]))
    assert float(optimizer.dynamic_scale.numpy()) < 2.0 ** 30, "the scale must have come down: updates overflowed"
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
