"""Asynchronous checkpoint writes (`config.train.async_checkpoint`): training goes on while the checkpoint is
written, and nothing names it before it is complete.

TensorFlow's own means do the work. `tf.train.CheckpointOptions(enable_async=True)` copies every variable to
host memory (the only part that blocks the loop) and writes the copies from a thread of its own. A
`tf.train.CheckpointManager.save` given those options records the checkpoint in the `checkpoint` state file and
deletes the old ones from that thread, in a write callback, only after the files are written
(torchtitan#930 is what happens otherwise). mwloop's own lookup finds checkpoints by `ckpt-N.index`, which
TensorFlow writes last. So `tf.train.latest_checkpoint`, the rotation and a rerun only ever see complete
checkpoints; the caller learns that a write is durable from `wait` (or `done`) and only then tells anyone.

Why a fresh `tf.train.Checkpoint` (and manager) per write: TensorFlow's helper copies the variables of every
later write of the same Checkpoint in a `tf.function`, and Keras 3's variables make a new `tf.Variable` in that
copy each time (`_copy_trackable_to_cpu` in keras/src/backend/tensorflow/core.py), which a `tf.function` refuses
("tf.function only supports singleton tf.Variables created on the first call"). The first write of a Checkpoint
copies eagerly and works, so every write here is a first write. A fresh manager reads the rotation from the
state file its predecessor wrote. The price: the host copies are allocated for each write (BENCHMARKS.md).
"""

from __future__ import annotations

import atexit
import threading

import tensorflow as tf


class AsyncWrite:
    """One checkpoint being written in the background: `ckpt-<step>` in `directory`, rotated to `max_to_keep`."""

    def __init__(self, trackables: dict, directory: str, step: int, max_to_keep: int):
        """Copies the state (blocking) and starts writing it; returns while the write goes on."""
        self.step, self.directory = int(step), directory
        self._written = threading.Event()
        self._checkpoint = tf.train.Checkpoint(**trackables)
        _ = self._checkpoint.save_counter  # eagerly: made the same way on every worker
        manager = tf.train.CheckpointManager(self._checkpoint, directory, max_to_keep=max_to_keep)
        # Callbacks run in the writing thread after the files are written; the manager appends its own
        # (state file, rotation) after ours, and `wait` joins both.
        options = tf.train.CheckpointOptions(enable_async=True,
                                             experimental_write_callbacks=[lambda path: self._written.set()])
        manager.save(checkpoint_number=self.step, options=options)

    def done(self) -> bool:
        """Whether the files are written (`wait` then returns at once)."""
        return self._written.is_set()

    def wait(self) -> None:
        """Blocks until the write and its commit (state file, rotation) ended; raises the write's error.
        Releases TensorFlow's helper: its thread would wait for a next write that never comes and its exit
        hook would keep the host copies of the whole state alive until the process exits."""
        checkpoint, self._checkpoint = self._checkpoint, None
        if checkpoint is None:
            return
        checkpoint.sync()
        helper = checkpoint._async_checkpointer_impl  # noqa: SLF001 -- no public way to end its thread
        if helper is not None:
            atexit.unregister(helper._join_async_save_thread)  # noqa: SLF001
            helper._join_async_save_thread()  # noqa: SLF001 -- ends the thread; raises the write's error
