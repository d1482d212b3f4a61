"""Joining a cluster, watched: which tasks are missing, and a deadline.

Joining a cluster waits for every task: TensorFlow's C++ start-up blocks until
all tasks have registered with the coordination service, and holds the GIL
while it does, so no Python thread of this process can run meanwhile. The
startup watchdog is therefore a small separate process (stdlib only): it
probes the other tasks' addresses, says which are missing, and ends this
process at the deadline (config.distribution.startup_timeout_s).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import tensorflow as tf

from mwloop import errors

# The watchdog's first probe comes this late, so a prompt cluster logs nothing.
STARTUP_PROBE_EVERY_S = 5.0
_STARTUP_KNOB = "config.distribution.startup_timeout_s"

# The watchdog is a program of its own (startup_watchdog.py), run by path with `python -I`: no TensorFlow, nothing
# of the user's environment.
WATCHDOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup_watchdog.py")


def task_name(task_type: str, index: int) -> str:
    return f"{task_type} {index}"


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)

def _exit_on_sigint() -> bool:
    """Makes SIGINT end this process at once with exit status 2 (errors.USER_ERROR); whether it could.

    Python-level handlers cannot run while TensorFlow's C++ holds the GIL, so
    the C handler is libc's `_exit` itself: it is async-signal-safe and gets
    the signal number, SIGINT = 2, as its status. Main thread only: only there
    can Python's own handler be put back afterwards.
    """
    if threading.current_thread() is not threading.main_thread() or errors.USER_ERROR != signal.SIGINT:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.signal.argtypes, libc.signal.restype = (ctypes.c_int, ctypes.c_void_p), ctypes.c_void_p
        sig_err = ctypes.c_void_p(-1).value
        return libc.signal(signal.SIGINT, ctypes.cast(libc._exit, ctypes.c_void_p)) != sig_err
    # No libc to speak of: the watchdog falls back to SIGKILL.
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def watchdog(resolver: tf.distribute.cluster_resolver.ClusterResolver, timeout_s: float) -> Iterator[None]:
    """While the block runs (joining the cluster), a watchdog process probes the other tasks.

    Every few seconds it logs the tasks whose address does not accept a TCP
    connection yet ("waiting for the cluster: worker 1 (host:port) not
    reachable yet (12 s of 300 s)"). After `timeout_s` (0: never) it prints one
    "error: the cluster did not come up ..." line and ends this process with
    exit code 2, even when the main thread is stuck inside TensorFlow. A
    Ctrl-C during the block also exits 2 at once (Python could not act on it).
    """
    spec = resolver.cluster_spec()
    me = (resolver.task_type, resolver.task_id)
    others = [(task_name(kind, i), *host_port(spec.task_address(kind, i)))
              for kind in ("chief", "worker", "ps") if kind in spec.jobs
              for i in range(spec.num_tasks(kind)) if (kind, i) != me]
    if not others:
        yield
        return
    # Its own session: a terminal's Ctrl-C goes to the training process, not to the watchdog.
    watchdog = subprocess.Popen(
        [sys.executable, "-I", WATCHDOG, json.dumps([others, timeout_s, STARTUP_PROBE_EVERY_S, _STARTUP_KNOB])],
        stdin=subprocess.PIPE, start_new_session=True)
    previous = signal.getsignal(signal.SIGINT)
    exit_on_sigint = _exit_on_sigint()
    try:
        yield
    finally:
        watchdog.stdin.close()
        # After this it can no longer signal us, so Python's handler can come back.
        watchdog.wait()
        if exit_on_sigint:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
