"""Disk and file-system failures as one line: a full disk, a read-only or vanished workdir, a file-size limit.

Anything mwloop writes can meet them (metrics.jsonl, summaries, config.json,
checkpoints, the lock), at any step. `one_line_errors(workdir)` wraps a run:
such an error ends it as a `DiskError` (a UserError: exit 2, the launcher does
not restart what would fail the same way) naming the path, the cause and the
checkpoint a rerun resumes from. Everything written before stays: checkpoints
are whole or ignored (mwloop.artifacts.checkpoint), config.json is replaced atomically,
and a torn last line of metrics.jsonl is dropped by the next run.
"""

from __future__ import annotations

import contextlib
import errno
import re
from collections.abc import Iterator

from mwloop.artifacts import files
from mwloop.errors import UserError

ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EIO}
# How TensorFlow's file systems word the same causes (they raise OpErrors with the OS message inside).
MESSAGES = re.compile(r"No space left|Disk quota|Read-only file system|File too large|Permission denied|"
                      r"Input/output error", re.IGNORECASE)


class DiskError(UserError):
    """Writing the workdir failed for a reason of the disk or file system (named in the message)."""


def reason(error: BaseException) -> str:
    """The first line of an OS or TensorFlow error, without TensorFlow's node and op decorations."""
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename + ': ' if error.filename else ''}{error.strerror}"
    text = getattr(error, "message", None) or str(error) or type(error).__name__
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text.splitlines()[0] if text.strip() else text)
    text = re.sub(r"\s*\[Op:.*$", "", text)
    cause = MESSAGES.search(text)
    # A long temporary path first: keep the cause in the line.
    if cause and cause.end() > 240:
        return f"{cause.group(0)}: {text[:200]}..."
    return text[:240]


def is_disk_error(error: BaseException) -> bool:
    """Whether `error` is a full disk, a read-only file system, a file-size limit or a refused write."""
    if isinstance(error, OSError) and error.errno in ERRNOS:
        return True
    # Only once an error is in hand: this module is imported without TensorFlow.
    import tensorflow as tf
    return isinstance(error, tf.errors.OpError) and bool(MESSAGES.search(getattr(error, "message", "") or ""))


def remedy(error: BaseException) -> str:
    """What the user does about `error`: the fix for its cause (a file-size limit is not a full disk)."""
    text = reason(error)
    if (isinstance(error, OSError) and error.errno == errno.EFBIG) or "File too large" in text:
        return "raise the file-size limit (ulimit -f, or the batch system's)"
    if (isinstance(error, OSError) and error.errno == errno.EROFS) or "Read-only file system" in text:
        return "make it writable"
    return "free disk space"


def _resumes_from(workdir: str) -> str:
    return files.resume_point(workdir)


@contextlib.contextmanager
def one_line_errors(workdir: str) -> Iterator[None]:
    """Turns a disk or file-system error inside the block into a DiskError naming the path and cause."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        if not is_disk_error(e):
            raise
        where = "" if "://" in workdir else f"; a rerun resumes from {_resumes_from(workdir)}"
        raise DiskError(f"writing to --workdir={workdir} failed ({reason(e)}): free disk space, make it writable "
                        f"or raise the file-size limit{where}") from None
