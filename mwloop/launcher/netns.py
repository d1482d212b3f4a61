"""Keeps a local multi-worker job's ports off the network: a network namespace with only loopback.

TensorFlow's cluster runtime is unauthenticated gRPC and binds every interface
(0.0.0.0, hard-coded in its server), so any host that reaches a worker's port
can run TensorFlow ops -- read and write files -- as the user. A job that runs
on one machine needs none of that reach: in a network namespace of its own
(Linux; unprivileged through a user namespace where the kernel allows it) the
workers still talk to each other over loopback, and nothing outside sees the
ports. The price: the workers have no network either (data must be on local or
mounted file systems).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def isolate() -> str | None:
    """Moves this process, and every process it starts afterwards, into a new network namespace whose
    loopback is up. Call before starting threads. Returns None, or why it could not."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux-only (this is {sys.platform})"
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    # Root needs no user namespace.
    flags = CLONE_NEWNET if uid == 0 else CLONE_NEWUSER | CLONE_NEWNET
    if libc.unshare(flags) != 0:
        return f"unshare failed: {os.strerror(ctypes.get_errno())}"
    try:
        # The same ids inside, so files the workers write keep their owner.
        if flags & CLONE_NEWUSER:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        # A new namespace's loopback starts down.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = struct.pack("16sH14x", b"lo", 0)
            current = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, request))[1]
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", current | IFF_UP))
    except OSError as e:
        return f"the new namespace could not be set up: {e}"
    return None


def join(namespace_fd: int) -> str | None:
    """Moves this (single-threaded) process into the network namespace open at `namespace_fd` (/proc/PID/ns/net
    of a process in it): a warm server forked for a launcher that isolated itself. Returns None, or why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(namespace_fd, CLONE_NEWNET) != 0:
        return f"setns failed: {os.strerror(ctypes.get_errno())}"
    return None
