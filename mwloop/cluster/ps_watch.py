"""Parameter servers: the chief's deadline on the tasks it waits for (config.distribution.peer_timeout_s).

Under ParameterServerStrategy the chief waits on the other tasks all the time: for the steps it scheduled
(`ClusterCoordinator.join`) and for the variables the ps tasks hold (every read, assign, eval and save).
TensorFlow puts no deadline there. A task that is killed drops its connections at once (a ps:
`ps.ParameterServerLost`; a worker: TensorFlow reruns its steps on the others), but one that freezes
(SIGSTOP, a hung or swapping host, a link that drops packets) leaves the chief waiting forever without a
word. TensorFlow does not reschedule a frozen worker's step either (measured: 2 workers, one SIGSTOPped,
`join` waited for its step for good).

Measured on a frozen task (SIGSTOP), from the chief:
- a TCP connect succeeds (the kernel accepts for the stopped process): it proves nothing;
- TensorFlow's `check_collective_ops_peer_health` refuses a parameter-server cluster ("not supposed to be
  called for local collectives");
- a tiny op on the task's device never returns, and a Python thread can wait for it with a timeout, but
  only while the main thread lets go of the GIL: a variable `assign` to a frozen ps blocks the chief's main
  thread inside TensorFlow with the GIL held, so no thread of the chief runs again;
- the task server's own gRPC `GetStatus` (what TensorFlow's workers answer about their devices) answers
  in milliseconds when alive, ends in DEADLINE_EXCEEDED when frozen and UNAVAILABLE when dead.

So the watch is a small separate process (the `grpc` package only, no TensorFlow), like the start-up
watchdog (`mwloop.cluster.startup`): it calls `GetStatus` on every worker and ps every few seconds, logs the tasks
that do not answer (`waiting for ps 1 (...): no answer for 10 s ...`), and when one has not answered for
`peer_timeout_s` (or every worker, or a ps, has been unreachable that long) it prints one `error: ...` line
naming it and what to do, and ends the chief with SIGKILL: the chief's main thread may be stuck inside
TensorFlow, where nothing softer reaches it. Exit -9 (137) is a crash to the launcher, which restarts the
whole job from the last checkpoint (--max_restarts), as a TFJob's restart policy does.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator

from mwloop.cluster import distribute

KNOB = "config.distribution.peer_timeout_s"
# Every TensorFlow server answers it (with its devices).
GET_STATUS = "/tensorflow.WorkerService/GetStatus"

# The watch is a program of its own (ps_watch_process.py), run by path with `python -I`: stdlib, grpc and
# mwloop.artifacts.files only.
WATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ps_watch_process.py")


def cluster_tasks() -> list[tuple[str, str, str]]:
    """(name, device, address) of every worker and ps of TF_CONFIG's cluster: the tasks the chief waits on."""
    cluster = distribute.parse_tf_config()["cluster"]
    return [(f"{kind} {i}", f"/job:{kind}/replica:0/task:{i}", address)
            for kind in ("worker", "ps") for i, address in enumerate(cluster.get(kind, []))]


def intervals(timeout_s: float) -> tuple[float, float]:
    """(probe every, log every) seconds: several probes per deadline, a waiting line every 30 s at most."""
    if not timeout_s:
        return 10.0, 30.0
    return min(10.0, max(0.5, timeout_s / 10)), min(30.0, max(2.0, timeout_s / 3))


@contextlib.contextmanager
def watching(timeout_s: float, workdir: str, tasks: list[tuple[str, str, str]] | None = None,
             chief_pid: int | None = None) -> Iterator[subprocess.Popen]:
    """While the block runs, a watch process probes `tasks` (default: TF_CONFIG's workers and ps) and ends
    `chief_pid` (default: this process) in one line when one stops answering for `timeout_s` (0: never)."""
    tasks = cluster_tasks() if tasks is None else tasks
    every, log_every = intervals(timeout_s)
    args = [tasks, timeout_s, every, log_every, os.getpid() if chief_pid is None else chief_pid, workdir, KNOB,
            GET_STATUS]
    # Its own session: a terminal's Ctrl-C goes to the chief, which saves; the watch ends when its pipe closes.
    watch = subprocess.Popen([sys.executable, "-I", WATCH, json.dumps(args)], stdin=subprocess.PIPE,
                             start_new_session=True)
    try:
        yield watch
    finally:
        watch.stdin.close()
        try:
            watch.wait(timeout=10)
        except subprocess.TimeoutExpired:
            watch.kill()
