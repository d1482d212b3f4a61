"""The machinery of `python -m tests.stress.faults`: run a case's commands, inject its fault, classify.

A case is one subprocess run of `python -m <module> ARGS` from the repository
root (optionally followed by a rerun), with a hard timeout, a fault injected
when its trigger line appears, and an expected kind. What happened is
classified from the exit code, the output and the workdir before and after:

  CLEAR ERROR         non-zero exit, the last stderr line is one `error: ...` line, no traceback
  TRACEBACK           non-zero exit with a Python traceback
  UNCLEAR ERROR       non-zero exit, no traceback, but the last stderr line is not an `error:` line
  HANG                the hard timeout expired (the process tree is SIGKILLed)
  SILENT WRONG RESULT exit 0 where an error was expected, or a success whose result is wrong
  DATA LOST           a readable checkpoint or a metrics line that existed before is gone or unreadable
  OK                  the expected success or recovery happened

The workdir before and after (snapshots, data lost, files written) is fault_workdir.py's; its names are
importable from here too.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import psutil

from tests.stress.fault_workdir import Snapshot
from tests.stress.fault_workdir import data_lost as data_lost
from tests.stress.fault_workdir import export_load_error as export_load_error
from tests.stress.fault_workdir import snapshot as snapshot
from tests.stress.fault_workdir import written as written

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLEAR_ERROR, TRACEBACK, UNCLEAR_ERROR = "CLEAR ERROR", "TRACEBACK", "UNCLEAR ERROR"
HANG, SILENT_WRONG, DATA_LOST, OK = "HANG", "SILENT WRONG RESULT", "DATA LOST", "OK"
TRACEBACK_MARK = "Traceback (most recent call last)"


class SetupError(RuntimeError):
    """A case's own preparation failed (not a finding about mwloop)."""


def base_env(extra_path: Sequence[str] = ()) -> dict[str, str]:
    """The environment of every command: the repository (and `extra_path`) importable, no cluster, quiet TF."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("SLURM_")}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, *extra_path]), TF_CPP_MIN_LOG_LEVEL="3",
               GCE_METADATA_IP="127.0.0.1:9", PYTHONUNBUFFERED="1")
    return env


@dataclasses.dataclass
class Run:
    """One finished (or timed-out) command."""
    args: list[str]
    code: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float
    fired: bool  # whether the fault was injected
    facts: dict = dataclasses.field(default_factory=dict)  # what the fault's action noted (e.g. worker pids)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def command(self) -> str:
        return shlex.join(["python", "-m", *self.args])

    def last_lines(self, n: int = 8) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()][-n:] or \
            [line for line in self.stdout.splitlines() if line.strip()][-n:]


@dataclasses.dataclass
class Fault:
    """What to do to a running command, and when: on a line matching `on`, once a `step N/` log line
    has N >= `at_step`, or `after_s` seconds after the start."""
    describe: str
    action: Callable[[subprocess.Popen], None]
    on: str | None = None
    at_step: int | None = None
    after_s: float | None = None

    def due(self, line: str) -> bool:
        if self.on and re.search(self.on, line):
            return True
        step = re.search(r"step (\d+)/", line) if self.at_step is not None else None
        return bool(step and int(step[1]) >= self.at_step)


class Ctx:
    """A case's scratch directory, environment and named values (formatted into its arguments)."""

    def __init__(self, directory: str, shared: dict, timeout: float):
        self.dir = directory
        self.workdir = os.path.join(directory, "run")
        self.env = base_env([directory])  # throw-away task modules are written here
        self.shared = shared  # results cached across cases (reference runs)
        # `python -m mwloop.main` runs forked from a warm server (tests/warm_main.py) instead of fresh processes:
        # the pytest subset sets it, for cases whose fault is not in TensorFlow's start-up.
        self.warm_forks = bool(shared.get("warm_forks"))
        self.timeout = timeout
        self.vars: dict[str, object] = {"dir": directory, "workdir": self.workdir}
        self.background: list[subprocess.Popen] = []
        self.closers: list[Callable[[], None]] = []
        self.snapshots: list[Snapshot] = []  # the workdir before the case, after its first command, ...

    def path(self, *parts: str) -> str:
        return os.path.join(self.dir, *parts)

    def format(self, args: Sequence[str]) -> list[str]:
        return [a.format(**self.vars) for a in args]

    def write(self, relative: str, text: str | bytes) -> str:
        path = self.path(relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        return path

    def run(self, args: Sequence[str], fault: Fault | None = None, env: dict | None = None) -> Run:
        return execute(self.format(args), env or self.env, self.timeout, fault, warm_forks=self.warm_forks)

    def must_run(self, args: Sequence[str], codes: Sequence[int] = (0,), env: dict | None = None) -> Run:
        """A setup command that must succeed (exit in `codes`)."""
        run = execute(self.format(args), env or self.env, self.timeout, warm_forks=self.warm_forks)
        if run.code not in codes:
            raise SetupError(f"setup `{run.command()}` exited {run.code}: {' | '.join(run.last_lines(3))}")
        return run

    def start(self, args: Sequence[str], ready: str, timeout_s: float = 90) -> subprocess.Popen:
        """A background command (stopped after the case) once a line matching `ready` appeared."""
        proc = subprocess.Popen([sys.executable, "-m", *self.format(args)], cwd=ROOT, env=self.env, text=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.background.append(proc)
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:
            if re.search(ready, line):
                threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
                return proc
            if time.monotonic() > deadline:
                break
        raise SetupError(f"background `{shlex.join(args)}` never printed {ready!r} (exit {proc.poll()})")

    def cleanup(self) -> None:
        for close in self.closers:
            close()
        for proc in self.background:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    kill_tree(proc)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to a command this harness started and to everything it started."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session and group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
    proc.kill()  # a forked run is in its server's group, not a group of its own
    for child in descendants:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def execute(args: list[str], env: dict, timeout: float, fault: Fault | None = None, warm_forks: bool = False) -> Run:
    """`python -m ARGS` from the repository root; the fault fires on its trigger; SIGKILL at `timeout`.
    `warm_forks`: a `mwloop.main` run is forked from a warm server (tests/warm_main.py), the rest start fresh."""
    start = time.monotonic()
    if warm_forks and args[0] == "mwloop.main":
        from tests import warm_main
        proc = warm_main.popen(args[1:], env=env, cwd=ROOT)
    else:
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                                start_new_session=True)
    out: list[str] = []
    err: list[str] = []
    merged: list[str] = []
    lock = threading.Lock()

    def pump(stream, sink):
        for line in stream:
            with lock:
                sink.append(line)
                merged.append(line)

    pumps = [threading.Thread(target=pump, args=(s, sink), daemon=True) for s, sink in
             ((proc.stdout, out), (proc.stderr, err))]
    for p in pumps:
        p.start()
    seen, fired, timed_out = 0, False, False
    while proc.poll() is None:
        if time.monotonic() - start > timeout:
            kill_tree(proc)
            timed_out = True
            break
        if fault and not fired:
            with lock:
                new, seen = merged[seen:], len(merged)
            if any(fault.due(line) for line in new) or (
                    fault.after_s is not None and time.monotonic() - start >= fault.after_s):
                fault.action(proc)
                fired = True
        time.sleep(0.02)
    proc.wait()
    for p in pumps:
        p.join(timeout=10)
    return Run(args, None if timed_out else proc.returncode, "".join(out), "".join(err),
               time.monotonic() - start, fired, getattr(proc, "facts", {}))


# ---------------------------------------------------------------------------- faults

def send(sig: int, again_after_s: float | None = None, delay_s: float = 0.0) -> Callable[[subprocess.Popen], None]:
    """The command itself gets `sig` after `delay_s` (and again `again_after_s` later, when given)."""
    def act(proc: subprocess.Popen) -> None:
        time.sleep(delay_s)
        proc.send_signal(sig)
        if again_after_s is not None:
            time.sleep(again_after_s)
            proc.send_signal(sig)
    return act


def workers(proc: subprocess.Popen) -> list[psutil.Process]:
    """The launcher's `mwloop.main` tasks, in start order (worker 0 first): forked by its warm-start server
    (mwloop.launcher.warm; their command line is the server's), or its own children under --nowarm_starts."""
    found = []
    for child in psutil.Process(proc.pid).children():
        command = " ".join(child.cmdline())
        if "mwloop.launcher.warm" in command:
            found += child.children()
        elif "mwloop.main" in command:
            found.append(child)
    return sorted(found, key=lambda c: (c.create_time(), c.pid))


def send_worker(index: int, sig: int) -> Callable[[subprocess.Popen], None]:
    """Worker `index` of a launcher gets `sig`."""
    def act(proc: subprocess.Popen) -> None:
        procs = workers(proc)
        os.kill(procs[index].pid, sig)
        proc.facts = {"worker_pids": [p.pid for p in procs]}
    return act


# ---------------------------------------------------------------------------- classification

def last_stderr_line(run: Run) -> str:
    lines = [line.strip() for line in run.stderr.splitlines() if line.strip()]
    return re.sub(r"^\[worker \d+\] ", "", lines[-1]) if lines else ""


def error_kind(run: Run) -> tuple[str, str]:
    """How a command that exited non-zero failed: (kind, detail)."""
    if TRACEBACK_MARK in run.output:
        exception = [line for line in run.stderr.splitlines() if re.match(r"^(\[worker \d+\] )?\w+(\.\w+)*"
                                                                         r"(Error|Exception|Interrupt)\b", line)]
        return TRACEBACK, f"exit {run.code}; {(exception or run.last_lines(1) or [''])[-1].strip()}"
    last = last_stderr_line(run)
    if last.startswith("error:") and len(last) > len("error: ") + 10:
        return CLEAR_ERROR, last
    return UNCLEAR_ERROR, f"exit {run.code}; last line: {last or '(no stderr)'}"


# ---------------------------------------------------------------------------- cases

Check = Callable[[Ctx, list[Run]], "str | None"]


@dataclasses.dataclass
class Case:
    """One fault case. `args` (and `rerun`) are `python -m` arguments, formatted with the Ctx's vars.

    expect: CLEAR_ERROR or OK. For OK, the first command must exit with one of `codes`; then `rerun`
    (if any) must exit 0; then `check` must return None (else: a SILENT WRONG RESULT). For CLEAR_ERROR,
    the error line must match `message` and a fresh workdir must stay empty.
    """
    name: str
    expect: str
    expected: str  # the table's description of the expected outcome
    args: list[str]
    setup: Callable[[Ctx], None] | None = None
    fault: Fault | None = None
    codes: tuple[int, ...] = (0,)
    rerun: list[str] | None = None
    message: str | None = None
    check: Check | None = None
    env: dict[str, str] | None = None
    fresh_stays_empty: bool = True  # a CLEAR ERROR in a fresh workdir must leave no config, metrics or checkpoints
    multi: bool = False  # several TensorFlow processes: slow, not for the fast subset
    timeout: float | None = None


def summary(runs: Sequence[Run]) -> list[str]:
    """What a successful case's logs say about saving and resuming, for the table."""
    facts = []
    for pattern, words in ((r"saving a checkpoint at step (\d+)", "saved at step {}"),
                           (r"falling back to \S*?(ckpt-\d+)", "fell back to {}"),
                           (r"resumed from step (\d+)", "resumed from step {}"),
                           (r"restart (\d+/\d+)", "restart {}")):
        for run in runs:
            if m := re.search(pattern, run.output):
                facts.append(words.format(m[1]))
                break
    return facts


def error(name: str, expected: str, args: list[str], message: str | None = None, **kw) -> Case:
    """A case whose expected outcome is a clear one-line error (`message`: a regex it must match)."""
    return Case(name, CLEAR_ERROR, f"clear error: {expected}", args, message=message, **kw)


def ok(name: str, expected: str, args: list[str], **kw) -> Case:
    """A case that must succeed as `expected` says."""
    return Case(name, OK, expected, args, **kw)
