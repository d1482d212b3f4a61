"""SavedModel export with serving signatures for float image batches and encoded image bytes."""

from __future__ import annotations

import keras
import tensorflow as tf

from mwloop.data import Source


def export(model: keras.Model, clone: keras.Model, directory: str, source: Source) -> str:
    """Writes `model`'s weights as a SavedModel in `directory`; returns it.

    `clone` is a fresh, undistributed copy of the architecture: the export reads
    the trained weights into it, so the SavedModel holds plain variables
    whatever strategy trained them. Endpoints: `serve(images)` takes a float
    batch shaped like the training inputs, `serve_bytes(encoded)` takes encoded
    images (PNG/JPEG) and applies the eval preprocessing; both return class
    probabilities.
    """
    clone.set_weights(model.get_weights())
    archive = keras.export.ExportArchive()
    archive.track(clone)

    def probabilities(images: tf.Tensor) -> tf.Tensor:
        return tf.nn.softmax(tf.cast(clone(images, training=False), tf.float32))

    archive.add_endpoint("serve", probabilities,
                         input_signature=[tf.TensorSpec([None, *source.input_shape], tf.float32, name="images")])
    if source.decode_image is not None:
        decode = source.decode_image
        archive.add_endpoint(
            "serve_bytes",
            lambda encoded: probabilities(tf.map_fn(decode, encoded, fn_output_signature=tf.float32)),
            input_signature=[tf.TensorSpec([None], tf.string, name="encoded")])
    tf.io.gfile.makedirs(directory)
    archive.write_out(directory, verbose=False)
    return directory
