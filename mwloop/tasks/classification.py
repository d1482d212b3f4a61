"""Image classification: the built-in datasets (`config.dataset.name`) and models (`config.model.name`),
sparse cross-entropy (with optional label smoothing) and accuracy, on the public Task API."""

from __future__ import annotations

import functools

import keras
import numpy as np
import tensorflow as tf

from mwloop import models
from mwloop.data import Source, get_source
from mwloop.step import graph_checks
from mwloop.task import Endpoint, Sums, Task


class ImageClassification(Task):
    """Batches {"image", "label"}; the model returns logits. Reports loss and accuracy."""

    def __init__(self, config):
        super().__init__(config)
        self._source: Source | None = None

    @property
    def source(self) -> Source:
        """The dataset, loaded once, on first use."""
        if self._source is None:
            self._source = get_source(self.config.dataset)
            for split, arrays in (("train", self._source.train_arrays), ("eval", self._source.eval_arrays)):
                # Labels in memory: checked once here, not in every step.
                if arrays is not None:
                    _check_labels(arrays["label"], self._source.num_classes, split)
        return self._source

    def build_model(self) -> keras.Model:
        return models.build(self.config.model, input_shape=self.source.input_shape,
                            num_classes=self.source.num_classes, weight_decay=self.config.optimizer.weight_decay)

    def train_arrays(self) -> dict[str, np.ndarray] | None:
        return self.source.train_arrays

    def train_records(self):
        return self.source.train_records

    def eval_arrays(self) -> dict[str, np.ndarray] | None:
        return self.source.eval_arrays

    def eval_sets(self):
        """With config.dataset.train_eval_examples = n > 0: "train", the first n training examples (the
        gap to "eval" shows over-fitting), reported as eval_train."""
        n = self.config.dataset.get("train_eval_examples", 0)
        arrays = self.source.train_arrays
        return {"train": {k: v[:n] for k, v in arrays.items()}} if n and arrays is not None else {}

    def train_dataset(self, ctx, *, global_batch_size, seed, start_step):
        return self.source.train_dataset_fn(global_batch_size, seed, start_step)(ctx)

    def eval_dataset(self, ctx, *, global_batch_size):
        return self.source.eval_dataset_fn(global_batch_size)(ctx)

    def forward(self, model, batch, training):
        return tf.cast(model(batch["image"], training=training), tf.float32)

    def loss(self, batch, outputs):
        # A label the model has no class for is one line naming it (not a graph-execution traceback).
        labels = tf.cast(batch["label"], tf.int32)
        # File-backed data: only the step sees its labels.
        if self.source.train_arrays is None:
            labels = graph_checks.assert_labels_in_range(labels, tf.shape(outputs)[-1])
        smoothing = self.config.train.label_smoothing
        if smoothing:
            return keras.losses.categorical_crossentropy(tf.one_hot(labels, tf.shape(outputs)[-1]), outputs,
                                                         from_logits=True, label_smoothing=smoothing)
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def metric_sums(self, batch, outputs, weights) -> Sums:
        correct = tf.equal(tf.argmax(outputs, -1, output_type=tf.int32), tf.cast(batch["label"], tf.int32))
        return {"correct": tf.reduce_sum(tf.cast(correct, tf.float32) * weights)}

    def finalize(self, sums):
        return {"accuracy": sums["correct"] / sums["weight_sum"] if sums["weight_sum"] else 0.0}

    def serving_endpoints(self, model) -> dict[str, Endpoint]:
        """`serve(images)`: a float batch shaped like the training inputs; `serve_bytes(encoded)`:
        PNG/JPEG bytes with the eval preprocessing (datasets that have it). Both return class
        probabilities."""
        def probabilities(images):
            return tf.nn.softmax(tf.cast(model(images, training=False), tf.float32))

        endpoints = {"serve": (probabilities, [tf.TensorSpec([None, *self.source.input_shape], tf.float32,
                                                             name="images")])}
        if self.source.decode_image is not None:
            decode = functools.partial(tf.map_fn, self.source.decode_image, fn_output_signature=tf.float32)
            endpoints["serve_bytes"] = (lambda encoded: probabilities(decode(encoded)),
                                        [tf.TensorSpec([None], tf.string, name="encoded")])
        return endpoints


def _check_labels(labels: np.ndarray, num_classes: int, split: str) -> None:
    """In-memory labels against the model's classes: one line naming the first bad one."""
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        raise graph_checks.DataCheckError(
            f"{split} label {int(labels[bad.argmax()])} is outside the model's {num_classes} classes "
            f"(0..{num_classes - 1}); check the data or the model's number of classes")
