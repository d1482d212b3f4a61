"""Checkpoints across workers: read from the chief's directory, write everywhere.

Every worker calls save, because saving distributed variables can run
collectives. The chief writes into `workdir/checkpoints`; every other worker
writes into its own temporary directory, removed after each save's write (locked while in use: `scratch.py`
sweeps those a killed worker left). Every worker restores from the chief's directory, so all start from the
same weights.

The workdir is the run's truth: before each save the chief checks that the workdir and its lock are still
this run's (`workdir_lock.lost`), and with several workers one small all-reduce per save tells every worker,
so all stop together, in one line, saving nothing. Beside each checkpoint the chief keeps the config it was
trained with (`ckpt-N.config.json`, removed with it): the resume check compares with it, so deleting
config.json alone hides nothing. TensorFlow's `checkpoint` state file is rewritten from the checkpoint files
found before the first save, so a stale or planted one can never make the rotation delete files it names
outside the run.

With `async_writes` (config.train.async_checkpoint) a save copies the state and returns while the write goes
on (`async_save.py`), on every worker: the others' scratch directory lives until their write ended, or every
save would still hold up the whole cluster for the slowest worker's synchronous write. One write is in flight
at most: the next save, a `final` save (preemption, Ctrl-C), `restore` and `wait` first wait for it.
`checkpointed_step` names the newest checkpoint known complete.

Every reader of checkpoints (a resume, --mode=eval and export, the best checkpoint's export, the side-car, a warm
start) reads through `read_into` and `first_readable`: each attempt into a tf.train.Checkpoint of its own, and a
checkpoint that vanished or is half-written under the reader (a rotation deleting it mid-read) is skipped for the
one before it. A failed read never poisons the next: TensorFlow's restore into a reused root keeps, on failure,
the deferred restoration of what it creates lazily (its `save_counter`), so the next restore read the vanished
checkpoint again or found `save_counter` unmatched ("does not hold this config's model").
"""

from __future__ import annotations

import contextlib
import glob as globbing
import os
import re
from collections.abc import Callable, Iterator
from typing import TypeVar

import tensorflow as tf
from absl import logging

from mwloop.artifacts import async_save, disk, files, jsonl, scratch, workdir_lock
from mwloop.errors import UserError

_RECORD = re.compile(r"ckpt-(\d+)" + re.escape(files.CHECKPOINT_CONFIG))


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


# What a checkpoint that vanished or is half-written under its reader raises: skipped for the one before it.
UNREADABLE = (tf.errors.OpError, IndexError, OSError)
Read = TypeVar("Read")


def read_into(path: str, *, what: str = "does not match this model",
              fix: str = "use a fresh --workdir or the config that wrote it", **trackables) -> None:
    """Restores `trackables` (e.g. model=..., step=...) from the checkpoint at `path`, through a tf.train.Checkpoint
    made for this one read, so a failed read leaves nothing behind for the next. Every one of them must come from
    the checkpoint; values it holds that they have no object for (the optimizer's, for an evaluator) are fine.

    Raises:
      one of UNREADABLE: the checkpoint vanished or is half-written.
      CheckpointError: it holds another model: "checkpoint PATH <what> (<why>); <fix>" (`mismatch`).
    """
    try:
        tf.train.Checkpoint(**trackables).restore(path).assert_existing_objects_matched().expect_partial()
    except (ValueError, AssertionError) as e:
        raise mismatch(path, e, what, fix) from None


def first_readable(candidates: list[str], read: Callable[[str], Read]) -> tuple[str, Read] | None:
    """(path, `read(path)`) of the first of `candidates` (newest first) whose read does not raise UNREADABLE,
    each skipped one warned about with what comes next; None when none is readable. Other errors (another
    model) pass."""
    for i, path in enumerate(candidates):
        try:
            return path, read(path)
        except UNREADABLE as e:
            fallback = candidates[i + 1] if i + 1 < len(candidates) else "nothing (no older checkpoint)"
            logging.warning("checkpoint %s is unreadable (%s); falling back to %s",
                            path, str(e).splitlines()[0][:200], fallback)
    return None


def mismatch(path: str, error: Exception, what: str, fix: str) -> CheckpointError:
    """The one-line error for a checkpoint of another model ("checkpoint PATH <what> (<why>); <fix>");
    the run ends with it."""
    # The half-done restore would print a warning per unmatched value when it is collected, after (and
    # burying) the one-line error; the run ends here, so TensorFlow's warnings have nothing left to say.
    tf.get_logger().setLevel("ERROR")
    return CheckpointError(f"checkpoint {path} {what} ({str(error).splitlines()[0][:200]}); {fix}")


class Checkpointer:
    """A `tf.train.Checkpoint` with a read manager (chief dir) and a write manager (own dir).

    Attributes:
      checkpointed_step: the newest step this process saved and knows complete (None: none yet).
    """

    def __init__(self, strategy: tf.distribute.Strategy, workdir: str, *, chief: bool, max_to_keep: int,
                 subdir: str = "checkpoints", async_writes: bool = False,
                 why_lost: Callable[[], str | None] | None = None,
                 broadcast: Callable[[list[float]], list[bool]] | None = None, config_record: str | None = None,
                 **trackables):
        """A checkpointer of `trackables` into `workdir/subdir`.

        Args:
          chief: whether this process keeps what it saves (the others save to a temporary directory, since
            saving runs collectives, and delete it).
          async_writes: saves return while the write goes on.
          why_lost: asked on the chief before each save: why the workdir is no longer this run's, or None.
          broadcast: with several workers, gives every worker the chief's flags (the chief's `why_lost`).
          config_record: the run's config as JSON, written beside each checkpoint (`ckpt-N.config.json`).
        """
        self.directory = os.path.join(workdir, subdir)
        self.checkpoint = tf.train.Checkpoint(**trackables)
        # Restores read into a checkpoint of their own (`read_into`): a failed one never poisons this one.
        self._trackables = trackables
        self.async_writes = async_writes
        self._writer = async_save.AsyncWriter(self.checkpoint) if async_writes else None
        # A non-chief's directory of the write in flight.
        self._scratch = contextlib.ExitStack()
        self.checkpointed_step: int | None = None
        # Created eagerly on every worker: a lazily created save counter would
        # exist on the chief only and desynchronise the collectives.
        _ = self.checkpoint.save_counter
        self.strategy = strategy
        self.is_chief = chief
        self.max_to_keep = max_to_keep
        # Made at the first save: after the lock.
        self._manager: tf.train.CheckpointManager | None = None
        self._why_lost, self._broadcast, self.config_record = why_lost, broadcast, config_record
        if not chief:
            # What killed workers of earlier runs left in TMPDIR.
            scratch.sweep()

    @property
    def read_manager(self) -> tf.train.CheckpointManager:
        """The chief's rotating manager, its state file first rewritten from the checkpoint files found."""
        if self._manager is None:
            if self.is_chief:
                _rewrite_state(self.directory)
            self._manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep=self.max_to_keep)
        return self._manager

    def restore(self) -> str | None:
        """Restores the newest usable checkpoint of the chief's directory; returns its path.

        A checkpoint that cannot be read (truncated, corrupt) is skipped with a
        warning for the one before it; one written by a different model is an error.
        """
        # A write of this process in flight is not a checkpoint yet.
        self.wait()
        candidates = saved_checkpoints(self.directory)
        found = first_readable(candidates, lambda path: read_into(path, **self._trackables))
        if found:
            return found[0]
        if candidates:
            raise CheckpointError(f"no readable checkpoint in {self.directory}; move it away to start fresh")
        return None

    def restore_from(self, candidates: list[str]) -> str | None:
        """Restores everything this checkpointer holds from the first readable of `candidates` (another run's
        checkpoints, newest first: a warm start of the whole state); returns its path, None when none is
        readable. One written by another model is an error."""
        found = first_readable(candidates, lambda path: read_into(
            path, what="holds another run's state", fix="warm-start from a run of the same model, optimizer and "
                                                       "task, or set config.init_checkpoint_state='weights'",
            **self._trackables))
        return found[0] if found else None

    def save(self, step: int, *, final: bool = False) -> None:
        """Saves on every worker (a collective); only the chief's copy is kept.

        With `async_writes` the save returns while the write goes on, after waiting for the one
        before; `final` (a preemption's or Ctrl-C's save, before the process exits) waits for the write in
        flight, then saves and returns once this write is complete too.
        A failed write (disk full, file-size limit, permissions) is a CheckpointError naming the cause;
        the checkpoints already written stay readable, and a rerun resumes from the newest of them.
        A workdir that is no longer this run's is a WorkdirLostError on every worker, before anything is saved.
        """
        # At most one write in flight: its copies and the rotation's order stay simple.
        self.wait()
        self._stop_if_lost(step)
        with self._failure(step):
            if self._writer is not None and not final:
                self._write_record(step)
                try:
                    self._writer.start(self._write_manager(), step)
                except BaseException:
                    # Nothing in flight: nothing to keep the directory for.
                    self._scratch.close()
                    raise
            else:
                self._save(step)
                self.checkpointed_step = int(step)

    def wait(self) -> int | None:
        """Waits for the write in flight (if any) and its commit; returns `checkpointed_step`. Raises the
        CheckpointError of a write that failed."""
        if self._writer is not None and self._writer.step is not None:
            step = self._writer.step
            try:
                with self._failure(step):
                    self._writer.wait()
                    self._remove_orphan_records()
            finally:
                self._scratch.close()
            self.checkpointed_step = step
        return self.checkpointed_step

    def done(self) -> bool:
        """Whether no write is in flight any more (then `wait` returns at once)."""
        return self._writer is None or self._writer.done()

    @contextlib.contextmanager
    def _failure(self, step: int) -> Iterator[None]:
        """A failed write of `step` as a CheckpointError naming the cause and what a rerun resumes from."""
        try:
            yield
        except (tf.errors.UnavailableError, tf.errors.CancelledError):
            # A task that went away (a ps: mwloop.loop.ps names it), not a problem of the disk.
            raise
        except (tf.errors.OpError, OSError) as e:
            previous = saved_checkpoints(self.directory)
            raise CheckpointError(
                f"saving the checkpoint of step {step} to {self.directory} failed ({disk.reason(e)}); "
                f"{disk.remedy(e)}, then rerun: it resumes from "
                f"{os.path.basename(previous[0]) if previous else 'the start'}") from None

    def _stop_if_lost(self, step: int) -> None:
        why = self._why_lost() if self._why_lost is not None and self.is_chief else None
        # Every worker calls save: the flag reaches all of them at once.
        if self._broadcast is not None:
            if self._broadcast([float(why is not None)])[0] and why is None:
                why = "the chief found its workdir removed, or locked by another run, while this run trained"
        if why is not None:
            raise workdir_lock.WorkdirLostError(
                f"{why}; stopping without saving the checkpoint of step {step} (nothing is written into a "
                f"workdir this run no longer owns): give each run a workdir of its own")

    def _write_manager(self) -> tf.train.CheckpointManager:
        """The chief's rotating manager; on another worker one into a fresh scratch directory, removed once
        the write ended (`wait`, or `_save`). Made per save, not at start: a worker that dies before saving
        leaves nothing behind (killed mid-save, a directory the next start sweeps)."""
        if self.is_chief:
            return self.read_manager
        write_dir = self._scratch.enter_context(
            scratch.owned_dir(f"mwloop-worker{self.strategy.cluster_resolver.task_id}-"))
        return tf.train.CheckpointManager(self.checkpoint, write_dir, max_to_keep=1)

    def _save(self, step: int) -> None:
        self._write_record(step)
        try:
            self._write_manager().save(checkpoint_number=step)
            self._remove_orphan_records()
        finally:
            # Another worker's scratch directory: the write ended.
            self._scratch.close()

    def _write_record(self, step: int) -> None:
        """First: a checkpoint is never without the config it was trained with (the chief's)."""
        if self.config_record is not None and self.is_chief:
            tf.io.gfile.makedirs(self.directory)
            jsonl.replace_file(os.path.join(self.directory, f"ckpt-{int(step)}") + files.CHECKPOINT_CONFIG,
                               self.config_record)

    def _remove_orphan_records(self) -> None:
        """The `ckpt-N.config.json` files whose checkpoint the rotation removed go with it."""
        if not self.is_chief:
            return
        kept = {files.checkpoint_step(p) for p in saved_checkpoints(self.directory)}
        pattern = os.path.join(self.directory if "://" in self.directory else globbing.escape(self.directory),
                               "ckpt-*" + files.CHECKPOINT_CONFIG)
        for path in tf.io.gfile.glob(pattern) if "://" in self.directory else globbing.glob(pattern):
            found = _RECORD.fullmatch(os.path.basename(path))
            if found and int(found[1]) not in kept and (
                    "://" in path or not os.path.islink(path) and os.path.isfile(path)):
                tf.io.gfile.remove(path)


def _rewrite_state(directory: str) -> None:
    """TensorFlow's `checkpoint` state file in `directory`, rewritten to name only the checkpoint files there
    (oldest first): the manager deletes what the file names, and a stale, torn or planted one could name
    files anywhere. A link at its place is removed, not followed."""
    state = os.path.join(directory, "checkpoint")
    found = saved_checkpoints(directory)
    if "://" not in directory and os.path.islink(state):
        os.remove(state)
    elif tf.io.gfile.exists(state):
        tf.io.gfile.remove(state)
    if found:
        # With a time per checkpoint (its index file's), the manager may rotate them away again: without
        # one, TensorFlow treats every checkpoint it recovers as preserved and never deletes it.
        oldest_first = found[::-1]
        tf.compat.v1.train.update_checkpoint_state(
            directory, found[0], all_model_checkpoint_paths=oldest_first,
            all_model_checkpoint_timestamps=_written_at(oldest_first), last_preserved_timestamp=0.0)


def _written_at(prefixes: list[str]) -> list[float]:
    """When each checkpoint was written (its index file's mtime, never decreasing along `prefixes`, which
    go oldest first: the rotation deletes in that order)."""
    times: list[float] = []
    for prefix in prefixes:
        try:
            written = tf.io.gfile.stat(prefix + ".index").mtime_nsec / 1e9
        # Gone meanwhile: its place in the order is what matters.
        except tf.errors.OpError:
            written = times[-1] if times else 1.0
        times.append(max(written, times[-1] if times else 1.0))
    return times
