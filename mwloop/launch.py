"""Local multi-worker launcher: N `mwloop.main` processes on this machine.

    python -m mwloop.launch --num_workers=2 [--max_restarts=K] -- --config=configs/mlp.py --workdir=DIR

Each worker gets its own TF_CONFIG (worker-only form, worker 0 is chief) on
free localhost ports, and each line it prints is prefixed with `[worker i] `.
Synchronous training cannot go on without every worker: when one exits
non-zero (or is killed by a signal, or fails because a peer froze or its link
went down: mwloop.cluster.peers) the others are stopped, and all workers are started
again on fresh ports, up to `--max_restarts` times (default 3: such faults are
mostly transient), resuming from the chief's latest checkpoint. Exit code 42 (a
preemption: every worker saved, then exited) is restarted the same way; exit
code 2 (a user error, which would only repeat) and 130 (Ctrl-C) are not. With
`--max_restarts=0` the launcher fails fast. Its last line is then one
`error: ...` line naming the task and that task's own error.

With `--num_ps=M` it starts a parameter-server cluster instead: a chief (`[chief] `), the N workers and
M ps tasks (`[ps i] `), with chief + worker + ps TF_CONFIGs. The run ends when the chief does; a worker
that dies is restarted on its own address while the chief goes on; a ps that dies ends the attempt
(restarted like a crash with --max_restarts). See docs/multi_worker.md, "Parameter servers".

SIGTERM or SIGHUP (its terminal closed) to the launcher: every worker saves
and exits 42, the launcher exits 143 / 129. Ctrl-C to the launcher asks every
worker to save and exit 130 (forwarded as errors.INTERRUPT_SIGNAL, so a
terminal's Ctrl-C that reached the workers too is not counted twice), waits
up to --grace_s, then exits 130; a second Ctrl-C
kills the workers at once. The workers die with the launcher, even when it is
SIGKILLed (mwloop.launcher.children).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO

import portpicker
from absl import app, flags, logging

from mwloop import errors
from mwloop.launcher import children, netns

POLL_S = 0.1
# After a ps task dies, how long the chief gets to notice (at its next step) and say so in one line.
PS_LOSS_WAIT_S = 30.0

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_workers", 2, "Worker processes to start on this machine.", lower_bound=1)
flags.DEFINE_integer("num_ps", 0, "> 0: parameter-server training: a chief, the workers and this many ps tasks "
                     "(ParameterServerStrategy; docs/multi_worker.md).", lower_bound=0)
# 3 by default: a frozen or unreachable worker, a preemption or a lost node is usually transient, and a restart from
# the last checkpoint costs one start-up; a user error (exit 2) and Ctrl-C are never restarted, and a crash that
# repeats gives up after 3 tries with its one-line error. --max_restarts=0 fails fast.
DEFAULT_MAX_RESTARTS = 3
flags.DEFINE_integer("max_restarts", DEFAULT_MAX_RESTARTS, "Restart all workers up to this many times after a "
                     "crash, a lost worker or a preemption (never after a user error, exit 2, or Ctrl-C).",
                     lower_bound=0)
flags.DEFINE_float("grace_s", 10.0, "Seconds a stopped worker gets between SIGTERM and SIGKILL.", lower_bound=0)
flags.DEFINE_string("module", "mwloop.main", "Python module each worker runs: python -m MODULE ARGS.")
flags.DEFINE_enum("network", "isolated", ["isolated", "host"],
                  "isolated: the workers' unauthenticated TensorFlow ports are reachable only on this job's own "
                  "loopback (a network namespace; the workers then have no network); host: the machine's network.")


def tf_config(ports: list[int], index: int) -> str:
    """The worker-only TF_CONFIG of worker `index` in a localhost cluster on `ports`."""
    return json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def describe_exit(returncode: int) -> str:
    """'exited with 1', 'exited with -9 (SIGKILL)'."""
    if returncode < 0:
        try:
            return f"exited with {returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            pass
    return f"exited with {returncode}"


# The last one-line `error: ...` each worker printed, by its output prefix: the launcher repeats it last.
_last_errors: dict[bytes, str] = {}


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    """Copies `stream` to `out` line by line, each line prefixed (whole lines, so workers don't interleave)."""
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
            out.flush()
            if line.startswith(b"error: "):
                _last_errors[prefix] = line[len(b"error: "):].decode(errors="replace").strip()
    stream.close()


def start_workers(command: list[str], num_workers: int, env: dict[str, str], procs: list[subprocess.Popen],
                  pumps: list[threading.Thread]) -> None:
    """Starts `command` once per worker on fresh ports, appending to `procs` and `pumps` as it goes
    (so the caller can stop what has started if it is interrupted half-way)."""
    ports = [portpicker.pick_unused_port() for _ in range(num_workers)]
    lock = threading.Lock()
    for i in range(num_workers):
        worker_env = dict(env, TF_CONFIG=tf_config(ports, i), PYTHONUNBUFFERED="1")
        proc = children.popen_tied(command, env=worker_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
        procs.append(proc)
        logging.info("started worker %d (pid %d) on localhost:%d", i, proc.pid, ports[i])
        prefix = f"[worker {i}] ".encode()
        for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            pumps.append(threading.Thread(target=_pump, args=(stream, prefix, out, lock), daemon=True))
            pumps[-1].start()


def wait_for_exit(procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Waits until every process has exited or `timeout_s` passed; whether all exited."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


class _Terminated(Exception):
    """The launcher received SIGTERM or SIGHUP (its terminal closed): the workers save and stop, like a preemption."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum, frame) -> None:
    raise _Terminated(signum)


_killed_on_stop: list[int] = []  # pids the last stop had to SIGKILL (they saved nothing on the way out)


def stop_workers(procs: list[subprocess.Popen], grace_s: float, signum: int = signal.SIGTERM) -> None:
    """`signum` to every running worker, SIGKILL to those still running after `grace_s` or at a Ctrl-C."""
    _killed_on_stop.clear()
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)
    deadline = time.monotonic() + grace_s
    why = f"still running {grace_s:.0f}s after {signal.Signals(signum).name}"
    while True:
        try:
            if wait_for_exit(procs, deadline - time.monotonic()):
                return
            break
        except KeyboardInterrupt:  # Ctrl-C (again): the user will not wait for the checkpoint
            why = "Ctrl-C while it was stopping"
            break
        except _Terminated:  # already stopping as gracefully as SIGTERM asks
            continue
    for p in procs:
        if p.poll() is None:
            logging.warning("worker pid %d %s; sending SIGKILL", p.pid, why)
            p.kill()
            _killed_on_stop.append(p.pid)
    wait_for_exit(procs, float("inf"))


def first_failure(procs: list[subprocess.Popen]) -> tuple[str, int] | None:
    """(name, returncode) of the first worker found exited non-zero ("worker 1", -9), or None."""
    for i, p in enumerate(procs):
        if p.poll() not in (None, 0):
            return f"worker {i}", p.returncode
    return None


def run_once(command: list[str], num_workers: int, env: dict[str, str], grace_s: float) -> tuple[str, int] | None:
    """Runs all workers to the end; None when all exit 0, else (name, returncode) of the first failure.

    On a failure the other workers are stopped at once, except after a
    preemption or interrupt (exit 42 or 130), where they get `grace_s` to
    finish their own checkpoint and exit. Ctrl-C to the launcher asks the
    workers to save and exit (errors.INTERRUPT_SIGNAL), SIGTERM to it stops
    them with SIGTERM (a preemption).
    """
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    stop_signal = signal.SIGTERM
    try:
        start_workers(command, num_workers, env, procs, pumps)
        while (failure := first_failure(procs)) is None and any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
        if failure is not None and failure[1] in (errors.PREEMPTED, errors.INTERRUPTED):
            wait_for_exit(procs, grace_s)
        return failure
    except KeyboardInterrupt:
        logging.warning("interrupted: the workers save a checkpoint and exit (waiting up to %.0fs; Ctrl-C again "
                        "to kill them now)", grace_s)
        stop_signal = errors.INTERRUPT_SIGNAL
        raise
    finally:
        stop_workers(procs, grace_s, stop_signal)
        for pump in pumps:
            pump.join(timeout=5)
        if any(p.returncode for p in procs):
            logging.info("worker exits: %s", ", ".join(f"{i} {describe_exit(p.returncode)}"
                                                       for i, p in enumerate(procs)))


def ps_cluster(num_workers: int, num_ps: int) -> dict[str, list[str]]:
    """A parameter-server cluster of a chief, `num_workers` workers and `num_ps` ps tasks on free localhost ports."""
    return {kind: [f"localhost:{portpicker.pick_unused_port()}" for _ in range(n)]
            for kind, n in (("chief", 1), ("worker", num_workers), ("ps", num_ps))}


def _start_task(command: list[str], env: dict[str, str], cluster: dict[str, list[str]], kind: str, index: int,
                pumps: list[threading.Thread], lock: threading.Lock) -> subprocess.Popen:
    """Starts one task of a parameter-server cluster, its output prefixed `[chief] `, `[worker i] `, `[ps i] `."""
    config = json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})
    proc = children.popen_tied(command, env=dict(env, TF_CONFIG=config, PYTHONUNBUFFERED="1"),
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    name = "chief" if kind == "chief" else f"{kind} {index}"
    logging.info("started %s (pid %d) on %s", name, proc.pid, cluster[kind][index])
    for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
        pumps.append(threading.Thread(target=_pump, args=(stream, f"[{name}] ".encode(), out, lock), daemon=True))
        pumps[-1].start()
    return proc


def run_ps_once(command: list[str], num_workers: int, num_ps: int, env: dict[str, str], grace_s: float,
                worker_restarts: int) -> tuple[str, int] | None:
    """Runs a parameter-server cluster until the chief exits; None if it exits 0, else (name, returncode).

    Workers and ps tasks serve until stopped. A worker that dies does not end the run: the chief's
    coordinator reruns its steps on the other workers, and the launcher starts it again on the same
    address (up to `worker_restarts` times), where the coordinator takes it back. A ps that dies ends it:
    the chief notices at its next step and exits with a one-line error (it gets PS_LOSS_WAIT_S or `grace_s`
    to say so).
    """
    cluster = ps_cluster(num_workers, num_ps)
    procs: dict[tuple[str, int], subprocess.Popen] = {}
    pumps: list[threading.Thread] = []
    lock = threading.Lock()
    try:
        for kind in ("ps", "worker", "chief"):
            for i in range(len(cluster[kind])):
                procs[kind, i] = _start_task(command, env, cluster, kind, i, pumps, lock)
        down: set[int] = set()  # workers left dead (no restarts left)
        while (chief := procs["chief", 0]).poll() is None:
            time.sleep(POLL_S)
            for (kind, i), proc in list(procs.items()):
                if kind == "ps" and proc.poll() is not None:
                    wait_s = max(grace_s, PS_LOSS_WAIT_S)
                    logging.error("ps %d %s: its variables are gone; waiting up to %.0fs for the chief to stop", i,
                                  describe_exit(proc.returncode), wait_s)
                    wait_for_exit([chief], wait_s)
                    return f"ps {i}", proc.returncode
                if kind == "worker" and i not in down and proc.poll() is not None:
                    left = worker_restarts > 0
                    logging.warning("worker %d %s; the chief reruns its steps on the other workers%s", i,
                                    describe_exit(proc.returncode),
                                    "; restarting it on the same address" if left else " (no restarts left)")
                    if left:
                        worker_restarts -= 1
                        procs[kind, i] = _start_task(command, env, cluster, kind, i, pumps, lock)
                    else:
                        down.add(i)
            if len(down) == num_workers:
                return f"worker {max(down)}", procs["worker", max(down)].returncode
        return None if chief.returncode == 0 else ("chief", chief.returncode)
    finally:
        stop_workers(list(procs.values()), grace_s)  # the servers never end by themselves
        for pump in pumps:
            pump.join(timeout=5)


def launch(args: list[str], num_workers: int, max_restarts: int = DEFAULT_MAX_RESTARTS,
           env: dict[str, str] | None = None, grace_s: float = 10.0, module: str = "mwloop.main",
           num_ps: int = 0) -> int:
    """Runs `python -m MODULE ARGS` as `num_workers` local workers, restarting all up to `max_restarts` times.

    With `num_ps` > 0, a parameter-server cluster instead (`run_ps_once`): a chief, the workers and
    `num_ps` ps tasks; the run ends when the chief does.

    Returns 0 when every worker exits 0, else non-zero: the failing worker's
    exit code, 128 + N when it was killed by signal N, 130 / 143 / 129 when the
    launcher itself got SIGINT / SIGTERM / SIGHUP (SIGHUP, a closed terminal, is handled like SIGTERM:
    the workers save and exit 42). A worker's user error (exit 2) or
    Ctrl-C (exit 130) stops all workers without a restart.
    """
    command = [sys.executable, "-m", module, *args]
    env = dict(os.environ if env is None else env)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)} \
        if in_main_thread else {}
    try:
        restarts = 0
        while (failure := (run_ps_once(command, num_workers, num_ps, env, grace_s, max_restarts) if num_ps
                           else run_once(command, num_workers, env, grace_s))) is not None:
            name, code = failure
            if code == errors.USER_ERROR:
                # The last line a user reads: plain, like a worker's own one-line errors.
                message = _last_errors.get(f"[{name}] ".encode(), "a user error (see its output above)")
                print(f"error: {name}: {message} (stopped all workers, no restart: it would repeat)",
                      file=sys.stderr, flush=True)
                return code
            if code == errors.INTERRUPTED:
                logging.warning("%s was interrupted (exit %d); stopped all workers, no restart", name, code)
                return code
            said = _last_errors.get(f"[{name}] ".encode())
            if restarts == max_restarts:
                # The last line a user reads: one line, naming the task and its own error if it printed one.
                print(f"error: {name} {describe_exit(code)}{' (' + said + ')' if said else ''}; stopped all workers "
                      f"({restarts} of {max_restarts} restarts done); rerun to resume from the last checkpoint",
                      file=sys.stderr, flush=True)
                return code if code > 0 else 128 - code
            restarts += 1
            logging.warning("restart %d/%d: %s %s%s; restarting all workers", restarts,
                            max_restarts, name, describe_exit(code), f" ({said})" if said else "")
            _last_errors.clear()
        logging.info("all %d workers finished", num_workers)
        return 0
    except KeyboardInterrupt:
        logging.warning("interrupted: stopped all workers")
        return errors.INTERRUPTED
    except _Terminated as e:
        if _killed_on_stop:  # e.g. a chief stuck on a frozen ps cannot save: say so rather than claim a save
            logging.warning("%s: %d process(es) did not stop within --grace_s=%g and were killed (pid %s); a rerun "
                            "resumes from the last checkpoint saved before", e, len(_killed_on_stop), grace_s,
                            ", ".join(map(str, _killed_on_stop)))
        else:
            logging.warning("%s: the workers saved a checkpoint and stopped (a rerun resumes there)", e)
        return 128 + e.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise app.UsageError("give the arguments for the workers after '--', e.g. "
                             "python -m mwloop.launch --num_workers=2 -- --config=configs/mlp.py --workdir=DIR")
    _protect_ports(FLAGS.network)
    sys.exit(launch(argv[1:], FLAGS.num_workers, FLAGS.max_restarts, grace_s=FLAGS.grace_s, module=FLAGS.module,
                    num_ps=FLAGS.num_ps))


def _protect_ports(network: str) -> None:
    """Keeps the workers' ports off the network (SECURITY.md), or says plainly that they are not."""
    reason = netns.isolate() if network == "isolated" else "--network=host"
    if reason is None:
        logging.info("workers run in a network namespace of their own: their ports are reachable only from "
                     "each other (--network=host gives them the machine's network)")
        if os.environ.get("MLFLOW_TRACKING_URI", "").startswith(("http://", "https://")):
            logging.warning("MLFLOW_TRACKING_URI=%s is out of reach from the workers' namespace (no network): use "
                            "--network=host, or unset it for the SQLite store beside the workdir (docs/tracking.md)",
                            os.environ["MLFLOW_TRACKING_URI"])
        return
    logging.warning("the workers' TensorFlow ports listen on every interface, unauthenticated (%s): any host that "
                    "reaches them can run TensorFlow ops as you; use a firewalled or private network (SECURITY.md)",
                    reason)


if __name__ == "__main__":
    try:
        app.run(main)
    except KeyboardInterrupt:  # a Ctrl-C that came between launch()'s own handlers: still no traceback
        sys.exit(errors.INTERRUPTED)
