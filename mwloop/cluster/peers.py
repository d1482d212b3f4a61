"""A peer that stalls or fails mid-run (multi-worker): one line naming it, exit 1, and a restart resumes.

Synchronous training needs every worker at every all-reduce. When one stops
answering (frozen, killed, its link down), TensorFlow's coordination service
notices that its heartbeats stopped (within about 10 s here) and fails the
collectives of every other worker with an `UnavailableError` (or
`DeadlineExceededError` with config.distribution.collective_timeout_s,
`AbortedError` / `CancelledError` for the ops already queued), each with a
hundred lines of graph and gRPC trace. `failures_are_lost` turns them into
`PeerLost`: one line naming the task, printed as `error: ...`, exit 1 — a
crash worth a restart, which the launcher does (`--max_restarts`, default 3) from
the last checkpoint. No save on the way out: saving a checkpoint is itself a
collective that needs the lost worker; the last periodic or preemption
checkpoint is what a restart resumes from (the message names it).

TensorFlow's preemption handler also runs watcher threads that die with the
same errors; `quiet_watcher_threads` logs their end in one line instead of a
thread traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections.abc import Iterator

import tensorflow as tf
from absl import logging

from mwloop.artifacts import files
from mwloop.errors import JobLost

# The errors a collective or the coordination service raises when a peer is gone.
LOST = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError,
        tf.errors.CancelledError)
_TASK = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")
_UNHEALTHY = re.compile(r"unhealthy[^:]*:\s*/job:(\w+)(?:/replica:\d+)?/task:(\d+)")
# TensorFlow's failure_handling threads (PreemptionCheckpointHandler): their deaths are a symptom, not news.
_WATCHERS = ("PeerTerminationWatcher", "WorkerTerminationSignalWatcher", "PeerStepWatcher")


class PeerLost(JobLost):
    """Another task of the cluster stopped answering; this attempt ends (exit 1: a restart can succeed)."""


def _tf_config() -> dict:
    try:
        value = json.loads(os.environ.get("TF_CONFIG", "") or "{}")
        return value if isinstance(value, dict) else {}
    except ValueError:
        return {}


def who(error: BaseException) -> str:
    """The task an error blames ("worker 1"): the one TensorFlow calls unhealthy, else another task or address
    the message names, else the only other task of the cluster; "a peer" when none of these says."""
    text = getattr(error, "message", None) or str(error)
    unhealthy = _UNHEALTHY.search(text)
    if unhealthy:
        return f"{unhealthy[1]} {unhealthy[2]}"
    config = _tf_config()
    task = config.get("task", {}) if isinstance(config.get("task"), dict) else {}
    me = (str(task.get("type")), str(task.get("index")))
    named = [(m[1], m[2]) for m in _TASK.finditer(text) if (m[1], m[2]) != me]
    if named:
        return f"{named[0][0]} {named[0][1]}"
    others = [(kind, str(i), address) for kind, addresses in (config.get("cluster") or {}).items()
              if isinstance(addresses, list) for i, address in enumerate(addresses) if (kind, str(i)) != me]
    by_address = [o for o in others if o[2] in text]
    if by_address or len(others) == 1:
        kind, index, address = (by_address or others)[0]
        return f"{kind} {index} ({address})"
    return "a peer"


def message(error: BaseException, workdir: str) -> str:
    """The one line for a lost peer: who, why, what was saved, what happens next."""
    resume = files.resume_point(workdir, none="the last checkpoint")
    return (f"{who(error)} stopped answering ({type(error).__name__}: frozen, killed or cut off): this attempt "
            f"ends without a save (saving needs every worker); a restart resumes from {resume} (the launcher "
            f"restarts with --max_restarts, a scheduler with its restart policy)")


@contextlib.contextmanager
def failures_are_lost(strategy: tf.distribute.Strategy, workdir: str) -> Iterator[None]:
    """Turns a lost peer's error inside the block into PeerLost (multi-worker runs only)."""
    try:
        yield
    except LOST as e:
        if strategy.extended._in_multi_worker_mode():  # noqa: SLF001 - no public "is multi-worker"
            raise PeerLost(message(e, workdir)) from None
        raise


def quiet_watcher_threads() -> None:
    """A TensorFlow watcher thread that dies of a lost peer logs one warning instead of a traceback."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        name = getattr(args.thread, "name", "") or ""
        if isinstance(args.exc_value, tf.errors.OpError) and name.startswith(_WATCHERS):
            logging.warning("%s ended: %s", name.split("-")[0], str(args.exc_value).splitlines()[0][:160])
            return
        previous(args)

    if not getattr(threading.excepthook, "mwloop_quiet", False):
        hook.mwloop_quiet = True
        threading.excepthook = hook
