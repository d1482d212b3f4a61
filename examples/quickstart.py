"""Bring your own task in one file: python -m mwloop.main --config=examples/quickstart.py"""

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_breast_cancer

import mwloop


class Tumours(mwloop.Task):
    """Benign or malignant from 30 measurements (scikit-learn's bundled breast cancer data)."""

    def _split(self, train: bool) -> dict[str, np.ndarray]:
        x, y = load_breast_cancer(return_X_y=True)
        x = (x - x.mean(0)) / x.std(0)
        keep = (np.arange(len(y)) % 5 != 0) == train  # every fifth example is held out
        return {"inputs": x[keep].astype(np.float32), "label": y[keep].astype(np.float32)}

    def train_arrays(self):
        return self._split(train=True)

    def eval_arrays(self):
        return self._split(train=False)

    def build_model(self):
        return keras.Sequential([keras.Input((30,), name="inputs"),
                                 keras.layers.Dense(self.config.hidden, activation="relu"),
                                 keras.layers.Dense(1)])

    def loss(self, batch, outputs):  # per example: mwloop divides by the global batch
        return keras.losses.binary_crossentropy(batch["label"][:, None], outputs, from_logits=True)

    def metric_sums(self, batch, outputs, weights):  # additive sums; weights mask eval padding
        correct = tf.cast((outputs[:, 0] > 0) == (batch["label"] > 0.5), tf.float32)
        return {"correct": tf.reduce_sum(correct * weights)}

    def finalize(self, sums):
        return {"accuracy": sums["correct"] / sums["examples"]}


def get_config(arg=None):
    config = mwloop.base_config(task=Tumours)
    config.name, config.hidden = "quickstart", 16
    config.train.update(global_batch_size=32, steps=300, steps_per_loop=50, log_every_steps=100,
                        eval_every_steps=100, checkpoint_every_steps=100)
    config.optimizer.update(name="adam", learning_rate=0.01, weight_decay=0.0)
    return config
