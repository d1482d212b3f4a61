"""The tests' `python -m mwloop.main` runs, forked from a warm-start server as the launcher's tasks are.

A test that runs the command line pays a TensorFlow import per process (~4 s on an idle core of this machine,
more under xdist), and the suite runs dozens of them. `run` and `popen` fork them instead from one
`mwloop.launcher.warm` server per environment in this test process, which imported TensorFlow once: each run
is still its own `mwloop.main` process with its own arguments, environment, working directory, exit code and
output (tests/test_warm.py shows the child is what a fresh start would be). Another command, or
MWLOOP_WARM_STARTS=0, starts a fresh process.
"""

from __future__ import annotations

import atexit
import io
import os
import signal
import subprocess
import sys
import threading

from mwloop.launcher import warm
from tests.helpers import ROOT

# pytest sets PYTEST_CURRENT_TEST per test, and tests give their runs a TMPDIR, a PYTHONPATH (their own task
# modules) of their own: without them here, every test's environment would be a new one (a forked child takes
# them as a fresh interpreter would: warm_server._become).
PER_TASK_ENV = (*warm.PER_TASK_ENV, "PYTEST_CURRENT_TEST", "TMPDIR", "PYTHONPATH", "GCE_METADATA_IP")
# Servers kept per test process (0.7 GB each): the newest ones; older idle ones are closed when a new one starts.
KEPT_SERVERS = 3
_servers: dict[frozenset, warm.WarmServer] = {}
_lock = threading.Lock()


def _server(env: dict[str, str]) -> warm.WarmServer:
    key = frozenset((k, v) for k, v in env.items() if k not in PER_TASK_ENV)
    with _lock:
        if key in _servers:
            _servers[key] = _servers.pop(key)  # the newest used
        else:
            if not _servers:
                atexit.register(lambda: [s.close() for s in _servers.values()])
            for old in list(_servers)[:max(0, len(_servers) + 1 - KEPT_SERVERS)]:
                if _servers[old].idle():
                    _servers.pop(old).close()
            _servers[key] = warm.WarmServer(PER_TASK_ENV, listen=True)
        return _servers[key]


def serving(env: dict[str, str]) -> dict[str, str]:
    """`env` for a launcher, agent or sweep the test starts: its warm-start server is forked from this test
    process's (warm.PARENT_ENV), no TensorFlow import of its own. Not for one whose process group the test
    signals or freezes (its tasks are in the test server's group) or that runs under Slurm."""
    env = dict(env)
    env.setdefault("PYTHONPATH", ROOT)
    server = _server(env)
    server.open(env)
    return dict(env, **{warm.PARENT_ENV: server.listen_path})


class Process:
    """The part of subprocess.Popen's interface tests use, for a forked run (or a fresh one: `cold`)."""

    def __init__(self, forked: warm.WarmProcess | None, cold: subprocess.Popen | None, merged: bool, text: bool):
        self._forked, self._cold = forked, cold
        self.pid = (forked or cold).pid
        if cold is not None:
            self.stdout, self.stderr = cold.stdout, cold.stderr
        else:
            wrap = (lambda f: io.TextIOWrapper(f, errors="replace")) if text else (lambda f: f)
            self.stdout = wrap(forked.stdout) if forked.stdout is not None else None
            self.stderr = wrap(forked.stderr) if forked.stderr is not None else None
            if merged:
                self.stdout, self.stderr = self.stderr, None

    @property
    def returncode(self) -> int | None:
        return (self._forked or self._cold).returncode

    def poll(self) -> int | None:
        return (self._forked or self._cold).poll()

    def wait(self, timeout: float | None = None) -> int:
        return (self._forked or self._cold).wait(timeout)

    def send_signal(self, signum: int) -> None:
        (self._forked or self._cold).send_signal(signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple:
        """(stdout, stderr) read to their end, after the exit; kills it after `timeout` seconds (and raises
        subprocess.TimeoutExpired)."""
        if self._cold is not None:
            return self._cold.communicate(timeout=timeout)
        out: dict[str, object] = {}
        readers = [threading.Thread(target=lambda n=name, f=f: out.__setitem__(n, f.read()), daemon=True)
                   for name, f in (("stdout", self.stdout), ("stderr", self.stderr)) if f is not None]
        for reader in readers:
            reader.start()
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        for reader in readers:
            reader.join()
        return out.get("stdout"), out.get("stderr")


def popen(args: list[str], *, env: dict[str, str] | None = None, cwd: str = ROOT, stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, text: bool = True) -> Process:
    """`python -m mwloop.main *args`, forked warm when it can be. `stdout`/`stderr`: PIPE, DEVNULL, or
    stderr=STDOUT (both on `stdout`), as subprocess.Popen takes them."""
    env = dict(os.environ if env is None else env)
    # What `-m` from ROOT would import anyway: one server for the tests that say so and those that do not.
    env.setdefault("PYTHONPATH", ROOT)
    command = [sys.executable, "-m", warm.WARM_MODULE, *args]
    merged = stderr == subprocess.STDOUT
    output = None
    if stdout == subprocess.DEVNULL and stderr == subprocess.DEVNULL:
        output = os.open(os.devnull, os.O_WRONLY)
    elif (stdout, stderr) not in ((subprocess.PIPE, subprocess.PIPE), (subprocess.PIPE, subprocess.STDOUT)):
        return Process(None, subprocess.Popen(command, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text),
                       merged, text)
    read_end = None
    if merged:
        read_end, output = os.pipe()
    try:
        forked = _server(env).start(command, env, output=output, cwd=cwd)
    finally:
        if output is not None:
            os.close(output)
    if forked is None:
        if read_end is not None:
            os.close(read_end)
        return Process(None, subprocess.Popen(command, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text),
                       merged, text)
    if read_end is not None:
        forked.stderr = open(read_end, "rb", buffering=0)
    return Process(forked, None, merged, text)


def run(args: list[str], *, env: dict[str, str] | None = None, cwd: str = ROOT, timeout: float = 300,
        text: bool = True) -> subprocess.CompletedProcess:
    """`python -m mwloop.main *args` to its end, forked warm when it can be; its output captured, as
    subprocess.run(..., capture_output=True) gives it."""
    proc = popen(args, env=env, cwd=cwd, text=text)
    stdout, stderr = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess([sys.executable, "-m", warm.WARM_MODULE, *args], proc.returncode,
                                       stdout, stderr)
