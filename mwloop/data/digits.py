"""scikit-learn's handwritten digits, in memory: the built-in dataset that needs no download."""

from __future__ import annotations

import ml_collections
import numpy as np
import tensorflow as tf

from mwloop.data.source import Source, arrays_source, split


def digits(cfg: ml_collections.ConfigDict) -> Source:
    """scikit-learn's 1,797 real 8x8 handwritten digits (shipped with the package, no download)."""
    # Imported here: only this source needs sklearn.
    from sklearn.datasets import load_digits
    data = load_digits()
    images = (data.images.astype(np.float32) / 16.0)[..., None]
    if cfg.get("flatten", False):
        images = images.reshape(len(images), -1)
    labels = data.target.astype(np.int32)
    train, evaluation = split(images, labels, cfg.eval_fraction, cfg.split_seed)
    shape = images.shape[1:]

    def decode_image(encoded: tf.Tensor) -> tf.Tensor:
        """A grey PNG/JPEG of a digit (white ink on black, any size) as the model's input."""
        image = tf.image.resize(tf.image.decode_image(encoded, channels=1, expand_animations=False), (8, 8))
        return tf.reshape(image / 255.0, shape)

    return arrays_source("digits", train, evaluation, num_classes=10, decode_image=decode_image,
                         threads=cfg.get("threads", 0))
