"""One attempt of a local job: its tasks started one way, their output copied with a prefix, stopped together.

An `Attempt` holds what one start of the cluster owns: the task processes by name ("worker 1", "chief",
"ps 0"), the threads copying their output, the last `error:` line each printed (the launcher repeats it
last), and which ones a stop had to SIGKILL. `run_workers` (synchronous workers) and `run_parameter_servers`
(a chief, workers and ps tasks) each run one attempt to its end; `mwloop.launch` restarts a new one.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from typing import IO

import portpicker
from absl import logging

from mwloop import errors
from mwloop.launcher import children, closed_output
from mwloop.launcher.standby import Spares
from mwloop.launcher.warm import WarmServer

POLL_S = 0.1
# Spares for the next attempt start once this one trains (a worker logged a train step: the imports and the
# compilation of this attempt's own start-up no longer compete with theirs for the CPU), or this long after it
# started for a worker module that logs no steps.
SPARES_AFTER_S = 60.0
# LogTrain's line (launcher/console.py; absl's).
_TRAIN_LOG = re.compile(rb"(^\d\d:\d\d:\d\d |\] )step \d+/\d+")
# After a ps task dies, how long the chief gets to notice (at its next step) and say so in one line.
PS_LOSS_WAIT_S = 30.0


class Terminated(Exception):
    """The launcher received SIGTERM or SIGHUP (its terminal closed): the tasks save and stop, like a preemption."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def describe_exit(returncode: int) -> str:
    """'exited with 1', 'exited with -9 (SIGKILL)'."""
    if returncode < 0:
        try:
            return f"exited with {returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            pass
    return f"exited with {returncode}"


def wait_for_exit(procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Waits until every process has exited or `timeout_s` passed; whether all exited."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


class Attempt:
    """The tasks of one start of the job (see the module docstring); a context manager that stops them all."""

    def __init__(self, command: list[str], env: dict[str, str], grace_s: float,
                 interrupt_signal: int = errors.INTERRUPT_SIGNAL, spares: Spares | None = None,
                 warm: WarmServer | None = None):
        """`interrupt_signal`: what a Ctrl-C to the launcher sends the tasks (workers save and exit 130 on
        errors.INTERRUPT_SIGNAL; parameter servers get SIGTERM, since their ps tasks must outlive the chief's
        save). `spares`: standby processes (mwloop.launcher.standby) the tasks are taken from while any is
        alive; the same command, started earlier. `warm`: the launcher's warm-start server the tasks are forked
        from (mwloop.launcher.warm), when there are no spares; else each task is a fresh process."""
        self.command, self.env, self.grace_s = command, env, grace_s
        self.interrupt_signal = interrupt_signal
        self.procs: dict[str, subprocess.Popen] = {}
        # Task name -> its last `error: ...` line.
        self.last_errors: dict[str, str] = {}
        # Pids the stop had to SIGKILL (they saved nothing on the way out).
        self.killed: list[int] = []
        self.stop_signal = signal.SIGTERM
        self._pumps: list[threading.Thread] = []
        # Whole lines: tasks never interleave within one.
        self._lock = threading.Lock()
        self.spares = spares
        self.warm = warm
        self.started_at = time.monotonic()
        # Set once a task logged a train step.
        self.training = threading.Event()

    def start(self, name: str, tf_config: dict, address: str) -> subprocess.Popen:
        """Starts task `name` with `tf_config`, its output copied line by line, prefixed `[name] `."""
        proc = self.spares.take(tf_config) if self.spares is not None else None
        how = ", a standby process (imported ahead)" if proc is not None else ""
        env = dict(self.env, TF_CONFIG=json.dumps(tf_config), PYTHONUNBUFFERED="1")
        if proc is None and self.warm is not None:
            proc = self.warm.start(self.command, env)
            how = ", forked warm" if proc is not None else ""
        if proc is None:
            proc = children.popen_tied(self.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE)
        self.procs[name] = proc
        logging.info("started %s (pid %d) on %s%s", name, proc.pid, address, how)
        for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            self._pumps.append(threading.Thread(target=self._pump, args=(stream, name, out), daemon=True))
            self._pumps[-1].start()
        return proc

    def _pump(self, stream: IO[bytes], name: str, out: IO[bytes]) -> None:
        prefix = f"[{name}] ".encode()
        # Read to the end whatever happens to `out`: else the task blocks.
        for line in iter(stream.readline, b""):
            with self._lock:
                try:
                    out.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
                    out.flush()
                # The reader went away (`| head`): the task's output is dropped, it goes on.
                except OSError as e:
                    if not closed_output.is_closed_output(e):
                        raise
                    closed_output.note_closed(out.fileno(), "stdout" if out.fileno() == 1 else "stderr")
                if not self.training.is_set() and _TRAIN_LOG.search(line):
                    self.training.set()
                if line.startswith(b"error: "):
                    self.last_errors[name] = line[len(b"error: "):].decode(errors="replace").strip()
        stream.close()

    def prepare_spares(self, count: int) -> None:
        """Once this attempt trains (or SPARES_AFTER_S after it started), `count` spares for the next one."""
        if self.spares is not None and (self.training.is_set() or
                                        time.monotonic() - self.started_at >= SPARES_AFTER_S):
            self.spares.fill(count)
            # Filled once; the next attempt takes them.
            self.spares = None

    def first_failure(self) -> tuple[str, int] | None:
        """(name, returncode) of the first task found exited non-zero ("worker 1", -9), or None."""
        for name, proc in self.procs.items():
            if proc.poll() not in (None, 0):
                return name, proc.returncode
        return None

    def stop(self) -> None:
        """`stop_signal` to every running task, SIGKILL to those still running after `grace_s` or at a Ctrl-C."""
        procs = list(self.procs.values())
        for p in procs:
            if p.poll() is None:
                p.send_signal(self.stop_signal)
        deadline = time.monotonic() + self.grace_s
        why = f"still running {self.grace_s:.0f}s after {signal.Signals(self.stop_signal).name}"
        while True:
            try:
                if wait_for_exit(procs, deadline - time.monotonic()):
                    return
                break
            # Ctrl-C (again): the user will not wait for the checkpoint.
            except KeyboardInterrupt:
                why = "Ctrl-C while it was stopping"
                break
            # Already stopping as gracefully as SIGTERM asks.
            except Terminated:
                continue
        for name, p in self.procs.items():
            if p.poll() is None:
                logging.warning("%s (pid %d) %s; sending SIGKILL", name, p.pid, why)
                p.kill()
                self.killed.append(p.pid)
        wait_for_exit(procs, float("inf"))

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            logging.warning("interrupted: the tasks save a checkpoint and exit (waiting up to %.0fs; Ctrl-C again "
                            "to kill them now)", self.grace_s)
            self.stop_signal = self.interrupt_signal
        self.stop()
        for pump in self._pumps:
            pump.join(timeout=5)
        if any(p.returncode for p in self.procs.values()):
            if all(name.startswith("worker ") for name in self.procs):
                exits = ", ".join(f"{name[7:]} {describe_exit(p.returncode)}" for name, p in self.procs.items())
                logging.info("worker exits: %s", exits)
            else:
                logging.info("task exits: %s", ", ".join(f"{name} {describe_exit(p.returncode)}"
                                                         for name, p in self.procs.items()))


def worker_config(ports: list[int], index: int) -> dict:
    """The worker-only TF_CONFIG of worker `index` in a localhost cluster on `ports`."""
    return {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}


def run_workers(attempt: Attempt, num_workers: int, refill: bool = False) -> tuple[str, int] | None:
    """Runs `num_workers` synchronous workers (worker 0 is the chief) on fresh ports to the end; None when all exit
    0, else (name, returncode) of the first failure.

    On a failure the other workers are stopped at once, except after a preemption or interrupt (exit 42 or
    130), where they get `grace_s` to finish their own checkpoint and exit. `refill`: the attempt's spares are
    filled again for the next attempt once this one trains.
    """
    ports = [portpicker.pick_unused_port() for _ in range(num_workers)]
    for i in range(num_workers):
        attempt.start(f"worker {i}", worker_config(ports, i), f"localhost:{ports[i]}")
    if not refill:
        attempt.spares = None
    procs = list(attempt.procs.values())
    while (failure := attempt.first_failure()) is None and any(p.poll() is None for p in procs):
        attempt.prepare_spares(num_workers)
        time.sleep(POLL_S)
    if failure is not None and failure[1] in (errors.PREEMPTED, errors.INTERRUPTED):
        wait_for_exit(procs, attempt.grace_s)
    return failure


def ps_cluster(num_workers: int, num_ps: int) -> dict[str, list[str]]:
    """A parameter-server cluster of a chief, `num_workers` workers and `num_ps` ps tasks on free localhost ports."""
    return {kind: [f"localhost:{portpicker.pick_unused_port()}" for _ in range(n)]
            for kind, n in (("chief", 1), ("worker", num_workers), ("ps", num_ps))}


def run_parameter_servers(attempt: Attempt, num_workers: int, num_ps: int,
                          worker_restarts: int) -> tuple[str, int] | None:
    """Runs a parameter-server cluster until the chief exits; None if it exits 0, else (name, returncode).

    Workers and ps tasks serve until stopped. A worker that dies does not end the run: the chief's
    coordinator reruns its steps on the other workers, and the attempt starts it again on the same
    address (up to `worker_restarts` times), where the coordinator takes it back. A ps that dies ends it:
    the chief notices at its next step and exits with a one-line error (it gets PS_LOSS_WAIT_S or `grace_s`
    to say so).
    """
    cluster = ps_cluster(num_workers, num_ps)

    def start(kind: str, index: int) -> subprocess.Popen:
        return attempt.start("chief" if kind == "chief" else f"{kind} {index}",
                             {"cluster": cluster, "task": {"type": kind, "index": index}}, cluster[kind][index])

    for kind in ("ps", "worker", "chief"):
        for i in range(len(cluster[kind])):
            start(kind, i)
    # Workers left dead (no restarts left).
    down: set[int] = set()
    chief = attempt.procs["chief"]
    while chief.poll() is None:
        time.sleep(POLL_S)
        for i in range(num_ps):
            if (ps := attempt.procs[f"ps {i}"]).poll() is not None:
                wait_s = max(attempt.grace_s, PS_LOSS_WAIT_S)
                logging.error("ps %d %s: its variables are gone; waiting up to %.0fs for the chief to stop", i,
                              describe_exit(ps.returncode), wait_s)
                wait_for_exit([chief], wait_s)
                return f"ps {i}", ps.returncode
        for i in range(num_workers):
            if i in down or (worker := attempt.procs[f"worker {i}"]).poll() is None:
                continue
            left = worker_restarts > 0
            logging.warning("worker %d %s; the chief reruns its steps on the other workers%s", i,
                            describe_exit(worker.returncode),
                            "; restarting it on the same address" if left else " (no restarts left)")
            if left:
                worker_restarts -= 1
                start("worker", i)
            else:
                down.add(i)
        if len(down) == num_workers:
            return f"worker {max(down)}", attempt.procs[f"worker {max(down)}"].returncode
    return None if chief.returncode == 0 else ("chief", chief.returncode)
