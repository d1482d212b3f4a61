"""The ResNets' synchronized batch normalization (config model.sync_batch_norm): a replica's training batch is
normalised by the global batch's statistics, so a step's math does not depend on how many replicas share it."""

from __future__ import annotations

import json

import keras
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from mwloop import models
from mwloop.artifacts import resume_check
from mwloop.config import base

GLOBAL_BATCH = 8


def _images() -> np.ndarray:
    """A global batch whose halves have clearly different statistics (each replica's own would differ)."""
    images = np.random.default_rng(0).normal(size=(GLOBAL_BATCH, 4, 4, 2)).astype(np.float32)
    images[GLOBAL_BATCH // 2:] = 3 * images[GLOBAL_BATCH // 2:] + 2
    return images


def _on_two_replicas(strategy, sync_batch_norm: bool, images: np.ndarray) -> tuple[np.ndarray, keras.Model]:
    """The training-mode logits of a small ResNet built in `strategy`'s scope, each replica given its half of the
    global batch, concatenated in replica order; and the model."""
    with strategy.scope():
        model = models.resnet.small_resnet(input_shape=images.shape[1:], num_classes=3, widths=(4, 4),
                                           sync_batch_norm=sync_batch_norm)
    half = GLOBAL_BATCH // 2
    rows = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(images[ctx.replica_id_in_sync_group * half:][:half]))
    logits = tf.function(lambda x: strategy.run(lambda rows: model(rows, training=True), args=(x,)))(rows)
    return np.concatenate([np.asarray(v) for v in strategy.experimental_local_results(logits)]), model


def _on_one_replica(model: keras.Model, images: np.ndarray) -> np.ndarray:
    """The same weights' training-mode logits on the whole batch, one replica (no strategy)."""
    alone = models.resnet.small_resnet(input_shape=images.shape[1:], num_classes=3, widths=(4, 4),
                                       sync_batch_norm=False)
    alone.set_weights(model.get_weights())
    return np.asarray(alone(tf.constant(images), training=True))


@pytest.mark.parametrize("sync_batch_norm", [True, False])
def test_synchronized_batch_norm_on_two_replicas_is_one_replica_on_the_whole_batch(mirrored_strategy,
                                                                                   sync_batch_norm):
    images = _images()
    split, model = _on_two_replicas(mirrored_strategy, sync_batch_norm, images)
    whole = _on_one_replica(model, images)
    difference = float(np.max(np.abs(split - whole)) / np.max(np.abs(whole)))
    if sync_batch_norm:
        # Float rounding only: the synchronized variance is E[x^2] - E[x]^2 of all-reduced sums.
        assert difference < 1e-5, difference
    else:
        assert difference > 1e-2, difference  # each replica normalised by its own half: another function


def test_the_config_knob_reaches_every_batch_norm_layer_of_both_resnets():
    config = base.load("configs/resnet.py", "imagenet_records", {"model.sync_batch_norm": True, "model.width": 2,
                                                                 "model.blocks": (1, 1)}, check=False)
    small = ml_collections.ConfigDict({"name": "resnet_small", "widths": (2,), "sync_batch_norm": True})
    for model_config in (config.model, small):
        model = models.build(model_config, input_shape=(8, 8, 3), num_classes=3, weight_decay=0.0)
        norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
        assert norms and all(layer.synchronized for layer in norms), model.name
    default = base.load("configs/resnet.py", "imagenet_records", check=False)
    assert default.model.sync_batch_norm is False
    # It changes the math: a resume that turns it on or off is a change to the run (the model section's policy).
    recorded = json.loads(default.to_json_best_effort())
    assert set(resume_check.changes(config, recorded, 100)) >= {"model.sync_batch_norm"}

