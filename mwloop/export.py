"""SavedModel export of a trained model with the task's serving endpoints."""

from __future__ import annotations

import keras
import tensorflow as tf

from mwloop.task import Task, TaskError


def export(model: keras.Model, task: Task, directory: str) -> str:
    """Writes `model`'s weights as a SavedModel in `directory` with `task.serving_endpoints`; returns it.

    The export reads the trained weights into a fresh, undistributed copy of the
    architecture (`task.build_model()` outside any strategy scope), so the
    SavedModel holds plain variables whatever strategy trained them.
    """
    clone = task.build_model()
    clone.set_weights(model.get_weights())
    endpoints = task.serving_endpoints(clone)
    if not endpoints:
        raise TaskError(f"task {type(task).__name__}: serving_endpoints returned none; return at least one, "
                        f"or set config.export=False")
    archive = keras.export.ExportArchive()
    archive.track(clone)
    for name, (function, input_signature) in endpoints.items():
        archive.add_endpoint(name, function, input_signature=input_signature)
    tf.io.gfile.makedirs(directory)
    archive.write_out(directory, verbose=False)
    return directory
