"""Calls into a task's replica-context methods, with the user's mistakes as one-line errors.

A typo in `forward`, `loss`, `metric_sums` or a custom step raises while mwloop traces the step, deep inside
TensorFlow's and mwloop's frames: dozens of lines, classed as an internal error. `call` turns it into one
line naming the task method, the exception and the user's own file:line (and the keys that exist, for a
missing key of a dict of outputs or a batch); mwloop.main prints it and exits 2.

`one_line_errors` is the other half, around every place mwloop traces a step (`mwloop.loop`): Mirrored and
MultiWorkerMirrored run each replica's function in a thread of its own, and a collective's work (an
`all_gather` or `all_reduce` of the task's: TensorFlow's `merge_call`) runs on the main thread. An error
there (`ValueError: destinations can not be empty`, a shape an all_gather cannot concatenate) is raised by
`strategy.run` on the main thread, outside the task's frames, as TensorFlow's own exception: a traceback,
exit 1, restarted by the launcher although it can only repeat. TensorFlow then stops the replica threads
waiting in that merge_call by raising inside them; `call` notes which task method and line each was in,
and `one_line_errors` gives the main thread's exception that place.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from typing import Iterator

from mwloop.errors import UserError, is_user_file
from mwloop.task import TaskError


class UserCodeError(TaskError):
    """An exception raised by a task's own replica-context code (the message names method, error and line)."""


# (task method, " at file:line (code)") of each task call a stop of TensorFlow's replica threads unwound
# during the current `one_line_errors` (replica threads append, the main thread reads: list.append is atomic).
_stopped_calls: list[tuple[str, str]] = []


def _user_frames(tb) -> list[traceback.FrameSummary]:
    """The traceback's frames in the user's own files (not mwloop's, TensorFlow's, Keras' or Python's)."""
    return [f for f in traceback.extract_tb(tb) if is_user_file(f.filename)]


def _keys(name: str, value) -> str:
    return f"{name} has keys {sorted(map(str, value))}" if isinstance(value, dict) else ""


def _stop_of_replica_thread(error: BaseException) -> bool:
    """Whether `error` is TensorFlow stopping a replica thread (mirrored_run's private `_RequestedStop`) because
    another thread failed: not the task's error, which is the one `strategy.run` raises."""
    return type(error).__name__ == "_RequestedStop" and type(error).__module__.endswith(".mirrored_run")


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Around a call that traces a step (`strategy.run` of replica functions that call the task): an exception
    TensorFlow raised on the main thread while a task method waited in a collective becomes a UserCodeError
    naming that method and its line, as `call` names the task's own errors. Others pass unchanged."""
    _stopped_calls.clear()
    try:
        yield
    except Exception as error:
        if isinstance(error, UserError) or type(error).__module__.startswith("mwloop") or not _stopped_calls:
            raise
        method, where = _stopped_calls[0]
        detail = str(error).splitlines()[0] if str(error) else ""
        raise UserCodeError(f"{method} raised {type(error).__name__}: {detail}{where}") from None
    finally:
        _stopped_calls.clear()


def call(task, method: str, *args, **kwargs):
    """`task.<method>(*args, **kwargs)`; an exception it raises becomes a one-line `UserCodeError`.

    mwloop's own errors (UserError) and control-flow exceptions of its tracing pass through unchanged.
    """
    try:
        return getattr(task, method)(*args, **kwargs)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 - anything the user's code raised is the user's to fix
        if type(error).__module__.startswith("mwloop"):
            raise
        frames = _user_frames(sys.exc_info()[2])
        where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
        if frames and frames[-1].name != method and callable(getattr(type(task), frames[-1].name, None)):
            # The task's own method that raised (loss, called by compute_loss).
            method = frames[-1].name
        # The error is the main thread's: one_line_errors names this place.
        if _stop_of_replica_thread(error):
            _stopped_calls.append((f"task {type(task).__name__}.{method}", where))
            raise
        detail = str(error).splitlines()[0] if str(error) else ""
        hint = ""
        if isinstance(error, KeyError):
            named = [("batch", a) for a in args[:1] if isinstance(a, dict) and method != "forward"]
            candidates = {"forward": [("batch", args[1] if len(args) > 1 else None)],
                          "compute_loss": [("batch", args[1] if len(args) > 1 else None)],
                          "loss": [("batch", args[0] if args else None), ("outputs", args[1] if len(args) > 1
                                                                          else None)],
                          "metric_sums": [("batch", args[0] if args else None),
                                          ("outputs", args[1] if len(args) > 1 else None)],
                          "train_step": [("batch", args[2] if len(args) > 2 else None)],
                          "eval_step": [("batch", args[1] if len(args) > 1 else None)]}.get(method, named)
            listed = [text for text in (_keys(n, v) for n, v in candidates) if text]
            hint = f"; {', '.join(listed)}" if listed else ""
        raise UserCodeError(f"task {type(task).__name__}.{method} raised {type(error).__name__}: {detail}{where}"
                            f"{hint}") from None
