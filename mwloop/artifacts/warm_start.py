"""Warm start: a fresh run's model weights from another run's checkpoint (config.init_checkpoint).

Checkpoint keys are paths in TensorFlow's object graph
("model/_functional/_operations/1/_kernel/..."), not Keras names, so the keys
of this run's model are found by walking the same graph breadth first, as
TensorFlow does when it names them; the name pattern matches Keras variable
paths ("dense_1/kernel"), what a user sees in `model.weights`.
"""

from __future__ import annotations

import collections
import os
import re

import keras
import tensorflow as tf
from absl import logging

from mwloop.artifacts import checkpoint
from mwloop.artifacts.checkpoint import CheckpointError

_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


def candidates(path: str) -> list[str]:
    """The checkpoint prefixes `path` names, newest first: those of a checkpoints folder or a run's workdir (the
    newest readable one is taken), or the prefix itself (".../ckpt-600")."""
    for directory in (path, os.path.join(path, "checkpoints")):
        if tf.io.gfile.isdir(directory):
            found = checkpoint.saved_checkpoints(directory)
            if found:
                return found
    if tf.io.gfile.exists(path + ".index"):
        return [path]
    raise CheckpointError(f"config.init_checkpoint={path!r} is not a checkpoint, a checkpoints folder or a run's "
                          f"workdir with one; give the path of another run's ckpt-N or workdir")


def object_keys(root: tf.train.Checkpoint) -> dict[int, str]:
    """id(object) -> its checkpoint key under `root`."""
    keys: dict[int, str] = {}
    seen = {id(root)}
    queue = collections.deque([(root, "")])
    # Breadth first: TensorFlow names each object by its first (shortest) path.
    while queue:
        obj, path = queue.popleft()
        for name, child in tf.train.TrackableView(obj).children(obj).items():
            if id(child) in seen:
                continue
            seen.add(id(child))
            child_path = f"{path}/{name}" if path else name
            keys[id(child)] = child_path + _VALUE
            queue.append((child, child_path))
    return keys


def load(model: keras.Model, root: tf.train.Checkpoint, path: str, include: str = ".*") -> int:
    """Copies the weights whose Keras path matches the regex `include` from the checkpoint at `path` into
    `model` (every worker reads the same file); returns how many. A missing or mis-shaped variable is a
    one-line CheckpointError naming it.

    `root` is this run's checkpoint: a key depends on every object in it (Keras 3 trainable weights are
    named under the optimizer, the shortest path to them), so another mwloop run's checkpoint has the same
    keys; a checkpoint of the model alone is read too.
    """
    try:
        pattern = re.compile(include)
    except re.error as e:
        raise CheckpointError(f"config.init_checkpoint_include={include!r} is not a regular expression ({e})") \
            from None
    chosen = [v for v in model.weights if pattern.search(v.path)]
    if not chosen:
        raise CheckpointError(f"config.init_checkpoint_include={include!r} matches none of the model's weights "
                              f"(e.g. {', '.join(v.path for v in model.weights[:3])})")
    keys = [object_keys(root), object_keys(tf.train.Checkpoint(model=model))]
    prefixes = candidates(path)
    # Another run's rotation may delete its newest checkpoint while it is read: the one before it is taken.
    found = checkpoint.first_readable(prefixes, lambda prefix: _values(prefix, chosen, keys))
    if found is None:
        raise CheckpointError(f"config.init_checkpoint: no readable checkpoint in {', '.join(prefixes)}; give "
                              f"another run's ckpt-N or workdir")
    prefix, values = found
    # Only after every value is read: a failed warm start changes nothing.
    for variable, value in zip(chosen, values):
        variable.assign(value)
    logging.info("warm start: %d of %d weights from %s", len(chosen), len(model.weights), prefix)
    return len(chosen)


def _values(prefix: str, chosen: list, key_maps: list[dict[int, str]]) -> list:
    """The values of the `chosen` weights in the checkpoint at `prefix`, read whole before any is assigned. A
    missing or mis-shaped variable is a CheckpointError naming it; an unreadable file raises as TensorFlow does."""
    try:
        reader = tf.train.load_checkpoint(prefix)
    except ValueError as e:
        raise CheckpointError(f"config.init_checkpoint: cannot read {prefix} ({str(e).splitlines()[0][:200]})") \
            from None
    shapes = reader.get_variable_to_shape_map()
    keys = {id(v): next((c[id(v)] for c in key_maps if c.get(id(v)) in shapes), None) for v in chosen}
    for variable in chosen:
        key = keys.get(id(variable))
        if key not in shapes:
            raise CheckpointError(f"warm start: {prefix} has no value for {variable.path}; it holds another "
                                  f"model, or narrow config.init_checkpoint_include to the shared layers")
        if list(shapes[key]) != list(variable.shape):
            raise CheckpointError(f"warm start: {variable.path} is {tuple(variable.shape)} here but "
                                  f"{tuple(shapes[key])} in {prefix}; exclude it with "
                                  f"config.init_checkpoint_include")
    return [reader.get_tensor(keys[id(v)]) for v in chosen]
