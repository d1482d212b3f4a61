"""One attempt of a local job: its tasks started one way, their output copied with a prefix, stopped together.

An `Attempt` holds what one start of the cluster owns: the task processes by name ("worker 1", "chief",
"ps 0"), the threads copying their output, the last `error:` line each printed (the launcher repeats it
last), and which ones a stop had to SIGKILL. `run_workers` (synchronous workers) and `run_parameter_servers`
(a chief, workers and ps tasks) each run one attempt to its end; `mwloop.launch` restarts a new one.
"""

from __future__ import annotations

import json
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
from mwloop.launcher.warm import WarmServer

POLL_S = 0.1
# After a ps task dies, how long the chief gets to notice (at its next step) and say so in one line.
PS_LOSS_WAIT_S = 30.0


class Terminated(BaseException):
    """The launcher received SIGTERM or SIGHUP (its terminal closed): the tasks save and stop, like a preemption.

    A BaseException, as KeyboardInterrupt is: no `except Exception` on its way (ours, a library's) takes the
    launcher's end for an error to log and carry on from."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# What the launcher's signal handler raised. CPython runs a handler wherever the main thread is, and what it
# raises inside a fork hook (a subprocess with preexec_fn runs os.register_at_fork's: logging's), a __del__ or a
# weakref callback is printed as "ignored" and lost: the job would go on as if no signal came. The launcher's
# waits (`pause`) raise it again.
_raised: list[BaseException] = []


def on_signal(signum: int, frame=None) -> None:
    """The launcher's handler of SIGTERM and SIGHUP (raises Terminated) and SIGINT (KeyboardInterrupt)."""
    e = KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)
    _raised.append(e)
    raise e


def handle_signals() -> dict[int, object]:
    """Installs `on_signal` for SIGTERM, SIGHUP and SIGINT, from the main thread, after `forget_signals`; SIGHUP
    and SIGINT ignored from the start stay ignored, as Python leaves SIGINT (nohup's SIGHUP, a background job's
    Ctrl-C). Returns the handlers it replaced."""
    forget_signals()
    return {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
            if s == signal.SIGTERM or signal.getsignal(s) != signal.SIG_IGN}


def forget_signals() -> None:
    """Where the launcher's handlers are installed or restored: a signal raised before is not this job's (every
    `except` that takes one ends the job, and no wait follows it)."""
    _raised.clear()


def pause(seconds: float) -> None:
    """time.sleep for the launcher's (or a sweep's) waits, raising first a signal's exception that was lost on its
    way (see `_raised`); only in the main thread, where the handler raised it."""
    if _raised and threading.current_thread() is threading.main_thread():
        raise _raised[-1]
    time.sleep(seconds)


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
                 interrupt_signal: int = errors.INTERRUPT_SIGNAL, warm: WarmServer | None = None):
        """`interrupt_signal`: what a Ctrl-C to the launcher sends the tasks (workers save and exit 130 on
        errors.INTERRUPT_SIGNAL; parameter servers get SIGTERM, since their ps tasks must outlive the chief's
        save). `warm`: the launcher's warm-start server the tasks are forked from (mwloop.launcher.warm); without
        it (or where it cannot), each task is a fresh process."""
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
        self.warm = warm

    def start(self, name: str, tf_config: dict, address: str) -> subprocess.Popen:
        """Starts task `name` with `tf_config`, its output copied line by line, prefixed `[name] `."""
        env = dict(self.env, TF_CONFIG=json.dumps(tf_config), PYTHONUNBUFFERED="1")
        proc = self.warm.start(self.command, env) if self.warm is not None else None
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
                if line.startswith(b"error: "):
                    self.last_errors[name] = line[len(b"error: "):].decode(errors="replace").strip()
        stream.close()

    def first_failure(self) -> tuple[str, int] | None:
        """(name, returncode) of the first task found exited non-zero ("worker 1", -9), or None."""
        for name, proc in self.procs.items():
            if proc.poll() not in (None, 0):
                return name, proc.returncode
        return None

    def stop(self) -> None:
        """`stop_signal` to every running task, SIGKILL to those still running after `grace_s` or at a Ctrl-C.

        A SIGTERM/SIGHUP (Terminated) or Ctrl-C to the launcher while it stops them is raised once they have
        stopped: the stop (a re-form's coordinated save, say) is then the job's end, never swallowed."""
        procs = list(self.procs.values())
        running = [p for p in procs if p.poll() is None]
        for p in running:
            p.send_signal(self.stop_signal)
        if self.stop_signal == signal.SIGKILL:
            self.killed += [p.pid for p in running]
        elif running:
            logging.info("waiting up to %.0fs for %d task(s) to exit after %s", self.grace_s, len(running),
                         signal.Signals(self.stop_signal).name)
        deadline = time.monotonic() + self.grace_s
        why = f"still running {self.grace_s:.0f}s after {signal.Signals(self.stop_signal).name}"
        pending: BaseException | None = None
        while True:
            try:
                if wait_for_exit(procs, deadline - time.monotonic()):
                    break
                self._kill_the_rest(why)
                break
            # Ctrl-C (again): the user will not wait for the checkpoint.
            except KeyboardInterrupt as e:
                pending = e
                self._kill_the_rest("Ctrl-C while it was stopping")
                break
            # Already stopping as gracefully as SIGTERM asks: the stop goes on, then the signal ends the launcher.
            except Terminated as e:
                logging.warning("%s while stopping the tasks: they go on saving (up to %.0fs), then the launcher "
                                "exits", e, max(0.0, deadline - time.monotonic()))
                pending = e
        wait_for_exit(procs, float("inf"))
        if pending is not None:
            raise pending

    def _kill_the_rest(self, why: str) -> None:
        for name, p in self.procs.items():
            if p.poll() is None:
                logging.warning("%s (pid %d) %s; sending SIGKILL", name, p.pid, why)
                p.kill()
                self.killed.append(p.pid)

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            logging.warning("interrupted: the tasks save a checkpoint and exit (waiting up to %.0fs; Ctrl-C again "
                            "to kill them now)", self.grace_s)
            self.stop_signal = self.interrupt_signal
        # A signal during the stop is raised once the tasks stopped: their exits are said first.
        try:
            self.stop()
        finally:
            for pump in self._pumps:
                pump.join(timeout=5)
            self._say_exits()

    def _say_exits(self) -> None:
        # One still running: a signal ended the stop's last wait (it is raised now, the tasks are tied to us).
        if any(p.poll() is None for p in self.procs.values()):
            return
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


def run_workers(attempt: Attempt, num_workers: int) -> tuple[str, int] | None:
    """Runs `num_workers` synchronous workers (worker 0 is the chief) on fresh ports to the end; None when all exit
    0, else (name, returncode) of the first failure.

    On a failure the other workers are stopped at once, except after a preemption or interrupt (exit 42 or
    130), where they get `grace_s` to finish their own checkpoint and exit.
    """
    ports = [portpicker.pick_unused_port() for _ in range(num_workers)]
    for i in range(num_workers):
        attempt.start(f"worker {i}", worker_config(ports, i), f"localhost:{ports[i]}")
    procs = list(attempt.procs.values())
    while (failure := attempt.first_failure()) is None and any(p.poll() is None for p in procs):
        pause(POLL_S)
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
        pause(POLL_S)
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
