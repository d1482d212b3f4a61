"""One run per workdir: the chief holds an exclusive lock on DIR/.lock while it runs.

The lock is an OS file lock (fcntl), so it dies with its process: a lock left
by a crashed or killed run is simply taken over by the next one.
"""

from __future__ import annotations

import fcntl
import os
import socket

from mwloop.errors import UserError


class WorkdirBusyError(UserError):
    """Another live run holds the workdir."""


def make(workdir: str) -> None:
    """Creates `workdir`, or raises a one-line UserError saying why it cannot be."""
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:  # a file in the way, no permission, a read-only file system
        raise UserError(f"--workdir={workdir} cannot be created ({e.strerror}); pick another --workdir") from None


def acquire(workdir: str):
    """Takes the workdir's lock or raises WorkdirBusyError naming the holder; keep the returned file open."""
    make(workdir)
    handle = open(os.path.join(workdir, ".lock"), "a+")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise WorkdirBusyError(
            f"workdir {workdir} is in use by a live run ({holder}); wait for it, stop it, or use another --workdir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle
