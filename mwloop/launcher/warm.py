"""Warm starts: a launcher's tasks forked from one process that has imported TensorFlow already.

A task started as a fresh `python -m mwloop.main ...` spends seconds importing Python, TensorFlow, Keras and
mwloop before it does anything of its own (~5 s on an idle core here, more when several start at once on a
busy machine), and every restart and every elastic re-form pays it again for each task. None of it depends on
the task: TF_CONFIG is read when the strategy is created, after the imports, and no TensorFlow runtime exists
until then. So the launcher starts one *warm server* (`python -m mwloop.launcher.warm_server`) with the tasks'
environment; it imports what every task imports, once, and then forks a task whenever the launcher asks:
the child takes its TF_CONFIG, its own stdout/stderr pipes (passed over a Unix socket, SCM_RIGHTS) and
/dev/null as stdin, and runs `python -m MODULE ARGS` in the same interpreter as that command would
(`__main__`, sys.argv, the interpreter's own exit: atexit, non-daemon threads, exit codes, tracebacks).
This is the zygote of Android and of multiprocessing's forkserver, without multiprocessing's re-import of
the parent's `__main__` and with a child that is an ordinary command. This module is the launcher's end (the
client); mwloop.launcher.warm_server is the server's.

Forking is safe here because the server never starts TensorFlow's runtime (no context, no device, no gRPC
server): the threads its imports leave (a memory allocator's and two idle ones) hold no lock a child needs, and
a 2-worker collective job, parameter servers and the whole launcher suite run forked.

Lifetimes: a child dies with the server (PR_SET_PDEATHSIG) and the server exits when the launcher's end of
the socket closes, so a SIGKILLed launcher still leaves no task behind. The server ignores SIGINT, SIGTERM
and SIGHUP: a terminal's Ctrl-C or a scheduler's SIGTERM to the whole process group must reach the tasks
(they save) without killing the server and, with it, the tasks.

What it costs: the server's memory (~0.7 GB with TensorFlow and Keras imported) for the launcher's lifetime.
`--nowarm_starts` (or MWLOOP_WARM_STARTS=0, which sweeps and agents read too) starts every task as a fresh
process instead. Only `mwloop.main` tasks are forked: another --module may import nothing of TensorFlow's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from absl import logging

from mwloop.launcher import children

# A request or a reply is one datagram of this size at most (SOCK_SEQPACKET keeps their boundaries).
_MESSAGE_BYTES = 1 << 20
# What every training task imports (mwloop.main's modules), imported by the server before it forks any.
PRELOAD = ("mwloop.run.train", "ml_collections.config_flags", "absl.app")
# The server's own module (its command line: `python -m mwloop.launcher.warm_server FD ...`).
SERVER_MODULE = "mwloop.launcher.warm_server"
# The module whose tasks are forked warm: its imports are known (PRELOAD). Another
# --module (a user's own worker, the tests' stand-in workers) may import nothing of TensorFlow's, or have
# import-time effects of its own: its tasks start as fresh processes.
WARM_MODULE = "mwloop.main"
# MWLOOP_WARM_STARTS=0: every task of every launcher, agent and sweep starts as a fresh process.
OFF_ENV = "MWLOOP_WARM_STARTS"
# The path of a running warm server's socket (`WarmServer(listen=True)`): a launcher, agent or sweep that finds it
# in its environment has a server of its own forked from that one (no import of its own) when their environments
# agree, instead of starting one. A sweep sets it for its multi-worker trials' launchers, the tests for theirs.
# Tasks of a server forked this way are in that server's process group, not the launcher's.
PARENT_ENV = "MWLOOP_WARM_SERVER"
# What may differ between the tasks of one server: read when a task runs, never at import. Anything else in a
# task's environment is the server's (it imported with it), or the task starts cold.
PER_TASK_ENV = ("TF_CONFIG", "MWLOOP_SWEEP", "MWLOOP_TRIAL", "MWLOOP_ELASTIC_WORKERS", "PYTHONUNBUFFERED", PARENT_ENV)
# The name of the thread that reads a server's replies (one per server, for the launcher's lifetime).
REPLIES_THREAD = "warm-start replies"
# How long a start waits for the server's imports before the task is started cold instead.
READY_TIMEOUT_S = 300.0


class WarmProcess:
    """A task forked by the warm server: the part of subprocess.Popen's interface the launcher uses.

    Not the launcher's child (the server's), so its exit status arrives from the server (`_exited`)."""

    def __init__(self, pid: int, stdout_fd: int | None = None, stderr_fd: int | None = None):
        """`stdout_fd`, `stderr_fd`: the read ends of its output pipes, if it has its own."""
        self.pid = pid
        self.stdin = None
        self.stdout = None if stdout_fd is None else open(stdout_fd, "rb", buffering=0)
        self.stderr = None if stderr_fd is None else open(stderr_fd, "rb", buffering=0)
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, returncode: int) -> None:
        self.returncode = returncode
        self._done.set()

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the exit; its code. Raises subprocess.TimeoutExpired after `timeout` seconds."""
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Sends `signum` unless it exited already (its pid may be reused then)."""
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmServer:
    """The launcher's end of a warm server: `start` forks a task from it, `close` ends it.

    The server process starts at the first `start`, with that task's environment (without TF_CONFIG), from the
    calling thread: the launcher's main thread, which outlives it (mwloop.launcher.children ties it there)."""

    def __init__(self, per_task_env: tuple[str, ...] = PER_TASK_ENV, listen: bool = False):
        """`per_task_env`: the variables a task's environment may hold of its own (read after the imports); in
        every other variable it must equal the server's, or it starts cold. `listen`: the server also forks a
        server for each launcher, agent or sweep given its `listen_path` in PARENT_ENV."""
        self.per_task_env = per_task_env
        self.listen_path: str | None = None
        self._listen = listen
        self._servers: set[int] = set()
        self.env: dict[str, str] | None = None
        self.server: subprocess.Popen | _ForkedServer | None = None
        self._socket: socket.socket | None = None
        self._tasks: dict[int, WarmProcess] = {}
        self._started: list[int] = []
        self._unclaimed_exits: dict[int, int] = {}
        self._replies = threading.Condition()
        self._ready = False
        self._gone = False
        self._start_lock = threading.Lock()

    def open(self, env: dict[str, str]) -> None:
        """Starts the server now, from the calling thread, with the environment of tasks that will be `env` but
        for `per_task_env`: for callers whose tasks start from threads that end before the others' tasks do (a
        sweep's agents). Does nothing if it runs already or warm starts are off."""
        if os.environ.get(OFF_ENV) == "0":
            return
        with self._start_lock:
            if self.server is None:
                self._launch(self._shared(env))

    def _shared(self, env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in self.per_task_env}

    def idle(self) -> bool:
        """Whether no task of this server, and no server forked from it, runs (closing it then stops nothing)."""
        with self._replies:
            return not self._tasks and not self._servers

    def _launch(self, env: dict[str, str]) -> None:
        self.env = env
        if os.environ.get(PARENT_ENV) and self._fork_from(os.environ[PARENT_ENV], env):
            return
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [sys.executable, "-m", SERVER_MODULE, str(theirs.fileno())]
        passed = [theirs]
        if self._listen:
            # Bound here, before the server starts: a launcher may connect at once (it waits for the imports).
            self.listen_path = os.path.join(tempfile.mkdtemp(prefix="mwloop-warm-"), "server")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(self.listen_path)
            listener.listen(16)
            passed.append(listener)
            command += [str(listener.fileno()), json.dumps(list(self.per_task_env))]
        self.server = children.popen_tied(command, env=env, pass_fds=[s.fileno() for s in passed],
                                          stdin=subprocess.DEVNULL)
        for s in passed:
            s.close()
        logging.info("started a warm-start server (pid %d): tasks are forked from it, their imports done once "
                     "(MWLOOP_WARM_STARTS=0 or the launcher's --nowarm_starts: fresh processes)", self.server.pid)
        threading.Thread(target=self._read_replies, daemon=True, name=REPLIES_THREAD).start()

    def _fork_from(self, path: str, env: dict[str, str]) -> bool:
        """Has the server listening at `path` fork one for this caller, in its network namespace; False (and a
        line why) when it cannot, or when its imports saw another environment than `env`'s tasks would."""
        ours = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            ours.settimeout(30)
            ours.connect(path)
            namespace = os.open("/proc/self/ns/net", os.O_RDONLY)
            try:
                socket.send_fds(ours, [b"fork"], [namespace])
            finally:
                os.close(namespace)
            ready = json.loads(ours.recv(_MESSAGE_BYTES) or b'{"event": "gone"}')
            ours.settimeout(None)
        except (OSError, ValueError) as e:
            ready = {"event": "unreachable", "why": str(e)}
        ignored = {*self.per_task_env, *ready.get("per_task_env", ())}
        differ = sorted(k for k in {*env, *ready.get("env", {})} - ignored
                        if env.get(k) != ready.get("env", {}).get(k))
        if ready["event"] != "ready" or differ:
            ours.close()
            why = f"environments differ in {', '.join(differ)}" if ready["event"] == "ready" else \
                ready.get("why", ready["event"])
            logging.info("the warm-start server at %s=%s cannot serve these tasks (%s): starting one of our own",
                         PARENT_ENV, path, why)
            return False
        self._socket, self._ready = ours, True
        self.server = _ForkedServer(ready["pid"], self)
        logging.info("forked a warm-start server (pid %d) from the one at %s: tasks are forked from it",
                     ready["pid"], path)
        threading.Thread(target=self._read_replies, daemon=True, name=REPLIES_THREAD).start()
        return True

    def _read_replies(self) -> None:
        while True:
            try:
                message = self._socket.recv(_MESSAGE_BYTES)
            except OSError:
                message = b""
            if not message:
                break
            reply = json.loads(message)
            with self._replies:
                if reply["event"] == "ready":
                    self._ready = True
                elif reply["event"] == "server started":
                    self._servers.add(reply["pid"])
                elif reply["event"] == "server exited":
                    self._servers.discard(reply["pid"])
                elif reply["event"] == "started":
                    self._started.append(reply["pid"])
                elif reply["event"] == "exited":
                    if reply["pid"] in self._tasks:
                        self._tasks.pop(reply["pid"])._exited(reply["returncode"])
                    else:
                        self._unclaimed_exits[reply["pid"]] = reply["returncode"]
                self._replies.notify_all()
        # The server is gone: its tasks died with it (PR_SET_PDEATHSIG, SIGKILL) and cannot be waited for here.
        with self._replies:
            self._gone = True
            for task in self._tasks.values():
                task._exited(-signal.SIGKILL)
            self._tasks.clear()
            self._replies.notify_all()

    def start(self, command: list[str], env: dict[str, str], output: int | None = None,
              cwd: str | None = None) -> WarmProcess | None:
        """Forks `command` (`python -m mwloop.main ARGS`) with `env`; None when it cannot (another command, `env`
        differs from the server's in more than `per_task_env`, or the server died or is not ready after
        READY_TIMEOUT_S): start it cold then.

        `output`: a file descriptor the task's stdout and stderr both go to (a trial's log); by default each is a
        pipe of its own, read from the returned process's `stdout` and `stderr`. `cwd`: its working directory
        (by default the server's, which is the caller's)."""
        if command[:3] != [sys.executable, "-m", WARM_MODULE] or os.environ.get(OFF_ENV) == "0":
            return None
        asked = time.time()
        shared = self._shared(env)
        with self._start_lock:
            if self.server is None:
                self._launch(shared)
            elif shared != self.env:
                return None
            with self._replies:
                if not (self._ready or self._gone):
                    logging.info("waiting for the warm-start server (pid %d) to finish its imports (up to %.0fs, then "
                                 "a fresh process)", self.server.pid, READY_TIMEOUT_S)
                if not self._replies.wait_for(lambda: self._ready or self._gone, READY_TIMEOUT_S) or self._gone:
                    logging.warning("the warm-start server (pid %d) is %s; starting the task as a fresh process",
                                    self.server.pid, "gone" if self._gone else "not ready")
                    return None
            ours, theirs = ([], [output, output]) if output is not None else _two_pipes()
            request = {"module": command[2], "args": command[3:], "env": env, "sent": asked, "cwd": cwd}
            try:
                socket.send_fds(self._socket, [json.dumps(request).encode()], theirs)
                sent = True
            except OSError:
                sent = False
            finally:
                if output is None:
                    for fd in theirs:
                        os.close(fd)
            with self._replies:
                self._replies.wait_for(lambda: self._started or self._gone or not sent)
                if not self._started:
                    for fd in ours:
                        os.close(fd)
                    return None
                task = WarmProcess(self._started.pop(0), *ours)
                self._tasks[task.pid] = task
                # It may have exited before it was registered here.
                if task.pid in self._unclaimed_exits:
                    self._tasks.pop(task.pid)._exited(self._unclaimed_exits.pop(task.pid))
                return task

    def close(self) -> None:
        """Ends the server (tasks still running die with it: stop them first)."""
        if self.server is None:
            return
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
        try:
            self.server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        if self.listen_path is not None:
            shutil.rmtree(os.path.dirname(self.listen_path), ignore_errors=True)


class _ForkedServer:
    """A server forked for us by another (PARENT_ENV): its child, not ours; it exits when our socket closes."""

    def __init__(self, pid: int, owner: WarmServer):
        self.pid, self._owner = pid, owner

    def wait(self, timeout: float | None = None) -> None:
        """Waits until its end of the socket closed; raises subprocess.TimeoutExpired after `timeout` seconds."""
        with self._owner._replies:
            if not self._owner._replies.wait_for(lambda: self._owner._gone, timeout):
                raise subprocess.TimeoutExpired(f"warm-start server {self.pid}", timeout)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _two_pipes() -> tuple[list[int], list[int]]:
    """([stdout's read end, stderr's read end], [their write ends])."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    return [out_r, err_r], [out_w, err_w]
