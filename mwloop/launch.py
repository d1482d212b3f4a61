"""Local multi-worker launcher: N `mwloop.main` processes on this machine.

    python -m mwloop.launch --num_workers=2 [--max_restarts=K] -- --config=configs/mlp.py --workdir=DIR

Each worker gets its own TF_CONFIG (worker-only form, worker 0 is chief) on
free localhost ports, and each line it prints is prefixed with `[worker i] `.
Synchronous training cannot go on without every worker, so the launcher fails
fast: when one worker exits non-zero (or is killed by a signal) the others are
stopped. With `--max_restarts=K` all workers are instead started again, up to
K times, and resume from the chief's latest checkpoint. Exit code 42 is a
preemption (all workers saved, then exited), also restarted.
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

PREEMPTED = 42  # exit code of every worker after a preemption checkpoint
POLL_S = 0.1

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_workers", 2, "Worker processes to start on this machine.", lower_bound=1)
flags.DEFINE_integer("max_restarts", 0, "Restart all workers up to this many times after a crash or preemption.",
                     lower_bound=0)
flags.DEFINE_float("grace_s", 10.0, "Seconds a stopped worker gets between SIGTERM and SIGKILL.", lower_bound=0)


def tf_config(ports: list[int], index: int) -> str:
    """The worker-only TF_CONFIG of worker `index` in a localhost cluster on `ports`."""
    return json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def describe_exit(returncode: int) -> str:
    """'exited with 1', 'exited with -9 (killed by SIGKILL)'."""
    if returncode < 0:
        try:
            return f"exited with {returncode} (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            pass
    return f"exited with {returncode}"


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    """Copies `stream` to `out` line by line, each line prefixed (whole lines, so workers don't interleave)."""
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


def start_workers(args: list[str], num_workers: int, env: dict[str, str]) -> tuple[list[subprocess.Popen],
                                                                                    list[threading.Thread]]:
    """Starts `python -m mwloop.main ARGS` once per worker, on fresh ports; returns processes and pump threads."""
    ports = [portpicker.pick_unused_port() for _ in range(num_workers)]
    lock = threading.Lock()
    procs, pumps = [], []
    for i in range(num_workers):
        worker_env = dict(env, TF_CONFIG=tf_config(ports, i), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen([sys.executable, "-m", "mwloop.main", *args], env=worker_env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        logging.info("started worker %d (pid %d) on localhost:%d", i, proc.pid, ports[i])
        procs.append(proc)
        prefix = f"[worker {i}] ".encode()
        for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            pump = threading.Thread(target=_pump, args=(stream, prefix, out, lock), daemon=True)
            pump.start()
            pumps.append(pump)
    return procs, pumps


def wait_for_exit(procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Waits until every process has exited or `timeout_s` passed; whether all exited."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def stop_workers(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every running worker, SIGKILL to those still running after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    if not wait_for_exit(procs, grace_s):
        for p in procs:
            if p.poll() is None:
                logging.warning("worker pid %d did not stop within %.0fs of SIGTERM; killing it", p.pid, grace_s)
                p.kill()
        wait_for_exit(procs, float("inf"))


def first_failure(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """(index, returncode) of the first worker found exited non-zero, or None."""
    for i, p in enumerate(procs):
        if p.poll() not in (None, 0):
            return i, p.returncode
    return None


def run_once(args: list[str], num_workers: int, env: dict[str, str], grace_s: float) -> tuple[int, int] | None:
    """Runs all workers to the end; None when all exit 0, else (index, returncode) of the first failure.

    On a failure the other workers are stopped. A preempted worker (exit 42)
    first gives the others `grace_s` to finish their own checkpoint and exit.
    """
    procs, pumps = start_workers(args, num_workers, env)
    try:
        while (failure := first_failure(procs)) is None and any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
        if failure is not None and failure[1] == PREEMPTED:
            wait_for_exit(procs, grace_s)
        return failure
    finally:
        stop_workers(procs, grace_s)  # also on Ctrl-C / SIGTERM to the launcher
        for pump in pumps:
            pump.join(timeout=5)


class _Terminated(Exception):
    """The launcher received SIGTERM."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def launch(args: list[str], num_workers: int, max_restarts: int = 0, env: dict[str, str] | None = None,
           grace_s: float = 10.0) -> int:
    """Runs `mwloop.main ARGS` on `num_workers` local workers, restarting all up to `max_restarts` times.

    Returns 0 when every worker exits 0, else non-zero: the failing worker's
    exit code, or 128 + signal number when it was killed (130 for Ctrl-C).
    """
    env = dict(os.environ if env is None else env)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        restarts = 0
        while True:
            failure = run_once(args, num_workers, env, grace_s)
            if failure is None:
                logging.info("all %d workers finished", num_workers)
                return 0
            index, code = failure
            if restarts >= max_restarts:
                logging.error("worker %d %s; stopped all workers (restarts done: %d of %d)", index,
                              describe_exit(code), restarts, max_restarts)
                return code if code > 0 else 128 - code
            restarts += 1
            logging.warning("restart %d/%d: worker %d %s; restarting all workers", restarts, max_restarts, index,
                            describe_exit(code))
    except KeyboardInterrupt:
        logging.warning("interrupted; stopped all workers")
        return 128 + signal.SIGINT
    except _Terminated:
        logging.warning("terminated; stopped all workers")
        return 128 + signal.SIGTERM
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def main(argv: list[str]) -> None:
    args = argv[1:]
    if not args:
        raise app.UsageError("give the arguments for mwloop.main after '--', e.g. "
                             "python -m mwloop.launch --num_workers=2 -- --config=configs/mlp.py --workdir=DIR")
    sys.exit(launch(args, FLAGS.num_workers, FLAGS.max_restarts, grace_s=FLAGS.grace_s))


if __name__ == "__main__":
    app.run(main)
