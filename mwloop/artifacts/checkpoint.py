"""Checkpoints across workers: read from the chief's directory, write everywhere.

Every worker calls save, because saving distributed variables can run
collectives. The chief writes into `workdir/checkpoints`; every other worker
writes into its own temporary directory, removed after each save. Every worker
restores from the chief's directory, so all start from the same weights.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import tensorflow as tf
from absl import logging

from mwloop.artifacts import disk, files
from mwloop.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that exists but cannot be used for this run."""


def check_writable(directory: str) -> None:
    """Creates `directory` and writes a probe file in it, so a read-only or full disk fails at start
    in one line instead of at the first save, after training."""
    probe = os.path.join(directory, f".write-probe-{os.getpid()}")
    try:
        tf.io.gfile.makedirs(directory)
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("probe\n")
        tf.io.gfile.remove(probe)
    except (tf.errors.OpError, OSError) as e:
        raise CheckpointError(f"cannot write checkpoints to {directory} ({disk.reason(e)}); make it writable or "
                              f"use another --workdir") from None


def saved_checkpoints(directory: str) -> list[str]:
    """Checkpoint prefixes in `directory` (local or remote), newest step first (`files.saved_checkpoints`)."""
    return files.saved_checkpoints(directory, glob=tf.io.gfile.glob)


def mismatch(path: str, error: Exception, what: str, fix: str) -> CheckpointError:
    """The one-line error for a checkpoint of another model ("checkpoint PATH <what> (<why>); <fix>");
    the run ends with it."""
    # The half-done restore would print a warning per unmatched value when it is collected, after (and
    # burying) the one-line error; the run ends here, so TensorFlow's warnings have nothing left to say.
    tf.get_logger().setLevel("ERROR")
    return CheckpointError(f"checkpoint {path} {what} ({str(error).splitlines()[0][:200]}); {fix}")


class Checkpointer:
    """A `tf.train.Checkpoint` with a read manager (chief dir) and a write manager (own dir)."""

    def __init__(self, strategy: tf.distribute.Strategy, workdir: str, *, chief: bool, max_to_keep: int,
                 subdir: str = "checkpoints", **trackables):
        """`chief`: whether this process keeps what it saves (the others save to a temporary directory, since
        saving runs collectives, and delete it)."""
        self.directory = os.path.join(workdir, subdir)
        self.checkpoint = tf.train.Checkpoint(**trackables)
        # Created eagerly on every worker: a lazily created save counter would
        # exist on the chief only and desynchronise the collectives.
        _ = self.checkpoint.save_counter
        self.strategy = strategy
        self.is_chief = chief
        self.read_manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep=max_to_keep)

    def restore(self) -> str | None:
        """Restores the newest usable checkpoint of the chief's directory; returns its path.

        A checkpoint that cannot be read (truncated, corrupt) is skipped with a
        warning for the one before it; one written by a different model is an error.
        """
        candidates = saved_checkpoints(self.directory)
        for i, path in enumerate(candidates):
            try:
                # Every object of this run must come from the checkpoint; values it holds that this run has
                # no object for (an action's state, when the action is off now) are fine.
                self.checkpoint.restore(path).assert_existing_objects_matched().expect_partial()
                return path
            except (tf.errors.OpError, IndexError, OSError) as e:  # truncated or corrupt files
                fallback = candidates[i + 1] if i + 1 < len(candidates) else "nothing (no older checkpoint)"
                logging.warning("checkpoint %s is unreadable (%s); falling back to %s",
                                path, str(e).splitlines()[0][:200], fallback)
            except (ValueError, AssertionError) as e:
                raise mismatch(path, e, "does not match this model",
                               "use a fresh --workdir or the config that wrote it") from None
        if candidates:
            raise CheckpointError(f"no readable checkpoint in {self.directory}; move it away to start fresh")
        return None

    def save(self, step: int) -> None:
        """Saves on every worker (a collective); only the chief's copy is kept.

        A failed write (disk full, file-size limit, permissions) is a CheckpointError naming the cause;
        the checkpoints already written stay readable, and a rerun resumes from the newest of them.
        """
        try:
            self._save(step)
        except (tf.errors.UnavailableError, tf.errors.CancelledError):
            raise  # a task that went away (a ps: mwloop.loop.ps names it), not a problem of the disk
        except (tf.errors.OpError, OSError) as e:
            previous = saved_checkpoints(self.directory)
            raise CheckpointError(
                f"saving the checkpoint of step {step} to {self.directory} failed ({disk.reason(e)}); "
                f"{disk.remedy(e)}, then rerun: it resumes from "
                f"{os.path.basename(previous[0]) if previous else 'the start'}") from None

    def _save(self, step: int) -> None:
        if self.is_chief:
            self.read_manager.save(checkpoint_number=step)
            return
        # A fresh temporary directory per save, made here rather than at start, so
        # a worker that dies before saving leaves nothing behind.
        write_dir = tempfile.mkdtemp(prefix=f"mwloop-worker{self.strategy.cluster_resolver.task_id}-")
        try:
            tf.train.CheckpointManager(self.checkpoint, write_dir, max_to_keep=1).save(checkpoint_number=step)
        finally:
            shutil.rmtree(write_dir, ignore_errors=True)
