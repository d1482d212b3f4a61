"""Step functions, tested alone: global-batch loss scaling and masked eval sums."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mwloop import testing
from mwloop.config import base as config_base
from mwloop.models import mlp
from mwloop.step import steps
from mwloop.tasks.classification import ImageClassification

GLOBAL_BATCH = 16


class TinyClassification(ImageClassification):
    """The built-in classification task on 8 features and 3 classes, with an L2 penalty."""

    def build_model(self):
        return mlp.mlp(input_shape=(8,), num_classes=3, hidden=(5,), kernel_regularizer=keras.regularizers.L2(1e-2))


def tiny_task() -> TinyClassification:
    config = config_base.base_config()
    config.optimizer.update({"name": "sgd", "learning_rate": 0.5, "schedule": "constant", "momentum": 0.0})
    return TinyClassification(config)


def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"image": rng.standard_normal((GLOBAL_BATCH, 8)).astype(np.float32),
            "label": rng.integers(0, 3, GLOBAL_BATCH).astype(np.int32)}


@pytest.mark.slow
def test_two_replica_update_equals_single_device_update_on_the_global_batch(mirrored_strategy):
    figures = testing.assert_replicas_agree(tiny_task(), batch(), num_replicas=2, num_steps=3)
    assert set(figures) == {"weights", "loss", "examples", "accuracy"} and figures["weights"] < 1e-6
    assert testing.assert_loss_scaled_by_global_batch(tiny_task(), batch(), num_replicas=2) < 1e-6


@pytest.mark.slow
def test_a_loss_scaled_per_replica_fails_the_check(mirrored_strategy):
    """The check can fail: a loss divided by each replica's own batch is twice too large on 2 replicas."""
    class PerReplicaMean(TinyClassification):
        def loss(self, batch, outputs):
            losses = super().loss(batch, outputs)
            return losses * GLOBAL_BATCH / tf.cast(tf.shape(losses)[0], tf.float32)

    with pytest.raises(AssertionError, match="not scaled by the global count"):
        testing.assert_loss_scaled_by_global_batch(PerReplicaMean(tiny_task().config), batch(), num_replicas=2)
    with pytest.raises(AssertionError, match="2 replicas differ from 1"):
        testing.assert_replicas_agree(PerReplicaMean(tiny_task().config), batch(), num_replicas=2)


def test_eval_step_counts_only_unmasked_examples():
    task = tiny_task()
    model = task.build_model()
    data = {k: tf.constant(v) for k, v in batch().items()}
    full = steps.eval_step(task, model, data)
    mask = np.zeros(GLOBAL_BATCH, np.float32)
    mask[:5] = 1.0
    head = steps.eval_step(task, model, {k: v[:5] for k, v in data.items()})
    masked = steps.eval_step(task, model, dict(data, mask=tf.constant(mask)))
    assert float(full["examples"]) == GLOBAL_BATCH and float(masked["examples"]) == 5
    assert set(masked) == {"loss_sum", "weight_sum", "examples", "correct"}
    for key in masked:
        np.testing.assert_allclose(masked[key].numpy(), head[key].numpy(), rtol=1e-6)


def test_finalize_divides_once():
    sums = {"loss_sum": 3.0, "weight_sum": 4.0, "examples": 4.0, "correct": 2.0}
    assert steps.finalize(tiny_task(), sums) == {"loss": 0.75, "examples": 4.0, "accuracy": 0.5}


@pytest.mark.slow
@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
def test_overflowing_scaled_gradients_are_skipped_not_failed(strategy_name, request):
    """mixed_float16: gradients of the scaled loss overflow while the loss scale is too high; Keras'
    LossScaleOptimizer skips those updates and lowers the scale, so the loop must not call them
    non-finite; and on 2 replicas (where Keras alone let one replica's Inf through) no weight goes bad."""
    from mwloop.loop import loops as loop
    strategy = (request.getfixturevalue("mirrored_strategy") if strategy_name == "mirrored"
                else tf.distribute.get_strategy())
    keras.mixed_precision.set_global_policy("mixed_float16")  # conftest resets it after the test
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = mlp.mlp(input_shape=(8,), num_classes=3, hidden=(5,))
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0 ** 30)
        optimizer.build(model.trainable_variables)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(batch()).repeat())
    train_loop = loop.make_train_loop(strategy, tiny_task(), model, optimizer, global_batch_size=GLOBAL_BATCH)
    sums, status = train_loop(iter(dataset), tf.constant(20))
    assert float(status["nonfinite"]) == 0 and np.isfinite(float(sums["loss_sum"]))
    assert float(optimizer.dynamic_scale.numpy()) < 2.0 ** 30, "the scale must have come down: updates overflowed"
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
