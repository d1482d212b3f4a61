"""A tiny task for unit tests of the loop, the update and evaluation: when a test needs "some task", this one
traces and trains in a fraction of the built-in image classification's time.

Three classes from 8 random features (a few hundred examples made with numpy, the same on every call), a
two-layer MLP, per-example cross-entropy and an accuracy from additive sums. `tiny_config()` is
`mwloop.base_config(task=TinyTask)` with settings small enough for a Trainer run of a second or two.
"""

from __future__ import annotations

import keras
import ml_collections
import numpy as np
import tensorflow as tf

import mwloop

FEATURES, CLASSES = 8, 3
NUM_TRAIN, NUM_EVAL = 256, 100


def arrays(num: int, seed: int) -> dict[str, np.ndarray]:
    """`num` examples: standard normal features, labels a fixed function of the first two."""
    inputs = np.random.default_rng(seed).standard_normal((num, FEATURES)).astype(np.float32)
    label = (inputs[:, 0] > 0).astype(np.int32) + (inputs[:, 1] > 0.5).astype(np.int32)
    return {"inputs": inputs, "label": label}


class TinyTask(mwloop.Task):
    """3-way classification of 8 features: Dense(16, relu) -> Dense(3) logits."""

    def train_arrays(self):
        return arrays(NUM_TRAIN, seed=0)

    def eval_arrays(self):
        return arrays(NUM_EVAL, seed=1)

    def build_model(self):
        return keras.Sequential([keras.Input((FEATURES,), name="inputs"),
                                 keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(CLASSES)])

    def loss(self, batch, outputs):  # per example: mwloop divides by the global batch
        return keras.losses.sparse_categorical_crossentropy(batch["label"], outputs, from_logits=True)

    def metric_sums(self, batch, outputs, weights):  # weights mask eval padding
        correct = tf.cast(tf.equal(tf.argmax(outputs, -1, output_type=tf.int32), batch["label"]), tf.float32)
        return {"correct": tf.reduce_sum(correct * weights)}

    def finalize(self, sums):
        return {"accuracy": sums["correct"] / sums["examples"]}


def tiny_config(task: type = TinyTask, **overrides) -> ml_collections.ConfigDict:
    """base_config(task=task) for a short single-process run (SGD, constant rate, no export), with dotted-key
    `overrides` applied."""
    config = mwloop.base_config(task=task)
    config.name = "tiny"
    config.distribution.strategy = "default"
    config.train.update(global_batch_size=32, steps=20, steps_per_loop=10, log_every_steps=10,
                        eval_every_steps=20, checkpoint_every_steps=20)
    config.eval.global_batch_size = 32
    config.optimizer.update(name="sgd", learning_rate=0.1, schedule="constant", momentum=0.0, weight_decay=0.0,
                            warmup_steps=0)
    config.export = False
    config.update_from_flattened_dict(overrides)
    return config


def reference_metrics(model: keras.Model, data: dict[str, np.ndarray]) -> dict[str, float]:
    """Loss, accuracy and examples of `model` on `data` in plain numpy: what an eval must report."""
    logits = model(data["inputs"], training=False).numpy().astype(np.float64)
    logits -= logits.max(1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    label = data["label"]
    return {"loss": float(-log_probs[np.arange(len(label)), label].mean()),
            "accuracy": float((logits.argmax(1) == label).mean()), "examples": float(len(label))}
