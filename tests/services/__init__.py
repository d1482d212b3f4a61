"""Real services for the tests (PostgreSQL, a one-node Slurm cluster, etcd), started by the suite and stopped by PID.

Each service runs from a fresh temporary directory, listens on 127.0.0.1 or a Unix socket on ports picked
by portpicker, and runs as an unprivileged user where the server insists (PostgreSQL refuses root). The
packages come from Debian (`bash tests/services/install.sh`, which `.ci/run` runs through README's test
command); a service that cannot start raises ServiceError with one line naming the daemon and why, and the
fixtures turn that into a failed (never skipped) test.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence

INSTALL = "bash tests/services/install.sh"


class ServiceError(RuntimeError):
    """A service that could not start: one line naming the daemon and why."""


def private_dir(prefix: str, owner: str | None = None) -> str:
    """A fresh directory under the system temp dir (not pytest's: its parents are closed to other users),
    owned by `owner` when given. Removed when its service stops; kept (with its logs) when it failed to start."""
    path = tempfile.mkdtemp(prefix=prefix)
    os.chmod(path, 0o755)
    if owner:
        entry = pwd.getpwnam(owner)
        os.chown(path, entry.pw_uid, entry.pw_gid)
    return path


def find_program(name: str, extra_dirs: Sequence[str] = ()) -> str:
    """The path of an installed program, or ServiceError saying how to install it."""
    for directory in extra_dirs:
        candidate = os.path.join(directory, name)
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if not found:
        raise ServiceError(f"{name} is not installed: run `{INSTALL}` "
                           "(Debian packages postgresql, slurm-wlm, munge, etcd-server)")
    return found


def as_user(user: str | None) -> dict:
    """Popen arguments that run a process as `user` (only needed, and only possible, as root)."""
    if not user or os.geteuid() != 0 or user == "root":
        return {}
    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def last_line(path: str, default: str = "no output") -> str:
    """The daemon's own reason for stopping, on one line: the last three lines of its log that say fatal, error,
    could not, cannot or failed (the first of them is usually the cause, the last "initialization failed"),
    else its last line."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return default
    reasons = [line for line in lines if re.search(r"fatal|error|could ?n[o']t|cannot|failed", line, re.IGNORECASE)]
    return " | ".join(reasons[-3:] or lines[-1:] or [default])


class Daemon:
    """One server process in the foreground of its own session, its output in `log`."""

    def __init__(self, name: str, argv: Sequence[str], log: str, env: dict[str, str] | None = None,
                 user: str | None = None, cwd: str | None = None, stop_signal: int = signal.SIGTERM):
        self.name, self.log, self.stop_signal = name, log, stop_signal
        with open(log, "ab") as out:
            self.process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            **as_user(user))

    @property
    def pid(self) -> int:
        return self.process.pid

    def check_alive(self) -> None:
        """ServiceError with the daemon's last log line if it has exited."""
        code = self.process.poll()
        if code is not None:
            raise ServiceError(f"{self.name} exited with code {code} at start-up: {last_line(self.log)} "
                               f"(log: {self.log})")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Its stop signal to the daemon's PID (it stops its own children), then SIGKILL to its process group
        (its session, started with it) if it outlives `timeout_s`."""
        if self.process.poll() is None:
            self.process.send_signal(self.stop_signal)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)  # whatever of its session is left
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()


def wait_until(ready: Callable[[], bool], what: str, daemons: Sequence[Daemon], timeout_s: float) -> None:
    """Polls `ready()` until true; ServiceError naming `what` if a daemon exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        for daemon in daemons:
            daemon.check_alive()
        if ready():
            return
        if time.monotonic() > deadline:
            logs = ", ".join(f"{d.name}: {last_line(d.log)}" for d in daemons)
            raise ServiceError(f"{what} not ready after {timeout_s:.0f} s ({logs})")
        time.sleep(0.1)
