"""Child processes that die with their parent, so a killed launcher or sweep leaves no orphans.

A parent's `finally` does not run when it is SIGKILLed (or OOM-killed); its
children would run on, unseen, holding the workdir lock and their ports. On
Linux the kernel can signal a child when its parent dies
(prctl(PR_SET_PDEATHSIG)); elsewhere children start as usual.

Linux ties this to the parent *thread*: the child is signalled when the thread
that started it exits. Start tied children from a thread that outlives them
(the main thread, or one that waits for them), not from a short-lived one.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@functools.cache
def _prctl():
    """libc's prctl, or None off Linux. Looked up in the parent: between fork and exec the child
    may not load libraries (another thread may hold the loader's lock)."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent(signum: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen: the child gets `signum` when the calling thread dies,
    by any signal, SIGKILL included. None where the platform cannot do it."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def tie_to_parent() -> None:
        """Runs in the child, between fork and exec: keep it minimal."""
        if prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(int(signum))) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        # The parent died before prctl took effect: no signal would ever come.
        if os.getppid() != parent:
            os.kill(os.getpid(), signum)

    return tie_to_parent


def popen_tied(args: Sequence[str], *, death_signal: int = signal.SIGKILL, **kwargs) -> subprocess.Popen:
    """subprocess.Popen(args, **kwargs) whose child gets `death_signal` when this thread (the parent) dies.

    SIGKILL (the default) is sure to end the child; SIGTERM lets an mwloop
    run save a checkpoint first, but a child that hangs would then outlive its
    parent.
    """
    # preexec_fn is unsafe with threads only when it takes a lock another thread may hold (imports, logging,
    # loading libraries): tie_to_parent makes two system calls through a function looked up beforehand.
    return subprocess.Popen(args, preexec_fn=die_with_parent(death_signal), **kwargs)  # noqa: PLW1509
