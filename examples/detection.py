"""A small detection-style task with a loss of three parts, on generated data, on mwloop's public Task API.

Each example is a padded set of up to `MAX_OBJECTS` objects (6 features each; between 1 and MAX_OBJECTS are
real, the rest zeros). Per object the model predicts a class (3 classes) and a box (4 numbers); per example it
predicts how many objects there are. The loss has three parts with *different* global normalisers, as in
detection (class + box) and most multi-task models:

- `cls`: cross-entropy per real object, divided by the global number of real objects ("weights");
- `box`: L1 error of the 4 box numbers per real object, divided by the global number of real objects;
- `count`: squared error of the object count per example, divided by the global batch ("batch").

The total is their sum weighted by `config.loss_weights` (sweepable). mwloop reports `loss/cls`,
`loss/box`, `loss/count` and the total `loss`; `metric_sums` adds object accuracy (per-object weights) and
the count's MAE (per-example `mask`, exact with eval padding).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from mwloop import LossPart, Sums, Task

MAX_OBJECTS, FEATURES, NUM_CLASSES = 8, 6, 3


def generate(num_examples: int, seed: int) -> dict[str, np.ndarray]:
    """Padded object sets: "objects" [n, MAX_OBJECTS, FEATURES], "present" (1 for a real object), per-object
    "label" and "box" [n, MAX_OBJECTS, 4] (linear in the features, with noise), and "count" [n]."""
    rng = np.random.default_rng(seed)
    count = rng.integers(1, MAX_OBJECTS + 1, num_examples)
    present = (np.arange(MAX_OBJECTS)[None, :] < count[:, None]).astype(np.float32)
    objects = rng.standard_normal((num_examples, MAX_OBJECTS, FEATURES)).astype(np.float32) * present[..., None]
    projection = np.random.default_rng(1234).standard_normal((FEATURES, NUM_CLASSES + 4)).astype(np.float32)
    scores = objects @ projection
    box = scores[..., NUM_CLASSES:] + 0.1 * rng.standard_normal((num_examples, MAX_OBJECTS, 4)).astype(np.float32)
    return {"objects": objects, "present": present, "label": scores[..., :NUM_CLASSES].argmax(-1).astype(np.int32),
            "box": (box * present[..., None]).astype(np.float32), "count": count.astype(np.float32)}


class Detection(Task):
    """Class, box and count heads over padded object sets; reads `config.dataset` (sizes, seed),
    `config.model.hidden` and `config.loss_weights` (through the inherited `loss_weights`)."""

    def __init__(self, config):
        super().__init__(config)
        self._data: dict[str, dict[str, np.ndarray]] = {}

    def train_arrays(self) -> dict[str, np.ndarray]:
        if "train" not in self._data:  # mwloop asks more than once: generate once
            self._data["train"] = generate(self.config.dataset.num_train_examples, self.config.dataset.seed)
        return self._data["train"]

    def eval_arrays(self) -> dict[str, np.ndarray]:
        if "eval" not in self._data:
            self._data["eval"] = generate(self.config.dataset.num_eval_examples, self.config.dataset.seed + 1)
        return self._data["eval"]

    def build_model(self) -> keras.Model:
        """Per-object layers (Dense on the last axis) and a pooled count head; outputs a dict."""
        objects = keras.Input((MAX_OBJECTS, FEATURES), name="objects")
        hidden = keras.layers.Dense(self.config.model.hidden, activation="relu")(objects)
        pooled = keras.layers.GlobalAveragePooling1D()(hidden)  # padding objects are zeros: a count signal
        outputs = {"cls": keras.layers.Dense(NUM_CLASSES, name="cls", dtype="float32")(hidden),  # float32 heads
                   "box": keras.layers.Dense(4, name="box", dtype="float32")(hidden),  # under mixed precision
                   "count": keras.layers.Dense(1, name="count", dtype="float32")(pooled)[:, 0]}
        return keras.Model(objects, outputs, name="detection")

    def forward(self, model, batch, training):
        return model(batch["objects"], training=training)

    def loss(self, batch, outputs) -> dict[str, LossPart]:
        """Three unreduced parts, each with its own global normaliser (mwloop divides)."""
        present = batch["present"]
        cls = keras.losses.sparse_categorical_crossentropy(batch["label"], outputs["cls"], from_logits=True)
        box = tf.reduce_sum(tf.abs(outputs["box"] - batch["box"]), axis=-1)
        count = tf.square(outputs["count"] - batch["count"])
        return {"cls": LossPart(cls, present, "weights"),
                "box": LossPart(box, present, "weights"),
                "count": LossPart(count, normalizer="batch")}

    def metric_sums(self, batch, outputs, weights, mask=None) -> Sums:
        """Object accuracy over real objects (weights["cls"]: present x eval padding) and the count's absolute
        error over real examples (`mask`, one weight per example)."""
        correct = tf.cast(tf.equal(tf.argmax(outputs["cls"], -1, output_type=tf.int32), batch["label"]), tf.float32)
        return {"correct": tf.reduce_sum(correct * weights["cls"]),
                "count_abs_error": tf.reduce_sum(tf.abs(outputs["count"] - batch["count"]) * mask)}

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        objects = sums["weight_sum/cls"]
        return {"accuracy": sums["correct"] / objects if objects else 0.0,
                "count_mae": sums["count_abs_error"] / sums["examples"] if sums["examples"] else 0.0}
