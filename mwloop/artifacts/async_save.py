"""Asynchronous checkpoint writes (`config.train.async_checkpoint`): training goes on while the checkpoint is
written, and nothing names it before it is complete.

TensorFlow's own means do the work. `tf.train.CheckpointOptions(enable_async=True)` snapshots every variable
into host copies (the only part that blocks the loop: the copies are allocated once, at the first write, and
share buffers with the variables until training changes them) and writes the copies from a thread of its own.
A `tf.train.CheckpointManager.save` given those options records the checkpoint in the `checkpoint` state file
and deletes old ones in a write callback, in that thread, only after the files are written (torchtitan#930 is
what happens otherwise). mwloop's own lookup finds checkpoints by `ckpt-N.index`, which TensorFlow writes
last. So `tf.train.latest_checkpoint`, the rotation and a rerun only ever see complete checkpoints, and the
caller learns from `wait` that a write is durable before it tells anyone.

One fix for Keras 3 (`_keras_copies_reused`): TensorFlow copies the variables of every write after the first in
a `tf.function`, and each Keras variable's `_copy_trackable_to_cpu` (keras/src/backend/tensorflow/core.py) makes
a new `tf.Variable` there at every call, which a `tf.function` refuses at the second write ("tf.function only
supports singleton tf.Variables created on the first call"). During a write, a Keras variable's copy is the host
copy TensorFlow keeps for the `tf.Variable` it wraps (the same tensor, under the same checkpoint key), so every
write assigns into the same copies. Measured against the other ways (BENCHMARKS.md): a fresh
`tf.train.Checkpoint` per write also works, but allocates the copies and traces the save function again each
time: on ResNet-50 it blocked longer than a synchronous save.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import keras
import tensorflow as tf


class AsyncWriter:
    """Writes a `tf.train.Checkpoint`'s checkpoints in TensorFlow's background thread, one write in flight.

    Attributes:
      step: the step of the write in flight (None: nothing in flight).
    """

    def __init__(self, checkpoint: tf.train.Checkpoint):
        self._checkpoint = checkpoint
        self.step: int | None = None
        self._written = threading.Event()

    def start(self, manager: tf.train.CheckpointManager, step: int) -> None:
        """Snapshots the state (blocking) and starts writing `ckpt-<step>` through `manager` (its rotation and
        state file move once the files are written); call `wait` first if a write is in flight."""
        if self.step is not None:
            raise RuntimeError(f"the write of step {self.step} is still in flight; wait for it first")
        written = self._written = threading.Event()
        # Callbacks run in the writing thread after the files are written; the manager appends its own
        # (state file, rotation) after this one, and `wait` joins both.
        options = tf.train.CheckpointOptions(enable_async=True,
                                             experimental_write_callbacks=[lambda path: written.set()])
        with _keras_copies_reused():
            manager.save(checkpoint_number=step, options=options)
        self.step = int(step)

    def done(self) -> bool:
        """Whether no write is in flight or its files are written (`wait` then returns at once)."""
        return self.step is None or self._written.is_set()

    def wait(self) -> int | None:
        """Blocks until the write in flight and its commit (state file, rotation) ended; returns its step (None:
        nothing was in flight). Raises the write's error."""
        step, self.step = self.step, None
        if step is None:
            return None
        self._checkpoint.sync()
        # `sync` does not raise what the thread caught (the next write would, naming no step): ask for it here.
        helper = getattr(self._checkpoint, "_async_checkpointer_impl", None)
        raise_error = getattr(helper, "_check_async_thread_error", None)
        if raise_error is not None:
            raise_error()
        if not self._written.is_set():
            raise OSError(f"the asynchronous write of step {step} ended without writing its files")
        return step


def _copy_owner() -> type | None:
    """The Keras class defining `_copy_trackable_to_cpu` (None if this Keras has none)."""
    return next((c for c in keras.Variable.__mro__ if "_copy_trackable_to_cpu" in vars(c)), None)


@contextlib.contextmanager
def _keras_copies_reused() -> Iterator[None]:
    """While TensorFlow snapshots the state: a Keras variable's host copy is its wrapped variable's."""
    owner = _copy_owner()
    if owner is None:
        yield
        return

    def reuse(self, object_map) -> None:
        self.value._copy_trackable_to_cpu(object_map)  # noqa: SLF001 -- made once, assigned at each write
        object_map[self] = object_map[self.value]

    original = owner._copy_trackable_to_cpu  # noqa: SLF001
    owner._copy_trackable_to_cpu = reuse  # noqa: SLF001
    try:
        yield
    finally:
        owner._copy_trackable_to_cpu = original  # noqa: SLF001
