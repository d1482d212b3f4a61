"""The warm-start server's end (`python -m mwloop.launcher.warm_server`): imports once, then forks tasks.

mwloop.launcher.warm (the launcher's end) says why and how it is used. Here: the server's loop (`_serve`), the
servers it forks for other launchers (`_fork_server`), and what turns a forked child into the command it stands
for (`_become`).
"""

from __future__ import annotations

import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import tempfile

from mwloop.launcher import children, netns
from mwloop.launcher.warm import _MESSAGE_BYTES, PRELOAD

# How often the server looks for children that exited (os.waitpid) while no request comes.
_REAP_S = 0.05
# A server's environment when it was started (what its imports saw), sent with its "ready".
_launched_env: dict[str, str] = {}


def _serve(connection: socket.socket, listener: socket.socket | None = None,
           per_task_env: tuple[str, ...] = ()) -> tuple[str, object]:
    """The server's loop: forks a child per request and reports children's exits; with a `listener`, also forks a
    server of its own for each process that connects there (`WarmServer(listen=True)`). Returns only in a child:
    ("task", its request), or ("server", its connection); the server itself exits when its caller's end closes."""
    tie = children.die_with_parent(signal.SIGKILL)
    selector = selectors.DefaultSelector()
    selector.register(connection, selectors.EVENT_READ, "tasks")
    if listener is not None:
        selector.register(listener, selectors.EVENT_READ, "servers")
    live: set[int] = set()
    servers: set[int] = set()
    try:
        connection.send(json.dumps({"event": "ready", "pid": os.getpid(), "env": _launched_env,
                                    "per_task_env": list(per_task_env)}).encode())
    except OSError:
        # The caller closed before the imports were done: no task will come.
        sys.exit(0)
    while True:
        for key, _ in selector.select(_REAP_S):
            if key.data == "servers":
                forked = _fork_server(listener)
                if isinstance(forked, socket.socket):
                    selector.close()
                    connection.close()
                    if tie is not None:
                        tie()
                    return "server", forked
                if forked is not None:
                    servers.add(forked)
                    connection.send(json.dumps({"event": "server started", "pid": forked}).encode())
                continue
            try:
                message, fds, _, _ = socket.recv_fds(connection, _MESSAGE_BYTES, 2)
            except OSError:
                message = b""
            if not message:
                sys.exit(0)
            pid = os.fork()
            if pid == 0:
                selector.close()
                connection.close()
                if listener is not None:
                    listener.close()
                if tie is not None:
                    tie()
                request = json.loads(message)
                request["fds"] = fds
                return "task", request
            for fd in fds:
                os.close(fd)
            live.add(pid)
            connection.send(json.dumps({"event": "started", "pid": pid}).encode())
        while live or servers:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in servers:
                servers.discard(pid)
                connection.send(json.dumps({"event": "server exited", "pid": pid}).encode())
                continue
            live.discard(pid)
            connection.send(json.dumps({"event": "exited", "pid": pid,
                                        "returncode": os.waitstatus_to_exitcode(status)}).encode())


def _fork_server(listener: socket.socket) -> socket.socket | int | None:
    """Accepts a connection on `listener` and forks a server for it, in the caller's network namespace (the
    descriptor it sends): in the child, the connection; in this server, the child's pid (None: the caller went
    away first)."""
    conn, _ = listener.accept()
    conn.settimeout(10)
    try:
        _, fds, _, _ = socket.recv_fds(conn, _MESSAGE_BYTES, 1)
    except OSError:
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:
        listener.close()
        why = None
        for fd in fds:
            why = netns.join(fd)
            os.close(fd)
        conn.settimeout(None)
        if why is not None:
            conn.send(json.dumps({"event": "refused", "why": why}).encode())
            os._exit(0)
        return conn
    conn.close()
    for fd in fds:
        os.close(fd)
    return pid


def _become(request: dict) -> None:
    """Turns the forked child into `python -m MODULE ARGS` as a fresh start would have it."""
    stdout_fd, stderr_fd = request["fds"]
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    os.close(stdout_fd)
    os.close(stderr_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    # A fresh interpreter's handlers (the server ignored these).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    _take_interpreter_env(request["env"])
    # The task's environment whole: a variable the server had and the task has not is not the task's.
    os.environ.clear()
    os.environ.update(request["env"])
    # tempfile caches the directory it found first: this task's TMPDIR, as a fresh process would read it.
    tempfile.tempdir = None
    if request.get("cwd"):
        os.chdir(request["cwd"])
        # As `python -m` would have it: the working directory first on the path.
        sys.path[0] = os.getcwd()
    from mwloop.run import goodput_clock
    # Its start-up is counted from when the launcher asked for it, as a fresh start's would be.
    goodput_clock.count_from(request["sent"])
    sys.argv = [request["module"], *request["args"]]


def _take_interpreter_env(env: dict[str, str]) -> None:
    """What a fresh interpreter reads from its environment before any import, taken from the task's `env` where it
    differs from the server's (a server whose callers let these vary per task: the tests' servers): its
    PYTHONPATH (sys.path after the script's directory) and PYTHONUNBUFFERED (unbuffered stdout and stderr)."""
    old, new = (_entries(e.get("PYTHONPATH", "")) for e in (os.environ, env))
    if old != new:
        sys.path[1:] = [*new, *(p for p in sys.path[1:] if p not in old and p not in new)]
    if env.get("PYTHONUNBUFFERED"):
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if isinstance(getattr(stream, "buffer", None), io.FileIO):
                continue  # unbuffered already (-u)
            unbuffered = io.TextIOWrapper(io.FileIO(stream.fileno(), "w", closefd=False), encoding=stream.encoding,
                                          errors=stream.errors, line_buffering=stream.line_buffering,
                                          write_through=True)
            setattr(sys, name, unbuffered)
            setattr(sys, f"__{name}__", unbuffered)


def _entries(path: str) -> list[str]:
    return [os.path.abspath(p) for p in path.split(os.pathsep) if p]


def preload() -> None:
    """Imports PRELOAD, TensorFlow as quietly as mwloop.main does."""
    from mwloop.launcher import console
    console.import_tensorflow_quietly()
    for name in PRELOAD:
        __import__(name)


def main(argv: list[str]) -> None:
    """The warm server (`python -m mwloop.launcher.warm_server FD [LISTENER_FD PER_TASK_ENV_JSON]`): imports, then
    serves; in each forked task, runs the requested module; each forked server serves its own caller."""
    global _launched_env
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    _launched_env = dict(os.environ)
    connection = socket.socket(fileno=int(argv[1]))
    listener, per_task_env = None, ()
    if len(argv) > 2:
        listener = socket.socket(fileno=int(argv[2]))
        per_task_env = tuple(json.loads(argv[3]))
    preload()
    kind, value = _serve(connection, listener, per_task_env)
    while kind == "server":
        kind, value = _serve(value, None, per_task_env)
    request = value
    _become(request)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv)
