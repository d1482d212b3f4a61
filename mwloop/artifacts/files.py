"""The files of a run, in one place: what a workdir holds, where, and how to read it. No TensorFlow (the sweep
tools, the watch processes and error messages use it too).

    DIR/config.json             the run's resolved config (rewritten atomically at each start)
    DIR/metrics.jsonl           one JSON object per event: {"step", "split", ...} (appended; jsonl.py); train
                                events carry `time`; the goodput records: mwloop.artifacts.goodput
    DIR/log.txt                 a sweep trial's console (written by its agent)
    DIR/checkpoints/ckpt-N      the rotating checkpoints, numbered by step (ckpt-N.index + data shards, and
                                ckpt-N.config.json: the config it was trained with, removed with it)
    DIR/best_checkpoint/ckpt-N  the best eval's weights (one)
    DIR/export/N, export_best/N SavedModels by step, TF Serving's layout (`latest` links the newest)

Checkpoints are found from their files (`ckpt-N.index`), never from TensorFlow's `checkpoint` state file, which
a crash mid-save can leave stale or broken.
"""

from __future__ import annotations

import glob as globbing
import json
import os
import re
from collections.abc import Callable

from absl import logging

from mwloop.artifacts import jsonl

CONFIG = "config.json"
METRICS = "metrics.jsonl"
LOG = "log.txt"
CHECKPOINTS = "checkpoints"
BEST_CHECKPOINT = "best_checkpoint"
EXPORT = "export"
EXPORT_BEST = "export_best"
SUMMARIES = "summaries"
# ckpt-N.config.json beside ckpt-N: the config that checkpoint was trained with.
CHECKPOINT_CONFIG = ".config.json"

# The fields of a metrics.jsonl event that are not metrics: every reader that takes an event's numbers as
# metrics (MLflow's backfill, the sweep's results) skips them. `time`: seconds since the epoch, on train events
# and the goodput records (mwloop.artifacts.goodput).
ENVELOPE = ("step", "split", "time")

_INDEX = re.compile(r"ckpt-(\d+)\.index")


def checkpoint_step(prefix: str) -> int:
    """The step of a checkpoint prefix (".../ckpt-600" -> 600)."""
    return int(prefix.rsplit("-", 1)[1])


def saved_checkpoints(directory: str, glob: Callable[[str], list[str]] | None = None) -> list[str]:
    """The checkpoint prefixes in `directory`, newest step first. `glob` lists a pattern's paths (default:
    the local file system's; the checkpointer passes `tf.io.gfile.glob` for remote workdirs)."""
    pattern = os.path.join(globbing.escape(directory) if glob is None else directory, "ckpt-*.index")
    indexes = [(int(m[1]), path[:-len(".index")]) for path in (glob or globbing.glob)(pattern)
               if (m := _INDEX.fullmatch(os.path.basename(path)))]
    return [prefix for _, prefix in sorted(indexes, reverse=True)]


def newest_checkpoint_step(workdir: str) -> int | None:
    """The step of the run's newest rotating checkpoint in the local `workdir`, or None (none, or remote)."""
    if "://" in workdir:
        return None
    saved = saved_checkpoints(os.path.join(workdir, CHECKPOINTS))
    return checkpoint_step(saved[0]) if saved else None


def checkpoint_config(prefix: str) -> dict | None:
    """The config the local checkpoint `prefix` was trained with (`ckpt-N.config.json`), or None."""
    try:
        return jsonl.read_json(prefix + CHECKPOINT_CONFIG, nofollow=True)
    except (OSError, jsonl.CorruptFileError):
        return None


def trained_to_the_end(workdir: str) -> bool:
    """Whether the local `workdir`'s newest checkpoint is its run's last step (`train.steps` of the config it
    was trained with, else of config.json): the run only evaluates and exports from here, so a launcher must
    not re-form it (False when either is unknown)."""
    saved = saved_checkpoints(os.path.join(workdir, CHECKPOINTS)) if "://" not in workdir else []
    if not saved:
        return False
    recorded = checkpoint_config(saved[0])
    try:
        if recorded is None:
            with open(os.path.join(workdir, CONFIG)) as f:
                recorded = json.load(f)
        last = recorded["train"]["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return isinstance(last, int) and checkpoint_step(saved[0]) >= last


def resume_point(workdir: str, none: str = "the start") -> str:
    """What a rerun of `workdir` resumes from, for messages: "ckpt-N", or `none`."""
    step = newest_checkpoint_step(workdir)
    return f"ckpt-{step}" if step is not None else none


def read_metrics(workdir: str) -> list[dict]:
    """The events of the local `workdir`'s metrics.jsonl (none if it has none yet; a torn last line is skipped
    with a warning; a corrupt file raises jsonl.CorruptFileError)."""
    path = os.path.join(workdir, METRICS)
    return jsonl.read(path) if os.path.exists(path) else []


class MetricsTail:
    """Follows a growing metrics.jsonl: each `poll` returns the complete lines appended since the last one (a torn
    last line waits for its end; a corrupt line costs only its own event, with a warning). A file replaced under
    it (a resume drops the events past its checkpoint: writers.truncate_after) is read again from its start."""

    def __init__(self, workdir: str):
        self.path, self.offset = os.path.join(workdir, METRICS), 0
        self.events: list[dict] = []
        self._inode: int | None = None

    def poll(self) -> list[dict]:
        """The events appended since the last poll (all of them again after the file was replaced)."""
        try:
            with open(self.path, "rb") as f:
                status = os.fstat(f.fileno())
                if status.st_ino != self._inode or status.st_size < self.offset:
                    self._inode, self.offset, self.events = status.st_ino, 0, []
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        new = []
        for line in data[:end].decode(errors="replace").splitlines():
            try:
                new += jsonl.parse(line + "\n", self.path)
            except jsonl.CorruptFileError:
                logging.warning("%s has a line that is not a JSON object (%r); skipping it", self.path, line[:60])
        self.events += new
        return new
