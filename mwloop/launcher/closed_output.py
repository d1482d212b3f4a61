"""A reader that goes away does not stop training: `python -m mwloop.launch ... | head -1`.

`head` exits after its line; the next write to the pipe fails with EPIPE (Python ignores SIGPIPE). The
launcher's threads that copy the workers' output died of that BrokenPipeError, nobody read the workers'
pipes any more, and once a pipe's 64 KiB filled every worker blocked in its next log line: the job hung for
good. A run's record is its workdir (checkpoints, metrics.jsonl), not its console, so the choice here is that
the job goes on to its end, as if the output went to /dev/null: the first failed write points that stream's
file descriptor at /dev/null (so every later write, Python's own flush at exit included, succeeds), notes it
once on the other stream, and the launcher keeps draining the workers' pipes. Ending the job instead would
make `| head` a way to stop training by accident, and a terminal that closes already has SIGHUP (the tasks
save and stop).
"""

from __future__ import annotations

import errno
import io
import os
import sys
import threading
from typing import Any

_lock = threading.Lock()
_closed_fds: set[int] = set()


def is_closed_output(error: BaseException) -> bool:
    """Whether `error` is a write to a pipe (or socket) whose reader went away."""
    return isinstance(error, BrokenPipeError) or (isinstance(error, OSError) and error.errno in (
        errno.EPIPE, errno.ECONNRESET))


def note_closed(fd: int, name: str) -> None:
    """`fd` (1 or 2) lost its reader: from now on it writes to /dev/null; the loss is said once on the other."""
    with _lock:
        if fd in _closed_fds:
            return
        _closed_fds.add(fd)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)
    other = 2 if fd == 1 else 1
    # The note goes to stderr only: a program reading stdout wants data.
    if other in _closed_fds or other == 1:
        return
    try:
        os.write(other, f"note: {name} was closed by its reader; training goes on to its end, its {name} output "
                        f"is dropped (the workdir's metrics.jsonl and checkpoints have the run)\n".encode())
    except OSError:
        pass


class _Guarded(io.TextIOBase):
    """A text stream whose writes survive a closed reader (see the module docstring)."""

    def __init__(self, inner: Any, name: str):
        super().__init__()
        self._inner, self._name = inner, name
        self._fd = inner.fileno()
        self.buffer = _GuardedBinary(inner.buffer, self._fd, name) if hasattr(inner, "buffer") else None

    def write(self, text: str) -> int:
        try:
            return self._inner.write(text)
        except OSError as e:
            return self._closed(e, len(text))

    def flush(self) -> None:
        try:
            self._inner.flush()
        except OSError as e:
            self._closed(e, 0)

    def _closed(self, error: OSError, size: int) -> int:
        if not is_closed_output(error):
            raise error
        note_closed(self._fd, self._name)
        try:
            # What was held goes to /dev/null now.
            self._inner.flush()
        except OSError:
            pass
        return size

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return self._inner.isatty()

    def __getattr__(self, name: str) -> Any:
        """encoding, errors, line_buffering...: the wrapped stream's."""
        return getattr(self._inner, name)


class _GuardedBinary(io.RawIOBase):
    """`sys.stdout.buffer` of a guarded stream: bytes writes that survive a closed reader too."""

    def __init__(self, inner: Any, fd: int, name: str):
        super().__init__()
        self._inner, self._fd, self._name = inner, fd, name

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return self._inner.write(data)
        except OSError as e:
            if not is_closed_output(e):
                raise
            note_closed(self._fd, self._name)
            return len(data)

    def flush(self) -> None:
        try:
            self._inner.flush()
        except OSError as e:
            if not is_closed_output(e):
                raise
            note_closed(self._fd, self._name)
            self._inner.flush()

    def fileno(self) -> int:
        return self._fd


def survive_closed_output() -> None:
    """sys.stdout and sys.stderr (and absl's log handler, which holds sys.stderr) survive a reader that goes
    away: an entry point (launch, main, sweep) calls it first."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _Guarded) or not hasattr(stream, "fileno"):
            continue
        try:
            guarded = _Guarded(stream, name)
        # No real file (a test's capture): nothing to guard.
        except (OSError, ValueError, io.UnsupportedOperation):
            continue
        setattr(sys, name, guarded)
        _repoint_handlers(stream, guarded)


def _repoint_handlers(old: Any, new: Any) -> None:
    """Log handlers that write to `old` (absl's, created at import) write to `new`."""
    import logging
    handlers = list(logging.getLogger().handlers)
    try:
        from absl import logging as absl_logging
        handlers.append(absl_logging.get_absl_handler().python_handler)
    except ImportError:
        pass
    for handler in handlers:
        if getattr(handler, "stream", None) is old:
            handler.stream = new
